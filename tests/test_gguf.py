"""GGUF files (atomd/model/gguf_file.py, gguf_weights.py) written here with llama.cpp's own
`gguf` package from tiny random HF checkpoints: Llama (its q / k rows permuted as
convert_hf_to_gguf.py writes them), Qwen2 (q/k/v bias, tied embeddings), Qwen3 (q/k norm);
tensors quantised by gguf's numpy quantisers (Q8_0, Q4_0, BF16, F16), or random K-quant
blocks (Q4_K, Q5_K, Q6_K: gguf has no quantiser for them), the vocabulary and chat template
in the metadata. The reference is HF run on the weights as gguf's own dequantisers read them:
prompt logits within 2e-4 (both float32, summation order apart), 48 greedy ids equal.
"""
from __future__ import annotations

import json
import re
import shutil

import gguf
import numpy as np
import pytest
import torch
import transformers
from tokenizers import SentencePieceBPETokenizer
from tokenizers import Tokenizer as HFTokenizer

from atomd.llm import LLM
from atomd.model import gguf_file, gguf_weights
from atomd.model.quant import QuantizedWeight, qlinear
from atomd.tokenizer import Tokenizer
from contracts.sampling import SamplingParams
from tests.test_model_hf import CORPUS, _prompt_logits, hf_model, make_checkpoint, prompts_of
from tests.test_quant_engine import assert_equals_hf_on, hf_from_files, hf_greedy

pytestmark = pytest.mark.unit
torch.set_num_threads(1)
Q = gguf.GGMLQuantizationType
# hidden 256, intermediate 512: every linear's input a whole number of K-quant super-blocks
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
ROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
         "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
KINDS = {"attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o", "ffn_gate": "gate", "ffn_up": "up",
         "ffn_down": "down"}  # write_gguf's `types` keys of the layer linears
K_BLOCKS = {Q.Q2_K: 84, Q.Q3_K: 110, Q.Q4_K: 144, Q.Q5_K: 176, Q.Q6_K: 210}


EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
EXPERT_KINDS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}


