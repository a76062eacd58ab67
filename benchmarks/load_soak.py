"""Load and soak through the router to a real 1P+1D pair on 127.0.0.1 (issue #18).

    .venv/bin/python -m benchmarks.load_soak --clients 1000 --soak-seconds 300

Starts a prefill engine and a decode engine (`atomd serve`, the built-in model, one torch
thread each) and a router in front of them, then:

- **load**: `--clients` streaming clients at once (`--rounds` bursts of one request each,
  then the same clients sending back to back for `--load-seconds`), short prompts,
  `--max-tokens` tokens each, 10% of them closing mid-stream after the first event and 5%
  hanging up before the first byte; every client must finish before a deadline;
- **soak**: `--soak-concurrency` workers sending a steady mix for `--soak-seconds`
  (completions and chat, streamed and not, mid-stream and early disconnects, bad requests
  that must get a 4xx), with RSS and open file descriptors of every process (router, each
  engine's API server and engine core) sampled every second.

After each phase the cluster must settle: both pools back at baseline, no pinned block on
P, nothing running or waiting, every in-flight gauge of router and engines at 0, no
client connection left and none in CLOSE_WAIT; P's expired leases are reported. Writes
benchmarks/results/load_soak.md (requests, errors, p50/p99 TTFT and total latency, RSS
and fds per process before/after, the machine's load average).

The pieces (`PDStack`, the request kinds, `run_burst`, `run_soak`, `Sampler`, the leak
check) are shared with tests/test_load_pd.py and tests/test_soak.py.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import pathlib
import random
import sys
import time
from collections import Counter

import aiohttp

from atomd.bench.client import chunk_text
from benchmarks.machine import loadavg
from launch.process import EngineServer, RouterServer, http

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "load_soak.md"

MAX_MODEL_LEN = 256
# max_num_seqs 256: a 1000-client burst runs in ~4 waves of 256 decodes per step; the rest
# wait in the engines' queues (no admission limit anywhere, so all 1000 are served).
# The pool is the default: 256 MiB, at most max_num_seqs full contexts (4096 blocks).
ENGINE_ARGS = ["--max-model-len", str(MAX_MODEL_LEN), "--num-threads", "1", "--max-num-seqs", "256"]
# No --max-concurrent-requests: the router routes every request at once (its default), so
# nothing is refused with 429; the engines queue what they cannot run yet.
ROUTER_ARGS = ["--health-interval-s", "1"]
START_TIMEOUT_S = 180.0

PROMPTS = ["def add(a, b):", "import os", "class Point:", "for i in range(10):", "# a comment",
           "x = [1, 2, 3]", "print('hello')", "while True:", "return None", "with open(path) as f:"]


# ============================================================================ processes

def proc_rss(pid: int) -> int:
    """Resident set size in bytes (VmRSS of /proc/PID/status)."""
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def proc_fds(pid: int) -> int:
    """Open file descriptors (entries of /proc/PID/fd)."""
    return len(os.listdir(f"/proc/{pid}/fd"))


TCP_LISTEN, TCP_CLOSE_WAIT = 0x0A, 0x08


def tcp_sockets(pid: int) -> list[tuple[int, int, int]]:
    """(local port, remote port, state) of every TCP socket the process holds open
    (its /proc/PID/fd socket inodes looked up in /proc/PID/net/tcp and tcp6)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[9] in inodes:
                    out.append((int(fields[1].rsplit(":", 1)[1], 16), int(fields[2].rsplit(":", 1)[1], 16),
                                int(fields[3], 16)))
    return out


