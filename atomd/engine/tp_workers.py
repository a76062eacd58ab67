"""Tensor parallelism across processes: the engine core is TP rank 0 and drives N - 1 worker
processes it starts (`TPWorkers`), each running `python -m atomd.engine.tp_workers` (`main`).

Who does what. Rank 0 schedules, samples and talks to the API; before each forward it
broadcasts the step's inputs (`TPStep`: packed token ids, counts, block tables, the blocks to
copy) over the TP communicator (atomd/engine/tp_collective.py), then every rank runs its shard
of the same forward (atomd/model/tensor_parallel.py: two all-reduces a layer, the logits
gathered); the workers drop their logits. Only rank 0 has a scheduler: a worker's state is its
weights and its KV cache.

Where the KV lives. Every rank's cache (its own KV heads, an ordinary KVCache to its attention
kernels) is one slice of a single shared-memory tensor [N, blocks, layers, k|v, block, heads,
head_dim] that rank 0 creates in /dev/shm before it starts the workers and maps too; the name is
unlinked once every rank has mapped it. So rank 0 can read or write any worker's slice of a block
(`TPWorkers.kv_all`).

Lifetimes. A worker dies with rank 0 (PR_SET_PDEATHSIG, or a thread watching its parent where rank
0 started it off its main thread, and its wait for the next step notices rank 0's exit); rank 0
stops its workers on close (a stop message, then SIGKILL by PID after a deadline). A worker that dies makes rank 0's next collective raise CollectiveTimeout within the
TP timeout (the communicator checks its peers' PIDs): the step fails, the engine core reports
itself dead (the API answers 503 and errors the requests in flight) and kills the other workers.
"""
from __future__ import annotations

import collections
import ctypes
import logging
import math
import mmap
import os
import pathlib
import pickle
import secrets
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import torch

from atomd.engine.tp_collective import TPGroup, new_tp_group
from atomd.model.tensor_parallel import TensorParallel, load_tp_adapter

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
STOP_DEADLINE_S = 5.0  # a worker told to stop exits by then, or is killed
PARENT_POLL_S = 0.5  # a worker started off rank 0's main thread checks its parent this often
JOIN_TIMEOUT_S = 600.0  # every rank loads its shard before the join
LOADED = b"atomd-tp-worker-loaded"


class TPStep(msgspec.Struct, array_like=True, tag=True):
    """One forward's inputs as the workers need them (a ScheduledBatch's arrays, as bytes)."""

    stop: bool = False
    is_prefill: bool = False
    token_ids: bytes = b""  # int32
    num_scheduled: bytes = b""  # int32
    num_computed: bytes = b""  # int32
    needs_sample: bytes = b""  # bool
    block_tables: list[list[int]] = []
    seq_ids: list[int] = []
    all_logits: bool = False
    hidden_indices: bytes | None = None  # int64
    block_copies: list[tuple[int, int]] = []
    lora_paths: list[str | None] = []  # each sequence's LoRA adapter directory (None: the base model); [] none


class MtpStep(msgspec.Struct, array_like=True, tag=True):
    """After a step's sampling, with DeepSeek's MTP drafter (MtpProposer.run): each row's next token
    and the rows that draft, for every rank's share of the MTP layer's first pass."""

    next_ids: bytes  # int64
    rows: bytes  # int64


class MtpPass(msgspec.Struct, array_like=True, tag=True):
    """One chained MTP pass (MtpProposer._chain, k > 1), sent right before rank 0 runs it: the live
    chains' slots (rows of the first pass's drafting rows), their last drafts, positions and block
    tables (borrowed scratch blocks included)."""

    slots: bytes  # int64
    token_ids: bytes  # int64
    positions: bytes  # int64
    block_tables: list[list[int]]


# what rank 0 broadcasts; a worker runs each message as it comes (with MTP: a step, its first pass, its
# chained passes, as many as rank 0 announces)
WorkerMessage = TPStep | MtpStep | MtpPass


