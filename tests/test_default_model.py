"""The built-in default model, checked against Hugging Face transformers as the reference."""
from __future__ import annotations

import math
import os
import pathlib
import subprocess
import sys
import sysconfig

import jinja2
import pytest
import torch
import transformers  # the reference implementation

from atomd.model import default
from atomd.model.default import HELD_OUT_FILES, PACKAGED_CHECKPOINT, default_model_dir

REPO = pathlib.Path(__file__).resolve().parent.parent
MARKERS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]


@pytest.fixture(scope="module")
def hf_model():
    torch.set_num_threads(1)
    return transformers.AutoModelForCausalLM.from_pretrained(PACKAGED_CHECKPOINT).eval()


@pytest.fixture(scope="module")
def hf_tokenizer():
    return transformers.AutoTokenizer.from_pretrained(PACKAGED_CHECKPOINT)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("ATOMD_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.unit
def test_packaged_checkpoint_is_a_small_gqa_llama(hf_model):
    assert default.is_intact(PACKAGED_CHECKPOINT)
    cfg = hf_model.config
    assert cfg.model_type == "llama" and type(hf_model).__name__ == "LlamaForCausalLM"
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # exercises the GQA path
    assert not cfg.tie_word_embeddings
    assert hf_model.lm_head.weight.data_ptr() != hf_model.model.embed_tokens.weight.data_ptr()
    weights = sum(p.stat().st_size for p in PACKAGED_CHECKPOINT.glob("*.safetensors"))
    assert weights <= 25 * 10**6


@pytest.mark.unit
def test_tokenizer_loads_both_ways_and_agrees(hf_tokenizer):
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(PACKAGED_CHECKPOINT / "tokenizer.json"))
    text = "def area(r):\n    return 3.14159 * r ** 2  # é\n"
    assert hf_tokenizer(text).input_ids == fast(text).input_ids
    assert hf_tokenizer(text).input_ids[0] == hf_tokenizer.bos_token_id
    assert hf_tokenizer.decode(hf_tokenizer(text).input_ids, skip_special_tokens=True) == text
    assert hf_tokenizer.eos_token == "<|eos|>" and hf_tokenizer.bos_token == "<|bos|>"
    for marker in MARKERS:  # each marker is one special token, never split
        assert len(hf_tokenizer.encode(marker, add_special_tokens=False)) == 1, marker


@pytest.mark.unit
def test_cache_created_from_scratch_and_idempotent(cache_dir):
    path = default_model_dir()
    assert path == cache_dir / "default-model"
    for src in PACKAGED_CHECKPOINT.iterdir():
        assert (path / src.name).read_bytes() == src.read_bytes(), src.name
    stamp = (path / "model.safetensors").stat()
    assert default_model_dir() == path
    again = (path / "model.safetensors").stat()
    assert (again.st_ino, again.st_mtime_ns) == (stamp.st_ino, stamp.st_mtime_ns)  # not rewritten
    assert sorted(p.name for p in cache_dir.iterdir()) == ["default-model"]  # no temp dirs left


@pytest.mark.unit
@pytest.mark.parametrize("damage", ["truncate_weights", "delete_tokenizer", "flip_config_byte"])
def test_corrupted_cache_is_repaired(cache_dir, damage):
    path = default_model_dir()
    if damage == "truncate_weights":
        with (path / "model.safetensors").open("r+b") as f:
            f.truncate(1000)
    elif damage == "delete_tokenizer":
        (path / "tokenizer.json").unlink()
    else:
        raw = bytearray((path / "config.json").read_bytes())
        raw[10] ^= 1
        (path / "config.json").write_bytes(bytes(raw))
    assert not default.is_intact(path)
    assert default_model_dir() == path
    assert default.is_intact(path)
    for src in PACKAGED_CHECKPOINT.iterdir():
        assert (path / src.name).read_bytes() == src.read_bytes(), src.name


@pytest.mark.unit
def test_held_out_cross_entropy_far_below_uniform(hf_model, hf_tokenizer):
    """A real language model: next-token loss on unseen stdlib source is far below log V."""
    source = pathlib.Path(sysconfig.get_paths()["stdlib"], HELD_OUT_FILES[0]).read_text()
    ids = torch.tensor(hf_tokenizer(source, verbose=False).input_ids)
    losses = []
    with torch.no_grad():
        for start in range(0, min(len(ids), 4096), 512):
            window = ids[start:start + 512][None]
            losses.append(hf_model(window, labels=window).loss.item())
    ce = sum(losses) / len(losses)
    assert ce < 0.6 * math.log(hf_model.config.vocab_size), ce


@pytest.mark.unit
def test_chat_template_renders_with_jinja2_and_round_trips(hf_tokenizer):
    messages = [{"role": "system", "content": "You write Python."},
                {"role": "user", "content": "Write a Python function: Return the sum."}]
    reference = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    template = jinja2.Environment().from_string(hf_tokenizer.chat_template)
    ours = template.render(messages=messages, add_generation_prompt=True,
                           bos_token=hf_tokenizer.bos_token, eos_token=hf_tokenizer.eos_token)
    assert ours == reference
    assert ours.startswith("<|bos|><|system|>\nYou write Python.<|end|>\n<|user|>\n")
    assert ours.endswith("<|end|>\n<|assistant|>\n")  # the generation prompt opens the assistant turn
    ids = hf_tokenizer.encode(ours, add_special_tokens=False)
    assert ids.count(hf_tokenizer.bos_token_id) == 1
    assert hf_tokenizer.decode(ids) == ours
    closed = template.render(messages=messages, add_generation_prompt=False,
                             bos_token=hf_tokenizer.bos_token, eos_token=hf_tokenizer.eos_token)
    assert closed.endswith("Return the sum.<|end|>\n")


@pytest.mark.unit
def test_generation_stops_at_end_of_turn(hf_model, hf_tokenizer):
    end = hf_tokenizer.convert_tokens_to_ids("<|end|>")
    assert set(hf_model.generation_config.eos_token_id) == {hf_tokenizer.eos_token_id, end}


@pytest.mark.integration
def test_make_default_model_cli_writes_a_loadable_folder(tmp_path):
    out = tmp_path / "ckpt"
    env = {**os.environ, "ATOMD_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", "atomd", "make-default-model", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert model.config.vocab_size == len(tok)
    assert not (tmp_path / "cache").exists()  # an explicit DIR leaves the cache alone


@pytest.mark.integration
def test_make_default_model_cli_defaults_to_the_cache(tmp_path):
    env = {**os.environ, "ATOMD_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", "atomd", "make-default-model"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(tmp_path / "cache" / "default-model")
    assert default.is_intact(tmp_path / "cache" / "default-model")


@pytest.mark.integration
def test_make_default_model_cli_refuses_a_foreign_directory(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    proc = subprocess.run([sys.executable, "-m", "atomd", "make-default-model", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "refusing to overwrite" in proc.stderr
    assert (tmp_path / "notes.txt").read_text() == "mine"
