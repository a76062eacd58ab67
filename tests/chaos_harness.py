"""The chaos tests' machinery: a 1P+1D cluster (plus a recompute-policy consumer) of real
`atomd serve` engines and routers on 127.0.0.1 whose faults are set per scenario, the
clients, and the checker run after every scenario (tests/test_chaos.py has the matrix).

Faults inside the engines go through kv_transfer/faults.py: each engine starts with
ATOMD_FAULTS_FILE pointing at its own spec file, which a scenario replaces (the engine
re-reads it), so one set of engine processes serves the whole matrix; engines a scenario
killed are restarted on the same port before the next one.
"""
from __future__ import annotations

import http.client as httpclient
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from launch.process import EngineServer, RouterServer, http, proc_start_time, reserve_port
from tests.pd_fixtures import kill_engine, metrics
from tests.server_fixtures import ENGINE_ARGS, REPO, START_TIMEOUT_S, ServerUnderTest, model_dir, server_log

LEASE_S = 3.0  # P's --kv-lease-s: pinned blocks of a transfer nobody heartbeats are freed after this
RECV_TIMEOUT_S = 3.0  # D's --kv-recv-timeout-s: a silent producer fails the pull after this
COMMON = ["--no-enable-prefix-caching", "--kv-lease-s", str(LEASE_S), "--kv-recv-timeout-s", str(RECV_TIMEOUT_S)]
ENGINE_FLAGS = {
    "P": ["--kv-role", "producer"],
    "D": ["--kv-role", "consumer", "--kv-load-failure-policy", "fail"],
    "DR": ["--kv-role", "consumer", "--kv-load-failure-policy", "recompute"],
}
ROUTERS = {"R": ("P", "D"), "RR": ("P", "DR")}  # name: (prefill, decode)
ROUTER_FLAGS = ["--health-interval-s", "0.5", "--prefill-timeout-s", "3", "--request-timeout-s", "6",
                "--total-timeout-s", "15", "--max-prefill-tries", "2", "--retry-backoff-s", "0.05"]
CLIENT_DEADLINE_S = 40.0  # no client waits longer: past it, the request hung
SETTLE_TIMEOUT_S = 30.0  # leases (3 s) and receive timeouts (3 s) have long passed by then
LOG_TAIL_LINES = 40  # of each server's log, in a failed scenario's report
DEATH_TIMEOUT_S = 30.0  # a process a fault SIGKILLed is reaped by then, however loaded the machine
PROMPT = [int(t) for t in range(101, 141)]  # 40 tokens: 3 blocks, one DATA message
BODY = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True}


class ChaosEngine(ServerUnderTest):
    """ServerUnderTest on a given port with a given environment (its fault spec file), its
    output in `log` (kept for the diagnosis of a failed scenario)."""

    def __init__(self, *extra: str, port: int | None, env: dict, log: pathlib.Path):
        EngineServer.__init__(self, model_dir(), *ENGINE_ARGS, *extra, port=port, env=env,
                              log=server_log(log), cwd=REPO)


def log_tail(path: str | os.PathLike | None, lines: int = LOG_TAIL_LINES) -> str:
    """The last `lines` lines of a server's log ("" when it went elsewhere)."""
    if path is None or str(path) == os.devnull:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 64 * lines * 4))
            return b"\n".join(f.read().splitlines()[-lines:]).decode(errors="replace")
    except OSError as e:
        return f"(no log: {e})"


def describe(name: str, proc: EngineServer | RouterServer) -> str:
    """A server's PID, whether it lives (or its exit code) and its log's tail."""
    code = proc.proc.poll()
    state = "alive" if code is None else f"exited with code {code}"
    return f"--- {name} (pid {proc.pid}, port {proc.port}): {state}; log {proc.log_path}\n{log_tail(proc.log_path)}"


@dataclass
class Outcome:
    """One client's request: complete | error (a clean OpenAI-style one) | dropped (the
    connection ended without either) | hang (past the deadline) | bad (a 5xx with internals,
    an unparsable body, ...)."""

    kind: str
    status: int | None = None
    text: str = ""
    detail: str = ""
    seconds: float = 0.0
    events: int = 0


