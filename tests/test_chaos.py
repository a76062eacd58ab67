"""The fault matrix (issue #18): real prefill / decode engines and routers on 127.0.0.1, each
scenario one fault (engine SIGKILL / SIGSTOP at a chosen point, side-channel messages
dropped / duplicated / delayed / reordered, a router restart, slow and vanishing clients),
then the checker (tests/chaos_harness.py: run_scenario):

* every client got a complete answer equal to the fault-free one, or a clean OpenAI-style
  error (never a hang: each client has a deadline; never a 5xx body with internals);
* once the lease (3 s) and receive timeout (3 s) have passed, every engine is idle with its
  whole pool free and P pins nothing;
* the counters on /metrics account for the fault (failed pulls by reason, fallbacks,
  expired leases, router upstream errors and aborts);
* the servers still serve: a fresh request gets the same greedy tokens over two legs.

One set of engines serves the whole matrix (faults are swapped through each engine's
ATOMD_FAULTS_FILE; what a scenario killed is restarted on its port). Unmarked scenarios are
the bounded subset `make test` runs; `make chaos` runs them all. With ATOMD_CHAOS_REPORT set,
every scenario appends its row (JSON) there: benchmarks/fault_matrix.py renders
benchmarks/results/faults.md from it.
"""
from __future__ import annotations

import json
import os
import threading
import time

import pytest

from tests.chaos_harness import LEASE_S, ChaosCluster, Scenario, run_scenario

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

FAILURES = "atomd:kv_transfer_failures_total"
FALLBACKS = "atomd:pd_fallback_total"
EXPIRED = "atomd:kv_leases_expired_total"
SUCCESS = "atomd:request_success_total"
UPSTREAM = "atomd_router:upstream_errors_total"
ROUTER_ABORTS = "atomd_router:kv_transfer_aborts_total"
ROUTER_REQUESTS = "atomd_router:requests_total"


def point(name: str, action: str, **kw) -> dict:
    return {"points": {name: dict(action=action, times=1, **kw)}}


def rule(role: str, kind: str | None, action: str, **kw) -> dict:
    r = dict(role=role, action=action, **kw)
    if kind is not None:
        r["kind"] = kind
    return r


def kill_d_while_p_answers(cluster: ChaosCluster, sc: Scenario, firsts, ctx) -> None:
    """P's answer is held back (a delay fault); D is killed meanwhile."""
    ctx["t_fault"] = cluster.wait_fired("P", sc.id)["t"]
    cluster.kill("D")


def restart_router_mid_stream(cluster: ChaosCluster, sc: Scenario, firsts, ctx) -> None:
    """Every client is streaming (D's steps slowed by a delay fault): SIGKILL the router and
    start a new one on the same port."""
    for f in firsts:
        assert f.wait(30), "a client never got its first event"
    ctx["t_fault"] = time.time()
    cluster.restart_router(sc.router)


def restart_router_in_prefill(cluster: ChaosCluster, sc: Scenario, firsts, ctx) -> None:
    """P holds its answer back (a delay fault); the router dies meanwhile and a new one starts."""
    ctx["t_fault"] = cluster.wait_fired("P", sc.id)["t"]
    cluster.restart_router(sc.router)


SLOW_STREAM = {"D": {"points": {"stream_mid": {"action": "delay", "delay_s": 0.4, "times": 6}}}}
P_ENGINES = ("P", "D")
R_ENGINES = ("P", "D", "DR")

