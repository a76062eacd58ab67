"""The API process's handle on its engine core(s) (the API side of the IPC; no torch).

`EngineClient` is what the server uses; two classes satisfy it:
- `EngineCoreClient`: one core process (spawned here) over two ZMQ ipc sockets carrying
  the messages of atomd/messages.py. It watches the process sentinel: when the core dies
  every waiting request fails with `EngineDeadError` at once.
- `DPEngineClient`: N ranks, one EngineCoreClient each, each with its own KV cache and
  prefix cache. A new request goes to the least-loaded live rank (its requests in flight,
  i.e. waiting + running there; ties to the lower rank) unless the request names a rank;
  it stays on that rank for its lifetime (its stream lives in that rank's client, aborts
  follow it). The server is ready only while every rank lives: a DP engine with a dead
  rank is dead as a unit (vLLM's rule), though the requests already on the live ranks run
  to their end; with expert parallelism the live ranks cannot (they share the experts): one
  rank's death fails every rank's requests at once.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import re
import shutil
import socket
import tempfile
import time
from typing import Any, Callable, Protocol

import msgspec
import zmq
import zmq.asyncio

from atomd.engine.core import remove_ipc_sockets, run_engine_core
from atomd.sim.shared_cores import alive
from atomd.messages import (AbortRequests, AddRequest, InputMessage, OutputMessage, Ready, RequestOutput,
                            StepOutputs, UtilityCall, UtilityResult)
from kv_transfer.params import KVTransferParams
from contracts.sampling import SamplingParams

logger = logging.getLogger("atomd.api.core_client")
IPC_PREFIX = "atomd-core-"  # + the API process's pid + "-": the API <-> core ipc sockets' folder in /tmp
IPC_FOLDER = re.compile(re.escape(IPC_PREFIX) + r"(\d+)-\w+")

_SUMMED = ("num_running", "num_waiting", "num_free_blocks", "num_total_blocks", "prefix_cache_queries",
           "prefix_cache_hits", "num_preemptions", "num_window_released_blocks", "spec_decode_num_drafts",
           "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens", "lora_request_loads")


class EngineDeadError(RuntimeError):
    """The engine core process is gone (or failed to start)."""


class RequestStream:
    """Deltas of one request, pushed by the output reader, pulled by its HTTP handler."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    async def next_batch(self) -> list[RequestOutput]:
        """Every delta that arrived since the last call (at least one), coalesced so a slow
        writer catches up in one chunk instead of one chunk per token."""
        items = [await self.queue.get()]
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        for item in items:
            if isinstance(item, BaseException):
                raise item
        return items


class EngineClient(Protocol):
    """What the server needs of its engine, one core or N DP ranks."""

    dead: str | None  # why the engine is gone, or None

    @property
    def alive(self) -> bool: ...

    @property
    def streams(self) -> dict[str, RequestStream]: ...  # requests in flight, by id

    @property
    def aborting(self) -> set[str]: ...  # aborted here, the engine's confirmation still due

    async def start(self, timeout_s: float = 600.0) -> Ready: ...

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    kv_transfer_params: KVTransferParams | None = None,
                    dp_rank: int | None = None, lora_name: str | None = None) -> RequestStream: ...

    def abort(self, request_id: str) -> None: ...

    async def call(self, method: str, *args: Any, timeout_s: float = 5.0) -> Any: ...

    def silent_s(self) -> float: ...  # how long a core with requests in flight has said nothing

    async def shutdown(self, timeout_s: float = 5.0) -> None: ...