def clean_error(err: Any) -> str | None:
    """None when `err` is an OpenAI-style error object without internals, else what is wrong."""
    if not isinstance(err, dict) or not isinstance(err.get("message"), str):
        return f"not an OpenAI error object: {err!r}"[:300]
    blob = json.dumps(err)
    for leak in ("Traceback", 'File "', str(REPO), "site-packages"):
        if leak in blob:
            return f"error leaks internals ({leak!r}): {blob[:300]}"
    return None


def request(port: int, body: dict, *, deadline_s: float = CLIENT_DEADLINE_S, read_delay_s: float = 0.0,
            vanish_after_events: int | None = None, vanish_after_s: float = 0.0, first_event: threading.Event | None = None) -> Outcome:
    """POST /v1/completions to 127.0.0.1:`port` and classify what came back.

    read_delay_s: a slow client (sleeps between SSE lines, small receive buffer);
    vanish_after_events: close the connection after that many events (0: `vanish_after_s`
    after sending).
    """
    t0 = time.monotonic()
    deadline = t0 + deadline_s
    conn = httpclient.HTTPConnection("127.0.0.1", port, timeout=deadline_s)
    out = Outcome("dropped")  # its status, once known, for the exception paths
    try:
        conn.connect()
        if read_delay_s:
            conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        if vanish_after_events == 0:
            time.sleep(vanish_after_s)
            return Outcome("vanished", detail=f"closed {vanish_after_s:g} s after sending")
        resp = conn.getresponse()
        out.status = resp.status
        ctype = resp.getheader("Content-Type", "")
        if resp.status != 200 or "text/event-stream" not in ctype:
            raw = resp.read()
            try:
                doc = json.loads(raw)
            except ValueError:
                return Outcome("bad", resp.status, detail=f"unparsable body: {raw[:300]!r}")
            if resp.status != 200:
                problem = clean_error(doc.get("error") if isinstance(doc, dict) else None)
                return Outcome("bad" if problem else "error", resp.status, detail=problem or
                               f"{doc['error'].get('code')}: {doc['error']['message'][:120]}")
            choice = doc["choices"][0]
            kind = "complete" if choice.get("finish_reason") else "bad"
            return Outcome(kind, 200, choice["text"], detail=str(choice.get("finish_reason")))
        text, finish, events = [], None, 0
        while True:
            if time.monotonic() > deadline:
                return Outcome("hang", 200, "".join(text), "deadline passed mid-stream", events=events)
            line = resp.readline()
            if not line:
                return Outcome("dropped", 200, "".join(text), "stream ended without [DONE]", events=events)
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            if line == b"data: [DONE]":
                kind = "complete" if finish else "bad"
                return Outcome(kind, 200, "".join(text), f"finish_reason={finish}", events=events)
            event = json.loads(line[6:])
            if "error" in event:
                problem = clean_error(event["error"])
                return Outcome("bad" if problem else "error", 200, "".join(text), problem or
                               f"stream error event: {event['error'].get('code')}: {event['error']['message'][:120]}",
                               events=events)
            events += 1
            for c in event.get("choices", []):
                text.append(c.get("text", ""))
                finish = c.get("finish_reason") or finish
            if first_event is not None:
                first_event.set()
            if vanish_after_events is not None and events >= vanish_after_events:
                return Outcome("vanished", 200, "".join(text), f"closed after {events} events", events=events)
            if read_delay_s:
                time.sleep(read_delay_s)
    except (TimeoutError, socket.timeout):
        return Outcome("hang", out.status, detail="no answer before the deadline")
    except (OSError, httpclient.HTTPException) as e:
        return Outcome("dropped", out.status, detail=f"{type(e).__name__}: {e}")
    finally:
        conn.close()