class PDStack:
    """A prefill engine P, a decode engine D (real `atomd serve`, built-in model) and a router.

    `log_dir`: where each process's output goes (None: nowhere). `stop()` ends all three
    (by PID, SIGTERM then SIGKILL); usable as a context manager.
    """

    def __init__(self, log_dir: str | os.PathLike | None = None, engine_args: list[str] = ENGINE_ARGS,
                 router_args: list[str] = ROUTER_ARGS):
        self.log_dir = pathlib.Path(log_dir) if log_dir is not None else None
        self.engine_args, self.router_args = list(engine_args), list(router_args)
        self.engines: dict[str, EngineServer] = {}
        self.router: RouterServer | None = None
        self.baseline: dict[str, int] = {}
        self.settle_trace: list[tuple[float, dict]] = []

    def _log(self, name: str) -> str | pathlib.Path:
        return self.log_dir / f"{name}.log" if self.log_dir is not None else os.devnull

    def start(self) -> "PDStack":
        try:
            for name, role in (("P", "producer"), ("D", "consumer")):
                self.engines[name] = EngineServer(None, *self.engine_args, "--kv-role", role,
                                                  log=self._log(name), cwd=ROOT)
            for engine in self.engines.values():  # both load at once
                engine.wait_ready(START_TIMEOUT_S)
            self.router = RouterServer([self.engines["P"].url], [self.engines["D"].url], *self.router_args,
                                       log=self._log("router"), cwd=ROOT)
            self.router.wait_ready(START_TIMEOUT_S)
            self.baseline = {name: self.stats(name)["num_total_blocks"] for name in self.engines}
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def url(self) -> str:
        return self.router.url

    def pids(self) -> dict[str, int]:
        """Every process of the stack: router, and each engine's API server and engine core."""
        out = {"router": self.router.pid}
        for name, engine in self.engines.items():
            out[f"{name} api"] = engine.pid
            out[f"{name} core"] = engine.engine_pid()
        return out

    def snapshot(self) -> dict[str, tuple[int, int]]:
        """{process: (RSS bytes, open fds)}."""
        return {name: (proc_rss(pid), proc_fds(pid)) for name, pid in self.pids().items()}

    def connections(self) -> dict[str, dict[str, int]]:
        """HTTP connections of the router and the engines' API servers: the router's from
        clients and to P / D (its keep-alive pools), each engine's from the router, and every
        socket in CLOSE_WAIT (the peer hung up, this side never closed it: a leak)."""
        ports = {"router": self.router.port, **{n: e.port for n, e in self.engines.items()}}
        out = {}
        for name, pid in (("router", self.router.pid), *((n, e.pid) for n, e in self.engines.items())):
            socks = [s for s in tcp_sockets(pid) if s[2] != TCP_LISTEN]
            c = {"close_wait": sum(1 for s in socks if s[2] == TCP_CLOSE_WAIT)}
            if name == "router":
                c["from_clients"] = sum(1 for s in socks if s[0] == ports["router"])
                c["to_P"] = sum(1 for s in socks if s[1] == ports["P"])
                c["to_D"] = sum(1 for s in socks if s[1] == ports["D"])
            else:
                c["from_router"] = sum(1 for s in socks if s[0] == ports[name])
            out[name] = c
        return out

    def alive(self) -> dict[str, bool]:
        return {"router": self.router.alive(), **{n: e.alive() for n, e in self.engines.items()}}

    def stats(self, name: str) -> dict:
        status, body = http("GET", self.engines[name].url + "/debug/stats", timeout=10)
        assert status == 200, body
        return json.loads(body)

    def router_gauges(self) -> dict[str, float]:
        """Requests active / queued and legs in flight at the router (summed over workers)."""
        return {name: sum(v for _, v in samples) for name, samples in
                prometheus_samples(self.router.url, ("atomd_router:requests_active", "atomd_router:requests_queued",
                                                     "atomd_router:worker_requests_in_flight")).items()}

    def unsettled(self) -> dict:
        """What is not back at rest yet ({} when settled): per engine the queues, free blocks
        vs baseline, API requests in flight, unconfirmed aborts; P's pinned blocks; the
        router's gauges."""
        out = {}
        for name in self.engines:
            s = self.stats(name)
            bad = {k: s[k] for k in ("num_running", "num_waiting", "api_requests_in_flight", "api_aborts_unconfirmed")
                   if s[k]}
            if s["num_free_blocks"] != self.baseline[name]:
                bad["num_free_blocks"] = f"{s['num_free_blocks']} of {self.baseline[name]}"
            if bad:
                out[name] = bad
        pinned = sum(v for _, v in prometheus_samples(self.engines["P"].url, ("atomd:kv_blocks_pinned",))
                     .get("atomd:kv_blocks_pinned", []))
        if pinned:
            out["P pinned blocks"] = pinned
        busy = {k: v for k, v in self.router_gauges().items() if v}
        if busy:
            out["router"] = busy
        # no client connection left at the router (the clients are gone), none in CLOSE_WAIT
        for name, c in self.connections().items():
            if c["close_wait"] or c.get("from_clients"):
                out[f"{name} connections"] = c
        return out

    def wait_settled(self, timeout_s: float = 15.0) -> float:
        """Poll until unsettled() is empty; AssertionError naming what is not at the deadline
        (default: half P's 30 s lease, so a transfer left to its lease fails). Returns the
        seconds it took."""
        started = time.monotonic()
        self.settle_trace = []  # (seconds, what was not settled), once a second
        while state := self.unsettled():
            waited = time.monotonic() - started
            if not self.settle_trace or waited - self.settle_trace[-1][0] >= 1.0:
                self.settle_trace.append((round(waited, 1), state))
            if waited > timeout_s:
                raise AssertionError(f"not settled after {timeout_s:g} s: {state}; before: {self.settle_trace}")
            time.sleep(0.1)
        return time.monotonic() - started

    def stop(self) -> None:
        for proc in [self.router, *self.engines.values()]:
            if proc is not None:
                proc.stop()

    def __enter__(self) -> "PDStack":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def prometheus_samples(url: str, names: tuple[str, ...]) -> dict[str, list[tuple[dict, float]]]:
    """The samples of the named metrics of GET url/metrics: {name: [(labels, value)]}."""
    from prometheus_client.parser import text_string_to_metric_families

    status, body = http("GET", url + "/metrics", timeout=10)
    assert status == 200, body
    out: dict[str, list] = {name: [] for name in names}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            if s.name in out:
                out[s.name].append((s.labels, s.value))
    return out


