"""MTP drafts against n-gram drafts at batch 1 (issue #37), on a small DeepSeek-V3-shaped model
with an MTP layer trained here.

Random weights accept almost nothing, so the model is trained first, the way the built-in model
was (scripts/train_default_model.py: the Python standard library, its held-out files kept out,
the built-in model's byte-level BPE tokenizer), with DeepSeek-V3's objective: the main model's
next-token loss plus lambda x the MTP layer's loss on the token after next (the MTP reads the
main model's final-normed hidden state at p and the embedding of the token at p + 1; embedding
and head shared with the main model). transformers' DeepseekV3 runs the main layers and the MTP's
decoder layer; the checkpoint is written as tests/test_deepseek_mtp.py writes one.

Then, same run, alternating, --rounds rounds: greedy batch-1 generation of --new tokens after
64-token prompts cut from the held-out files, with no speculation, n-gram (k = 1 and k = 3) and
MTP (k = 1 and k = 3: the one layer chained). Reported: decode tokens/s (medians), the ratio to no speculation, the acceptance
rate (accepted / drafted, the engine's spec_decode counters).

    .venv/bin/python benchmarks/mtp_drafts.py --minutes 4 --rounds 3

`--cost`: instead, where a step's CPU time goes with and without MTP k=1 (acceptance aside: any
checkpoint, trained or not): the engine's forwards by rows (1: plain decode, 2: a verify of one
draft) and the MTP pass after each forward (MtpProposer.run), thread CPU per call, and the engine
steps' CPU per decoded token (which the acceptance moves), medians of --rounds, with
atomd/model/deepseek.py's batch-1 C layer on and off (FUSED). `--dtype bfloat16`: every mode's
engines in bf16.

`--tp N`: instead, chained MTP drafts under tensor parallelism (#41): no drafts, MTP k=1 and k=3
at TP=N against the same at TP=1, one thread a rank, batch 1, alternating each round; reported per
configuration the decode tokens per CPU second of the engine's processes together (rank 0 and its
workers: /proc's utime + stime, the workers' waits in the collectives included) and per wall
second, medians of --rounds, and the acceptance; greedy outputs asserted equal.

    .venv/bin/python benchmarks/mtp_drafts.py --minutes 1 --tp 2 --rounds 3 --prompts 2 --new 48
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time

import torch
import transformers
from safetensors.torch import load_file, save_file

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
from atomd.llm import LLM  # noqa: E402
from atomd.model.default import PACKAGED_CHECKPOINT  # noqa: E402
from contracts.sampling import SamplingParams  # noqa: E402
from train_default_model import corpus_files, read_source  # noqa: E402

MTP_WEIGHT = 0.3  # DeepSeek-V3's lambda for the first 10T tokens


def config(vocab: int, layers: int, hidden: int) -> transformers.DeepseekV3Config:
    """DeepSeek-V3's proportions scaled to `hidden` (64: 4 heads, q_lora 48, kv_lora 32)."""
    heads = max(4, hidden // 32)
    return transformers.DeepseekV3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, moe_intermediate_size=hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1,
        q_lora_rank=3 * hidden // 4, kv_lora_rank=hidden // 2, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)


def rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def train(out: pathlib.Path, layers: int, hidden: int, minutes: float, seq: int, batch: int, seed: int) -> dict:
    tok_file = PACKAGED_CHECKPOINT / "tokenizer.json"
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_file))
    vocab = tok.get_vocab_size()
    train_files, _ = corpus_files(pathlib.Path(sysconfig.get_paths()["stdlib"]))
    ids = [t for e in tok.encode_batch([read_source(f) for f in train_files]) for t in e.ids + [2]]
    stream = torch.tensor(ids, dtype=torch.long)
    torch.manual_seed(seed)
    # the last layer: the MTP's; eager experts (grouped_mm's backward is slower on CPU)
    full = transformers.AutoModelForCausalLM.from_config(config(vocab, layers + 1, hidden),
                                                         experts_implementation="eager")
    mtp = torch.nn.ParameterDict({"enorm": torch.nn.Parameter(torch.ones(hidden)),
                                  "hnorm": torch.nn.Parameter(torch.ones(hidden)),
                                  "head_norm": torch.nn.Parameter(torch.ones(hidden)),
                                  "eh_proj": torch.nn.Parameter(torch.randn(hidden, 2 * hidden) * 0.02)})
    params = list(full.parameters()) + list(mtp.parameters())
    opt = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)
    m = full.model
    mask = torch.full((seq, seq), float("-inf")).triu(1)[None, None]
    positions = torch.arange(seq)[None]
    g = torch.Generator().manual_seed(seed)
    started, step, log = time.monotonic(), 0, []
    full.train()
    while time.monotonic() - started < minutes * 60:
        starts = torch.randint(0, len(stream) - seq - 2, (batch,), generator=g)
        x_ids = torch.stack([stream[s:s + seq + 2] for s in starts.tolist()])
        tokens = x_ids[:, :seq]
        x = m.embed_tokens(tokens)
        pe = m.rotary_emb(x, positions)
        for layer in m.layers[:layers]:
            x = layer(x, attention_mask=mask, position_ids=positions, position_embeddings=pe)
            x = x[0] if isinstance(x, tuple) else x
        h = m.norm(x)
        main_loss = torch.nn.functional.cross_entropy(full.lm_head(h).flatten(0, 1), x_ids[:, 1:seq + 1].flatten())
        e = rms(m.embed_tokens(x_ids[:, 1:seq + 1]), mtp["enorm"])
        y = torch.cat([e, rms(h, mtp["hnorm"])], dim=-1) @ mtp["eh_proj"].T
        y = m.layers[layers](y, attention_mask=mask, position_ids=positions, position_embeddings=pe)
        y = y[0] if isinstance(y, tuple) else y
        mtp_logits = full.lm_head(rms(y, mtp["head_norm"]))
        mtp_loss = torch.nn.functional.cross_entropy(mtp_logits.flatten(0, 1), x_ids[:, 2:seq + 2].flatten())
        loss = main_loss + MTP_WEIGHT * mtp_loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if step % 25 == 0:
            log.append((step, round(main_loss.item(), 3), round(mtp_loss.item(), 3)))
            print(f"step {step} main {main_loss.item():.3f} mtp {mtp_loss.item():.3f}", flush=True)
    full.eval()
    full.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((PACKAGED_CHECKPOINT / name).read_bytes())
    p = f"model.layers.{layers}."
    tensors = load_file(out / "model.safetensors")
    tensors.update({p + "enorm.weight": mtp["enorm"].detach().clone(), p + "hnorm.weight": mtp["hnorm"].detach().clone(),
                    p + "eh_proj.weight": mtp["eh_proj"].detach().clone(),
                    p + "shared_head.norm.weight": mtp["head_norm"].detach().clone()})
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    hf = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**hf, "num_hidden_layers": layers, "num_nextn_predict_layers": 1}))
    params_main = sum(t.numel() for n, t in tensors.items() if not n.startswith(p))
    return {"steps": step, "seconds": round(time.monotonic() - started), "loss_log": log[-3:],
            "main_params": params_main, "mtp_params": sum(t.numel() for n, t in tensors.items() if n.startswith(p))}


