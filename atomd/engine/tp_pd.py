"""PD with tensor parallelism: a TP engine's KV blocks on the wire in the TP=1 layout.

A TP=N engine's block is N per-worker slices in separate regions of its shared-memory cache
(atomd/engine/tp_workers.py), while the connector moves each block as one contiguous row of
a uint8 [blocks, block_bytes] array (zero-copy sends, kv_transfer/zmq_transport.check_kv). So
a TP engine in a PD role gives the connector a staging array of its blocks in the TP=1 layout
([layers, planes, block, every KV head, head_dim]) and converts locally with
contracts/kv_layout.convert_block:

- producer: after every forward, the blocks that forward wrote are gathered from the workers'
  slices into the staging rows (a served block is finished and pinned: no later forward
  writes it, so the sender thread reads settled bytes);
- consumer: when a pull lands (the connector reports it in get_finished), the blocks it wrote
  are scattered from the staging rows to every worker's slice (a replicated KV head to each
  worker holding it), before any forward reads them.

Every engine therefore shows its peers the TP=1 layout (its fingerprint is a TP=1 engine's),
and P with TP=a pairs with D with TP=b for any a, b that split the model. The price: a second
copy of the KV memory in a PD role and a copy of each moved block on each side.

`--tp-kv-transfer direct` (both sides the same TP size) skips the staging: the connector's rows
are the workers' slices as they lie in the shared cache (`direct_rows`: worker w's slice of block
b is row w * blocks + b), P grants and D pulls a block as its N slice rows (`TPDirectConnector`),
each landing in the same worker's slice on D. The fingerprint carries `tp_size` and `tp_rows`
(the blocks per worker, P's row stride), and a direct engine refuses a peer of another TP size.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from contracts.kv_layout import TPKVLayout, convert_block, holder, slices_match
from kv_transfer.params import tp_layout


class TPKVStaging:
    """The staging rows of a TP engine's cache `kv_all` [N, blocks, layers, planes, block, heads, head_dim]."""

    def __init__(self, kv_all: torch.Tensor, kv_heads: int, dtype: str):
        n, blocks, layers, planes, block_size, _, head_dim = kv_all.shape
        self.kv_all = kv_all
        self.layout = TPKVLayout(n, kv_heads, head_dim, planes, layers, block_size, dtype)
        self.wire = TPKVLayout(1, kv_heads, head_dim, planes, layers, block_size, dtype)
        self.blocks = np.zeros((blocks, self.wire.slice_bytes(0)), dtype=np.uint8)  # the connector's kv_blocks
        self._slices = [kv_all[w].view(blocks, -1).view(torch.uint8).numpy() for w in range(n)]
        self.copied_bytes = 0  # gathered and scattered: what --tp-kv-transfer direct does not copy

    def gather(self, block_ids) -> None:
        """The workers' slices of these blocks -> their staging rows."""
        for b in block_ids:
            convert_block(self.layout, self.wire, [s[b] for s in self._slices], out=[self.blocks[b]])
        self.copied_bytes += len(block_ids) * self.blocks.shape[1]

    def scatter(self, block_ids) -> None:
        """Staging rows of these blocks -> every worker's slice."""
        for b in block_ids:
            convert_block(self.wire, self.layout, [self.blocks[b]], out=[s[b] for s in self._slices])
        self.copied_bytes += len(block_ids) * self.blocks.shape[1]


def direct_rows(kv_all: torch.Tensor) -> np.ndarray:
    """The shared cache [N, blocks, ...] as the connector's uint8 rows, no copy: worker w's slice of
    block b is row w * blocks + b (each worker's slice of a block is contiguous)."""
    n, blocks = kv_all.shape[:2]
    return kv_all.view(torch.uint8).view(n * blocks, -1).numpy()


def slice_rows(block_ids, n: int, blocks: int) -> list[int]:
    """Each block's N slice rows (direct_rows of an engine with `blocks` blocks a worker), worker by worker."""
    return [w * blocks + b for w in range(n) for b in block_ids]


def direct_pull(producer: TPKVLayout, consumer: TPKVLayout, remote_ids, local_ids, producer_rows: int,
                consumer_rows: int) -> tuple[list[int], list[int], list[tuple[int, int]]]:
    """(P's rows, D's rows, replica copies) of a direct pull of P's blocks `remote_ids` into D's
    `local_ids` (contracts/kv_layout.slices_match holds: each of D's slices is one of P's, byte for
    byte). Each set of KV heads is pulled once, by the first of D's workers holding it, from the first
    of P's (rows of `producer_rows` / `consumer_rows` blocks a worker; a TP=1 layout has one worker);
    `copies` (from, to): D's workers that hold those heads too (replicated), copied locally on landing."""
    remote: list[int] = []
    local: list[int] = []
    copies: list[tuple[int, int]] = []
    first: dict[range, int] = {}
    for w in range(consumer.tp_size):
        heads = consumer.worker_heads(w)
        if heads in first:
            copies.append((first[heads], w))
            continue
        first[heads] = w
        s = holder(producer, heads.start)[0]
        remote += [s * producer_rows + b for b in remote_ids]
        local += [w * consumer_rows + b for b in local_ids]
    return remote, local, copies