# ============================================================================ requests

@dataclasses.dataclass
class Outcome:
    """One request: its kind, whether it went as expected, and its times (seconds)."""

    kind: str
    ok: bool
    status: int | None = None
    ttft: float | None = None  # streamed: send to the first event with text
    total: float | None = None  # send to the end (complete requests only)
    error: str = ""


KINDS = ("completion_stream", "completion_json", "chat_stream", "chat_json", "disconnect_mid", "disconnect_early",
         "bad_request")


class Traffic:
    """The request kinds, against one base URL, on one aiohttp session."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, model: str, max_tokens: int = 8,
                 rng: random.Random | None = None):
        self.session, self.base, self.model, self.max_tokens = session, base_url, model, max_tokens
        self.rng = rng or random.Random(0)

    def body(self, chat: bool, stream: bool) -> dict:
        prompt = self.rng.choice(PROMPTS)
        # ignore_eos: every answer has exactly max_tokens tokens, which usage must say
        body = {"model": self.model, "max_tokens": self.max_tokens, "ignore_eos": True, "stream": stream}
        if chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    def path(self, chat: bool) -> str:
        return self.base + ("/v1/chat/completions" if chat else "/v1/completions")

    async def stream(self, chat: bool, disconnect_after: int | None = None) -> Outcome:
        """A streamed request, checked: 200, text events, no error event, usage = max_tokens,
        `data: [DONE]` last. disconnect_after=N: close the connection after N events."""
        kind = "disconnect_mid" if disconnect_after is not None else ("chat_stream" if chat else "completion_stream")
        sent = time.monotonic()
        out = Outcome(kind, False)
        try:
            async with self.session.post(self.path(chat), json=self.body(chat, True)) as resp:
                out.status = resp.status
                if resp.status != 200:
                    out.error = f"HTTP {resp.status}: {(await resp.read())[:300]!r}"
                    return out
                events, usage, done = 0, None, False
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if done:
                        out.error = f"data after [DONE]: {data[:200]!r}"
                        return out
                    if data == b"[DONE]":
                        done = True
                        continue
                    obj = json.loads(data)
                    if "error" in obj:
                        out.error = f"error event: {obj['error']}"
                        return out
                    if chunk_text(obj, chat) and out.ttft is None:
                        out.ttft = time.monotonic() - sent
                    usage = obj.get("usage") or usage
                    events += 1
                    if disconnect_after is not None and events >= disconnect_after:
                        resp.close()  # hang up mid-stream: the connection is closed, not reused
                        out.ok = True
                        return out
                if disconnect_after is not None:
                    out.error = f"stream ended after {events} events, before the disconnect"
                elif not done:
                    out.error = f"no [DONE] after {events} events"
                elif out.ttft is None:
                    out.error = "no text in the stream"
                elif not usage or usage.get("completion_tokens") != self.max_tokens:
                    out.error = f"usage {usage}, expected {self.max_tokens} completion tokens"
                else:
                    out.ok, out.total = True, time.monotonic() - sent
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            out.error = f"{type(e).__name__}: {e}"
        return out

    async def json(self, chat: bool) -> Outcome:
        """A non-streamed request, checked: 200, text, usage = max_tokens."""
        sent = time.monotonic()
        out = Outcome("chat_json" if chat else "completion_json", False)
        try:
            async with self.session.post(self.path(chat), json=self.body(chat, False)) as resp:
                out.status = resp.status
                raw = await resp.read()
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {raw[:300]!r}"
                return out
            obj = json.loads(raw)
            choice = obj["choices"][0]
            text = choice["message"]["content"] if chat else choice["text"]
            if not text or obj["usage"]["completion_tokens"] != self.max_tokens:
                out.error = f"text {text!r}, usage {obj['usage']}"
            else:
                out.ok, out.total = True, time.monotonic() - sent
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, IndexError, TypeError) as e:
            out.error = f"{type(e).__name__}: {e}"
        return out

    async def disconnect_early(self, max_delay_s: float = 0.05) -> Outcome:
        """A streamed request abandoned before its first byte (a client that gives up while
        the request is queued, prefilled or its KV pulled): the task is cancelled, which
        closes the connection. One that already ended counts as its own kind."""
        chat = self.rng.random() < 0.5
        task = asyncio.ensure_future(self.stream(chat))
        await asyncio.sleep(self.rng.uniform(0, max_delay_s))
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return Outcome("disconnect_early", True)

    BAD = {  # name: (path, raw body); each must be answered with a 4xx
        "truncated_json": (False, b'{"model": "m", "prompt": "x", "max_tok'),
        "not_json": (True, b"\xff\xfe not json"),
        "negative_max_tokens": (False, {"prompt": "x", "max_tokens": -1}),
        "wrong_type": (True, {"messages": "hello", "max_tokens": 4}),
        "unknown_field": (False, {"prompt": "x", "max_tokens": 4, "no_such_field": 1}),
        "prompt_too_long": (False, {"prompt": "x " * (2 * MAX_MODEL_LEN), "max_tokens": 4}),
        "too_many_tokens": (True, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10 * MAX_MODEL_LEN}),
        "no_messages": (True, {"max_tokens": 4}),
    }

    async def bad(self, name: str | None = None) -> Outcome:
        name = name or self.rng.choice(sorted(self.BAD))
        chat, body = self.BAD[name]
        if isinstance(body, dict):
            body = json.dumps({"model": self.model, **body}).encode()
        out = Outcome("bad_request", False)
        try:
            async with self.session.post(self.path(chat), data=body,
                                         headers={"Content-Type": "application/json"}) as resp:
                out.status = resp.status
                raw = await resp.read()
            if 400 <= resp.status < 500:
                out.ok = True
            else:
                out.error = f"{name}: HTTP {resp.status} (want 4xx): {raw[:300]!r}"
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            out.error = f"{name}: {type(e).__name__}: {e}"
        return out

    async def one(self, kind: str) -> Outcome:
        if kind in ("completion_stream", "chat_stream"):
            return await self.stream(kind == "chat_stream")
        if kind in ("completion_json", "chat_json"):
            return await self.json(kind == "chat_json")
        if kind == "disconnect_mid":
            return await self.stream(self.rng.random() < 0.5, disconnect_after=1)
        if kind == "disconnect_early":
            return await self.disconnect_early()
        if kind == "bad_request":
            return await self.bad()
        raise ValueError(kind)


def session(timeout_s: float) -> aiohttp.ClientSession:
    """One client session with no connection limit (every client its own connection)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                 timeout=aiohttp.ClientTimeout(total=timeout_s))