SPECS = {"none": None, "ngram-k1": {"method": "ngram", "num_speculative_tokens": 1},
         "ngram-k3": {"method": "ngram", "num_speculative_tokens": 3}, "mtp-k1": {"method": "mtp", "num_speculative_tokens": 1},
         "mtp-k3": {"method": "mtp", "num_speculative_tokens": 3}}


def cost(path: pathlib.Path, rounds: int, new: int, dtype: str) -> int:
    """--cost (module docstring)."""
    import atomd.model.deepseek as deepseek
    from atomd.engine import mtp_proposer

    spent: dict[tuple, list[float]] = {}
    llms = {(fused, name): LLM(str(path), num_threads=1, max_model_len=512, enable_prefix_caching=False,
                               speculative_config=SPECS[name], dtype=dtype)
            for fused in (True, False) for name in ("none", "mtp-k1")}
    prompt = list(range(100, 164))
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    run = mtp_proposer.MtpProposer.run
    load = [os.getloadavg()[0]]
    for r in range(rounds + 1):  # round 0 warms every engine
        for (fused, name), llm in (llms.items() if r % 2 else reversed(llms.items())):
            totals: dict[str, list[float]] = {}

            def timed(part, fn):
                def wrapped(*a, **k):
                    t = time.thread_time()
                    try:
                        return fn(*a, **k)
                    finally:
                        key = part(*a) if callable(part) else part
                        totals.setdefault(key, []).append(time.thread_time() - t)
                return wrapped
            execute, step = llm.engine.runner.execute, llm.engine.step
            llm.engine.runner.execute = timed(lambda step, *_: f"forward, {int(sum(step.num_scheduled_tokens))} rows",
                                              execute)
            llm.engine.step = timed("engine step", step)
            mtp_proposer.MtpProposer.run = timed("MTP pass", run)
            deepseek.FUSED = fused
            try:
                llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
            finally:
                llm.engine.runner.execute, mtp_proposer.MtpProposer.run, deepseek.FUSED = execute, run, True
                del llm.engine.step  # the class's again
            if r:
                steps, part = totals.pop("engine step")[1:], "a decoded token (every step's work)"  # after the prompt's
                spent.setdefault((fused, name, part), []).append(sum(steps) / (new - 1) * 1e3)
                spent.setdefault((fused, name, part, "n"), []).append(len(steps))
                for part, ts in totals.items():
                    if not part.startswith("forward, 64"):  # the prompt's step
                        spent.setdefault((fused, name, part), []).append(statistics.mean(ts) * 1e3)
                        spent.setdefault((fused, name, part, "n"), []).append(len(ts))
        load.append(os.getloadavg()[0])
    print(f"{dtype}, one thread, {new} tokens after a 64-token prompt, {rounds} rounds, "
          f"load {min(load):.1f}-{max(load):.1f}")
    print("| batch-1 C layer | drafts | part | calls | CPU ms a call (median) |")
    print("|---|---|---|---:|---:|")
    for key in sorted(k for k in spent if len(k) == 3):
        fused, name, part = key
        print(f"| {'on' if fused else 'off'} | {name} | {part} | {statistics.median(spent[(*key, 'n')]):.0f} | "
              f"{statistics.median(spent[key]):.3f} |")
    return 0