class _Seq:
    """What ModelRunner reads of a sequence on a worker: its adapter, named by its path (WorkerLoras)."""

    def __init__(self, lora_name: str | None):
        self.lora_name = lora_name


class StepBatch:
    """A TPStep as the ModelRunner reads a ScheduledBatch (sequences only for their LoRA adapter)."""

    def __init__(self, step: TPStep):
        self.is_prefill = step.is_prefill
        self.token_ids = np.frombuffer(step.token_ids, np.int32)
        self.num_scheduled_tokens = np.frombuffer(step.num_scheduled, np.int32)
        self.num_computed_tokens = np.frombuffer(step.num_computed, np.int32)
        self.needs_sample = np.frombuffer(step.needs_sample, np.bool_)
        self.block_tables, self.seq_ids = step.block_tables, step.seq_ids
        self.seqs = [_Seq(p) for p in step.lora_paths]


class WorkerLoras:
    """A worker's LoRA adapters by directory: loaded (its part: tensor_parallel.load_tp_adapter) the
    first time a step names one, the least recently used dropped past `max_loras` (rank 0's
    registry holds no more resident, and a step names only resident ones)."""

    def __init__(self, load: Any, max_loras: int):
        self.load, self.max_loras = load, max_loras
        self.resident: collections.OrderedDict[str, Any] = collections.OrderedDict()

    def hold(self, paths: list[str | None]) -> None:
        needed = {p for p in paths if p is not None}
        for path in needed:
            if path not in self.resident:
                self.resident[path] = self.load(path, path)
            self.resident.move_to_end(path)
        while len(self.resident) > max(self.max_loras, len(needed)):
            self.resident.popitem(last=False)


def step_of(batch: Any, all_logits: bool, hidden_indices: torch.Tensor | None, loras: Any = None) -> TPStep:
    """`loras`: rank 0's LoraRegistry (None: LoRA off)."""
    paths = [] if loras is None or all(s.lora_name is None for s in batch.seqs) else \
        [None if s.lora_name is None else loras.resident[s.lora_name].path for s in batch.seqs]
    return TPStep(lora_paths=paths, is_prefill=batch.is_prefill, token_ids=batch.token_ids.astype(np.int32).tobytes(),
                  num_scheduled=batch.num_scheduled_tokens.astype(np.int32).tobytes(),
                  num_computed=batch.num_computed_tokens.astype(np.int32).tobytes(),
                  needs_sample=batch.needs_sample.astype(np.bool_).tobytes(), block_tables=batch.block_tables,
                  seq_ids=batch.seq_ids, all_logits=all_logits,
                  hidden_indices=None if hidden_indices is None else hidden_indices.numpy().astype(np.int64).tobytes(),
                  block_copies=list(batch.block_copies))


def map_kv(path: str, shape: tuple[int, ...], dtype: torch.dtype, create: bool) -> tuple[mmap.mmap, torch.Tensor]:
    """The shared KV tensor of `shape` in file `path` (created zeroed by rank 0)."""
    nbytes = math.prod(shape) * dtype.itemsize
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600) if create else os.open(path, os.O_RDWR)
    try:
        if create:
            os.ftruncate(fd, nbytes)
        elif os.fstat(fd).st_size != nbytes:
            raise ValueError(f"{path} is {os.fstat(fd).st_size} bytes, expected {nbytes}")
        mm = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
    return mm, torch.frombuffer(mm, dtype=torch.uint8).view(dtype).view(shape)


@dataclass
class WorkerSpec:
    """What rank 0 hands a worker on its stdin (pickled)."""

    config: Any  # the EngineConfig
    model_dir: str
    rank: int
    group: TPGroup
    kv_path: str
    kv_shape: tuple[int, ...]
    dtype: torch.dtype
    parent_pid: int
    started_on_main_thread: bool  # the death signal follows the starting thread (_die_with_parent)
    kv_dtype: torch.dtype  # the cache's: the model's dtype, or a narrow one (--kv-cache-dtype)