async def discover_model(s: aiohttp.ClientSession, base_url: str) -> str:
    async with s.get(base_url + "/v1/models") as resp:
        return (await resp.json())["data"][0]["id"]


# ============================================================================ tallies

def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


@dataclasses.dataclass
class Tally:
    outcomes: list[Outcome] = dataclasses.field(default_factory=list)
    stuck: int = 0  # clients still running at the deadline (cancelled then)
    seconds: float = 0.0

    @property
    def errors(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.ok]

    def summary(self) -> dict:
        ttft = [o.ttft for o in self.outcomes if o.ok and o.ttft is not None and o.total is not None]
        total_stream = [o.total for o in self.outcomes if o.ok and o.total is not None and o.ttft is not None]
        total_json = [o.total for o in self.outcomes if o.ok and o.total is not None and o.ttft is None]

        def ms(values, q):
            p = percentile(values, q)
            return None if p is None else round(p * 1000, 1)

        return {"requests": len(self.outcomes), "errors": len(self.errors), "stuck": self.stuck,
                "seconds": round(self.seconds, 1),
                "by_kind": dict(sorted(Counter(o.kind for o in self.outcomes).items())),
                "statuses": dict(sorted(Counter(str(o.status) for o in self.outcomes).items())),
                "ttft_ms": {"p50": ms(ttft, 50), "p99": ms(ttft, 99)},
                "stream_total_ms": {"p50": ms(total_stream, 50), "p99": ms(total_stream, 99)},
                "json_total_ms": {"p50": ms(total_json, 50), "p99": ms(total_json, 99)},
                "first_errors": [f"{o.kind}: {o.error}" for o in self.errors[:5]]}


