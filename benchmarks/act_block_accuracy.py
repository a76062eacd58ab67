"""How much the int8 activations' block size costs in accuracy (#35: the act block that follows the
weight's group, docs/design.md "int8 activations"): logits of float32 activations against x quantised to
int8 per block of 32 / 64 / 128 / 256 inputs and per row, on the same int8 / int4 weights (`--quantization`).

The int8 rounding of x is simulated in torch (each block's d = max|x| / 127, xq = rint(x / d), x replaced
by xq * d before the float-activation kernels): the same values the C kernels take, float sums in another
order (1e-6 of the terms, far below what is measured here). A block larger than a weight's group leaves
that weight's x in float32 (int4's groups of 128: its rows at 256 are not int8 activations); "rule" is the
shipped contract: each weight's act block its group, capped at 256. Models: the built-in default model (trained:
real activations) with perplexity on its held-out stdlib files, and benchmarks.offline's random Llama.
Greedy agreement: tokens equal to float activations' over 64 generated tokens from each prompt.

    python -m benchmarks.act_block_accuracy [--tokens 512]
"""
from __future__ import annotations

import argparse
import pathlib
import sysconfig
import tempfile

import torch

from atomd.llm import LLM
from atomd.model import default, linear as linear_mod
from contracts.sampling import SamplingParams

BLOCKS = (32, 64, 128, 256, "row", "rule")  # rule: the weight's group, capped at 256 (quant.act_block_of)
ORIGINAL = linear_mod.qlinear


def fake_quant(x: torch.Tensor, block: int) -> torch.Tensor:
    m, k = x.shape
    xb = x.float().reshape(m, k // block, block)
    amax = xb.abs().amax(-1, keepdim=True)
    d = amax / 127
    inv = torch.where(amax > 0, 127 / torch.where(amax > 0, amax, torch.ones_like(amax)), torch.zeros_like(amax))
    return (torch.round(xb * inv) * d).reshape(m, k).to(x.dtype)


def set_block(block):
    """linear.qlinear with x rounded per `block` (None: float activations) where the weight's shape fits."""
    def patched(x, w, bias=None, lib="auto"):
        b = x.shape[1] if block == "row" else next((a for a in (256, 128, 64, 32) if w.group_size % a == 0), 0) \
            if block == "rule" else block
        if block is not None and w.bits != 16 and b and w.in_features % b == 0 and (block == "row" or w.group_size % b == 0):
            x = fake_quant(x, b)
        return ORIGINAL(x, w, bias, lib)
    linear_mod.qlinear = patched


def prompt_logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """Logits of every prompt position: one prefill step (max_num_batched_tokens covers the prompt)."""
    from scheduler.scheduler import ScheduledBatchOutput
    engine = llm.engine
    engine.add_request("logits", prompt, SamplingParams(max_tokens=1, temperature=0.0))
    batch = engine.scheduler.schedule()
    logits = engine.runner.execute(batch, all_logits=True)
    engine.scheduler.postprocess(batch, ScheduledBatchOutput(batch.seq_ids, [[3] for _ in batch.seq_ids]))
    engine._requests.pop("logits")
    assert logits.shape[0] == len(prompt)
    return logits


def measure(name: str, path: str, method: str, prompt: list[int], gen_prompts: list[list[int]]) -> None:
    floats = LLM(path, num_threads=1, max_model_len=2048, max_num_batched_tokens=2048, enable_prefix_caching=False)
    llm = LLM(path, num_threads=1, max_model_len=2048, max_num_batched_tokens=2048, quantization=method,
              enable_prefix_caching=False)
    llm.engine.model.decode_layer = None  # batch-1 decode per op, through the patched qlinear
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    ids = lambda m: [o.outputs[0].token_ids for o in m.generate([{"prompt_token_ids": p} for p in gen_prompts], params)]  # noqa: E731
    ref = prompt_logits(floats, prompt)
    set_block(None)
    base, base_ids = prompt_logits(llm, prompt), ids(llm)
    ppl = lambda lg: float(torch.exp(torch.nn.functional.cross_entropy(lg[:-1].float(), torch.tensor(prompt[1:]))))  # noqa: E731
    d = (base - ref).abs()
    print(f"\n{name}, {method} weights ({len(prompt)} tokens, mean |logit| {float(ref.abs().mean()):.3f}): "
          f"float model ppl {ppl(ref):.3f}; {method} weights + float32 activations ppl {ppl(base):.3f}, "
          f"their logits vs the float model mean {float(d.mean()):.4f} / max {float(d.max()):.4f}")
    print("| act block | mean abs diff | max abs diff | ppl | greedy tokens equal |")
    print("|---|---:|---:|---:|---:|")
    for block in BLOCKS:
        set_block(block)
        lg = prompt_logits(llm, prompt)
        got = ids(llm)
        same = sum(sum(a == b for a, b in zip(g, r)) for g, r in zip(got, base_ids))
        total = sum(len(r) for r in base_ids)
        d = (lg - base).abs()
        print(f"| {block} | {float(d.mean()):.4f} | {float(d.max()):.4f} | {ppl(lg):.3f} | {same}/{total} |")
    set_block(None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=512)
    args = ap.parse_args()
    torch.manual_seed(0)
    path = str(default.default_model_dir())
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    text = "".join((stdlib / f).read_text() for f in default.HELD_OUT_FILES)
    ids = tok(text)["input_ids"]
    prompt = ids[:args.tokens]
    gen = [ids[i:i + 24] for i in range(1000, 1000 + 8 * 300, 300)]
    for method in ("int8", "int4"):
        measure("default model (trained)", path, method, prompt, gen)
    from benchmarks.offline import SHAPE, make_checkpoint
    g = torch.Generator().manual_seed(5)
    with tempfile.TemporaryDirectory() as tmp:
        p = make_checkpoint(pathlib.Path(tmp) / "llama")
        ids = torch.randint(3, SHAPE["vocab_size"], (256 + 8 * 8,), generator=g).tolist()
        for method in ("int8", "int4"):
            measure("random Llama (benchmarks.offline's)", str(p), method, ids[:256],
                    [ids[256 + 8 * i:256 + 8 * i + 8] for i in range(8)])


if __name__ == "__main__":
    main()