def gguf_names(name: str) -> str:
    if name.endswith((".mlp.gate.weight", ".block_sparse_moe.gate.weight")):  # the MoE router
        return f"blk.{name.split('.')[2]}.ffn_gate_inp.weight"
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    if name == "lm_head.weight":
        return "output.weight"
    parts = name.split(".")  # model.layers.i.<module...>.weight|bias
    return f"blk.{parts[2]}.{LAYER['.'.join(parts[3:-1])]}.{parts[-1]}"


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's Llama q / k row order (rotary pairs interleaved)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_k_blocks(qtype, rows: int, cols: int, rng) -> np.ndarray:
    """Random K-quant super-blocks [rows, cols / 256 * bytes] with small fp16 scales (weights ~0.01)."""
    size = K_BLOCKS[qtype]
    b = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
    if qtype == Q.Q6_K:
        b[..., 208:210] = (rng.uniform(1e-5, 3e-5, (rows, cols // 256, 1))).astype(np.float16).view(np.uint8)
    elif qtype == Q.Q3_K:
        b[..., 108:110] = (rng.uniform(1e-4, 3e-4, (rows, cols // 256, 1))).astype(np.float16).view(np.uint8)
    elif qtype == Q.Q2_K:
        d = rng.uniform(5e-4, 1e-3, (rows, cols // 256, 2)).astype(np.float16)
        b[..., 80:84] = d.view(np.uint8)
    else:
        d = rng.uniform(2e-5 if qtype == Q.Q5_K else 5e-5, 1e-4, (rows, cols // 256, 2)).astype(np.float16)
        b[..., 0:4] = d.view(np.uint8)
    return b.reshape(rows, -1)


def write_gguf(float_dir, path, arch: str, types: dict[str, object], rng_seed: int = 0, tokenizer: str | None = "gpt2"):
    """The checkpoint as a GGUF file; `types`: tensor kind -> ggml type (keys: linear, v, down,
    embed, output, or a ggml type for all linears). Returns {HF name: float32 weight as gguf's
    dequantisers read it back, in HF's row order}."""
    from safetensors.numpy import load_file

    hf = json.loads((float_dir / "config.json").read_text())
    tensors = load_file(float_dir / "model.safetensors")
    rng = np.random.default_rng(rng_seed)
    w = gguf.GGUFWriter(str(path), arch)
    heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hf["hidden_size"])
    w.add_block_count(hf["num_hidden_layers"])
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    w.add_rope_freq_base(10000.0)
    if hf.get("head_dim"):
        w.add_key_length(hf["head_dim"])
        w.add_value_length(hf["head_dim"])
    if tokenizer:
        add_vocabulary(w, float_dir, tokenizer)
    experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
    if experts:  # llama.cpp's MoE keys; each layer's experts stacked [experts, out, in] per linear
        w.add_expert_count(experts)
        w.add_expert_used_count(hf["num_experts_per_tok"])
        if "moe_intermediate_size" in hf:
            w.add_expert_feed_forward_length(hf["moe_intermediate_size"])
    seen = {}
    stacks: dict[tuple[str, str], dict[int, tuple[str, np.ndarray]]] = {}
    for name, t in sorted(tensors.items()):
        m = EXPERT.fullmatch(name)
        if m:
            stacks.setdefault((m.group(1), EXPERT_KINDS[m.group(3)]), {})[int(m.group(2))] = (name, t)
            continue
        g = gguf_names(name)
        kind = ("embed" if g == "token_embd.weight" else "output" if g == "output.weight"
                else KINDS.get(g.split(".")[2]) if t.ndim == 2 else None)  # None: F32 (norms, the router)
        qtype = Q.F32 if kind is None else types.get(kind, types["linear"])
        rows_permuted = arch == "llama" and g.split(".")[-2] in ("attn_q", "attn_k")
        n_heads = heads if ".attn_q." in g else kv_heads
        data = permute(t, n_heads) if rows_permuted else t
        if qtype in K_BLOCKS:
            raw = random_k_blocks(qtype, *t.shape, rng)
        else:
            raw = gguf.quants.quantize(np.ascontiguousarray(data, np.float32), qtype)
        w.add_tensor(g, raw, raw_dtype=qtype)
        back = gguf.quants.dequantize(raw, qtype).reshape(t.shape).astype(np.float32)
        seen[name] = unpermute(back, n_heads) if rows_permuted else back
    for (layer, kind), by_expert in sorted(stacks.items()):
        names, ts = zip(*(by_expert[e] for e in range(experts)))
        qtype = types.get(kind, types["linear"])
        raw = gguf.quants.quantize(np.ascontiguousarray(np.stack(ts), np.float32), qtype)
        w.add_tensor(f"blk.{layer}.ffn_{kind}_exps.weight", raw, raw_dtype=qtype)
        back = gguf.quants.dequantize(raw, qtype).reshape(len(ts), *ts[0].shape).astype(np.float32)
        seen.update(zip(names, back))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return seen


def add_vocabulary(w, float_dir, model: str) -> None:
    """The HF tokenizer.json's byte-level BPE as convert_hf_to_gguf.py writes it (model gpt2;
    another name: a file claiming that model)."""
    tok = json.loads((float_dir / "tokenizer.json").read_text())
    vocab = {**tok["model"]["vocab"], **{a["content"]: a["id"] for a in tok["added_tokens"]}}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in tok["added_tokens"] if a["special"]}
    w.add_tokenizer_model(model)
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_chat_template(json.loads((float_dir / "tokenizer_config.json").read_text())["chat_template"])


@pytest.fixture(scope="module", autouse=True)
def cache_dir(tmp_path_factory):
    yield from module_cache_dir(tmp_path_factory)


def module_cache_dir(tmp_path_factory):
    """A module fixture's body: GGUF checkpoint directories go to a cache of the module's own
    (servers and workers started there inherit it); the compiled kernels stay the machine's:
    one build, not one per test run."""
    from atomd.model.default import cache_root

    kernels = cache_root() / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    root = tmp_path_factory.mktemp("cache")
    (root / "kernels").symlink_to(kernels, target_is_directory=True)
    mp = pytest.MonkeyPatch()
    mp.setenv("ATOMD_CACHE_DIR", str(root))
    yield root
    mp.undo()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-hf")
    return {"llama": make_checkpoint(root / "llama", "llama", seed=21, **SHAPE, **ROPE),
            "qwen2": make_checkpoint(root / "qwen2", "qwen2", seed=22, **SHAPE),
            "qwen3": make_checkpoint(root / "qwen3", "qwen3", seed=23, head_dim=64, **SHAPE)}


def hf_on(float_dir, weights: dict[str, np.ndarray]):
    import copy

    model = copy.deepcopy(hf_model(float_dir))
    with torch.no_grad():
        params = dict(model.named_parameters())
        for name, w in weights.items():
            params[name].copy_(torch.from_numpy(w))
        if model.config.tie_word_embeddings:
            assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


CASES = {  # id -> (arch, types)
    "llama-Q8_0": ("llama", {"linear": Q.Q8_0, "embed": Q.F32, "output": Q.Q8_0}),
    "llama-Q4_0": ("llama", {"linear": Q.Q4_0, "embed": Q.F16, "output": Q.Q4_0}),
    "llama-Q4_K_M-like": ("llama", {"linear": Q.Q4_K, "v": Q.Q6_K, "down": Q.Q5_K, "embed": Q.Q4_K,
                                    "output": Q.Q6_K}),
    "llama-F16": ("llama", {"linear": Q.F16, "embed": Q.F16, "output": Q.F16}),
    # the legacy types: Q4_1 with a Q5_1 v (q / k / v then int8), a Q5_0 down, a Q5_1 head
    "llama-Q4_1-Q5": ("llama", {"linear": Q.Q4_1, "v": Q.Q5_1, "down": Q.Q5_0, "embed": Q.F32, "output": Q.Q5_1}),
    "llama-Q3_K_M-like": ("llama", {"linear": Q.Q3_K, "v": Q.Q5_K, "down": Q.Q2_K, "embed": Q.F32, "output": Q.Q6_K}),
    "qwen2-Q8_0": ("qwen2", {"linear": Q.Q8_0, "embed": Q.Q8_0}),  # tied: the packed embedding is the head too
    "qwen3-Q4_0": ("qwen3", {"linear": Q.Q4_0, "embed": Q.BF16, "output": Q.Q8_0}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_gguf_file_equals_hf_on_its_dequantised_weights(case, checkpoints, tmp_path):
    arch, types = CASES[case]
    float_dir = checkpoints[arch]
    path = tmp_path / f"{case}.gguf"
    weights = write_gguf(float_dir, path, arch, types)
    llm = LLM(str(path), num_threads=1, max_model_len=256)
    layer = llm.engine.model.layers[0]
    if types["linear"] in (Q.F16, Q.BF16):
        assert not any(isinstance(t, QuantizedWeight) for t in layer.linears())
    else:  # packed as stored: int4 for the 4-bit types, int8 for the rest (and siblings of mixed types)
        bits = {Q.Q8_0: 8, Q.Q4_0: 4, Q.Q4_1: 4, Q.Q3_K: 8, Q.Q4_K: 4}[types["linear"]]
        assert isinstance(layer.o, QuantizedWeight) and layer.o.bits == bits
        assert isinstance(layer.gate_up, QuantizedWeight) and layer.gate_up.bits == bits
        assert isinstance(layer.qkv, QuantizedWeight) and layer.qkv.bits == (8 if "v" in types else bits)
        assert isinstance(layer.down, QuantizedWeight) and layer.down.bits == (8 if "down" in types else bits)
    head = llm.engine.model.lm_head
    packed_head = types.get("output" if "output" in types else "embed") not in (Q.F32, Q.F16, Q.BF16)
    assert isinstance(head, QuantizedWeight) == packed_head
    assert_equals_hf_on(llm, hf_on(float_dir, weights), 2 * 16 + 7, seed=12)


def test_q8_0_file_is_close_to_the_float_model(checkpoints, tmp_path):
    """Q8_0's own rounding against the float checkpoint it was written from (the random model's
    logits: mean |logit| 1.3): mean difference under 0.06 and max under 0.3 (measured 0.034 /
    0.19; Q4_0: 0.53 / 3.5), the argmax at every prompt position unchanged."""
    write_gguf(checkpoints["llama"], tmp_path / "m.gguf", "llama", {"linear": Q.Q8_0, "embed": Q.F32, "output": Q.Q8_0})
    llm = LLM(str(tmp_path / "m.gguf"), num_threads=1, max_model_len=256)
    prompt = prompts_of([24], seed=5)[0]
    with torch.inference_mode():
        want = hf_model(checkpoints["llama"])(torch.tensor([prompt])).logits[0]
    got = _prompt_logits(llm, prompt)
    diff = (got - want).abs()
    assert diff.mean() < 0.06 and diff.max() < 0.3
    assert diff.max() > 1e-5  # the quantised weights are what ran
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_tokenizer_and_chat_template_come_from_the_metadata(checkpoints, tmp_path):
    write_gguf(checkpoints["qwen2"], tmp_path / "m.gguf", "qwen2", {"linear": Q.Q8_0, "embed": Q.F32})
    from atomd.model.hub import model_path

    made = model_path(str(tmp_path / "m.gguf"))
    assert made == model_path(str(tmp_path))  # a directory holding one .gguf: the same
    ours, theirs = Tokenizer.from_dir(made), Tokenizer.from_dir(checkpoints["qwen2"])
    reference = HFTokenizer.from_file(str(checkpoints["qwen2"] / "tokenizer.json"))
    for text in [*CORPUS[:3], "  two  spaces\n\n\tand <|user|> special <|end|> tokens 12345 ünïcödé 🙂"]:
        assert ours.encode(text) == reference.encode(text).ids
        assert ours.decode(ours.encode(text)) == reference.decode(reference.encode(text).ids)
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(messages)
    assert (ours.bos_token, ours.eos_token) == (theirs.bos_token, theirs.eos_token)


def test_a_tokenizer_json_beside_the_file_is_used(checkpoints, tmp_path):
    """A GGUF without a vocabulary (or one atomd cannot rebuild), in a directory with the model's tokenizer."""
    write_gguf(checkpoints["qwen3"], tmp_path / "m.gguf", "qwen3", {"linear": Q.Q8_0, "embed": Q.F32},
               tokenizer=None)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(checkpoints["qwen3"] / f, tmp_path / f)
    llm = LLM(str(tmp_path), num_threads=1, max_model_len=256)
    out = llm.generate(["def main():"], SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 48 and isinstance(out.text, str)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_blocks_unpack_to_what_ggml_dequantises_and_the_kernel_multiplies(qtype):
    rng = np.random.default_rng(int(qtype))
    rows, cols = 40, 512
    raw = random_k_blocks(qtype, rows, cols, rng) if qtype in K_BLOCKS else \
        gguf.quants.quantize(rng.normal(0, 0.05, (rows, cols)).astype(np.float32), qtype)
    want = gguf.quants.dequantize(raw, qtype).reshape(rows, cols)
    info = gguf_file.TensorInfo("blk.0.attn_output.weight", (rows, cols), int(qtype), 0)
    ints = gguf_weights.int_weight(info, raw.reshape(-1))
    np.testing.assert_allclose(ints.dequantize(), want, rtol=1e-6, atol=1e-9)
    packed = ints.packed()
    np.testing.assert_allclose(packed.dequantize().numpy(), want, rtol=1e-6, atol=1e-9)
    x = torch.randn(3, cols)
    torch.testing.assert_close(qlinear(x, packed), x @ torch.from_numpy(want).T, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("edit,message", [
    ("tq1_0", "GGUF tensor .* is TQ1_0: atomd reads F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K"),
    ("arch", "GGUF architecture 'gemma' is not supported"),
    ("t5", "GGUF tokenizer model 't5' is not supported .*tokenizer.json beside"),
])
def test_unsupported_files_are_refused_by_name(edit, message, checkpoints, tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(checkpoints["qwen3"], path, "qwen3", {"linear": Q.TQ1_0 if edit == "tq1_0" else Q.Q8_0, "embed": Q.F32},
               tokenizer="t5" if edit == "t5" else "gpt2")
    if edit == "arch":  # general.architecture's value, the first 'qwen3' in the file (same length)
        path.write_bytes(path.read_bytes().replace(b"qwen3", b"gemma", 1))
    with pytest.raises(ValueError, match=message):
        LLM(str(path), num_threads=1, max_model_len=256)


def test_quantization_flag_on_a_quantized_file_is_refused(checkpoints, tmp_path):
    write_gguf(checkpoints["qwen3"], tmp_path / "m.gguf", "qwen3", {"linear": Q.Q4_0, "embed": Q.F32})
    with pytest.raises(ValueError, match="already quantized \\(GGUF"):
        LLM(str(tmp_path / "m.gguf"), num_threads=1, max_model_len=256, quantization="int8")


def test_serve_a_gguf_file(checkpoints, tmp_path):
    """`atomd serve --model file.gguf`: the API process's tokenizer and chat template and the
    engine's weights all from the file; greedy text equals HF on the dequantised weights."""
    import openai

    from tests.server_fixtures import start_server

    weights = write_gguf(checkpoints["qwen2"], tmp_path / "m.gguf", "qwen2", {"linear": Q.Q4_0, "embed": Q.F32})
    reference = HFTokenizer.from_file(str(checkpoints["qwen2"] / "tokenizer.json"))
    prompt = "def main():"
    want = hf_greedy(hf_on(checkpoints["qwen2"], weights), reference.encode(prompt).ids, 8)
    srv = start_server(str(tmp_path / "m.gguf"))
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
        out = client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=8,
                                        temperature=0, extra_body={"ignore_eos": True})
        assert out.choices[0].text == reference.decode(want)
        chat = client.chat.completions.create(model=out.model, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
        assert chat.usage.prompt_tokens == len(Tokenizer.from_dir(checkpoints["qwen2"]).encode_chat(
            [{"role": "user", "content": "hi"}]))
    finally:
        srv.stop()


def test_broken_files_are_refused_with_the_reason(checkpoints, tmp_path):
    from atomd.model.hub import model_path

    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="is not a GGUF file"):
        model_path(str(tmp_path / "junk.gguf"))
    write_gguf(checkpoints["qwen3"], tmp_path / "m.gguf", "qwen3", {"linear": Q.Q8_0, "embed": Q.F32})
    data = (tmp_path / "m.gguf").read_bytes()
    for cut, message in ((100, "ends inside its header"), (len(data) - 1000, "runs past the end of the file")):
        (tmp_path / "cut" / str(cut)).mkdir(parents=True)
        (tmp_path / "cut" / str(cut) / "m.gguf").write_bytes(data[:cut])
        with pytest.raises(ValueError, match=message):
            gguf_file.GGUFFile(tmp_path / "cut" / str(cut) / "m.gguf")
    (tmp_path / "two").mkdir()
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / "two" / name).write_bytes(data)
    with pytest.raises(ValueError, match="holds 2 .gguf files"):
        model_path(str(tmp_path / "two"))


def write_sentencepiece_gguf(path) -> list[str]:
    """A GGUF holding only a SentencePiece vocabulary as llama.cpp writes Llama 2's (model llama:
    unk / bos / eos, the 256 <0xNN> byte pieces, pieces with scores, no merges), plus a
    user-defined <think>; the pieces learned by tokenizers' SentencePiece BPE on CORPUS."""
    spm = SentencePieceBPETokenizer()
    spm.train_from_iterator(CORPUS + ["the quick brown fox jumps over the lazy dog"] * 20, vocab_size=200,
                            min_frequency=2, show_progress=False, special_tokens=["<unk>"])
    learned = json.loads(spm.to_str())["model"]["vocab"]
    pieces = [t for t, _ in sorted(learned.items(), key=lambda kv: kv[1]) if t != "<unk>"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["<think>"] + pieces
    T = gguf.TokenType
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * 260 + [-float(i) for i in range(len(pieces))])  # earlier pieces merge first
    w.add_token_types([T.UNKNOWN, T.CONTROL, T.CONTROL] + [T.BYTE] * 256 + [T.USER_DEFINED] + [T.NORMAL] * len(pieces))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tokens


def test_sentencepiece_vocabulary_tokenizes_as_transformers_reads_the_file(tmp_path):
    """transformers' own GGUF tokenizer (AutoTokenizer with gguf_file) is the reference: the same
    ids (bos first, merges recovered from the scores, bytes outside the vocabulary as <0xNN>,
    <think> whole) and the same text back."""
    write_sentencepiece_gguf(tmp_path / "spm.gguf")
    ours = HFTokenizer.from_str(json.dumps(gguf_file.tokenizer_json(gguf_file.GGUFFile(tmp_path / "spm.gguf"))))
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    texts = ["hello world", " leading space", "  two  spaces  ", "the quick brown fox", "naïve café 日本語 🙂 ☃",
             "<think>why</think> so", "def main():\n\tprint(1)\n", ""]
    for text in texts:
        ids = ours.encode(text).ids
        assert ids == ref(text)["input_ids"], text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
    assert ours.encode("naïve ☃").tokens[-3:] == ["<0xE2>", "<0x98>", "<0x83>"]  # byte fallback: not in CORPUS


def test_sentencepiece_without_scores_is_refused(tmp_path):
    tokens = write_sentencepiece_gguf(tmp_path / "spm.gguf")
    raw = (tmp_path / "spm.gguf").read_bytes().replace(b"tokenizer.ggml.scores", b"tokenizer.ggml.xxxxxx", 1)
    (tmp_path / "spm.gguf").write_bytes(raw)
    assert len(tokens) > 260
    with pytest.raises(ValueError, match="SentencePiece vocabulary without merges or one score per token"):
        gguf_file.tokenizer_json(gguf_file.GGUFFile(tmp_path / "spm.gguf"))


MOE_CASES = {  # the experts stored packed, the routers F32 (as llama.cpp keeps ffn_gate_inp)
    "qwen3moe-Q8_0": ("qwen3_moe", "qwen3moe", {"linear": Q.Q8_0, "embed": Q.F32, "output": Q.Q8_0}),
    "mixtral-Q4_0-Q8_0-down": ("mixtral", "llama", {"linear": Q.Q4_0, "down": Q.Q8_0, "embed": Q.F16,
                                                     "output": Q.Q4_0}),
}


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-moe")
    # llama.cpp renormalises the k routing weights (its qwen3moe always does): so does the reference
    return {"qwen3_moe": make_checkpoint(root / "qwen3_moe", "qwen3_moe", seed=24, head_dim=64, norm_topk_prob=True,
                                         moe_intermediate_size=64, **SHAPE),
            "mixtral": make_checkpoint(root / "mixtral", "mixtral", seed=25, **SHAPE, **ROPE)}


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_moe_gguf_equals_hf_on_its_dequantised_weights(case, moe_checkpoints, tmp_path):
    kind, arch, types = MOE_CASES[case]
    float_dir = moe_checkpoints[kind]
    weights = write_gguf(float_dir, tmp_path / "m.gguf", arch, types)
    llm = LLM(str(tmp_path / "m.gguf"), num_threads=1, max_model_len=256)
    model = llm.engine.model
    assert type(model).__name__ == {"qwen3_moe": "Qwen3MoeModel", "mixtral": "MixtralModel"}[kind]
    moe = model.layers[0].moe
    assert moe.quantized and len(moe.gate_up) == 8 and all(isinstance(w, QuantizedWeight) for w in moe.gate_up)
    assert moe.gate_up[0].bits == (8 if types["linear"] == Q.Q8_0 else 4) and moe.down[0].bits == 8
    assert_equals_hf_on(llm, hf_from_files(float_dir, weights, tmp_path / "hf"), 2 * 16 + 7, seed=12)


def test_moe_file_whose_expert_count_disagrees_with_its_tensors_is_refused(moe_checkpoints, tmp_path):
    write_gguf(moe_checkpoints["qwen3_moe"], tmp_path / "m.gguf", "qwen3moe", {"linear": Q.Q8_0, "embed": Q.F32})
    key = b"qwen3moe.expert_count"
    raw = bytearray((tmp_path / "m.gguf").read_bytes())
    at = raw.index(key) + len(key) + 4  # then the value type (uint32), then the count
    assert int.from_bytes(raw[at:at + 4], "little") == 8
    raw[at:at + 4] = (16).to_bytes(4, "little")
    (tmp_path / "m.gguf").write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"ffn_gate_exps.weight has shape \(8, 64, 256\): expected \[16 experts"):
        LLM(str(tmp_path / "m.gguf"), num_threads=1, max_model_len=64)


def test_expert_parallel_over_quantized_experts_is_refused(moe_checkpoints, tmp_path):
    from atomd.model.expert_parallel import ExpertParallel

    write_gguf(moe_checkpoints["mixtral"], tmp_path / "m.gguf", "llama", {"linear": Q.Q8_0, "embed": Q.F32})
    model = LLM(str(tmp_path / "m.gguf"), num_threads=1, max_model_len=64).engine.model
    with pytest.raises(ValueError, match="expert parallelism over quantized experts"):
        model.use_expert_parallel(ExpertParallel(None, 0, 2))