async def finish(tasks: list[asyncio.Task], timeout_s: float) -> int:
    """Wait up to `timeout_s` for the client tasks; cancel the ones still running and return
    how many there were (stuck). A task that raised raises here: a client's own bug is not
    an outcome to count."""
    _, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for t in tasks:
        if not t.cancelled() and t.exception() is not None:
            raise t.exception()
    return len(pending)


# ============================================================================ load: a burst

def burst_kind(i: int) -> str:
    """Client i of a burst: 10% close mid-stream after the first event, 5% hang up before
    the first byte, the rest stream to the end (completions and chat alternating)."""
    if i % 10 == 3:
        return "disconnect_mid"
    if i % 20 == 7:
        return "disconnect_early"
    return "chat_stream" if i % 2 else "completion_stream"


async def run_burst(base_url: str, clients: int, max_tokens: int = 8, seconds: float = 0.0,
                    deadline_s: float = 180.0, request_timeout_s: float = 150.0) -> Tally:
    """`clients` streaming clients started at once, each on its own connection, each sending
    requests back to back (kinds by `burst_kind`) until `seconds` have passed (at least one
    each: `seconds` 0 is one burst). Every client must be done `deadline_s` after the end
    (the rest are counted `stuck`, then cancelled)."""
    tally = Tally()
    async with session(request_timeout_s) as s:
        traffic = Traffic(s, base_url, await discover_model(s, base_url), max_tokens)
        started = time.monotonic()
        end = started + seconds

        async def client(i: int) -> None:
            n = 0
            while True:
                tally.outcomes.append(await traffic.one(burst_kind(i + n * 7)))
                n += 1
                if time.monotonic() >= end:
                    return

        tasks = [asyncio.ensure_future(client(i)) for i in range(clients)]
        tally.stuck = await finish(tasks, seconds + deadline_s)
        tally.seconds = time.monotonic() - started
    return tally


