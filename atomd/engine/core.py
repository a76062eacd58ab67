"""The engine core: one LLMEngine's loop in its own process (the rank side of the IPC).

The API process (aiohttp, tokenizer, SSE; atomd/api/core_client.py) and the engine (torch,
scheduler) share no interpreter, so a slow forward never stalls HTTP and a crashed engine
never takes the server's answers with it. The messages are in atomd/messages.py; each
socket has exactly one writer (ZMQ sockets are not thread-safe).

The core blocks on its input socket while idle (no spin) and drains it without blocking
between steps, so aborts land before the next forward; a step with no output (a chunk of
a long prefill, or nothing runnable yet) is followed by a 1 ms wait on the socket.

Data parallelism (`DPEngineCore`): with `--prefill-delayer`, `--dp-lockstep` or
`--enable-expert-parallel` the ranks join one gloo group (atomd/engine/dp_collective.py) and
every rank steps every tick, an idle rank an empty pass, because each tick holds exactly one
delayer collective (and one lockstep all-reduce, or each sparse layer's expert-parallel
all-to-alls: an idle rank's are the model's idle_forward) that every rank must join. So the
loop never blocks on its socket longer than IDLE_TICK_MS. An expert-parallel rank whose group
broke cannot run alone (it lacks the others' experts): its core fails, its requests error.
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
import pathlib
import time
from typing import TYPE_CHECKING

import msgspec
import zmq

from atomd.messages import (UTILITY_METHODS, AbortRequests, AddRequest, CoreError, InputMessage, OutputMessage,
                            Ready, RequestOutput, StepOutputs, UtilityCall, UtilityResult)
from kv_transfer import faults
from atomd.engine.lora_registry import LoraNotLoaded
from kv_transfer.trust import UntrustedKVParams
from contracts.errors import ErrorCode

if TYPE_CHECKING:  # the API process imports this module to spawn the core: no torch, no gloo there
    from atomd.config import EngineConfig
    from atomd.engine.dp_collective import Lockstep, ObservedPrefillDelayer
    from atomd.engine.engine_loop import EngineLoop
    from scheduler.prefill_delayer import Collective

logger = logging.getLogger("atomd.engine.core")

IDLE_POLL_MS = 1000  # how often an idle core wakes to check its parent is still alive
STALLED_POLL_MS = 1  # busy but the last step had no output: wait on the socket, do not spin
SERVING_POLL_MS = 10  # a producer whose only work is pinned blocks: poll for their release
LOADING_POLL_MS = 5  # idle but a LoRA adapter is being read in the background: poll for its end
IDLE_TICK_MS = 5  # a DP rank that ticks with its group: its wait on the socket between (empty) ticks


def ticks_every_rank(config: EngineConfig) -> bool:
    return config.data_parallel_size > 1 and (config.prefill_delayer != "off" or config.dp_lockstep
                                              or config.enable_expert_parallel)


class EngineCore:
    """Runs `engine` against the two sockets until the parent goes away."""

    def __init__(self, engine: EngineLoop, inp: zmq.Socket, out: zmq.Socket, parent_pid: int):
        self.engine, self.inp, self.out, self.parent_pid = engine, inp, out, parent_pid
        self.pending: list[tuple[int, concurrent.futures.Future]] = []  # utility calls answered later
        self.decoder = msgspec.msgpack.Decoder(InputMessage)
        self.encoder = msgspec.msgpack.Encoder()

    def send(self, msg: OutputMessage) -> None:
        self.out.send(self.encoder.encode(msg), copy=False)

    def run(self) -> None:
        stalled = False  # the last step produced nothing (e.g. every request waits for remote KV)
        while True:
            busy = self.engine.has_unfinished_requests()
            loading = self.engine.lora_loads_pending()  # a background read: poll for its end, do not sleep
            timeout = (self.stalled_poll_ms() if stalled else 0) if busy else LOADING_POLL_MS if loading \
                else IDLE_POLL_MS
            if self.inp.poll(timeout):
                self.drain_input()
            elif not busy and os.getppid() != self.parent_pid:
                logger.warning("engine core: API process %d is gone, exiting", self.parent_pid)
                return
            elif not busy:
                self.engine.check_alive()
            if self.engine.has_unfinished_requests():
                outputs = self.engine.step()
                stalled = not outputs
                if outputs:
                    if faults.ACTIVE:  # tests: kill / stop / delay before the API sees these
                        faults.engine_outputs(outputs)
                    self.send(StepOutputs(outputs))
            self.answer_pending()

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
                                        kv_transfer_params=msg.kv_transfer_params, lora_name=msg.lora_name)
            except Exception as e:  # refused on arrival: that request's error, never the core's death
                if isinstance(e, LoraNotLoaded):  # an adapter not loaded here
                    code, error = ErrorCode.MODEL_NOT_FOUND, str(e)
                elif isinstance(e, ValueError):  # the API answers a 4xx with the message
                    code = ErrorCode.KV_PARAMS_UNTRUSTED if isinstance(e, UntrustedKVParams) \
                        else ErrorCode.INVALID_REQUEST
                    error = str(e)
                else:  # a bug this request hit: the trace goes to the log only
                    logger.exception("engine core: admitting request %s failed", msg.request_id)
                    code, error = None, f"internal error admitting the request ({type(e).__name__})"
                self.send(StepOutputs([RequestOutput(
                    msg.request_id, [], None, True, None, len(msg.prompt_token_ids), 0, error=error,
                    error_code=code)]))
        elif isinstance(msg, AbortRequests):
            for request_id in msg.request_ids:
                self.engine.abort_request(request_id)
        else:
            self.handle_utility(msg)

    def handle_utility(self, call: UtilityCall) -> None:
        """Answer now, or once the engine's Future is done (an adapter read in the background)."""
        result = self.call_utility(call)
        if isinstance(result.result, concurrent.futures.Future):
            self.pending.append((call.call_id, result.result))
        else:
            self.send(result)

    def answer_pending(self) -> None:
        """Between steps: the deferred utility calls whose work landed get their answers."""
        if not self.pending:
            return
        self.engine.finish_lora_loads()
        for entry in [p for p in self.pending if p[1].done()]:
            self.pending.remove(entry)
            self.send(UtilityResult(entry[0], result=entry[1].result()))

    def call_utility(self, call: UtilityCall) -> UtilityResult:
        if call.method not in UTILITY_METHODS:
            return UtilityResult(call.call_id, error=f"unknown utility method {call.method!r}")
        try:
            return UtilityResult(call.call_id, result=getattr(self.engine, call.method)(*call.args))
        except Exception as e:  # a failed query is the caller's answer, not the engine's death
            logger.exception("engine core: utility %s failed", call.method)
            return UtilityResult(call.call_id, error=f"{type(e).__name__}: {e}")