class TPWorkers:
    """Rank 0's side: the shared KV cache, the worker processes, the communicator."""

    split: Any = None  # rank 0's TPSplit and the whole model's ModelConfig (start_workers)
    model_config: Any = None

    def __init__(self, config: Any, model_dir: str, kv_shape: tuple[int, ...], dtype: torch.dtype,
                 kv_dtype: torch.dtype | None = None):
        """kv_shape: one rank's cache [blocks, layers, planes, block, heads, head_dim] of kv_dtype (default dtype)."""
        kv_dtype = kv_dtype or dtype
        size = config.tensor_parallel_size
        self.group = new_tp_group(config.tp_communicator, size, timeout_s=config.tp_collective_timeout_s,
                                  join_timeout_s=JOIN_TIMEOUT_S)
        self.kv_path = os.path.join(SHM_DIR, f"atomd-tp-kv-{os.getpid()}-{secrets.token_hex(8)}")
        self._mm, self.kv_all = map_kv(self.kv_path, (size, *kv_shape), kv_dtype, create=True)
        self.comm = None
        self.procs: list[subprocess.Popen] = []
        try:
            for rank in range(1, size):
                proc = subprocess.Popen([sys.executable, "-m", "atomd.engine.tp_workers"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE)
                self.procs.append(proc)
                spec = WorkerSpec(config, str(model_dir), rank, self.group, self.kv_path, (size, *kv_shape), dtype,
                                  os.getpid(), threading.current_thread() is threading.main_thread(), kv_dtype)
                proc.stdin.write(pickle.dumps(spec))
                proc.stdin.close()
        except BaseException:
            self.close()
            raise
        log.info("tensor parallelism: %d ranks over %s, workers pid %s", size, config.tp_communicator,
                 [p.pid for p in self.procs])

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def wait_loaded(self, timeout_s: float = JOIN_TIMEOUT_S) -> None:
        """Until every worker says it loaded its shard (a line on its stdout); RuntimeError naming the
        rank at once if one exits first (a worker that never reached the join would otherwise be
        waited for the whole join timeout: the communicator only watches ranks that joined)."""
        deadline = time.monotonic() + timeout_s
        for rank, proc in enumerate(self.procs, start=1):
            while True:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"tensor parallelism: worker rank {rank} (pid {proc.pid}) did not load "
                                       f"its shard within {timeout_s} s")
                if not select.select([proc.stdout], [], [], 0.1)[0]:
                    continue
                line = proc.stdout.readline()
                if line.strip() == LOADED:
                    break
                if not line:  # end of file: the worker exited
                    raise RuntimeError(f"tensor parallelism: worker rank {rank} (pid {proc.pid}) exited with code "
                                       f"{proc.wait()} while loading its shard (its log says why)")

    def join(self, split: Any) -> TensorParallel:
        """Rank 0's TensorParallel, once every worker has loaded its shard and mapped the cache."""
        try:
            self.wait_loaded()
            self.comm = self.group.join(0)
        finally:
            _unlink(self.kv_path)  # mapped by every rank that joined; a failed join leaves no file either
        return TensorParallel(self.comm, split)

    def check_alive(self) -> None:
        """RuntimeError naming the first worker that has exited."""
        for rank, proc in enumerate(self.procs, start=1):
            if proc.poll() is not None:
                raise RuntimeError(f"tensor parallelism: worker rank {rank} (pid {proc.pid}) exited with code "
                                   f"{proc.returncode}")

    def broadcast(self, step: TPStep) -> None:
        self.comm.broadcast_bytes(msgspec.msgpack.encode(step))

    def send_mtp(self, next_ids: np.ndarray, rows: torch.Tensor) -> None:
        """The MTP layer's inputs of this step (MtpStep), before rank 0 runs its share of it."""
        self.comm.broadcast_bytes(msgspec.msgpack.encode(MtpStep(next_ids.astype(np.int64).tobytes(),
                                                                  rows.numpy().astype(np.int64).tobytes())))

    def send_mtp_pass(self, slots: list[int], token_ids: torch.Tensor, positions: torch.Tensor,
                      tables: list[list[int]]) -> None:
        """A chained MTP pass (MtpPass), before rank 0 runs its share of it."""
        self.comm.broadcast_bytes(msgspec.msgpack.encode(MtpPass(
            np.asarray(slots, np.int64).tobytes(), token_ids.numpy().astype(np.int64).tobytes(),
            positions.numpy().astype(np.int64).tobytes(), tables)))

    def close(self) -> None:
        """Stop the workers (a stop message while the group works, then SIGKILL by PID)."""
        told = False
        if self.comm is not None and getattr(self.comm, "broken", None) is None:
            try:
                self.broadcast(TPStep(stop=True))
                told = True
            except Exception as e:  # a broken group: killed at once below
                log.warning("tensor parallelism: stop message not delivered: %s", e)
        deadline = time.monotonic() + (STOP_DEADLINE_S if told else 0)
        for p in self.procs:
            try:
                p.wait(max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs = []
        if self.comm is not None:
            self.comm.close()
            self.comm = None
        _unlink(self.kv_path)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def uses_mtp(config: Any) -> bool:
    spec = config.speculative()
    return spec is not None and spec.method == "mtp"


def start_workers(config: Any, model_dir: Any, dtype: torch.dtype, pool_blocks: Any) -> tuple[TPWorkers, Any]:
    """Rank 0, before it loads its own shard: its TPSplit and the started workers (loading theirs
    meanwhile). pool_blocks(bytes per block of the whole engine) -> KV blocks (EngineLoop's)."""
    from atomd.engine.kv_cache import KVCache, check_kv_planes, kv_storage_dtype
    from atomd.model.loader import read_config, tp_split
    from atomd.model.tp_split import shard_config

    full = read_config(model_dir)
    split = tp_split(full, 0, config.tensor_parallel_size)
    local = shard_config(full, split)
    # what a rank caches a token and layer: its K and V heads, or MLA's whole latent row (one plane; the
    # same on every rank: each computes it from the unsplit kv_a_proj_with_mqa)
    planes, heads, head_dim = (1, 1, full.latent_dim) if getattr(full, "kv_lora_rank", 0) else \
        (2, local.num_kv_heads, local.head_dim)
    kv_dtype = kv_storage_dtype(config.kv_cache_dtype, dtype)  # narrow: each worker's heads 1 or 2 bytes a value
    check_kv_planes(kv_dtype, dtype, planes, config.kv_cache_dtype, full.architecture)  # before any worker starts
    layers = local.num_layers + uses_mtp(config)  # DeepSeek's MTP layer: one more latent layer
    per_rank = KVCache.bytes_per_block(layers, config.block_size, heads, head_dim, kv_dtype, planes)
    blocks = pool_blocks(per_rank * split.size)  # --kv-cache-memory is the whole engine's
    shape = (blocks, layers, planes, config.block_size, heads, head_dim)
    workers = TPWorkers(config, model_dir, shape, dtype, kv_dtype)
    workers.split, workers.model_config = split, full
    return workers, split


class TPRunner:
    """Rank 0's ModelRunner: each forward's inputs to the workers first, then its own shard."""

    def __init__(self, runner: Any, workers: TPWorkers):
        self.runner, self.workers = runner, workers

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)

    @property
    def loras(self) -> Any:  # the engine sets its LoraRegistry here: the ModelRunner's
        return self.runner.loras

    @loras.setter
    def loras(self, registry: Any) -> None:
        self.runner.loras = registry

    def execute(self, batch: Any, all_logits: bool = False, hidden_indices: torch.Tensor | None = None):
        self.workers.broadcast(step_of(batch, all_logits, hidden_indices, self.loras))
        return self.runner.execute(batch, all_logits=all_logits, hidden_indices=hidden_indices)