# ============================================================================ soak

SOAK_MIX = {"completion_stream": 30, "chat_stream": 20, "completion_json": 15, "chat_json": 10,
            "disconnect_mid": 8, "disconnect_early": 7, "bad_request": 10}


class Sampler:
    """RSS and fds of every process of a stack, every `interval_s`, on a thread."""

    def __init__(self, stack: PDStack, interval_s: float = 1.0):
        self.stack, self.interval_s = stack, interval_s
        self.pids = stack.pids()
        self.samples: list[tuple[float, dict[str, tuple[int, int]]]] = []
        self._stop = asyncio.Event()

    def sample(self, t: float) -> None:
        self.samples.append((t, {name: (proc_rss(pid), proc_fds(pid)) for name, pid in self.pids.items()}))

    async def run(self, started: float) -> None:
        while not self._stop.is_set():
            self.sample(time.monotonic() - started)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.interval_s)

    def stop(self) -> None:
        self._stop.set()


async def run_soak(stack: PDStack, seconds: float, concurrency: int, max_tokens: int = 8, seed: int = 0,
                   sampler: Sampler | None = None, request_timeout_s: float = 60.0) -> Tally:
    """`concurrency` workers send SOAK_MIX back to back for `seconds`; `sampler` (if given)
    samples the processes meanwhile. A worker still busy 60 s after the end counts stuck."""
    tally = Tally()
    rng = random.Random(seed)
    kinds, weights = zip(*SOAK_MIX.items())
    async with session(request_timeout_s) as s:
        model = await discover_model(s, stack.url)
        started = time.monotonic()
        end = started + seconds

        async def worker(w: int) -> None:
            traffic = Traffic(s, stack.url, model, max_tokens, random.Random(seed * 1000 + w))
            while time.monotonic() < end:
                tally.outcomes.append(await traffic.one(rng.choices(kinds, weights)[0]))

        sampling = asyncio.ensure_future(sampler.run(started)) if sampler else None
        tasks = [asyncio.ensure_future(worker(w)) for w in range(concurrency)]
        tally.stuck = await finish(tasks, seconds + request_timeout_s)
        tally.seconds = time.monotonic() - started
        if sampling is not None:
            sampler.stop()
            await sampling
    return tally


def growth(samples: list[tuple[float, dict[str, tuple[int, int]]]], seconds: float) -> dict[str, tuple[int, int]]:
    """Per process: (RSS growth in bytes, fd growth) from the second quarter of the run to its
    last quarter, each quarter taken at its maximum (a leak raises the peaks; in-flight
    connections and allocator churn move the samples in between)."""
    q2 = [s for t, s in samples if seconds / 4 <= t < seconds / 2]
    q4 = [s for t, s in samples if t >= 3 * seconds / 4]
    if not q2 or not q4:
        raise ValueError(f"too few samples ({len(samples)}) over {seconds} s")
    out = {}
    for name in q2[0]:
        rss = max(s[name][0] for s in q4) - max(s[name][0] for s in q2)
        fds = max(s[name][1] for s in q4) - max(s[name][1] for s in q2)
        out[name] = (rss, fds)
    return out