class _SliceGrants:
    """P's sender, granting every worker's slice row of the blocks it is asked to pin."""

    def __init__(self, sender: Any, n: int, blocks: int):
        self.sender, self.n, self.blocks = sender, n, blocks

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sender, name)

    def grant(self, transfer_id: str, block_ids: list[int], access_token: str, lease_s: float) -> None:
        self.sender.grant(transfer_id, slice_rows(block_ids, self.n, self.blocks), access_token, lease_s)


class TPDirectConnector:
    """A connector over direct_rows (--tp-kv-transfer direct): P pins a block's N slice rows; D pulls
    into each of its workers' slices the slice of the P worker holding the same KV heads (P's TP size
    and row stride from its fingerprint: `tp_size`, `tp_rows`; a peer without `tp_rows` has the TP=1
    layout on the wire, one row a block), once per set of heads: D's workers that replicate those heads
    get a local copy when the pull lands, before the scheduler sees it. It is what the scheduler holds
    (it sees each remote sequence's params before its pull)."""

    def __init__(self, connector: Any, layout: TPKVLayout, blocks: int, rows: np.ndarray):
        self.connector, self.layout, self.blocks, self.rows = connector, layout, blocks, rows
        self._producers: dict[int, tuple[TPKVLayout, int]] = {}  # sequence id -> P's layout, blocks a worker
        self._copies: dict[int, tuple[list[tuple[int, int]], list[int]]] = {}  # sequence id -> copies, blocks
        self.copied_bytes = 0  # the replicas' local copies
        if connector.is_producer:
            connector.sender = _SliceGrants(connector.sender, layout.tp_size, blocks)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.connector, name)

    def update_state_after_alloc(self, seq: Any) -> None:
        self.connector.update_state_after_alloc(seq)
        compat = getattr(seq.kv_transfer_params, "compat", None)
        if isinstance(compat, dict):
            try:
                producer = tp_layout(compat, self.layout.planes)
            except ValueError:
                return  # compat_mismatch refuses the load, naming the field
            rows = compat.get("tp_rows", 0)
            self._producers[seq.id] = (producer, rows if isinstance(rows, int) and rows >= 0 else 0)

    def start_load_kv(self, meta: Any) -> None:
        for load in getattr(meta, "loads", ()):
            producer, rows = self._producers.pop(load.seq_id, (None, 0))
            # refused: compat_mismatch named the layouts (slices_match is checked there)
            if load.refused is None and producer is not None and slices_match(producer, self.layout):
                local = list(load.local_block_ids)
                load.remote_block_ids, load.local_block_ids, copies = direct_pull(
                    producer, self.layout, load.remote_block_ids, local, rows, self.blocks)
                if copies:
                    self._copies[load.seq_id] = (copies, local)
        self.connector.start_load_kv(meta)

    def get_finished(self) -> Any:
        out = self.connector.get_finished()
        for seq_id in out.finished_recving:
            copies, local = self._copies.pop(seq_id, ((), ()))
            for src, dst in copies:
                self.rows[[dst * self.blocks + b for b in local]] = self.rows[[src * self.blocks + b for b in local]]
                self.copied_bytes += len(local) * self.rows.shape[1]
        for seq_id in out.failed_recving:
            self._copies.pop(seq_id, None)
        return out


def written_blocks(batch: Any, block_size: int) -> list[int]:
    """The blocks a forward of `batch` writes KV into (each sequence's scheduled positions)."""
    out: list[int] = []
    for table, done, n in zip(batch.block_tables, batch.num_computed_tokens.tolist(),
                              batch.num_scheduled_tokens.tolist()):
        out += [b for b in table[done // block_size:(done + n - 1) // block_size + 1] if b >= 0]
    return out


class TPStagedConnector:
    """A consumer's connector whose landed pulls are scattered to the workers before the
    scheduler sees them (everything else is the wrapped connector's)."""

    def __init__(self, connector: Any, staging: TPKVStaging):
        self.connector, self.staging = connector, staging
        self._pulls: dict[int, list[int]] = {}  # sequence id -> the blocks its pull writes

    def __getattr__(self, name: str) -> Any:
        return getattr(self.connector, name)

    def start_load_kv(self, meta: Any) -> None:
        for load in getattr(meta, "loads", ()):
            self._pulls[load.seq_id] = list(load.local_block_ids)
        self.connector.start_load_kv(meta)

    def get_finished(self) -> Any:
        out = self.connector.get_finished()
        for seq_id in out.finished_recving:
            self.staging.scatter(self._pulls.pop(seq_id, ()))
        for seq_id in out.failed_recving:
            self._pulls.pop(seq_id, None)
        return out