SCENARIOS = [
    # --- engines killed / stopped at chosen points ------------------------------------
    Scenario("p_kill_before_answer", {"P": point("before_answer", "kill")}, fired=("P",),
             what="SIGKILL P (core + API) before the prefill leg answers",
             any_counter=(("R", UPSTREAM, {"leg": "prefill"}),)),
    Scenario("p_core_crash_before_answer", {"P": point("before_answer", "crash")}, fired=("P",),
             what="P's engine core dies (SIGKILL, its API process lives) before the prefill leg answers",
             any_counter=(("R", UPSTREAM, {"leg": "prefill"}),)),
    Scenario("p_stop_before_answer", {"P": point("before_answer", "stop")}, fired=("P",), must="error",
             what="SIGSTOP P before the prefill leg answers (SIGCONT after the client's answer)",
             any_counter=(("R", UPSTREAM, {"leg": "prefill"}),)),
    Scenario("p_kill_between_legs", {"P": point("between_legs", "kill")}, fired=("P",), must="error",
             what="SIGKILL P when D's READ arrives (P answered, D about to pull); D policy fail",
             counters=(("D", FAILURES, {"reason": "timeout"}, 1),)),
    Scenario("p_kill_between_legs_recompute", {"P": point("between_legs", "kill")}, router="RR", fired=("P",),
             must="complete", engines=R_ENGINES, what="the same, D policy recompute",
             counters=(("DR", FALLBACKS, {"reason": "timeout"}, 1),)),
    Scenario("p_stop_between_legs", {"P": point("between_legs", "stop")}, fired=("P",), must="error",
             what="SIGSTOP P when D's READ arrives; D policy fail",
             counters=(("D", FAILURES, {"reason": "timeout"}, 1),)),
    Scenario("p_kill_mid_pull", {"P": point("kv_pull_mid", "kill")}, fired=("P",), must="error", bounded=True,
             what="SIGKILL P after its first DATA message (mid-pull); D policy fail",
             counters=(("D", FAILURES, {"reason": "timeout"}, 1),)),
    Scenario("p_kill_mid_pull_recompute", {"P": point("kv_pull_mid", "kill")}, router="RR", fired=("P",),
             must="complete", engines=R_ENGINES, what="the same, D policy recompute",
             counters=(("DR", FALLBACKS, {"reason": "timeout"}, 1),)),
    Scenario("p_kill_mid_pull_3_clients", {"P": point("kv_pull_mid", "kill")}, clients=3, fired=("P",),
             what="SIGKILL P mid-pull with 3 requests in flight; D policy fail",
             counters=(("D", FAILURES, {}, 1),)),
    Scenario("p_stop_mid_pull", {"P": point("kv_pull_mid", "stop")}, fired=("P",), must="error", bounded=True,
             what="SIGSTOP P mid-pull; D policy fail",
             counters=(("D", FAILURES, {"reason": "timeout"}, 1),)),
    Scenario("d_kill_before_p_answers", {"P": point("before_answer", "delay", delay_s=1.5)}, fired=("P",),
             action=kill_d_while_p_answers, must="error",
             what="SIGKILL D while P computes the prefill leg",
             any_counter=(("R", UPSTREAM, {"leg": "decode"}), ("R", ROUTER_ABORTS, {}), ("P", EXPIRED, {}))),
    Scenario("d_kill_between_legs", {"D": point("between_legs", "kill")}, fired=("D",), must="error",
             what="SIGKILL D when the decode leg arrives (P holds the blocks)",
             any_counter=(("P", EXPIRED, {}), ("R", ROUTER_ABORTS, {}))),
    Scenario("d_stop_between_legs", {"D": point("between_legs", "stop")}, fired=("D",), must="error",
             what="SIGSTOP D when the decode leg arrives (SIGCONT after the client's answer)",
             any_counter=(("P", EXPIRED, {}), ("R", ROUTER_ABORTS, {}))),
    Scenario("d_slow_admission_past_lease", {"D": point("between_legs", "delay", delay_s=LEASE_S + 1)},
             fired=("D",), must="error", what="D admits the decode leg only after P's lease ran out; D policy fail",
             counters=(("P", EXPIRED, {}, 1), ("D", FAILURES, {"reason": "expired"}, 1))),
    Scenario("d_slow_admission_past_lease_recompute", {"DR": point("between_legs", "delay", delay_s=LEASE_S + 1)},
             router="RR", engines=R_ENGINES, fired=("DR",), must="complete",
             what="the same, D policy recompute",
             counters=(("P", EXPIRED, {}, 1), ("DR", FALLBACKS, {"reason": "expired"}, 1))),
    Scenario("d_kill_mid_pull", {"D": point("kv_pull_mid", "kill")}, fired=("D",), must="error",
             what="SIGKILL D after its first DATA message landed",
             any_counter=(("P", EXPIRED, {}), ("R", ROUTER_ABORTS, {}))),
    Scenario("d_stop_mid_pull", {"D": point("kv_pull_mid", "stop")}, fired=("D",), must="error",
             what="SIGSTOP D mid-pull (SIGCONT after the client's answer)",
             any_counter=(("P", EXPIRED, {}), ("R", ROUTER_ABORTS, {}), ("D", FAILURES, {}))),
    Scenario("d_kill_mid_stream", {"D": point("stream_mid", "kill", skip=3)}, fired=("D",), must="error",
             bounded=True, what="SIGKILL D after 4 streamed steps",
             any_counter=(("R", UPSTREAM, {"leg": "decode"}),)),
    Scenario("d_core_crash_mid_stream", {"D": point("stream_mid", "crash", skip=3)}, fired=("D",), must="error",
             what="D's engine core dies (its API process lives) after 4 streamed steps; D's API ends the "
                  "stream with an engine_dead error event, which the router relays and counts",
             counters=(("R", UPSTREAM, {"leg": "decode", "reason": "error_event_mid_stream"}, 1),)),
    Scenario("d_core_crash_mid_pull", {"D": point("kv_pull_mid", "crash")}, fired=("D",), must="error",
             what="D's engine core dies (its API process lives) mid-pull",
             any_counter=(("P", EXPIRED, {}), ("R", ROUTER_ABORTS, {}))),
    Scenario("d_core_freeze_mid_stream", {"D": point("stream_mid", "freeze", skip=3)}, fired=("D",), must="error",
             what="D's engine core wedged (SIGSTOP, its API process lives and answers /health) after 4 "
                  "streamed steps (SIGCONT after the client's answer)",
             counters=(("D", SUCCESS, {"finished_reason": "abort"}, 1),)),
    Scenario("d_stop_mid_stream", {"D": point("stream_mid", "stop", skip=3)}, fired=("D",), must="error",
             what="SIGSTOP D after 4 streamed steps (SIGCONT after the client's answer)",
             counters=(("D", SUCCESS, {"finished_reason": "abort"}, 1),)),
    # --- side-channel messages ----------------------------------------------------------
    Scenario("drop_read", {"P": {"channel": [rule("kv-sender", "READ", "drop", times=1)]}}, fired=("P",),
             must="error", what="READ lost (D -> P); D policy fail",
             counters=(("D", FAILURES, {"reason": "timeout"}, 1),)),
    Scenario("drop_read_recompute", {"P": {"channel": [rule("kv-sender", "READ", "drop", times=1)]}},
             router="RR", engines=R_ENGINES, fired=("P",), must="complete",
             what="READ lost; D policy recompute", counters=(("DR", FALLBACKS, {"reason": "timeout"}, 1),)),
    Scenario("drop_done", {"P": {"channel": [rule("kv-sender", "DONE", "drop", times=1)]}}, fired=("P",),
             must="complete", bounded=True, what="DONE lost (D -> P): the lease frees P's blocks",
             counters=(("P", EXPIRED, {}, 1),)),
    Scenario("drop_end", {"D": {"channel": [rule("kv-receiver", "END", "drop", times=1)]}}, fired=("D",),
             must="error", what="END lost (P -> D); D policy fail",
             counters=(("D", FAILURES, {"reason": "timeout"}, 1),)),
    Scenario("drop_end_and_abort", {"D": {"channel": [rule("kv-receiver", "END", "drop", times=1)]},
                                    "P": {"channel": [rule("kv-sender", "ABORT", "drop")]}}, fired=("D", "P"),
             must="error", what="END lost, then D's ABORT lost too: the router's abort (or the lease) frees P",
             counters=(("D", FAILURES, {"reason": "timeout"}, 1),),
             any_counter=(("R", ROUTER_ABORTS, {}), ("P", EXPIRED, {}))),
    Scenario("flaky_channel", {"P": {"seed": 7, "channel": [rule("kv-sender", None, "drop", p=0.3),
                                                            rule("kv-sender", None, "dup", p=0.2)]},
                               "D": {"seed": 8, "channel": [rule("kv-receiver", None, "drop", p=0.3),
                                                            rule("kv-receiver", None, "delay", p=0.2, delay_s=0.2)]}},
             clients=4, fired=("P", "D"), what="4 clients, 30% of side-channel messages lost both ways, "
                                               "20% duplicated (D -> P) or 0.2 s late (P -> D)"),
    Scenario("dup_all", {"P": {"channel": [rule("kv-sender", None, "dup")]},
                         "D": {"channel": [rule("kv-receiver", None, "dup")]}}, fired=("P", "D"),
             must="complete", what="every side-channel message delivered twice, both ways",
             unchanged=(("D", FAILURES, {}), ("P", EXPIRED, {}))),
    Scenario("delay_all", {"P": {"channel": [rule("kv-sender", None, "delay", delay_s=0.3)]},
                           "D": {"channel": [rule("kv-receiver", None, "delay", delay_s=0.3)]}},
             fired=("P", "D"), must="complete", what="every side-channel message 0.3 s late, both ways",
             unchanged=(("D", FAILURES, {}), ("P", EXPIRED, {}))),
    Scenario("reorder_data_end", {"D": {"channel": [rule("kv-receiver", "DATA", "reorder", times=1)]}},
             fired=("D",), must="error", bounded=True,
             what="DATA overtaken by END (P -> D); D policy fail",
             counters=(("D", FAILURES, {"reason": "incomplete"}, 1),)),
    Scenario("reorder_data_end_recompute", {"DR": {"channel": [rule("kv-receiver", "DATA", "reorder", times=1)]}},
             router="RR", engines=R_ENGINES, fired=("DR",), must="complete",
             what="DATA overtaken by END; D policy recompute",
             counters=(("DR", FALLBACKS, {"reason": "incomplete"}, 1),)),
    # --- router and clients ------------------------------------------------------------
    Scenario("router_restart", SLOW_STREAM, clients=3, action=restart_router_mid_stream, bounded=True,
             allowed=frozenset({"dropped", "complete"}),
             what="SIGKILL the router with 3 streams in flight, a new one on the same port",
             counters=(("D", SUCCESS, {"finished_reason": "abort"}, 1),)),
    Scenario("router_restart_in_prefill", {"P": point("before_answer", "delay", delay_s=1.0)}, fired=("P",),
             action=restart_router_in_prefill, allowed=frozenset({"dropped"}),
             what="SIGKILL the router while P computes the prefill leg, a new one on the same port: "
                  "nobody pulls P's blocks, the lease frees them",
             counters=(("P", EXPIRED, {}, 1),)),
    Scenario("slow_client", client_args={"read_delay_s": 0.2}, must="complete",
             what="a client reading one SSE line per 0.2 s (4 KiB receive buffer)"),
    Scenario("vanishing_client_mid_stream", SLOW_STREAM, client_args={"vanish_after_events": 1},
             allowed=frozenset({"vanished"}), bounded=True, what="the client disconnects after its first event",
             counters=(("D", SUCCESS, {"finished_reason": "abort"}, 1),
                       ("R", ROUTER_REQUESTS, {"status": "client_disconnect"}, 1))),
    Scenario("vanishing_client_mid_pull", {"D": point("kv_pull_mid", "delay", delay_s=1.0)},
             client_args={"vanish_after_events": 0, "vanish_after_s": 0.5}, allowed=frozenset({"vanished"}),
             fired=("D",), what="the client disconnects while D pulls (D's receiver held up 1 s mid-pull)",
             counters=(("D", SUCCESS, {"finished_reason": "abort"}, 1),)),
    Scenario("vanishing_client_in_prefill", {"P": point("before_answer", "delay", delay_s=1.0)},
             client_args={"vanish_after_events": 0, "vanish_after_s": 0.3}, allowed=frozenset({"vanished"}),
             fired=("P",), what="the client disconnects while P computes the prefill leg",
             counters=(("R", ROUTER_REQUESTS, {"status": "client_disconnect"}, 1),)),
]


