"""atomd.tokenizer against transformers' tokenizer (the reference) on the default model and a
tiny byte-level BPE whose multi-byte characters span several tokens."""
from __future__ import annotations

import pytest
import transformers

from atomd.tokenizer import Tokenizer
from tests.test_model_hf import write_tokenizer

TEXTS = ["def main():\n    print('hello')", "naïve café 日本語 🙂 done", "  leading spaces\tand\ttabs  ", ""]
CHATS = [[{"role": "user", "content": "What is 2+2?"}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo 🙂"},
          {"role": "assistant", "content": "hi"}, {"role": "user", "content": "again"}]]


@pytest.fixture(scope="module", params=["default", "tiny"])
def model_dir(request, tmp_path_factory):
    if request.param == "default":
        from atomd.model.default import default_model_dir

        return default_model_dir()
    path = tmp_path_factory.mktemp("tok")
    write_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def pair(model_dir):
    return Tokenizer.from_dir(model_dir), transformers.AutoTokenizer.from_pretrained(model_dir)


@pytest.mark.unit
@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_equal_transformers(pair, text):
    ours, hf = pair
    ids = ours.encode(text)
    assert ids == hf.encode(text)
    assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)


@pytest.mark.unit
@pytest.mark.parametrize("messages", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_equals_transformers(pair, messages, add_generation_prompt):
    ours, hf = pair
    want_text = hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert ours.apply_chat_template(messages, add_generation_prompt) == want_text
    want_ids = hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                      return_dict=False)
    assert ours.encode_chat(messages, add_generation_prompt) == list(want_ids)


@pytest.mark.unit
@pytest.mark.parametrize("text", TEXTS[:3])
def test_incremental_decode_streams_the_full_text(pair, text):
    ours, _ = pair
    ids = ours.encode(text)
    decoder = ours.incremental_decoder()
    pieces = [decoder.step(t) for t in ids]
    assert "".join(pieces) + decoder.flush() == ours.decode(ids)
    assert not any("\ufffd" in p for p in pieces)  # a split character is held, not garbled


@pytest.mark.unit
def test_multibyte_character_split_across_tokens_is_held_back(tmp_path):
    write_tokenizer(tmp_path)
    tok = Tokenizer.from_dir(tmp_path)
    ids = tok.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1  # the 4 bytes are separate tokens in this small vocabulary
    decoder = tok.incremental_decoder()
    assert [decoder.step(t) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert decoder.step(ids[-1]) == "🙂"


@pytest.mark.unit
def test_special_tokens_and_missing_template(tmp_path):
    write_tokenizer(tmp_path)
    tok = Tokenizer.from_dir(tmp_path)
    assert (tok.bos_token, tok.bos_token_id, tok.eos_token, tok.eos_token_id) == ("<|bos|>", 1, "<|eos|>", 2)
    tok.chat_template = None
    with pytest.raises(ValueError, match="chat_template"):
        tok.apply_chat_template(CHATS[0])
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path / "nowhere")