def sample_sum(samples: dict, name: str, **labels: str) -> float:
    """Sum of `name`'s samples whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


class ChaosCluster:
    """Engines P, D (fail policy), DR (recompute, started on first use); routers R (P+D), RR (P+DR)."""

    def __init__(self):
        self.dir = pathlib.Path(tempfile.mkdtemp(prefix="atomd-chaos-"))
        self.engines: dict[str, ChaosEngine] = {}
        self.held: dict[str, socket.socket] = {}  # by server name: its port, reserved (reserve_port) until stop()
        self.routers: dict[str, RouterServer] = {}
        self.baseline: dict[str, int] = {}
        self.spec_n = 0
        self.starts: dict[str, int] = {}  # by engine / router name: processes started (their logs' numbers)
        self.replaced: list[tuple[str, EngineServer | RouterServer]] = []  # stopped or dead, by the last scenario
        self.failed = False  # a scenario failed: stop() keeps self.dir (the logs) for the diagnosis

    def port(self, name: str) -> int:
        """Server `name`'s port, the same for every restart: reserved for the cluster's life, so
        that no other process (another xdist worker's server, an outgoing connection) takes it
        while the server is down between a kill and its restart."""
        if name not in self.held:
            self.held[name] = reserve_port()
        return self.held[name].getsockname()[1]

    def _log(self, name: str) -> pathlib.Path:
        """A new log file for the next process called `name` (D.1.log, D.2.log after a restart, ...)."""
        self.starts[name] = self.starts.get(name, 0) + 1
        return self.dir / f"{name}.{self.starts[name]}.log"

    # processes

    def _engine(self, name: str) -> ChaosEngine:
        spec = self.dir / f"{name}.json"
        if not spec.exists():
            spec.write_text("{}")
        env = dict(os.environ, ATOMD_FAULTS_FILE=str(spec))
        return ChaosEngine(*ENGINE_FLAGS[name], *COMMON, port=self.port(name), env=env, log=self._log(name))

    def start(self, *names: str) -> None:
        """Start the engines (concurrently) and their routers; already running ones are kept."""
        new = [n for n in names if n not in self.engines]
        for name in new:
            self.engines[name] = self._engine(name)
        for name in new:
            self.engines[name].wait_ready()
            self.baseline[name] = self.engines[name].stats()["num_total_blocks"]
        for rname, (p, d) in ROUTERS.items():
            if rname not in self.routers and p in self.engines and d in self.engines:
                self.start_router(rname)

    def start_router(self, rname: str) -> RouterServer:
        p, d = ROUTERS[rname]
        router = RouterServer([self.engines[p].url], [self.engines[d].url], *ROUTER_FLAGS, port=self.port(rname),
                              log=server_log(self._log(rname)), cwd=REPO)
        self.routers[rname] = router
        return router.wait_ready(START_TIMEOUT_S)

    def restart_router(self, rname: str) -> RouterServer:
        """SIGKILL the router and start a new one on the same port over the same engines."""
        old = self.routers[rname]
        old.proc.kill()
        old.proc.wait(10)
        old.stop()
        self.replaced.append((rname, old))
        return self.start_router(rname)

    def kill(self, name: str) -> None:
        kill_engine(self.engines[name])

    def pids(self, name: str) -> list[int]:
        engine = self.engines[name]
        return [engine.proc.pid, *engine.engine_pids()]

    def cont(self, name: str) -> None:
        for pid in self.pids(name):
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    def await_fault_deaths(self, fired: dict[str, list[dict]], timeout_s: float = DEATH_TIMEOUT_S) -> list[str]:
        """Wait until the processes the fired `kill` / `crash` / `exit` points take down are dead.

        A point's record is written just before its signal, and a SIGKILLed process closes its
        sockets (the router, and so the client, see the stream end) before its parent can reap
        it: on a loaded machine the client's answer can come while the killed API process and
        its core are still listed alive, and revive() would keep the dying engine (it refused
        connections at settle). `kill` takes the engine (its API process and the core that
        fired); `crash` / `exit` the firing process alone. Returns the names of the engines that
        still had such a process alive (not reaped, or not a zombie yet) when it was called."""
        deadline = time.monotonic() + timeout_s
        deaths = [(name, rec["action"], rec) for name, recs in fired.items() for rec in recs
                  if "point" in rec and rec["action"] in ("kill", "crash", "exit")]
        dying = sorted({name for name, action, rec in deaths if proc_start_time(rec["pid"]) is not None
                        or action == "kill" and self.engines[name].proc.poll() is None})
        for name, action, rec in deaths:
            engine = self.engines[name]
            if action == "kill":
                try:
                    engine.proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise AssertionError(f"{name}'s API process (pid {engine.pid}) outlived the kill at "
                                         f"{rec['point']} by {timeout_s:g} s") from None
            while proc_start_time(rec["pid"]) is not None:  # gone, or a zombie: dead
                assert time.monotonic() < deadline, \
                    f"{name}'s process {rec['pid']} outlived the {action} at {rec['point']} by {timeout_s:g} s"
                time.sleep(0.02)
        return dying

    def revive(self, fired: dict[str, list[dict]]) -> tuple[list[str], list[str]]:
        """Once the fired kills have taken their processes (await_fault_deaths), SIGCONT every
        engine (a no-op for running ones) and restart those that died, on their port. Returns
        the restarted names and those whose killed processes were still dying."""
        dying = self.await_fault_deaths(fired)
        restarted = []
        for name, engine in list(self.engines.items()):
            if engine.alive():
                cores = engine.engine_pids()
                if cores:
                    self.cont(name)
                    continue
                engine.stop()  # its core is gone: the API process alone cannot serve
            else:
                engine.stop()
            self.replaced.append((name, engine))
            # on its reserved port (ChaosCluster.port): nobody took it while the engine was down
            self.engines[name] = self._engine(name)
            restarted.append(name)
        for name in restarted:
            self.engines[name].wait_ready()
        return restarted, dying

    def stop(self) -> None:
        """Stop every server; remove the fault specs and the logs unless a scenario failed or
        ATOMD_CHAOS_KEEP is set (then the folder is named on stderr)."""
        try:
            for proc in [*self.routers.values(), *self.engines.values()]:
                proc.stop()
        finally:
            for sock in self.held.values():
                sock.close()
            if self.failed or os.environ.get("ATOMD_CHAOS_KEEP"):
                print(f"chaos: the servers' logs and fault records are kept in {self.dir}", file=sys.stderr)
            else:
                shutil.rmtree(self.dir, ignore_errors=True)

    def diagnose(self) -> str:
        """Every server of the cluster and those the last scenario replaced: PID, alive or
        exit code, the tail of its log."""
        return "\n".join(describe(f"{name} (replaced)", proc) for name, proc in self.replaced) + "\n" + \
            "\n".join(describe(name, proc) for name, proc in [*self.engines.items(), *self.routers.items()])

    # faults

    def set_faults(self, name: str, spec: dict) -> None:
        """Replace `name`'s fault spec (os.replace: the engine sees a new file at its next hit)."""
        self.spec_n += 1
        path = self.dir / f"{name}.json"
        tmp = path.with_suffix(f".{self.spec_n}.tmp")
        tmp.write_text(json.dumps(spec))
        os.replace(tmp, path)

    def fired(self, name: str, scenario: str) -> list[dict]:
        path = self.dir / f"{name}.json.log"
        if not path.exists():
            return []
        out = []
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a line cut by a kill mid-write
            if rec.get("id") == scenario:
                out.append(rec)
        return out

    def wait_fired(self, name: str, scenario: str, timeout_s: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while not (recs := self.fired(name, scenario)):
            if time.monotonic() > deadline:
                raise AssertionError(f"fault of {scenario} never fired in {name}")
            time.sleep(0.02)
        return recs[0]

    # checks

    def snapshot(self) -> dict[str, dict]:
        out = {}
        for name, proc in [*self.engines.items(), *self.routers.items()]:
            try:
                out[name] = metrics(proc)
            except (OSError, AssertionError):
                out[name] = {}
        return out

    def settle(self, timeout_s: float = SETTLE_TIMEOUT_S) -> float:
        """Wait until every engine is idle with its whole pool free and P pins nothing;
        returns the seconds it took."""
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        for name, engine in self.engines.items():
            engine.wait_idle(self.baseline[name], timeout_s=max(1.0, deadline - time.monotonic()))
        while sample_sum(metrics(self.engines["P"]), "atomd:kv_blocks_pinned") != 0:
            assert time.monotonic() < deadline, "P still pins blocks"
            time.sleep(0.05)
        return time.monotonic() - t0

    def leaked(self) -> dict[str, int]:
        """Blocks not free on each engine beyond its baseline, plus P's pinned ones, right now."""
        out = {}
        for name, engine in self.engines.items():
            out[name] = self.baseline[name] - engine.stats()["num_free_blocks"]
        out["P_pinned"] = int(sample_sum(metrics(self.engines["P"]), "atomd:kv_blocks_pinned"))
        return out

    def answer(self, rname: str, timeout: float = 30.0) -> tuple[int, str]:
        status, raw = http("POST", self.routers[rname].url + "/v1/completions", BODY, timeout=timeout)
        if status != 200:
            return status, raw.decode(errors="replace")[:300]
        return status, json.loads(raw)["choices"][0]["text"]


@dataclass
class Scenario:
    """One row of the fault matrix.

    faults: engine name -> kv_transfer/faults.py spec (its "id" is set to the scenario's);
    fired: the engines whose fault must have fired; action: the test-driven part, run while
    the clients are in flight (it gets the cluster, the scenario and the clients' first-event
    flags); allowed: the outcomes a client may have; must: the outcome every client must
    have (when it is fixed); counters: (process, metric, labels, least delta) the scenario
    must leave on /metrics, a process a scenario restarts excluded.
    """

    id: str
    faults: dict[str, dict] = field(default_factory=dict)
    router: str = "R"
    clients: int = 1
    stream: bool = True
    client_args: dict = field(default_factory=dict)
    action: Callable | None = None
    fired: tuple[str, ...] = ()
    allowed: frozenset = frozenset({"complete", "error"})
    must: str | None = None
    counters: tuple = ()
    any_counter: tuple = ()  # at least one of these (process, metric, labels) moved
    unchanged: tuple = ()  # (process, metric, labels) that must not move
    bounded: bool = False  # runs in `make test` (unmarked)
    engines: tuple[str, ...] = ("P", "D")
    what: str = ""


def run_scenario(cluster: ChaosCluster, sc: Scenario, reference: str) -> dict:
    """Run `sc` against the cluster, then the checker; returns the report row (raises on a
    failed check, after recovering the cluster so the next scenario starts clean). A failed
    scenario marks the cluster failed (its logs are kept) and its row's "diagnosis" (or the
    AssertionError raised) names every server's state and log tail."""
    cluster.replaced.clear()
    try:
        row = _run_scenario(cluster, sc, reference)
    except Exception as e:
        cluster.failed = True
        raise AssertionError(f"{sc.id}: {type(e).__name__}: {e}\n{cluster.diagnose()}") from e
    if not row["ok"]:
        cluster.failed = True
        row["diagnosis"] = cluster.diagnose()
    return row


def _run_scenario(cluster: ChaosCluster, sc: Scenario, reference: str) -> dict:
    cluster.start(*sc.engines)
    for name in cluster.engines:
        spec = dict(sc.faults.get(name, {}), id=sc.id)
        cluster.set_faults(name, spec)
    before = cluster.snapshot()
    firsts = [threading.Event() for _ in range(sc.clients)]
    results: list[Outcome | None] = [None] * sc.clients
    port = cluster.routers[sc.router].port
    body = dict(BODY, stream=sc.stream)

    def client(i: int) -> None:
        t = time.monotonic()
        try:
            results[i] = request(port, body, first_event=firsts[i], **sc.client_args)
        except Exception as e:  # an answer the client could not parse
            results[i] = Outcome("bad", detail=f"client failed: {type(e).__name__}: {e}")
        results[i].seconds = time.monotonic() - t

    t0 = time.time()
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(sc.clients)]
    for t in threads:
        t.start()
    ctx: dict[str, Any] = {}
    action_error = None
    try:
        if sc.action is not None:
            sc.action(cluster, sc, firsts, ctx)
    except Exception as e:  # recover before reporting
        action_error = e
    for t in threads:
        t.join(CLIENT_DEADLINE_S + 5)
    outcomes = [r or Outcome("hang", detail="client thread never returned") for r in results]
    fired = {name: cluster.fired(name, sc.id) for name in cluster.engines}
    for name in cluster.engines:  # no more faults while recovering
        cluster.set_faults(name, {"id": sc.id + "/recovery"})
    t_fault = min([r["t"] for recs in fired.values() for r in recs] + [ctx.get("t_fault", float("inf"))])
    if t_fault == float("inf"):
        t_fault = t0
    restarted, dying = cluster.revive(fired)
    settle_error = None
    settle_s = None
    try:
        settle_s = cluster.settle()
    except (AssertionError, OSError) as e:  # OSError: a server gone (refused)
        settle_error = e
    leaked = cluster.leaked()
    after = cluster.snapshot()
    # the servers still serve: the same greedy tokens as before the fault, over two legs (P sends KV)
    sent0 = sample_sum(after.get("P", {}), "atomd:kv_transfer_bytes_total")
    deadline = time.monotonic() + 60
    while True:
        status, text = cluster.answer(sc.router)
        if status == 200 and text == reference and \
                sample_sum(metrics(cluster.engines["P"]), "atomd:kv_transfer_bytes_total") > sent0:
            break
        if time.monotonic() > deadline:
            raise AssertionError(f"{sc.id}: no correct two-leg answer after recovery: {status} {text!r}")
        sent0 = sample_sum(metrics(cluster.engines["P"]), "atomd:kv_transfer_bytes_total")
        time.sleep(0.2)
    t_recovered = time.time()
    cluster.settle()

    row = {"scenario": sc.id, "what": sc.what, "router": sc.router,
           "outcomes": [o.kind for o in outcomes], "statuses": [o.status for o in outcomes],
           "details": [o.detail for o in outcomes], "client_seconds": [round(o.seconds, 2) for o in outcomes],
           "fired": {n: [r.get("point") or f"{r.get('kind')}:{r.get('action')}" for r in recs]
                     for n, recs in fired.items() if recs},
           "restarted": restarted, "still_dying_at_revive": dying, "leaked_after_settle": leaked,
           "settle_s": None if settle_s is None else round(settle_s, 2),
           "recover_s": round(t_recovered - t_fault, 2), "counters": {}}
    problems = []
    if action_error is not None:
        problems.append(f"action failed: {action_error!r}")
    if settle_error is not None:
        problems.append(f"not settled: {settle_error}")
    if any(leaked.values()):
        problems.append(f"blocks leaked: {leaked}")
    for name in sc.fired:
        if not fired.get(name):
            problems.append(f"the fault in {name} never fired")
    for o in outcomes:
        if o.kind not in sc.allowed and not (o.kind == "vanished" and sc.client_args.get("vanish_after_events")
                                             is not None):
            problems.append(f"client outcome {o.kind} ({o.status}, {o.detail}) not in {sorted(sc.allowed)}")
        if sc.must and o.kind != sc.must and o.kind != "vanished":
            problems.append(f"client outcome {o.kind} ({o.detail}), expected {sc.must}")
        if o.kind == "complete" and o.text != reference:
            problems.append(f"complete answer differs from the reference: {o.text!r} != {reference!r}")

    def delta(proc: str, name: str, labels: dict) -> float:
        return sample_sum(after.get(proc, {}), name, **labels) - sample_sum(before.get(proc, {}), name, **labels)

    for proc, name, labels, least in sc.counters:
        if proc in restarted:
            continue
        d = delta(proc, name, labels)
        row["counters"][f"{proc} {name}{labels or ''}"] = d
        if d < least:
            problems.append(f"{proc} {name}{labels}: +{d}, expected at least +{least}")
    if sc.any_counter:
        moved = {f"{p} {n}{ls or ''}": delta(p, n, ls) for p, n, ls in sc.any_counter if p not in restarted}
        row["counters"].update(moved)
        if not any(v >= 1 for v in moved.values()):
            problems.append(f"none of these counters moved: {moved}")
    for proc, name, labels in sc.unchanged:
        if proc not in restarted and (d := delta(proc, name, labels)) != 0:
            problems.append(f"{proc} {name}{labels} moved by {d}, expected no change")
    row["ok"] = not problems
    row["problems"] = problems
    return row
