"""The engine core process and its ZMQ/msgpack link to the API process."""
from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import msgspec
import pytest
import zmq

from atomd.engine import core

from atomd.api import core_client
from atomd import messages as M
from kv_transfer.params import KVTransferParams
from contracts.errors import ErrorCode
from contracts.logprobs import Logprob
from contracts.sampling import SamplingParams
from tests.server_fixtures import ENGINE_ARGS, model_dir

REPO = pathlib.Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- wire (unit)

@pytest.mark.unit
def test_wire_messages_round_trip():
    enc = msgspec.msgpack.Encoder()
    params = SamplingParams(max_tokens=3, temperature=0.0, stop=["\n"], logprobs=2)
    add = M.AddRequest("r1", [1, 2, 3], params, KVTransferParams(transfer_id="t"))
    assert msgspec.msgpack.decode(enc.encode(add), type=M.InputMessage) == add
    delta = M.RequestOutput("r1", [5], [Logprob(-0.1, [(5, -0.1)])], True, "length", 3, 0,
                            timing=(1.0, 2.0, 3.0, 4.0))
    failed = M.RequestOutput("r2", [], None, True, "abort", 3, 0, error="kv_transfer_failed: no",
                             error_code=ErrorCode.KV_TRANSFER_FAILED)
    out = M.StepOutputs([delta, failed])
    assert msgspec.msgpack.decode(enc.encode(out), type=M.OutputMessage) == out


@pytest.mark.unit
def test_undecodable_frame_is_answered_and_the_loop_goes_on():
    """No engine needed: a bad frame and an unknown utility never reach it."""
    ctx = zmq.Context()
    try:
        to_core, core_in = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        core_out, from_core = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        core_in.bind("inproc://in"), to_core.connect("inproc://in")
        from_core.bind("inproc://out"), core_out.connect("inproc://out")
        loop = core.EngineCore(None, core_in, core_out, parent_pid=os.getppid())
        enc = msgspec.msgpack.Encoder()
        to_core.send(b"\xc1 not msgpack")
        to_core.send(enc.encode({"kind": "launch_missiles"}))
        to_core.send(enc.encode(M.UtilityCall(7, "rm_rf")))
        assert core_in.poll(1000)
        loop.drain_input()
        dec = msgspec.msgpack.Decoder(M.OutputMessage)
        replies = [dec.decode(from_core.recv()) for _ in range(3)]
        assert [type(r) for r in replies] == [M.CoreError, M.CoreError, M.UtilityResult]
        assert not replies[0].fatal and "undecodable" in replies[0].message
        assert replies[2].call_id == 7 and "unknown utility method" in replies[2].error
        for s in (to_core, core_in, core_out, from_core):
            s.close(linger=0)
    finally:
        ctx.term()


# ---------------------------------------------------------------- a real core process

class CoreHarness:
    """An EngineCoreClient on its own event loop thread, so tests can share one core."""

    def __init__(self):
        from atomd.config import EngineConfig, add_engine_args

        parser = argparse.ArgumentParser()
        add_engine_args(parser)
        self.config = EngineConfig.from_args(parser.parse_args(["--model", str(model_dir()), *ENGINE_ARGS]))
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.client = core_client.EngineCoreClient(self.config)
        self.ready = self.run(self.client.start(120))

    def run(self, coro, timeout_s: float = 120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self):
        self.run(self.client.shutdown())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)

    async def generate(self, request_id: str, ids: list[int], params) -> list[int]:
        stream = self.client.add_request(request_id, ids, params)
        tokens = []
        while True:
            for d in await stream.next_batch():
                assert d.error is None, d.error
                tokens += d.new_token_ids
                if d.finished:
                    return tokens


@pytest.fixture(scope="module")
def harness():
    h = CoreHarness()
    yield h
    h.close()


@pytest.fixture(scope="module")
def offline():
    import torch

    from atomd import LLM

    torch.set_num_threads(1)
    return LLM(model=str(model_dir()), max_model_len=256, num_threads=1)


PROMPTS = [[1, 50, 60, 70], [1] + list(range(100, 140)), [1, 200]]