def run_engine_core(config: EngineConfig, input_addr: str, output_addr: str, parent_pid: int) -> None:
    """Entry point of the core process (multiprocessing spawn target)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ctx = zmq.Context()
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 2000)
    out.connect(output_addr)
    inp = ctx.socket(zmq.PULL)
    inp.connect(input_addr)
    encoder = msgspec.msgpack.Encoder()
    if faults.ACTIVE:
        faults.engine_core_started(parent_pid)
    try:
        engine_class = engine_class_of(config)
        group = DPGroup.join(config)  # None without DP ticking or a delayer
        kwargs = {"expert_group": group.collective} if group and group.expert_parallel else {}
        engine = engine_class(config, prefill_delayer=group.delayer if group else None, **kwargs)
        if group is None:
            core = EngineCore(engine, inp, out, parent_pid)
        else:
            group.wait_for_every_rank()  # every rank has built its engine: ticks may start
            core = DPEngineCore(engine, inp, out, parent_pid, group)
        out.send(encoder.encode(Ready(engine.model_name)))
        try:
            core.run()
        finally:
            engine.close()  # the KV side channel's sockets and I/O thread
    except KeyboardInterrupt:
        pass
    except Exception as e:
        logger.exception("engine core failed")
        # the trace is in this log; the message reaches clients (503 bodies): no trace, no path
        out.send(encoder.encode(CoreError(f"engine core failed: {type(e).__name__}", fatal=True)))
        raise SystemExit(1) from None
    finally:
        out.close()
        inp.close(linger=0)
        ctx.term()
        if os.getppid() != parent_pid:
            remove_ipc_sockets(input_addr, output_addr)


def remove_ipc_sockets(*addrs: str) -> None:
    """The API process makes the two ipc sockets' folder and removes it when it shuts down; when it
    died first (SIGKILL, OOM) its core, the survivor, removes them, so a crash leaves nothing in /tmp."""
    folders = set()
    for addr in addrs:
        if addr.startswith("ipc://"):
            path = pathlib.Path(addr[len("ipc://"):])
            path.unlink(missing_ok=True)
            folders.add(path.parent)
    for folder in folders:
        try:
            folder.rmdir()  # only if empty: never more than what the API process made
        except OSError:
            pass


def engine_class_of(config: EngineConfig) -> type[EngineLoop]:
    """The engine this core runs: the model (torch), or the simulated runner, which never
    imports torch (atomd/sim/engine.py)."""
    if getattr(config, "model_runner", "real") == "simulated":
        from atomd.sim.engine import SimulatedEngine

        return SimulatedEngine
    import torch

    from atomd.engine.llm_engine import LLMEngine

    if getattr(config, "num_threads", None):
        torch.set_num_threads(config.num_threads)
    return LLMEngine


class DPGroup:
    """This rank's place in the DP group: the collective, the PrefillDelayer over it (given
    to the engine's scheduler when it is built), the lockstep emulation, and whether the
    engine's sparse layers run expert-parallel over it."""

    def __init__(self, rank: int, ticks: bool, collective: Collective, delayer: ObservedPrefillDelayer | None,
                 lockstep: Lockstep | None, expert_parallel: bool = False):
        self.rank, self.ticks = rank, ticks
        self.collective, self.delayer, self.lockstep = collective, delayer, lockstep
        self.expert_parallel = expert_parallel
        # $ATOMD_STEP_SAMPLES=N: the last N ticks, for GET /debug/stats `tick_samples` (see record_tick)
        from atomd.engine.engine_loop import step_sample_buffer

        self.tick_samples = step_sample_buffer() if ticks else None

    def record_tick(self, started: float, cpu: float, forward: tuple[bool, int] | None) -> None:
        """[start s, wall s, this thread's CPU s, kind, tokens] of the tick that began at perf
        counter `started` and thread time `cpu`: kind 1 prefill, 0 decode, -1 no forward (the
        exchanges alone). Ticks line up across ranks (tick i is every rank's i-th), and the CPU
        time leaves out the waits in the collectives, so the per-tick maximum over the ranks is
        the step's critical path however loaded the machine (benchmarks/prefill_delayer.py)."""
        kind, tokens = (-1, 0) if forward is None else (int(forward[0]), forward[1])
        self.tick_samples.append([started, time.perf_counter() - started, time.thread_time() - cpu, kind, tokens])

    @classmethod
    def join(cls, cfg: EngineConfig) -> "DPGroup | None":
        """Join the ranks' gloo group when they tick together; None when nothing needs a group."""
        ticks = ticks_every_rank(cfg)
        if cfg.prefill_delayer == "off" and not ticks:
            return None
        from atomd.engine.dp_collective import GlooCollective, Lockstep, make_prefill_delayer
        from scheduler.prefill_delayer import SingleRank

        collective = GlooCollective(cfg.data_parallel_rank, cfg.data_parallel_size, cfg.dp_master_port,
                                    address=cfg.data_parallel_address,
                                    timeout_s=cfg.dp_collective_timeout_s) if ticks else SingleRank()
        delayer = make_prefill_delayer(cfg, collective) if cfg.prefill_delayer != "off" else None
        lockstep = Lockstep(collective) if cfg.dp_lockstep and ticks else None
        return cls(cfg.data_parallel_rank, ticks, collective, delayer, lockstep,
                   expert_parallel=cfg.enable_expert_parallel and ticks)

    def wait_for_every_rank(self) -> None:
        """Returns once every rank got here (its engine built), under the join timeout: the
        first tick's collective has only the short per-tick timeout."""
        if self.ticks:
            self.collective.barrier()


