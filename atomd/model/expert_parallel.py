"""Expert parallelism over the DP ranks: each rank holds 1/N of every sparse layer's experts
(contiguous: rank r has experts [r * E / N, (r + 1) * E / N)); attention and the KV cache stay
per rank, on its own requests.

Each step opens with one all-reduce on every rank, whether any rank has rows to run
(`anyone_has_rows`): when none has, no rank runs the exchanges (an idle server does not
spin through them every tick). Otherwise, per sparse layer, on every rank (an idle rank
with no rows of its own, so the collectives match; DecoderModel.idle_forward):
1. route its rows (the full router: every rank has every expert's row), sort the (token,
   choice) pairs by expert, which sorts them by owning rank too;
2. all-to-all the pair counts per expert: each rank learns how many rows every source sends
   to each of its experts, in (source, expert) order;
3. all-to-all the rows themselves, each pair's normed hidden state to its expert's rank;
4. run each local expert over its rows from every source (one GEMM per expert);
5. all-to-all the outputs back the way they came; the source scales them by the routing
   weights and sums each token's k as atomd/model/moe.py does (same roundings).

The transport is the DP group's (`comm.all_to_all` and `comm.all_reduce_sum`,
atomd/engine/dp_collective.py, gloo): one collective per step plus three per sparse layer,
every one under the group's timeout.

Hot experts (`--enable-eplb --num-redundant-experts R`, vLLM's EPLB flags): each rank also
holds R / N replica slots per sparse layer. Every `--eplb-step-interval` steps (the same step
on every rank: the ranks step in lockstep) the ranks all-reduce the (token, choice) pairs each
expert got since the last rebalance and each computes the same placement (`place_replicas`:
the hottest expert by load per copy goes to the least loaded rank that lacks it, until the
slots are full); the owners send the new replicas' weights to their slots in one all-to-all.
A (token, choice) pair then goes to one of its expert's copies (spread by token), so a hot
expert's rows are shared by several ranks; every copy holds the same weights, so the output
does not depend on which copy ran.
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from atomd.model.moe import MoeWeights, expert, grouped_experts, route


def place_replicas(load: np.ndarray, per_rank: int, ranks: int, slots: int) -> np.ndarray:
    """The experts each rank's `slots` replica slots hold ([ranks, slots], -1: empty) for one
    layer's expert load (pairs per expert, experts [r * per_rank, (r + 1) * per_rank) owned by
    rank r). Each copy of an expert carries load / copies; repeatedly the expert with the most
    load per copy gets one more copy, on the least loaded rank that neither owns nor holds it
    and has a free slot, if that lowers the busiest rank's load (else it gets no more copies).
    Deterministic (ties to the lower id), so every rank computes the same placement."""
    num = per_rank * ranks
    owner = np.arange(num) // per_rank
    copies = np.ones(num)
    held = np.full((ranks, slots), -1, dtype=np.int64)
    used = np.zeros(ranks, dtype=np.int64)
    blocked = np.zeros(num, dtype=bool)  # it gets no more copies

    def rank_loads(copies: np.ndarray, held: np.ndarray) -> np.ndarray:
        share = load / copies
        out = np.bincount(owner, weights=share, minlength=ranks)
        for q, row in enumerate(held):
            out[q] += share[row[row >= 0]].sum()
        return out

    while used.sum() < ranks * slots:  # each pass places a copy or blocks an expert: at most 2 E passes
        score = np.where(blocked, -1.0, load / copies)
        e = int(score.argmax())  # the first of equal scores
        if score[e] <= 0:
            break  # nothing left with load that could move: the other slots stay empty
        blocked[e] = True
        free = [q for q in range(ranks) if used[q] < slots and q != owner[e] and e not in held[q, :used[q]]]
        if not free:
            continue
        now = rank_loads(copies, held)
        q = min(free, key=lambda q: (now[q], q))
        trial_held, trial_copies = held.copy(), copies.copy()
        trial_held[q, used[q]] = e
        trial_copies[e] += 1
        if rank_loads(trial_copies, trial_held).max() < now.max() - 1e-9:
            held, copies = trial_held, trial_copies
            used[q] += 1
            blocked[e] = False
    return held


def slot_table(replicas: np.ndarray, per_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(copy_slots [E, most copies], copies [E]): the global slots holding each expert, its
    owner's first, -1 past its copies. A rank's slots: its per_rank experts, then its replica
    slots (replicas [ranks, slots]: the expert in each, -1 empty); global = rank * slots a rank
    + local."""
    ranks, slots = replicas.shape
    width = per_rank + slots
    table = [[e // per_rank * width + e % per_rank] for e in range(per_rank * ranks)]
    for q, row in enumerate(replicas.tolist()):
        for j, e in enumerate(row):
            if e >= 0:
                table[e].append(q * width + per_rank + j)
    most = max(len(t) for t in table)
    return (torch.tensor([t + [-1] * (most - len(t)) for t in table], dtype=torch.int64),
            torch.tensor([len(t) for t in table], dtype=torch.int64))


def slots_of_pairs(ids: torch.Tensor, rank: int, copy_slots: torch.Tensor, copies: torch.Tensor) -> torch.Tensor:
    """The global slot each (token, choice) pair of ids [T, k] runs on: one of its expert's
    copies, chosen by token (and by rank, so the ranks' first tokens start on different copies)."""
    flat = ids.flatten()
    copy = (torch.arange(flat.shape[0]) // ids.shape[1] + rank) % copies[flat]
    return copy_slots[flat, copy]


class ExpertParallel:
    """This rank's side of the sparse layers' exchange (module docstring)."""

    def __init__(self, comm: Any, rank: int, world_size: int, redundant_experts: int = 0,
                 rebalance_every: int = 0):
        if redundant_experts % world_size:
            raise ValueError(f"num_redundant_experts={redundant_experts} must be a multiple of the "
                             f"{world_size} ranks")
        self.comm, self.rank, self.world_size = comm, rank, world_size
        self.replica_slots = redundant_experts // world_size  # per rank and sparse layer
        self.rebalance_every = rebalance_every  # steps between rebalances (with replica slots)
        self.layers: list[MoeWeights] = []
        self.steps = 0  # anyone_has_rows calls: the same count on every rank
        self.num_exchanges = 0  # sparse-layer exchanges run (idle ones included): equal on every rank
        self.exchange_s = 0.0  # time inside the all-to-alls (waiting for the slowest rank included)
        self.num_rebalances = 0
        self.rebalance_s = 0.0

    def attach(self, w: MoeWeights) -> None:
        """A sparse layer of this rank joins: its global slot table, and its replica slots (empty
        until the first rebalance). A global slot is rank * slots_per_rank + local slot."""
        if w.quantized:
            raise ValueError("expert parallelism over quantized experts (a GGUF's) is not supported")
        per, r = w.gate_up.shape[0], self.replica_slots
        self.layers.append(w)
        w.slot_experts = torch.arange(w.first_expert, w.first_expert + per)
        if r:
            w.gate_up = torch.cat([w.gate_up, w.gate_up.new_zeros(r, *w.gate_up.shape[1:])])
            w.down = torch.cat([w.down, w.down.new_zeros(r, *w.down.shape[1:])])
            w.slot_experts = torch.cat([w.slot_experts, torch.full((r,), -1, dtype=torch.int64)])
        num = per * self.world_size
        w.replicas = np.full((self.world_size, r), -1, dtype=np.int64)  # every rank's replica slots
        w.window_load = torch.zeros(num, dtype=torch.int64)
        self._set_table(w)

    def _set_table(self, w: MoeWeights) -> None:
        w.copy_slots, w.copies = slot_table(w.replicas, w.gate_up.shape[0] - self.replica_slots)

    def anyone_has_rows(self, mine: bool) -> bool:
        """Every rank, once a step before its forward (or its idle pass): does any rank run rows?
        (And, every rebalance_every steps with replica slots, the rebalance: on every rank.)"""
        anyone = int(self.comm.all_reduce_sum(np.array([int(mine)], dtype=np.int64))[0]) > 0
        self.steps += 1
        if self.replica_slots and self.rebalance_every and self.steps % self.rebalance_every == 0:
            self.rebalance()
        return anyone

    def rebalance(self) -> None:
        """Every rank at the same step: the experts' load since the last rebalance, summed over the
        ranks; the same new placement computed everywhere; the replicas' weights moved."""
        started = time.perf_counter()
        window = np.concatenate([w.window_load.numpy() for w in self.layers])
        load = self.comm.all_reduce_sum(window)
        for i, w in enumerate(self.layers):
            num = w.window_load.shape[0]
            per = num // self.world_size
            if not load[i * num:(i + 1) * num].any():
                continue  # no rows since the last rebalance (an idle server): nothing learned, keep it
            new = place_replicas(load[i * num:(i + 1) * num].astype(np.float64), per, self.world_size,
                                 self.replica_slots)
            self._move_replicas(w, new, per)
            w.window_load.zero_()
        self.num_rebalances += 1
        self.rebalance_s += time.perf_counter() - started

    def _move_replicas(self, w: MoeWeights, new: np.ndarray, per: int) -> None:
        """Each changed replica slot gets its expert's weights from the expert's owner (one
        all-to-all of whole experts; none at all when no slot changed on any rank)."""
        changed = [(q, j, int(e)) for q in range(self.world_size) for j, e in enumerate(new[q])
                   if e >= 0 and e != w.replicas[q, j]]
        w.replicas = new
        w.slot_experts[per:] = torch.from_numpy(new[self.rank].copy())
        self._set_table(w)
        if not changed:
            return
        gate_up, down = w.gate_up, w.down
        sizes = (gate_up[0].numel(), down[0].numel())
        first = self.rank * per
        # to each rank q, in slot order: the experts this rank owns that q's changed slots now hold
        sends = [[e for q2, _, e in changed if q2 == q and e // per == self.rank] for q in range(self.world_size)]
        mine = [(j, e) for q, j, e in changed if q == self.rank]  # in slot order
        # from each owner o, in slot order: this rank's changed slots holding o's experts
        recv = [[(j, e) for j, e in mine if e // per == o] for o in range(self.world_size)]
        flat = [torch.cat([gate_up[e - first].flatten(), down[e - first].flatten()]) for q in sends for e in q]
        inp = torch.stack(flat) if flat else gate_up.new_empty(0, sum(sizes))
        out = gate_up.new_empty(len(mine), sum(sizes))
        self._all_to_all(out, inp, [len(r) for r in recv], [len(s) for s in sends])
        for row, (j, _) in zip(out, (je for r in recv for je in r)):
            gate_up[per + j].copy_(row[:sizes[0]].view_as(gate_up[per + j]))
            down[per + j].copy_(row[sizes[0]:].view_as(down[per + j]))

    def moe(self, h: torch.Tensor, w: MoeWeights,
            routed: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The sparse block's output [T, hidden] for this rank's rows h [T, hidden] (T may be 0);
        `routed`: a family's own routing of those rows (moe.moe's)."""
        n, per, k = self.world_size, w.gate_up.shape[0], w.top_k  # per: slots a rank (replicas included)
        rows, hidden = h.shape
        if rows:
            weights, ids = routed if routed is not None else route(h, w)
        else:  # nothing of its own: no routing, only its part in the exchange
            weights = torch.empty(0, k, dtype=h.dtype if w.cast_weights else torch.float32)
            ids = torch.empty(0, k, dtype=torch.int64)
        flat = ids.flatten()
        if self.replica_slots:  # each pair to one of its expert's copies: the global slot that runs it
            w.window_load += torch.bincount(flat, minlength=w.window_load.shape[0])
            flat = slots_of_pairs(ids, self.rank, w.copy_slots, w.copies)
        order = flat.argsort(stable=True)  # pairs grouped by slot: by the rank running it, token order kept
        counts = torch.bincount(flat, minlength=per * n)
        recv_counts = torch.empty_like(counts)  # [source, local expert]: pairs each source sends here
        self._all_to_all(recv_counts, counts, [per] * n, [per] * n)
        recv_counts = recv_counts.view(n, per)
        send_splits = counts.view(n, per).sum(1).tolist()
        recv_splits = recv_counts.sum(1).tolist()
        received = h.new_empty(sum(recv_splits), hidden)
        self._all_to_all(received, h[order // k], recv_splits, send_splits)
        outputs = self._local_experts(received, recv_counts, w)
        back = h.new_empty(rows * k, hidden)
        self._all_to_all(back, outputs, send_splits, recv_splits)
        self.num_exchanges += 1
        scales = weights.flatten()[order].unsqueeze(1)
        pairs = torch.empty(rows * k, hidden, dtype=h.dtype if w.cast_weights else torch.float32)
        pairs.index_copy_(0, order, back * scales)
        return pairs.view(rows, k, hidden).sum(dim=1).to(h.dtype)

    def _local_experts(self, received: torch.Tensor, recv_counts: torch.Tensor, w: MoeWeights) -> torch.Tensor:
        """Each local expert over its rows from every source; the outputs in the received order."""
        n, per = recv_counts.shape
        sizes = recv_counts.sum(0)
        held = w.slot_experts >= 0  # an empty replica slot gets no rows
        w.routed.index_add_(0, w.slot_experts[held], sizes[held])
        out = torch.empty_like(received)
        if not received.shape[0]:
            return out
        labels = torch.arange(per).repeat(n).repeat_interleave(recv_counts.flatten())
        order = labels.argsort(stable=True)  # rows grouped by local expert
        ones = torch.ones(len(order), dtype=out.dtype)  # unscaled: the source rank weights its pairs
        ends, counts = sizes.cumsum(0).tolist(), sizes.tolist()
        for e in grouped_experts(received, w, sizes, order, 1, ones, out):  # as the whole block runs each expert
            group = order[ends[e] - counts[e]:ends[e]]
            out.index_copy_(0, group, expert(received[group], w, e))
        return out

    def _all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int],
                    in_splits: list[int]) -> None:
        started = time.perf_counter()
        self.comm.all_to_all(out, inp, out_splits, in_splits)
        self.exchange_s += time.perf_counter() - started

    def stats(self) -> dict[str, Any]:
        return {"num_exchanges": self.num_exchanges, "exchange_s": self.exchange_s,
                "num_rebalances": self.num_rebalances, "rebalance_s": self.rebalance_s}