class EngineCoreClient:
    """The API process's handle on the core: start it, send requests, receive deltas."""

    def __init__(self, config: Any, on_abort_confirmed: Callable[[], None] | None = None):
        self.config = config
        self.on_abort_confirmed = on_abort_confirmed
        self.streams: dict[str, RequestStream] = {}
        self.aborting: set[str] = set()  # aborted here, the engine's final output still due
        self.calls: dict[int, asyncio.Future] = {}
        self.call_ids = itertools.count()
        self.dead: str | None = None  # why the core is gone
        self.on_dead: Callable[[str], None] | None = None  # called once, when this core is found dead
        self.last_heard = time.monotonic()  # the core's last message, or the start of its work
        self.ready: asyncio.Future[Ready] | None = None
        self.proc: multiprocessing.process.BaseProcess | None = None
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(OutputMessage)

    async def start(self, timeout_s: float = 600.0) -> Ready:
        """Spawn the core and wait for its Ready (or its death, or the deadline)."""
        loop = asyncio.get_running_loop()
        remove_dead_ipc_folders()
        self.ipc_dir = tempfile.mkdtemp(prefix=f"{IPC_PREFIX}{os.getpid()}-")
        in_addr, out_addr = f"ipc://{self.ipc_dir}/in", f"ipc://{self.ipc_dir}/out"
        self.sync_ctx, self.async_ctx = zmq.Context(), zmq.asyncio.Context()
        self.inp = self.sync_ctx.socket(zmq.PUSH)
        self.inp.setsockopt(zmq.SNDHWM, 0)  # never block the event loop on a send
        self.inp.bind(in_addr)
        self.out = self.async_ctx.socket(zmq.PULL)
        self.out.setsockopt(zmq.RCVHWM, 0)
        self.out.bind(out_addr)
        self.ready = loop.create_future()
        self.reader = asyncio.create_task(self.read_outputs())
        self.proc = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, args=(self.config, in_addr, out_addr, os.getpid()),
            name="atomd-engine-core", daemon=True)
        self.proc.start()
        loop.add_reader(self.proc.sentinel, self.on_core_exit)
        return await asyncio.wait_for(asyncio.shield(self.ready), timeout_s)

    @property
    def alive(self) -> bool:
        return self.dead is None and self.ready is not None and self.ready.done() \
            and not self.ready.exception()

    def send(self, msg: InputMessage) -> None:
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        self.inp.send(self.encoder.encode(msg), copy=False)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    kv_transfer_params: KVTransferParams | None = None,
                    dp_rank: int | None = None, lora_name: str | None = None) -> RequestStream:
        """`dp_rank`: this client is one rank; the server checked that any rank asked for is 0."""
        stream = RequestStream()
        self.send(AddRequest(request_id, prompt_token_ids, params, kv_transfer_params, lora_name))
        if not self.streams:  # an idle core owes nothing: its silence counts from now
            self.last_heard = time.monotonic()
        self.streams[request_id] = stream
        return stream

    def abort(self, request_id: str) -> None:
        """Forget the request here and free it in the engine (no-op once the core is dead)."""
        if self.streams.pop(request_id, None) is not None and self.dead is None:
            self.aborting.add(request_id)
            self.send(AbortRequests([request_id]))

    async def call(self, method: str, *args: Any, timeout_s: float = 5.0) -> Any:
        call_id = next(self.call_ids)
        fut = asyncio.get_running_loop().create_future()
        self.calls[call_id] = fut
        try:
            self.send(UtilityCall(call_id, method, list(args)))
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            self.calls.pop(call_id, None)

    async def read_outputs(self) -> None:
        while True:
            frame = await self.out.recv(copy=False)
            self.last_heard = time.monotonic()
            try:
                msg = self.decoder.decode(frame.buffer)
            except (msgspec.DecodeError, ValueError) as e:
                logger.error("undecodable frame from engine core: %s", e)
                continue
            if isinstance(msg, StepOutputs):
                self.dispatch(msg.outputs)
            elif isinstance(msg, UtilityResult):
                self.resolve(msg)
            elif isinstance(msg, Ready):
                self.ready.set_result(msg)
            elif msg.fatal:
                self.fail(msg.message)
            else:
                logger.error("engine core reported: %s", msg.message)

    def silent_s(self) -> float:
        """Seconds the core has said nothing while requests are in flight here (0 when none
        are): a core that steps answers every step, or between steps a utility call."""
        return time.monotonic() - self.last_heard if self.streams else 0.0

    def dispatch(self, deltas: list[RequestOutput]) -> None:
        for delta in deltas:
            stream = self.streams.get(delta.request_id)
            if stream is None:  # aborted here already: only the engine's confirmation matters
                if delta.finished and delta.request_id in self.aborting:
                    self.aborting.discard(delta.request_id)
                    if delta.finish_reason == "abort" and self.on_abort_confirmed:
                        self.on_abort_confirmed()
                continue
            if delta.finished:
                del self.streams[delta.request_id]
            stream.queue.put_nowait(delta)

    def resolve(self, res: UtilityResult) -> None:
        fut = self.calls.get(res.call_id)
        if fut is None or fut.done():
            return
        if res.error is not None:
            fut.set_exception(RuntimeError(res.error))
        else:
            fut.set_result(res.result)

    def on_core_exit(self) -> None:
        asyncio.get_running_loop().remove_reader(self.proc.sentinel)
        self.proc.join(1)  # the sentinel fires as the process exits; reap it for its exit code
        self.fail(self.dead or f"engine core process exited (exit code {self.proc.exitcode})")

    def fail(self, reason: str) -> None:
        """Fail everything waiting on the core, now and from here on."""
        first = self.dead is None
        if first:
            logger.error("engine core is dead: %s", reason)
        self.dead = reason
        err = EngineDeadError(reason)
        if self.ready is not None and not self.ready.done():
            self.ready.set_exception(err)
        for stream in self.streams.values():
            stream.queue.put_nowait(err)
        self.streams.clear()
        self.aborting.clear()
        for fut in self.calls.values():
            if not fut.done():
                fut.set_exception(err)
        if first and self.on_dead is not None:
            self.on_dead(reason)

    async def shutdown(self, timeout_s: float = 5.0) -> None:
        self.dead = self.dead or "engine core shut down"  # an expected exit, not an error to log
        if self.proc is not None and self.proc.is_alive():
            self.proc.terminate()
            deadline = asyncio.get_running_loop().time() + timeout_s
            while self.proc.is_alive() and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
            if self.proc.is_alive():
                self.proc.kill()
            self.proc.join(1)
        self.reader.cancel()
        self.inp.close(linger=0)
        self.out.close(linger=0)
        self.sync_ctx.term()
        self.async_ctx.term()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def remove_dead_ipc_folders(tmp: str | None = None) -> None:
    """The ipc folders of API processes that died together with their cores (a SIGKILLed process
    group: neither could remove its folder). The folder names its API process's pid; one whose
    process is gone holds only the two sockets, which nothing can connect to any more."""
    tmp = tmp or tempfile.gettempdir()
    for name in os.listdir(tmp):
        m = IPC_FOLDER.fullmatch(name)
        if m is None or alive(int(m.group(1))):
            continue
        folder = os.path.join(tmp, name)
        remove_ipc_sockets(f"ipc://{folder}/in", f"ipc://{folder}/out")


