"""Priority scheduling (issue 40): `--scheduling-policy priority` and the request's `priority`
(lower first, as vLLM) in admission and preemption order; fcfs unchanged. Unit tests drive
the scheduler with the fake model (tokens checked against its reference); the end-to-end test
runs a real server with a tiny KV pool: a low-priority long request is preempted for a
high-priority one, and both finish with the very tokens each gets alone."""
from __future__ import annotations

import json
import threading
import time

import pytest

from contracts.sampling import SamplingParams
from launch.process import http
from scheduler.scheduler import Scheduler
from scheduler.sequence import Sequence, SequenceStatus
from tests.fake_connector import FakeKV, FakeModel, prompt, reference_completion, scheduler_config, step
from tests.server_fixtures import model_dir, start_server


def make(policy: str, num_blocks: int, **kw):
    cfg = scheduler_config(num_kvcache_blocks=num_blocks, block_size=4, scheduling_policy=policy, **kw)
    return Scheduler(cfg), FakeModel(FakeKV(num_blocks, 4), 0)


def drive(sched, model, max_steps=500) -> tuple[dict[int, list[int]], list[int]]:
    """To completion: tokens per sequence, and the ids in the order they finished."""
    emitted, order = {}, []
    for _ in range(max_steps):
        if sched.is_finished():
            break
        for update in step(sched, model)[1]:
            emitted.setdefault(update.seq.id, []).extend(update.new_token_ids)
            if update.finished:
                order.append(update.seq.id)
    assert sched.is_finished()
    return emitted, order


@pytest.mark.unit
def test_waiting_requests_are_admitted_by_priority_then_arrival():
    sched, model = make("priority", 64, max_num_seqs=1)
    seqs = [Sequence(prompt(i, 5), SamplingParams(max_tokens=2, priority=p), arrive_time=float(i))
            for i, p in enumerate([5, 0, 5, -3, 0])]
    for seq in seqs:
        sched.add(seq)
    emitted, order = drive(sched, model)
    assert order == [seqs[i].id for i in (3, 1, 4, 0, 2)]
    for seq in seqs:
        assert emitted[seq.id] == reference_completion(seq.prompt_token_ids, 2)


@pytest.mark.unit
def test_fcfs_ignores_priority():
    sched, model = make("fcfs", 64, max_num_seqs=1)
    seqs = [Sequence(prompt(i, 5), SamplingParams(max_tokens=2, priority=-i)) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    assert drive(sched, model)[1] == [s.id for s in seqs]


def preemption_run(policy: str):
    """A long low-priority request runs; a high-priority one arrives; the pool (12 blocks of 4)
    cannot hold both to the end."""
    sched, model = make(policy, 12, max_num_seqs=4)
    low = Sequence(prompt(1, 6), SamplingParams(max_tokens=30, priority=10), arrive_time=1.0)
    high = Sequence(prompt(2, 6), SamplingParams(max_tokens=20, priority=0), arrive_time=2.0)
    sched.add(low)
    emitted = {}
    for _ in range(3):  # low prefills and decodes a little alone
        for u in step(sched, model)[1]:
            emitted.setdefault(u.seq.id, []).extend(u.new_token_ids)
    sched.add(high)
    preempted = []
    order = []
    for _ in range(500):
        if sched.is_finished():
            break
        before = sched.num_preemptions
        for u in step(sched, model)[1]:
            emitted.setdefault(u.seq.id, []).extend(u.new_token_ids)
            if u.finished:
                order.append(u.seq.id)
        if sched.num_preemptions > before:
            preempted += [s.id for s in (low, high) if s.status is SequenceStatus.WAITING and s.num_completion_tokens]
    assert sched.is_finished() and sched.block_manager.num_free_blocks == 12
    assert emitted[low.id] == reference_completion(low.prompt_token_ids, 30)
    assert emitted[high.id] == reference_completion(high.prompt_token_ids, 20)
    return low, high, preempted, order


@pytest.mark.unit
def test_priority_preempts_the_least_urgent_request():
    low, high, preempted, order = preemption_run("priority")
    assert preempted and set(preempted) == {low.id}
    assert order == [high.id, low.id]


@pytest.mark.unit
def test_fcfs_preempts_the_newest_request():
    low, high, preempted, order = preemption_run("fcfs")
    assert preempted and set(preempted) == {high.id}
    assert order == [low.id, high.id]


# ---------------------------------------------------------------------- end to end

BLOCKS = 14  # 16-token blocks: the two requests below need 2 x 9 at their ends


@pytest.fixture(scope="module")
def server():
    srv = start_server(model_dir(), "--scheduling-policy", "priority", "--num-kvcache-blocks", str(BLOCKS))
    yield srv
    srv.stop()


def complete(url: str, body: dict) -> dict:
    status, raw = http("POST", url + "/v1/completions", body)
    assert status == 200, raw
    return json.loads(raw)


LOW = {"prompt": "def fibonacci(n):\n    ", "max_tokens": 130, "temperature": 0, "ignore_eos": True, "priority": 9}
HIGH = {"prompt": "import os\nimport sys\n", "max_tokens": 120, "temperature": 0, "ignore_eos": True,
        "priority": -1}


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_low_priority_request_is_preempted_for_a_high_one_and_both_match_alone(server):
    alone = {name: complete(server.url, body)["choices"][0]["text"] for name, body in (("low", LOW), ("high", HIGH))}
    assert server.stats()["num_preemptions"] == 0  # alone, each fits the pool
    got, finished = {}, []

    def send(name: str, body: dict) -> None:
        got[name] = complete(server.url, body)["choices"][0]["text"]
        finished.append(name)

    low = threading.Thread(target=send, args=("low", LOW))
    low.start()
    deadline = time.monotonic() + 60
    while server.stats()["num_running"] == 0:  # low runs before high arrives
        assert low.is_alive() and time.monotonic() < deadline, "the low-priority request never ran"
        time.sleep(0.01)
    send("high", HIGH)
    low.join(120)
    assert got == alone
    assert finished == ["high", "low"]  # high was never held back by low: low was the one preempted
    assert server.stats()["num_preemptions"] > 0
    server.wait_idle(BLOCKS)


@pytest.mark.integration
def test_priority_needs_the_priority_policy(tmp_path):
    srv = start_server(model_dir())
    try:
        status, raw = http("POST", srv.url + "/v1/completions", {"prompt": "x", "max_tokens": 1, "priority": 1})
        assert status == 400 and json.loads(raw)["error"]["param"] == "priority"
        status, raw = http("POST", srv.url + "/v1/completions", {"prompt": "x", "max_tokens": 1, "priority": 0})
        assert status == 200
    finally:
        srv.stop()
