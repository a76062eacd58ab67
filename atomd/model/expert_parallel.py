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
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from atomd.model.moe import MoeWeights, expert, route


class ExpertParallel:
    """This rank's side of the sparse layers' exchange (module docstring)."""

    def __init__(self, comm: Any, rank: int, world_size: int):
        self.comm, self.rank, self.world_size = comm, rank, world_size
        self.num_exchanges = 0  # sparse-layer exchanges run (idle ones included): equal on every rank
        self.exchange_s = 0.0  # time inside the all-to-alls (waiting for the slowest rank included)

    def anyone_has_rows(self, mine: bool) -> bool:
        """Every rank, once a step before its forward (or its idle pass): does any rank run rows?"""
        return int(self.comm.all_reduce_sum(np.array([int(mine)], dtype=np.int64))[0]) > 0

    def moe(self, h: torch.Tensor, w: MoeWeights,
            routed: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The sparse block's output [T, hidden] for this rank's rows h [T, hidden] (T may be 0);
        `routed`: a family's own routing of those rows (moe.moe's)."""
        n, per, k = self.world_size, w.gate_up.shape[0], w.top_k
        rows, hidden = h.shape
        num_experts = per * n
        if rows:
            weights, ids = routed if routed is not None else route(h, w)
        else:  # nothing of its own: no routing, only its part in the exchange
            weights = torch.empty(0, k, dtype=h.dtype if w.cast_weights else torch.float32)
            ids = torch.empty(0, k, dtype=torch.int64)
        flat = ids.flatten()
        order = flat.argsort(stable=True)  # pairs grouped by expert: by owning rank, token order kept
        counts = torch.bincount(flat, minlength=num_experts)
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
        w.routed += sizes
        out = torch.empty_like(received)
        if not received.shape[0]:
            return out
        labels = torch.arange(per).repeat(n).repeat_interleave(recv_counts.flatten())
        order = labels.argsort(stable=True)  # rows grouped by local expert
        ends, sizes = sizes.cumsum(0).tolist(), sizes.tolist()
        for e in (e for e in range(per) if sizes[e]):
            group = order[ends[e] - sizes[e]:ends[e]]
            out.index_copy_(0, group, expert(received[group], w, e))
        return out

    def _all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int],
                    in_splits: list[int]) -> None:
        started = time.perf_counter()
        self.comm.all_to_all(out, inp, out_splits, in_splits)
        self.exchange_s += time.perf_counter() - started

    def stats(self) -> dict[str, Any]:
        return {"num_exchanges": self.num_exchanges, "exchange_s": self.exchange_s}