@pytest.mark.integration
def test_core_greedy_tokens_equal_offline_llm(harness, offline):
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    async def all_requests():
        return await asyncio.gather(*(harness.generate(f"g{i}", p, params) for i, p in enumerate(PROMPTS)))

    got = harness.run(all_requests())
    want = [o.outputs[0].token_ids for o in offline.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
    assert got == [list(w) for w in want]


@pytest.mark.integration
def test_abort_frees_blocks_and_utilities_answer(harness):
    baseline = harness.run(harness.client.call("stats"))["num_free_blocks"]

    async def start_then_abort():
        stream = harness.client.add_request("long", PROMPTS[1], SamplingParams(max_tokens=200, ignore_eos=True))
        await stream.next_batch()  # it runs and holds blocks
        assert (await harness.client.call("stats"))["num_free_blocks"] < baseline
        harness.client.abort("long")
        while (await harness.client.call("stats"))["num_running"]:
            await asyncio.sleep(0.01)
        return await harness.client.call("stats")

    stats = harness.run(start_then_abort())
    assert stats["num_free_blocks"] == baseline and stats["num_waiting"] == 0
    assert harness.run(harness.client.call("reset_prefix_cache")) in (True, False)
    with pytest.raises(RuntimeError, match="unknown utility"):
        harness.run(harness.client.call("shutdown_everything"))


@pytest.mark.integration
def test_garbage_on_the_input_socket_does_not_kill_the_core(harness):
    # sent from the client's loop thread: that socket has one writer
    harness.loop.call_soon_threadsafe(harness.client.inp.send, b"\x92\xa3bad\x01")
    params = SamplingParams(max_tokens=3, temperature=0.0)
    assert len(harness.run(harness.generate("after-garbage", PROMPTS[0], params))) == 3
    assert harness.client.proc.is_alive()


def cpu_ticks(pid: int) -> int:
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


@pytest.mark.integration
def test_idle_core_blocks_instead_of_spinning(harness):
    pid = harness.client.proc.pid
    before = cpu_ticks(pid)
    threading.Event().wait(1.0)  # observe one idle second (a window, not a wait for readiness)
    assert cpu_ticks(pid) - before <= os.sysconf("SC_CLK_TCK") // 10  # < 10% of a core


@pytest.mark.integration
def test_core_death_fails_waiters_at_once():
    h = CoreHarness()
    try:
        async def die_mid_request():
            stream = h.client.add_request("doomed", PROMPTS[1], SamplingParams(max_tokens=200, ignore_eos=True))
            await stream.next_batch()
            os.kill(h.client.proc.pid, signal.SIGKILL)
            with pytest.raises(core_client.EngineDeadError):
                while True:
                    await stream.next_batch()
            with pytest.raises(core_client.EngineDeadError):
                await h.client.call("stats")
            with pytest.raises(core_client.EngineDeadError):
                h.client.add_request("late", [1, 2], SamplingParams())

        h.run(die_mid_request(), timeout_s=30)
        assert not h.client.alive and "exit code -9" in h.client.dead
    finally:
        h.close()


@pytest.mark.integration
def test_a_killed_api_process_leaves_no_ipc_sockets():
    """The API process SIGKILLed (no shutdown ran): its core exits on its own and removes the ipc
    sockets' folder the API process made, as a clean shutdown does."""
    api = subprocess.Popen([sys.executable, "-c", "import time\nfrom tests.test_core_ipc import CoreHarness\n"
                            "h = CoreHarness()\nprint(h.client.ipc_dir, h.client.proc.pid, flush=True)\n"
                            "time.sleep(600)"], cwd=REPO, stdout=subprocess.PIPE, text=True)
    core_pid = None
    try:
        ipc_dir, core_pid = api.stdout.readline().split()
        core_pid = int(core_pid)
        assert os.path.basename(ipc_dir).startswith(f"{core_client.IPC_PREFIX}{api.pid}-")  # see below
        assert sorted(os.listdir(ipc_dir)) == ["in", "out"]
        api.kill()
        api.wait(10)
        deadline = time.monotonic() + 20  # the idle core checks its parent every IDLE_POLL_MS
        while os.path.exists(ipc_dir) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not os.path.exists(ipc_dir)
    finally:
        api.kill()
        api.wait(10)
        if core_pid is not None and os.path.exists(f"/proc/{core_pid}"):
            os.kill(core_pid, signal.SIGKILL)


@pytest.mark.unit
@pytest.mark.parametrize("error", [TypeError("unsupported operand"), KeyError("logprob"), IndexError("list index"),
                                   RecursionError("maximum recursion depth")])
def test_any_admission_failure_is_that_requests_error_and_the_core_lives(error):
    """Issue 42: only ValueError was caught, so one request's TypeError (a non-ASCII
    signature) killed the core. Any exception is now that request's error, with no trace."""
    class Engine:
        def add_request(self, *args, **kwargs):
            raise error

    ctx = zmq.Context()
    try:
        to_core, core_in = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        core_out, from_core = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        core_in.bind("inproc://in"), to_core.connect("inproc://in")
        from_core.bind("inproc://out"), core_out.connect("inproc://out")
        loop = core.EngineCore(Engine(), core_in, core_out, parent_pid=os.getppid())
        enc = msgspec.msgpack.Encoder()
        for rid in ("r1", "r2"):  # the second one is handled too: the loop went on
            to_core.send(enc.encode(M.AddRequest(rid, [1, 2], SamplingParams(max_tokens=1))))
        assert core_in.poll(1000)
        loop.drain_input()
        dec = msgspec.msgpack.Decoder(M.OutputMessage)
        for rid in ("r1", "r2"):
            out = dec.decode(from_core.recv()).outputs[0]
            assert out.request_id == rid and out.finished and out.error_code is None
            assert type(error).__name__ in out.error and "Traceback" not in out.error and "/" not in out.error
        for s in (to_core, core_in, core_out, from_core):
            s.close(linger=0)
    finally:
        ctx.term()


def test_the_ipc_folders_of_dead_api_processes_are_removed_at_the_next_start(tmp_path):
    """A process group SIGKILLed at once (API and core) leaves its folder: the next API process's
    start removes every folder whose API pid is gone, and nothing else."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(10)
    def folder(name: str, files=("in", "out")) -> pathlib.Path:
        d = tmp_path / name
        d.mkdir()
        for f in files:
            (d / f).touch()
        return d
    dead = folder(f"{core_client.IPC_PREFIX}{gone.pid}-k3j_x9")
    live = folder(f"{core_client.IPC_PREFIX}{os.getpid()}-a8b_c1")
    unnamed = folder(f"{core_client.IPC_PREFIX}q0w_e2r")  # not ours to judge
    more = folder(f"{core_client.IPC_PREFIX}{gone.pid}-zz", ("in", "out", "someone's"))
    core_client.remove_dead_ipc_folders(str(tmp_path))
    assert not dead.exists() and live.exists() and unnamed.exists()
    assert sorted(p.name for p in more.iterdir()) == ["someone's"]  # the sockets only, never more