def _cpu_s(pids: list[int]) -> float:
    """This process's CPU seconds plus those of `pids` (its TP workers) so far."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = time.process_time()
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    return total


def tensor_parallel(path: pathlib.Path, tp: int, prompts: list[list[int]], rounds: int, new: int) -> int:
    """--tp (module docstring)."""
    from benchmarks.machine import cpu_model, loadavg

    runs = {(size, name): LLM(str(path), num_threads=1, max_model_len=512, tensor_parallel_size=size,
                              speculative_config=SPECS[name])
            for size in (1, tp) for name in ("none", "mtp-k1", "mtp-k3")}
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    cpu_rates: dict[tuple, list[float]] = {key: [] for key in runs}
    wall_rates: dict[tuple, list[float]] = {key: [] for key in runs}
    outputs: dict[tuple, list] = {}
    load = [loadavg()]
    try:
        for r in range(rounds + 1):  # round 0 warms every engine up
            for key, llm in (runs.items() if r % 2 else reversed(runs.items())):
                pids = llm.engine.tp_workers.pids if llm.engine.tp_workers is not None else []
                cpu = wall = 0.0
                for prompt in prompts:  # batch 1: one request at a time
                    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, temperature=0.0),
                                 use_tqdm=False)
                    c, t = _cpu_s(pids), time.perf_counter()
                    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
                    cpu, wall = cpu + _cpu_s(pids) - c, wall + time.perf_counter() - t
                    outputs.setdefault(key, []).append(out.outputs[0].token_ids)
                if r:
                    cpu_rates[key].append(new * len(prompts) / cpu)
                    wall_rates[key].append(new * len(prompts) / wall)
            load.append(loadavg())
        base = outputs[(1, "none")]
        assert all(o == base for o in outputs.values()), "TP or speculation changed greedy output"
        print(f"\nCPU: {cpu_model()}; one thread a rank, {len(prompts)} prompts x {new} tokens a round, "
              f"{rounds} rounds; loadavg per round: {' | '.join(load)}")
        print(f"greedy outputs: {len({t for o in base for t in o})} distinct tokens in {sum(map(len, base))}")
        print("| TP | drafts | tok per CPU s (median) | rounds | tok per wall s (median) | acceptance |")
        print("|---:|---|---:|---|---:|---:|")
        for (size, name), llm in runs.items():
            s = llm.engine.stats()
            acc = (f"{s['spec_decode_num_accepted_tokens'] / s['spec_decode_num_draft_tokens']:.2f}"
                   if SPECS[name] else "-")
            print(f"| {size} | {name} | {statistics.median(cpu_rates[size, name]):.1f} | "
                  f"{' / '.join(f'{x:.1f}' for x in cpu_rates[size, name])} | "
                  f"{statistics.median(wall_rates[size, name]):.1f} | {acc} |")
        med = {key: statistics.median(v) for key, v in cpu_rates.items()}
        print(f"CPU-time ratios: TP={tp} k=3 / TP={tp} k=1 {med[tp, 'mtp-k3'] / med[tp, 'mtp-k1']:.2f}x, "
              f"TP={tp} k=3 / TP=1 k=3 {med[tp, 'mtp-k3'] / med[1, 'mtp-k3']:.2f}x, "
              f"TP={tp} k=3 / TP={tp} none {med[tp, 'mtp-k3'] / med[tp, 'none']:.2f}x, "
              f"TP=1 k=3 / TP=1 none {med[1, 'mtp-k3'] / med[1, 'none']:.2f}x")
    finally:
        for llm in runs.values():
            llm.engine.close()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=4.0, help="training time")
    ap.add_argument("--layers", type=int, default=4, help="main layers")
    ap.add_argument("--hidden", type=int, default=64, help="hidden size (heads, LoRA ranks scale with it)")
    ap.add_argument("--train-only", action="store_true", help="train into --dir and stop (measure later, quiet)")
    ap.add_argument("--seq", type=int, default=64, help="training sequence length")
    ap.add_argument("--batch", type=int, default=8, help="training batch")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="the engines' dtype")
    ap.add_argument("--dir", default=None, help="reuse a trained checkpoint directory")
    ap.add_argument("--cost", action="store_true", help="where a step's time goes, MTP k=1 vs none (module docstring)")
    ap.add_argument("--per-op", action="store_true", help="the per-op DeepSeek layer (deepseek.FUSED off): the A/B")
    ap.add_argument("--tp", type=int, default=0, help="MTP k=1 / k=3 at this TP size against TP=1 (module docstring)")
    args = ap.parse_args()
    torch.set_num_threads(1)  # one thread: the shared machine's other processes make more threads wait
    info = {}
    if args.dir and (pathlib.Path(args.dir) / "config.json").is_file():
        path = pathlib.Path(args.dir)
    else:
        path = pathlib.Path(args.dir or tempfile.mkdtemp(prefix="mtp_bench_"))
        path.mkdir(parents=True, exist_ok=True)
        info = train(path, args.layers, args.hidden, args.minutes, seq=args.seq, batch=args.batch, seed=0)
        print(json.dumps(info))
        (path / "training.json").write_text(json.dumps(info))
    if args.train_only:
        return 0
    if args.cost:
        return cost(path, args.rounds, args.new, args.dtype)
    if args.per_op:
        import atomd.model.deepseek as deepseek
        deepseek.FUSED = False
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    _, held = corpus_files(pathlib.Path(sysconfig.get_paths()["stdlib"]))
    held_ids = [t for f in held for t in tok.encode(read_source(f)).ids]
    prompts = [held_ids[i * 997:i * 997 + 64] for i in range(args.prompts)]
    if args.tp:
        return tensor_parallel(path, args.tp, prompts, args.rounds, args.new)
    llms = {name: LLM(str(path), num_threads=args.threads, max_model_len=512, speculative_config=spec,
                      dtype=args.dtype) for name, spec in SPECS.items()}
    params = SamplingParams(max_tokens=args.new, temperature=0.0, ignore_eos=True)
    rates: dict[str, list[float]] = {name: [] for name in SPECS}
    outputs = {}
    load = [os.getloadavg()[0]]
    for _ in range(args.rounds):
        for name, llm in llms.items():
            decode = 0.0
            for prompt in prompts:  # batch 1: one request at a time
                llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, temperature=0.0))
                started = time.perf_counter()
                out = llm.generate([{"prompt_token_ids": prompt}], params)[0]
                decode += time.perf_counter() - started
                outputs.setdefault(name, []).append(out.outputs[0].token_ids)
            rates[name].append(args.new * len(prompts) / decode)
        load.append(os.getloadavg()[0])
    base = outputs["none"]
    assert all(o == base for o in outputs.values()), "speculation changed greedy output"
    cpu = subprocess.run(["sh", "-c", "grep -m1 'model name' /proc/cpuinfo"], capture_output=True, text=True).stdout
    print(f"\nCPU: {cpu.strip()}  ({platform.machine()}), {args.dtype}, threads {args.threads}, "
          f"load {min(load):.1f}-{max(load):.1f}")
    print(f"uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    # a barely trained model loops: every drafter then accepts almost everything (say so)
    print(f"greedy outputs: {len({t for o in base for t in o})} distinct tokens in {sum(map(len, base))}")
    print("| batch 1 | tok/s (median) | rounds | vs none | acceptance |")
    print("|---|---:|---|---:|---:|")
    none = statistics.median(rates["none"])
    for name, llm in llms.items():
        s = llm.engine.stats()
        acc = (f"{s['spec_decode_num_accepted_tokens'] / s['spec_decode_num_draft_tokens']:.2f} "
               f"({s['spec_decode_num_accepted_tokens']}/{s['spec_decode_num_draft_tokens']})"
               if SPECS[name] else "-")
        med = statistics.median(rates[name])
        print(f"| {name} | {med:.1f} | {' / '.join(f'{r:.1f}' for r in rates[name])} | {med / none:.2f}x | {acc} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