def _die_with_parent(parent_pid: int, by_signal: bool) -> None:
    """by_signal: SIGKILL when the thread that started this process exits (Linux's PR_SET_PDEATHSIG is
    per thread: right where rank 0's main thread started it); else a watcher thread exits when the
    parent process is gone (rank 0 built on a thread that ends before the engine does)."""
    if by_signal:
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
            return
        except (OSError, AttributeError):
            pass

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        os._exit(1)
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main() -> None:
    """A worker: load this rank's shard, map its cache slice, join, then run every step rank 0 sends."""
    spec: WorkerSpec = pickle.load(sys.stdin.buffer)
    _die_with_parent(spec.parent_pid, spec.started_on_main_thread)
    if os.getppid() != spec.parent_pid:  # rank 0 died before the death signal was armed
        return
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s tp{spec.rank} %(name)s: %(message)s")
    from atomd.engine.kv_cache import KVCache
    from atomd.engine.runner import ModelRunner
    from atomd.model.loader import load_model, read_config, tp_split

    cfg = spec.config
    torch.set_num_threads(cfg.num_threads_or_all())
    size = cfg.tensor_parallel_size
    split = tp_split(read_config(spec.model_dir), spec.rank, size)
    ep = cfg.enable_expert_parallel and cfg.data_parallel_size > 1  # TP x EP: rank 0 runs the routed experts
    model = load_model(spec.model_dir, spec.dtype, max_positions=cfg.max_model_len, quantization=cfg.quantization,
                       activations=cfg.quantized_activations, tp=split,
                       expert_shard=(cfg.data_parallel_rank, cfg.data_parallel_size) if ep else None)
    _mm, kv_all = map_kv(spec.kv_path, spec.kv_shape, spec.kv_dtype, create=False)
    _, blocks, layers, planes, block_size, heads, head_dim = spec.kv_shape
    kv_cache = KVCache(blocks, layers, block_size, heads, head_dim, spec.kv_dtype, planes, kv=kv_all[spec.rank],
                       compute_dtype=model.dtype)
    runner = ModelRunner(model, kv_cache, cfg.attention_backend)
    mtp = None
    if uses_mtp(cfg):  # its share of the MTP layer's passes (MtpStep, MtpPass)
        from atomd.engine.mtp_proposer import MtpShare
        from atomd.model.deepseek_mtp import load_mtp
        mtp = MtpShare(model, load_mtp(pathlib.Path(spec.model_dir), model, split), kv_cache, runner.kernels)
    if cfg.enable_lora:
        whole = read_config(spec.model_dir)
        runner.loras = WorkerLoras(lambda name, path: load_tp_adapter(name, path, whole, split, model.dtype,
                                                                      cfg.max_lora_rank), cfg.max_loras)
    sys.stdout.buffer.write(LOADED + b"\n")  # TPWorkers.wait_loaded
    sys.stdout.buffer.flush()
    comm = spec.group.join(spec.rank)
    model.use_tensor_parallel(TensorParallel(comm, split))
    decoder = msgspec.msgpack.Decoder(WorkerMessage)
    log.info("tensor parallelism: rank %d of %d ready (%d KV heads of each layer)", spec.rank, size, heads)
    ints = lambda raw: torch.from_numpy(np.frombuffer(raw, np.int64).copy())  # noqa: E731
    with torch.inference_mode():
        while True:
            step = decoder.decode(comm.broadcast_bytes(None, timeout_s=math.inf))
            if isinstance(step, MtpStep):  # the MTP layer's first pass, over the last step's rows
                mtp.first(ints(step.next_ids), ints(step.rows), out[1], *runner.last_step)
                continue
            if isinstance(step, MtpPass):
                mtp.chained(ints(step.slots), ints(step.token_ids), ints(step.positions), step.block_tables)
                continue
            if step.stop:
                break
            if step.block_copies:
                src, dst = zip(*step.block_copies)
                kv_cache.kv[list(dst)] = kv_cache.kv[list(src)]
            hidden = None if step.hidden_indices is None else ints(step.hidden_indices)
            if step.lora_paths:
                runner.loras.hold(step.lora_paths)
            out = runner.execute(StepBatch(step), all_logits=step.all_logits, hidden_indices=hidden)
    comm.close()


if __name__ == "__main__":
    main()
    # nothing left to flush but the log: skip the interpreter's teardown of torch (1.5-2 s of a
    # 2-core machine at load 20-30 per stop, which every engine close waited for)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