@pytest.fixture(scope="module")
def chaos():
    cluster = ChaosCluster()
    try:
        cluster.start(*P_ENGINES)
        status, text = cluster.answer("R")
        assert status == 200, text
        cluster.reference = text  # the fault-free greedy answer every complete one must equal
        yield cluster
    finally:
        cluster.stop()


_report_lock = threading.Lock()


def report(row: dict) -> None:
    path = os.environ.get("ATOMD_CHAOS_REPORT")
    if path:
        with _report_lock, open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


@pytest.mark.parametrize("sc", [pytest.param(sc, id=sc.id, marks=() if sc.bounded else pytest.mark.chaos)
                                for sc in SCENARIOS])
def test_fault(chaos, sc):
    t0 = time.monotonic()
    row = run_scenario(chaos, sc, chaos.reference)
    row["scenario_s"] = round(time.monotonic() - t0, 2)
    diagnosis = row.pop("diagnosis", "")
    report(row)
    assert row["ok"], f"{sc.id}: {row['problems']}\n{json.dumps(row, indent=1)}\n{diagnosis}"


def test_faults_are_off_without_the_variables():
    """Production cost nil: without ATOMD_FAULTS / ATOMD_FAULTS_FILE the module is inactive
    (every hook is behind `if faults.ACTIVE`)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("ATOMD_FAULTS")}
    out = subprocess.run([sys.executable, "-c", "from kv_transfer import faults; print(faults.ACTIVE)"],
                         env=env, capture_output=True, text=True, check=True, cwd=os.path.dirname(__file__) + "/..")
    assert out.stdout.strip() == "False"


def test_channel_rules(monkeypatch):
    """kv_transfer/faults.py's side-channel rules on fake frames: drop, dup, delay, reorder,
    skip / times, and the seeded probability."""
    import msgspec

    from kv_transfer import faults

    def frames(kind: str) -> list[bytes]:
        return [msgspec.msgpack.encode([kind, "t"])]  # a DEALER's view: the header first

    def kinds(batch) -> list[str]:
        return [msgspec.msgpack.decode(f[0])[0] for f in batch]

    def use(*rules, seed=0):
        monkeypatch.setattr(faults, "_state", faults._State({"seed": seed, "channel": list(rules)}))
        monkeypatch.setattr(faults, "_FILE", None)

    sock = object()
    use(rule("kv-receiver", "END", "drop", times=1))
    assert kinds(faults.channel("kv-receiver", sock, frames("END"))) == []
    assert kinds(faults.channel("kv-receiver", sock, frames("END"))) == ["END"]  # times=1
    assert kinds(faults.channel("kv-sender", sock, frames("END"))) == ["END"]  # another role
    use(rule("kv-receiver", None, "dup", skip=1))
    assert kinds(faults.channel("kv-receiver", sock, frames("DATA"))) == ["DATA"]  # skipped
    assert kinds(faults.channel("kv-receiver", sock, frames("END"))) == ["END", "END"]
    use(rule("kv-receiver", "DATA", "reorder", times=1))
    assert kinds(faults.channel("kv-receiver", sock, frames("DATA"))) == []
    assert kinds(faults.channel("kv-receiver", sock, frames("END"))) == ["END", "DATA"]
    use(rule("kv-receiver", "DATA", "delay", delay_s=0.05))
    assert kinds(faults.channel("kv-receiver", sock, frames("DATA"))) == []
    deadline = time.monotonic() + 10
    while not (due := faults.channel_due("kv-receiver")):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert due[0][0] is sock and kinds([due[0][1]]) == ["DATA"]
    use(rule("kv-receiver", None, "drop", p=0.5), seed=3)
    first = [len(faults.channel("kv-receiver", sock, frames("DATA"))) for _ in range(64)]
    use(rule("kv-receiver", None, "drop", p=0.5), seed=3)
    assert [len(faults.channel("kv-receiver", sock, frames("DATA"))) for _ in range(64)] == first  # seeded
    assert 0 < sum(first) < 64


def test_engine_pids_leaves_out_a_dead_unreaped_core(request):
    """A core that died and is not reaped yet (a zombie) is no engine core: listed as one, the
    chaos harness kept an engine whose processes were already SIGKILLed."""
    import subprocess
    import sys

    from launch.process import EngineServer, proc_start_time

    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time\n"
                               "live = subprocess.Popen(['sleep', '60'])\n"
                               "dead = subprocess.Popen(['true'])\n"
                               "print(live.pid, dead.pid, flush=True)\n"
                               "time.sleep(60)  # reaps neither"], stdout=subprocess.PIPE, text=True)
    request.addfinalizer(parent.wait)
    request.addfinalizer(parent.kill)
    live, dead = map(int, parent.stdout.readline().split())
    request.addfinalizer(lambda: os.path.exists(f"/proc/{live}") and os.kill(live, 9))
    deadline = time.monotonic() + 30
    while proc_start_time(dead) is not None:  # `true` exits at once: a zombie of its parent
        assert time.monotonic() < deadline, "the child never exited"
        time.sleep(0.01)
    assert os.path.exists(f"/proc/{dead}")  # not reaped: still the parent's child
    server = EngineServer.__new__(EngineServer)
    server.proc = parent
    assert server.engine_pids() == [live]


def test_revive_waits_for_what_a_fired_kill_takes_down(request):
    """A kill point's record is written before its SIGKILLs land, and the killed engine's
    sockets close before it can be reaped: the harness waits for the deaths a fired point
    announces (the API process for `kill`, the firing process for `kill` and `crash`) before
    it judges which engines live. Here: processes that end a moment after the record."""
    import subprocess
    import sys

    from launch.process import proc_start_time
    from tests.chaos_harness import ChaosCluster

    def process(seconds: float) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"])
        request.addfinalizer(proc.wait)
        request.addfinalizer(proc.kill)
        return proc

    class Engine:  # what the harness reads of an engine: its API process
        def __init__(self, seconds: float):
            self.proc = process(seconds)
            self.pid = self.proc.pid

    cluster = ChaosCluster()
    request.addfinalizer(cluster.stop)
    request.addfinalizer(cluster.engines.clear)  # the fakes are stopped above
    cluster.engines.update(D=Engine(0.3), P=Engine(60))  # D's API process dies a moment after the record
    d_core, p_core = process(0.3), process(0.3)
    dying = cluster.await_fault_deaths({"D": [{"id": "s", "pid": d_core.pid, "point": "stream_mid", "action": "kill"}],
                                "P": [{"id": "s", "pid": p_core.pid, "point": "before_answer", "action": "crash"},
                                      {"id": "s", "pid": 1, "channel": "kv-sender", "kind": "DONE",
                                       "action": "drop"}]})
    assert cluster.engines["D"].proc.poll() is not None  # kill: the API process is gone
    assert proc_start_time(d_core.pid) is None and proc_start_time(p_core.pid) is None  # the firing ones too
    assert cluster.engines["P"].proc.poll() is None  # crash: the core alone
    assert dying == ["D", "P"]


def test_a_reserved_port_stays_ours_across_a_server_restart(request):
    """The chaos cluster restarts a killed server on its port: reserve_port keeps the port out
    of everyone else's hands meanwhile (another xdist worker's bind, an outgoing connection),
    yet the server binds and listens on it, every time it starts (a second listener cannot)."""
    import socket

    from launch.process import reserve_port

    held = reserve_port()
    request.addfinalizer(held.close)
    port = held.getsockname()[1]

    def server() -> socket.socket:  # as asyncio / aiohttp / the router bind: SO_REUSEADDR
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()
        return s

    for _ in range(2):  # start, "crash", restart on the same port
        first = server()
        with socket.create_connection(("127.0.0.1", port), timeout=10):
            pass
        with pytest.raises(OSError):
            server()  # a second listener
        first.close()
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))  # what free_port's bind(0) and connect() skip: the port is taken
        with pytest.raises(OSError):
            reserve_port(port)  # nor can anyone reserve it again
