"""EngineCore: the LLMEngine loop in its own process, and the API process's client for it.

The API process (aiohttp, tokenizer, SSE) and the engine (torch, scheduler) share no
interpreter, so a slow forward never stalls HTTP and a crashed engine never takes the
server's answers with it. They talk over two ZMQ PUSH/PULL ipc sockets carrying msgspec
msgpack; each socket has exactly one writer (ZMQ sockets are not thread-safe):

  API -> core (input)    AddRequest       prompt token ids + SamplingParams (+ kv_transfer_params)
                         AbortRequests    ids whose client went away: the engine frees their blocks
                         UtilityCall      stats / reset_prefix_cache / ...: one UtilityResult each
  core -> API (output)   Ready            sent once, after the engine is built
                         StepOutputs      one per engine step: the token deltas of every request
                         UtilityResult    the answer to a UtilityCall (result or error)
                         CoreError        a frame the core could not decode (the loop goes on),
                                          or a fatal error just before the core exits

The core blocks on its input socket while idle (no spin) and drains it without blocking
between steps, so aborts land before the next forward; a step with no output (a chunk of
a long prefill, or nothing runnable yet) is followed by a 1 ms wait on the socket. The client watches the process
sentinel: when the core dies every waiting request fails with `EngineDeadError` at once.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import shutil
import tempfile
import traceback
from typing import Any, Callable

import msgspec
import zmq
import zmq.asyncio

from scheduler.sequence import SamplingParams

logger = logging.getLogger("atomd.core")

IDLE_POLL_MS = 1000  # how often an idle core wakes to check its parent is still alive
STALLED_POLL_MS = 1  # busy but the last step had no output: wait on the socket, do not spin
SERVING_POLL_MS = 10  # a producer whose only work is pinned blocks: poll for their release
UTILITY_METHODS = ("stats", "reset_prefix_cache", "kv_transfer_info", "kv_transfer_abort")


# ---------------------------------------------------------------- wire messages

class AddRequest(msgspec.Struct, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    kv_transfer_params: dict[str, Any] | None = None


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class UtilityCall(msgspec.Struct, tag="utility"):
    call_id: int
    method: str
    args: list[Any] = []


class TokenDelta(msgspec.Struct, array_like=True):
    """One engine RequestOutput on the wire; `timing` only on the finished delta."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[Any] | None
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    kv_transfer_params: dict[str, Any] | None = None
    error: str | None = None
    # engine clock: (arrival, first_scheduled, first_token, finished)
    timing: tuple[float | None, float | None, float | None, float | None] | None = None


class Ready(msgspec.Struct, tag="ready"):
    model_name: str


class StepOutputs(msgspec.Struct, tag="outputs"):
    outputs: list[TokenDelta]


class UtilityResult(msgspec.Struct, tag="result"):
    call_id: int
    result: Any = None
    error: str | None = None


class CoreError(msgspec.Struct, tag="error"):
    message: str
    fatal: bool = False


InputMessage = AddRequest | AbortRequests | UtilityCall
OutputMessage = Ready | StepOutputs | UtilityResult | CoreError


def to_delta(out: Any) -> TokenDelta:
    """The engine's RequestOutput -> TokenDelta."""
    timing = None
    if out.finished:
        timing = (out.arrival_time, out.first_scheduled_time, out.first_token_time, out.finished_time)
    return TokenDelta(
        request_id=out.request_id, new_token_ids=list(out.new_token_ids),
        new_logprobs=out.new_logprobs, finished=out.finished, finish_reason=out.finish_reason,
        num_prompt_tokens=out.num_prompt_tokens, num_cached_tokens=out.num_cached_tokens,
        kv_transfer_params=out.kv_transfer_params, error=out.error, timing=timing)


# ---------------------------------------------------------------- the core process