def rank_config(config: Any, rank: int, master_port: int) -> Any:
    """Rank `rank`'s EngineConfig: its index, the group's port, its KV-events port (+ rank)."""
    events = config.kv_events_endpoint
    if events is not None:
        m = re.fullmatch(r"(.*:)(\d+)", events)
        if m is None:
            raise ValueError(f"kv_events_endpoint must end in :PORT with data_parallel_size > 1, got {events!r}")
        events = f"{m.group(1)}{int(m.group(2)) + rank}"
    return msgspec.structs.replace(config, data_parallel_rank=rank, dp_master_port=master_port,
                                   kv_events_endpoint=events)


def make_engine_client(config: Any, on_abort_confirmed: Callable[[], None] | None = None) -> EngineClient:
    if config.data_parallel_size == 1:
        return EngineCoreClient(config, on_abort_confirmed=on_abort_confirmed)
    return DPEngineClient(config, on_abort_confirmed=on_abort_confirmed)


def _unused_loopback_port() -> int:
    """The DP ranks' gloo master port when --dp-master-port is unset: free now on 127.0.0.1,
    where this process spawns every rank (launch.process.free_port's job for launchers; atomd
    never imports launch, which starts it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DPEngineClient:
    """EngineCoreClient's interface over N ranks (see the module docstring)."""

    def __init__(self, config: Any, on_abort_confirmed: Callable[[], None] | None = None):
        port = config.dp_master_port or _unused_loopback_port()
        self.config = config
        self.first_rank = config.local_dp_ranks.start  # self.ranks[i] is DP rank first_rank + i
        self.ranks = [EngineCoreClient(rank_config(config, r, port), on_abort_confirmed=on_abort_confirmed)
                      for r in config.local_dp_ranks]
        if config.enable_expert_parallel:  # a rank on another host failing reaches here as our ranks' failure
            for r, c in zip(config.local_dp_ranks, self.ranks):
                c.on_dead = lambda reason, r=r: self.fail_all(f"expert-parallel DP rank {r} failed: {reason}")

    def fail_all(self, reason: str) -> None:
        """Every rank's requests fail now: an expert-parallel rank cannot step without the others."""
        for c in self.ranks:
            c.fail(reason)

    async def start(self, timeout_s: float = 600.0) -> Ready:
        readies = await asyncio.gather(*(c.start(timeout_s) for c in self.ranks))
        return readies[0]

    @property
    def alive(self) -> bool:
        return all(c.alive for c in self.ranks)

    @property
    def dead(self) -> str | None:
        return next((f"DP rank {r}: {c.dead}" for r, c in enumerate(self.ranks) if c.dead is not None), None)

    @property
    def streams(self) -> dict[str, RequestStream]:
        return {rid: s for c in self.ranks for rid, s in c.streams.items()}

    @property
    def aborting(self) -> set[str]:
        return set().union(*(c.aborting for c in self.ranks))

    def place(self, dp_rank: int | None) -> int:
        """The index in self.ranks of DP rank `dp_rank` (the server checked it runs here), or of
        the least busy live rank."""
        if dp_rank is not None:
            return dp_rank - self.first_rank
        live = [r for r, c in enumerate(self.ranks) if c.dead is None]
        if not live:
            raise EngineDeadError(self.dead)
        return min(live, key=lambda r: (len(self.ranks[r].streams) + len(self.ranks[r].aborting), r))

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    kv_transfer_params: KVTransferParams | None = None,
                    dp_rank: int | None = None, lora_name: str | None = None) -> RequestStream:
        return self.ranks[self.place(dp_rank)].add_request(request_id, prompt_token_ids, params,
                                                           kv_transfer_params, lora_name=lora_name)

    def rank_of(self, request_id: str) -> int | None:
        return next((r for r, c in enumerate(self.ranks) if request_id in c.streams), None)

    def abort(self, request_id: str) -> None:
        rank = self.rank_of(request_id)
        if rank is not None:
            self.ranks[rank].abort(request_id)

    async def call(self, method: str, *args: Any, timeout_s: float = 5.0) -> Any:
        """`stats`: the ranks' sums plus `ranks`, each rank's own; `kv_transfer_info`: rank 0's
        answer plus `ranks` (each rank has its own side channel); `kv_transfer_abort`: True when
        the rank holding the transfer revoked it; the LoRA ones: the first rank's error, else rank
        0's answer; any other utility (e.g. reset_prefix_cache) runs on every rank and answers
        True when every rank did."""
        if method == "load_lora_adapter":
            return await self._load_lora_everywhere(*args, timeout_s=timeout_s)
        results = await asyncio.gather(*(c.call(method, *args, timeout_s=timeout_s) for c in self.ranks))
        if "lora" in method:
            return next((r for r in results if isinstance(r, dict) and r.get("error")), results[0])
        if method == "kv_transfer_info":
            return {**results[0], "ranks": results}
        if method == "kv_transfer_abort":
            return any(results)
        if method != "stats":
            return all(results)
        total: dict[str, Any] = {k: sum(s.get(k, 0) for s in results) for k in _SUMMED}
        total["kv_cache_usage"] = sum(s["kv_cache_usage"] for s in results) / len(results)
        total["ranks"] = results
        return total

    async def _load_lora_everywhere(self, name: str, path: str, timeout_s: float) -> Any:
        """Every rank loads the adapter, or none keeps it: when one rank refuses (or does not
        answer) the others unload it again, so the ranks never differ; the answer is the first
        rank's error. A rank that did not answer may still load it: its unload queues behind."""
        results = await asyncio.gather(*(c.call("load_lora_adapter", name, path, timeout_s=timeout_s)
                                         for c in self.ranks), return_exceptions=True)
        refused = [isinstance(r, dict) and bool(r.get("error")) for r in results]
        failed = next(((rank, r) for rank, r in enumerate(results) if refused[rank] or isinstance(r, BaseException)),
                      None)
        if failed is None:
            return results[0]
        undo = [c for c, no in zip(self.ranks, refused) if not no]
        await asyncio.gather(*(c.call("unload_lora_adapter", name, timeout_s=timeout_s) for c in undo),
                             return_exceptions=True)
        rank, error = failed
        if isinstance(error, BaseException):
            return {"error": f"DP rank {rank} did not load LoRA adapter {name!r} "
                             f"({type(error).__name__}: {error}); no rank keeps it", "status": 503}
        return dict(error, error=f"DP rank {rank}: {error['error']} (no rank keeps the adapter)")

    def silent_s(self) -> float:
        return max(c.silent_s() for c in self.ranks)

    async def shutdown(self, timeout_s: float = 5.0) -> None:
        await asyncio.gather(*(c.shutdown(timeout_s) for c in self.ranks if c.proc is not None))