class DPEngineCore(EngineCore):
    """A rank that steps with its group every tick (see the module docstring)."""

    def __init__(self, engine: EngineLoop, inp: zmq.Socket, out: zmq.Socket, parent_pid: int, group: DPGroup):
        super().__init__(engine, inp, out, parent_pid)
        self.group = group

    def run(self) -> None:
        group = self.group
        if not group.ticks:
            return super().run()
        while group.collective.broken is None:
            busy = self.engine.has_unfinished_requests()
            if self.inp.poll(0 if busy else IDLE_TICK_MS):
                self.drain_input()
            elif not busy and os.getppid() != self.parent_pid:
                return
            started, cpu = time.perf_counter(), time.thread_time()
            outputs = self.engine.step()  # every tick, idle or not: the group's collectives need every rank
            if group.tick_samples is not None:
                group.record_tick(started, cpu, self.engine.last_forward)
            if group.lockstep is not None:
                group.lockstep.end_of_step()
            if outputs:
                self.send(StepOutputs(outputs))
            self.answer_pending()
        if group.expert_parallel:  # the other ranks' experts are gone with them
            raise RuntimeError(f"DP rank {group.rank}: the expert-parallel group is broken "
                               f"({group.collective.broken})")
        # A peer is gone (its failure was counted): serve what this rank has, alone and
        # without the delayer, rather than fail open (and log it) on every tick from here on.
        logger.error("DP rank %d: the DP group is broken (%s); running alone", group.rank,
                     group.collective.broken)
        self.engine.scheduler.prefill_delayer = group.lockstep = None
        super().run()

    def call_utility(self, call: UtilityCall) -> UtilityResult:
        res = super().call_utility(call)
        if call.method == "stats" and res.error is None:
            group = self.group
            if group.tick_samples is not None:
                res.result["tick_samples"] = list(group.tick_samples)
            res.result = dict(res.result, dp_rank=group.rank,
                              prefill_delayer=group.delayer.stats() if group.delayer else None,
                              lockstep_errors=group.lockstep.num_errors if group.lockstep else 0)
        return res