class EngineCore:
    """Runs `engine` against the two sockets until the parent goes away."""

    def __init__(self, engine: Any, inp: zmq.Socket, out: zmq.Socket, parent_pid: int):
        self.engine, self.inp, self.out, self.parent_pid = engine, inp, out, parent_pid
        self.decoder = msgspec.msgpack.Decoder(InputMessage)
        self.encoder = msgspec.msgpack.Encoder()

    def send(self, msg: OutputMessage) -> None:
        self.out.send(self.encoder.encode(msg), copy=False)

    def run(self) -> None:
        stalled = False  # the last step produced nothing (e.g. every request waits for remote KV)
        while True:
            busy = self.engine.has_unfinished_requests()
            timeout = (self.stalled_poll_ms() if stalled else 0) if busy else IDLE_POLL_MS
            if self.inp.poll(timeout):
                self.drain_input()
            elif not busy and os.getppid() != self.parent_pid:
                logger.warning("engine core: API process %d is gone, exiting", self.parent_pid)
                return
            if self.engine.has_unfinished_requests():
                outputs = self.engine.step()
                stalled = not outputs
                if outputs:
                    self.send(StepOutputs([to_delta(o) for o in outputs]))

    def stalled_poll_ms(self) -> int:
        """A producer holding pinned blocks (up to a lease) need not wake every millisecond."""
        serving = getattr(self.engine, "only_serving_kv", None)
        return SERVING_POLL_MS if serving is not None and serving() else STALLED_POLL_MS

    def drain_input(self) -> None:
        while True:
            try:
                frame = self.inp.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                msg = self.decoder.decode(frame.buffer)
            except (msgspec.DecodeError, ValueError) as e:
                # One bad frame (version skew, a stray writer) must not take the engine down.
                logger.error("engine core: undecodable input frame (%d bytes): %s", len(frame.bytes), e)
                self.send(CoreError(f"undecodable input frame: {e}"))
                continue
            self.handle(msg)

    def handle(self, msg: InputMessage) -> None:
        if isinstance(msg, AddRequest):
            try:
                self.engine.add_request(msg.request_id, msg.prompt_token_ids, msg.sampling_params,
                                        kv_transfer_params=msg.kv_transfer_params)
            except ValueError as e:
                self.send(StepOutputs([TokenDelta(
                    msg.request_id, [], None, True, None, len(msg.prompt_token_ids), 0, error=str(e))]))
        elif isinstance(msg, AbortRequests):
            for request_id in msg.request_ids:
                self.engine.abort_request(request_id)
        else:
            self.send(self.call_utility(msg))

    def call_utility(self, call: UtilityCall) -> UtilityResult:
        if call.method not in UTILITY_METHODS:
            return UtilityResult(call.call_id, error=f"unknown utility method {call.method!r}")
        try:
            return UtilityResult(call.call_id, result=getattr(self.engine, call.method)(*call.args))
        except Exception as e:  # a failed query is the caller's answer, not the engine's death
            logger.exception("engine core: utility %s failed", call.method)
            return UtilityResult(call.call_id, error=f"{type(e).__name__}: {e}")


def run_engine_core(config: Any, input_addr: str, output_addr: str, parent_pid: int) -> None:
    """Entry point of the core process (multiprocessing spawn target)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ctx = zmq.Context()
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 2000)
    out.connect(output_addr)
    inp = ctx.socket(zmq.PULL)
    inp.connect(input_addr)
    encoder = msgspec.msgpack.Encoder()
    try:
        import torch

        from atomd.engine import LLMEngine

        if getattr(config, "num_threads", None):
            torch.set_num_threads(config.num_threads)
        from atomd.dp import make_engine_core

        engine = LLMEngine(config)
        core = make_engine_core(engine, inp, out, parent_pid)  # joins the DP ranks' group, if any
        out.send(encoder.encode(Ready(engine.model_name)))
        try:
            core.run()
        finally:
            engine.close()  # the KV side channel's sockets and I/O thread
    except KeyboardInterrupt:
        pass
    except Exception as e:
        logger.exception("engine core failed")
        out.send(encoder.encode(CoreError(f"engine core failed: {type(e).__name__}: {e}\n"
                                          f"{traceback.format_exc(limit=3)}", fatal=True)))
        raise SystemExit(1) from None
    finally:
        out.close()
        inp.close(linger=0)
        ctx.term()


# ---------------------------------------------------------------- the API side

class EngineDeadError(RuntimeError):
    """The engine core process is gone (or failed to start)."""


class RequestStream:
    """Deltas of one request, pushed by the output reader, pulled by its HTTP handler."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[TokenDelta | BaseException] = asyncio.Queue()

    async def next_batch(self) -> list[TokenDelta]:
        """Every delta that arrived since the last call (at least one), coalesced so a slow
        writer catches up in one chunk instead of one chunk per token."""
        items = [await self.queue.get()]
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        for item in items:
            if isinstance(item, BaseException):
                raise item
        return items


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
        self.ready: asyncio.Future[Ready] | None = None
        self.proc: multiprocessing.process.BaseProcess | None = None
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(OutputMessage)

    async def start(self, timeout_s: float = 600.0) -> Ready:
        """Spawn the core and wait for its Ready (or its death, or the deadline)."""
        loop = asyncio.get_running_loop()
        self.ipc_dir = tempfile.mkdtemp(prefix="atomd-core-")
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
                    kv_transfer_params: dict | None = None, dp_rank: int | None = None) -> RequestStream:
        """`dp_rank`: ignored, one core is one rank (atomd.dp.DPEngineClient places requests)."""
        stream = RequestStream()
        self.send(AddRequest(request_id, prompt_token_ids, params, kv_transfer_params))
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

    def dispatch(self, deltas: list[TokenDelta]) -> None:
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
        if self.dead is None:
            logger.error("engine core is dead: %s", reason)
        self.dead = reason
        err = EngineDeadError(reason)
        if not self.ready.done():
            self.ready.set_exception(err)
        for stream in self.streams.values():
            stream.queue.put_nowait(err)
        self.streams.clear()
        self.aborting.clear()
        for fut in self.calls.values():
            if not fut.done():
                fut.set_exception(err)

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