# ============================================================================ report

def mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def latency_row(label: str, summary: dict) -> str:
    def pair(d):
        return " / ".join("-" if v is None else f"{v:g}" for v in (d["p50"], d["p99"]))

    return (f"| {label} | {summary['requests']} | {summary['errors']} | {summary['stuck']} | {summary['seconds']} | "
            f"{pair(summary['ttft_ms'])} | {pair(summary['stream_total_ms'])} | {pair(summary['json_total_ms'])} |")


def process_table(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> list[str]:
    lines = ["| process | RSS before (MiB) | RSS after (MiB) | fds before | fds after |", "|---|---|---|---|---|"]
    for name in before:
        (r0, f0), (r1, f1) = before[name], after[name]
        lines.append(f"| {name} | {mib(r0)} | {mib(r1)} | {f0} | {f1} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="python -m benchmarks.load_soak")
    ap.add_argument("--clients", type=int, default=1000, help="concurrent streaming clients of a burst")
    ap.add_argument("--rounds", type=int, default=2, help="bursts of --clients (the first warms the pools)")
    ap.add_argument("--load-seconds", type=float, default=20.0,
                    help="then the same clients send back to back for this long (0: no such phase)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--soak-seconds", type=float, default=300.0)
    ap.add_argument("--soak-concurrency", type=int, default=16)
    ap.add_argument("--out", type=pathlib.Path, default=RESULTS)
    ap.add_argument("--log-dir", type=pathlib.Path, default=None, help="each process's output (default: none)")
    args = ap.parse_args(argv)
    if args.log_dir:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    load_start = loadavg()
    report = {"command": "python -m benchmarks.load_soak " + " ".join(sys.argv[1:] if argv is None else argv),
              "loadavg_start": load_start, "bursts": [], "soak": None}
    with PDStack(args.log_dir).start() as stack:
        start_snapshot = stack.snapshot()
        after_bursts = []
        phases = [0.0] * args.rounds + ([args.load_seconds] if args.load_seconds > 0 else [])
        for r, seconds in enumerate(phases):
            tally = asyncio.run(run_burst(stack.url, args.clients, args.max_tokens, seconds=seconds))
            settle = stack.wait_settled(60.0)
            summary = tally.summary()
            summary["settle_s"] = round(settle, 2)
            summary["loadavg"] = loadavg()
            summary["sustained_s"] = seconds
            summary["p_leases_expired"] = stack.stats("P")["kv_transfer"]["leases_expired"]  # cumulative
            after_bursts.append(stack.snapshot())
            report["bursts"].append(summary)
            print(f"burst {r + 1}: {json.dumps(summary)}", flush=True)
        sampler = Sampler(stack)
        before_soak = stack.snapshot()
        tally = asyncio.run(run_soak(stack, args.soak_seconds, args.soak_concurrency, args.max_tokens,
                                     sampler=sampler))
        settle = stack.wait_settled(60.0)
        after_soak = stack.snapshot()
        summary = tally.summary()
        summary["settle_s"] = round(settle, 2)
        summary["loadavg"] = loadavg()
        summary["p_leases_expired"] = stack.stats("P")["kv_transfer"]["leases_expired"]
        grown = growth(sampler.samples, tally.seconds)
        summary["growth"] = {k: (round(r / 2**20, 1), f) for k, (r, f) in grown.items()}
        report["soak"] = summary
        print(f"soak: {json.dumps(summary)}", flush=True)
        alive = stack.alive()
    report["loadavg_end"] = loadavg()
    write_report(args, report, start_snapshot, after_bursts, before_soak, after_soak, alive)
    print(f"wrote {args.out}")
    failed = any(b["errors"] or b["stuck"] for b in report["bursts"]) or report["soak"]["errors"] \
        or report["soak"]["stuck"] or report["soak"]["p_leases_expired"] or not all(alive.values())
    return 1 if failed else 0


def write_report(args, report, start_snapshot, after_bursts, before_soak, after_soak, alive) -> None:
    lines = ["## Load and soak through the router to a real 1P+1D pair (`benchmarks/load_soak.py`)", "",
             f"    .venv/bin/python -m benchmarks.load_soak --clients {args.clients} --rounds {args.rounds} "
             f"--load-seconds {args.load_seconds:g} "
             f"--soak-seconds {args.soak_seconds:g} --soak-concurrency {args.soak_concurrency}", "",
             f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load average (1/5/15 min) "
             f"{report['loadavg_start']} at the start, {report['loadavg_end']} at the end; "
             f"`nproc` = {os.cpu_count()}. Engines: `atomd serve {' '.join(ENGINE_ARGS)}` (built-in model) as "
             f"--kv-role producer / consumer; router `python -m router {' '.join(ROUTER_ARGS)}`. Completions and "
             f"chat with `max_tokens={args.max_tokens}` and `ignore_eos` (usage must say {args.max_tokens} tokens), "
             "prompts of a few tokens.", "",
             "| phase | requests | errors | stuck | seconds | TTFT p50 / p99 (ms) | stream total p50 / p99 (ms) | "
             "JSON total p50 / p99 (ms) |", "|---|---|---|---|---|---|---|---|"]
    for i, b in enumerate(report["bursts"]):
        what = (f"{args.clients} clients sending back to back for {b['sustained_s']:g} s" if b["sustained_s"]
                else f"{args.clients} clients at once, one request each")
        lines.append(latency_row(f"load {i + 1}: {what} (load {b['loadavg']})", b))
    s = report["soak"]
    lines.append(latency_row(f"soak: {args.soak_concurrency} workers, {args.soak_seconds:g} s "
                             f"(load {s['loadavg']})", s))
    lines += ["", "Kinds of request (load: 10% close after the first event, 5% before the first byte; soak: "
              f"the mix {SOAK_MIX}):", ""]
    for i, b in enumerate(report["bursts"]):
        lines.append(f"- load {i + 1}: {b['by_kind']}, statuses {b['statuses']}; settled in {b['settle_s']} s; "
                     f"P's leases expired so far: {b['p_leases_expired']}")
    lines.append(f"- soak: {s['by_kind']}, statuses {s['statuses']}; settled in {s['settle_s']} s; "
                 f"P's leases expired so far: {s['p_leases_expired']}")
    if any(b["first_errors"] for b in report["bursts"]) or s["first_errors"]:
        lines += ["", "First errors:", ""] + [f"- {e}" for b in [*report["bursts"], s] for e in b["first_errors"]]
    lines += ["", "RSS and open fds per process: at start (idle), after the load phases (settled; the router and "
              "engines keep the load's keep-alive connections until the engines' 75 s idle timeout), "
              "before and after the soak:", "",
              "| process | RSS start | RSS after load 1 | RSS after last load | RSS before soak | RSS after soak "
              "| fds start | fds after load 1 | fds after last load | fds before soak | fds after soak |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in start_snapshot:
        rss = [start_snapshot[name][0], after_bursts[0][name][0], after_bursts[-1][name][0], before_soak[name][0],
               after_soak[name][0]]
        fds = [start_snapshot[name][1], after_bursts[0][name][1], after_bursts[-1][name][1], before_soak[name][1],
               after_soak[name][1]]
        lines.append(f"| {name} | " + " | ".join(f"{mib(r)} MiB" for r in rss) + " | "
                     + " | ".join(str(f) for f in fds) + " |")
    lines += ["", "Soak growth, max of the last quarter minus max of the second quarter (MiB RSS, fds): "
              + ", ".join(f"{k} {v[0]:+g} / {v[1]:+d}" for k, v in s["growth"].items()) + ".",
              f"All processes alive at the end: {all(alive.values())}.", ""]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
