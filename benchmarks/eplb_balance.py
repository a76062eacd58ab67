#!/usr/bin/env python
"""How much the hot-expert replicas (`--enable-eplb`, atomd/model/expert_parallel.py) even out
the expert-parallel ranks' work (issue 36), on skewed routing.

The Qwen3-MoE benchmark shape's sparse layer (64 experts, top-8) over 2 and 4 ranks. Routing
is drawn, not computed: each token picks 8 distinct experts with Zipf(s) popularity over a
random order of the experts (real MoE routers are skewed; s = 0 is uniform). A window of
tokens measures the load, `place_replicas` places R replicas a rank from it, and a fresh
window (the same popularity, new tokens) is dispatched through the engine's own slot table
(`slot_table`, `slots_of_pairs`): the figure is the busiest rank's (token, choice) pairs over
the mean (1.0: perfectly even), without replicas and with R = 1, 2, 4 a rank. It is what
bounds an EP layer's step: every rank waits for the busiest. Medians over --rounds seeds.

    .venv/bin/python -m benchmarks.eplb_balance --rounds 5
"""
from __future__ import annotations

import argparse
import platform
import statistics

import numpy as np
import torch

from atomd.model.expert_parallel import place_replicas, slot_table, slots_of_pairs
from benchmarks.machine import loadavg

EXPERTS, TOP_K, TOKENS = 64, 8, 4096


def draw_routing(popularity: np.ndarray, tokens: int, rng: np.random.Generator) -> torch.Tensor:
    """[tokens, TOP_K] distinct experts a token, drawn by popularity (Gumbel top-k)."""
    keys = np.log(popularity)[None, :] + rng.gumbel(size=(tokens, popularity.shape[0]))
    return torch.from_numpy(np.argsort(-keys, axis=1)[:, :TOP_K].copy())


def busiest_over_mean(ids_by_rank: list[torch.Tensor], replicas: np.ndarray, per: int) -> float:
    copy_slots, copies = slot_table(replicas, per)
    slots = torch.cat([slots_of_pairs(ids, r, copy_slots, copies) for r, ids in enumerate(ids_by_rank)])
    per_rank = torch.bincount(slots // (per + replicas.shape[1]), minlength=replicas.shape[0]).double()
    return float(per_rank.max() / per_rank.mean())


def one_round(ranks: int, skew: float, seed: int) -> dict[int, float]:
    rng = np.random.default_rng(seed)
    popularity = 1.0 / np.arange(1, EXPERTS + 1) ** skew
    popularity = popularity[rng.permutation(EXPERTS)]
    per = EXPERTS // ranks
    window = [draw_routing(popularity, TOKENS // ranks, rng) for _ in range(ranks)]
    load = torch.bincount(torch.cat(window).flatten(), minlength=EXPERTS).double().numpy()
    fresh = [draw_routing(popularity, TOKENS // ranks, rng) for _ in range(ranks)]
    out = {}
    for r in (0, 1, 2, 4):
        replicas = place_replicas(load, per, ranks, r) if r else np.full((ranks, 0), -1, dtype=np.int64)
        out[r] = busiest_over_mean(fresh, replicas, per)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    print(f"{platform.processor() or platform.machine()}, load {loadavg()}; {EXPERTS} experts top-{TOP_K}, "
          f"{TOKENS} tokens a window, medians over {args.rounds} seeds")
    print("| ranks | Zipf s | no replicas | 1 a rank | 2 a rank | 4 a rank |")
    print("|---|---|---|---|---|---|")
    for ranks in (2, 4):
        for skew in (0.0, 0.6, 1.0, 1.4):
            rounds = [one_round(ranks, skew, seed) for seed in range(args.rounds)]
            med = {r: statistics.median(x[r] for x in rounds) for r in (0, 1, 2, 4)}
            print(f"| {ranks} | {skew} | " + " | ".join(f"{med[r]:.3f}" for r in (0, 1, 2, 4)) + " |")


if __name__ == "__main__":
    main()
