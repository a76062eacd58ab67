#!/usr/bin/env python
"""HTTP serving throughput of `atomd serve` vs the offline engine on the same load.

The load: N concurrent greedy requests (token-id prompts, fixed seed), each generating
exactly --output-len tokens (ignore_eos). The offline side runs `LLM.generate` on all of
them in this process; the HTTP side starts `atomd serve` with the same engine flags and
streams every request at once through aiohttp. Both use the same torch thread count.
Reported per round (offline and HTTP interleaved): output tokens/s of each and their
ratio (target >= 0.9); output tokens per CPU second (server = API + engine core), which
a shared machine's neighbours disturb less than wall time; and the CPU seconds of the API
process, the engine core and this client during the HTTP run.

    .venv/bin/python -m benchmarks.serve_throughput --num-threads 1 --rounds 5
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import random
import statistics
import sys
import time

import aiohttp

from launch.process import EngineServer


def cpu_seconds(pid: int) -> float:
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]


def run_offline(args, prompts) -> dict:
    import torch

    from atomd import LLM, SamplingParams

    torch.set_num_threads(args.num_threads)
    llm = LLM(model=args.model, max_model_len=args.max_model_len, max_num_seqs=len(prompts),
              num_threads=args.num_threads)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    t0, cpu0 = time.perf_counter(), time.process_time()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    assert all(len(o.outputs[0].token_ids) == args.output_len for o in outs)
    del llm
    return {"wall": wall, "cpu": cpu}


async def one_request(session, url: str, prompt: list[int], output_len: int, stream: bool) -> int:
    body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    async with session.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        if not stream:
            return (await resp.json())["usage"]["completion_tokens"]
        usage = None
        async for line in resp.content:
            if b'"usage":{' in line:  # only the last event; the client stays light (it shares the CPUs)
                usage = json.loads(line[6:])["usage"]
    return usage["completion_tokens"]


async def http_load(url: str, prompts, output_len: int, stream: bool = True) -> list[int]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=3600)) as s:
        return await asyncio.gather(*(one_request(s, url, p, output_len, stream) for p in prompts))


def run_http(args, prompts) -> dict[str, dict]:
    """One server, the load twice: streamed (SSE) and plain JSON."""
    server = EngineServer(args.model, "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(len(prompts)),
                          "--num-threads", str(args.num_threads), log=os.devnull)
    try:
        server.wait_ready(600)
        asyncio.run(http_load(server.url, prompts[:1], 4))  # warm-up
        api_pid, core_pid = server.proc.pid, server.engine_pid()
        results = {}
        for mode in ("SSE", "JSON"):
            cpu0 = (cpu_seconds(api_pid), cpu_seconds(core_pid), time.process_time())
            t0 = time.perf_counter()
            counts = asyncio.run(http_load(server.url, prompts, args.output_len, stream=mode == "SSE"))
            wall = time.perf_counter() - t0
            cpu1 = (cpu_seconds(api_pid), cpu_seconds(core_pid), time.process_time())
            assert counts == [args.output_len] * len(prompts), counts
            api, core, client = (b - a for a, b in zip(cpu0, cpu1))
            results[mode] = {"wall": wall, "api_cpu": api, "core_cpu": core, "client_cpu": client}
        return results
    finally:
        server.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint dir (default: the built-in default model)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--num-threads", type=int, default=1,
                   help="torch threads of both engines (1: the API process gets the other core)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=5, help="offline/HTTP pairs, interleaved")
    args = p.parse_args()
    if args.model is None:
        from atomd.model.default import default_model_dir

        args.model = str(default_model_dir())
    from atomd.tokenizer import Tokenizer

    vocab = Tokenizer.from_dir(args.model).vocab_size
    prompts = make_prompts(args.num_requests, args.prompt_len, vocab, args.seed)
    tokens = args.num_requests * args.output_len

    print("| round | path | wall s | out tok/s | vs offline | out tok per CPU s | vs offline | CPU during the run |\n"
          "|---|---|---|---|---|---|---|---|")
    ratios: dict[str, list[tuple[float, float]]] = {"SSE": [], "JSON": []}
    for r in range(args.rounds):  # alternate, so a neighbour's burst hits both sides alike
        off, https = run_offline(args, prompts), run_http(args, prompts)
        off_tps, off_eff = tokens / off["wall"], tokens / off["cpu"]
        print(f"| {r} | offline LLM.generate | {off['wall']:.2f} | {off_tps:.0f} | 1.00 | {off_eff:.0f} | 1.00 | |")
        for mode, h in https.items():
            h_tps, h_eff = tokens / h["wall"], tokens / (h["api_cpu"] + h["core_cpu"])
            ratios[mode].append((h_tps / off_tps, h_eff / off_eff))
            print(f"| {r} | HTTP {mode} | {h['wall']:.2f} | {h_tps:.0f} | {h_tps / off_tps:.2f} | {h_eff:.0f} "
                  f"| {h_eff / off_eff:.2f} | API {h['api_cpu']:.2f} s = {100 * h['api_cpu'] / h['wall']:.1f}% "
                  f"of a core, {100 * h['api_cpu'] / (h['api_cpu'] + h['core_cpu']):.1f}% of server CPU; "
                  f"core {h['core_cpu']:.2f} s; client {h['client_cpu']:.2f} s |", flush=True)
    for mode, rs in ratios.items():
        print(f"\nmedian over {args.rounds} rounds, HTTP {mode} / offline: tokens/s "
              f"{statistics.median(w for w, _ in rs):.2f}, tokens per CPU second {statistics.median(c for _, c in rs):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
