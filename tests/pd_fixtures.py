"""Helpers for the PD tests: prefill (producer) and decode (consumer) engines, a router in
front of them, a colocated engine as the reference, and readers for their metrics.

Every process is started by `PDCluster`, which stops them all in `stop()` (the fixtures'
finalizer); engines start concurrently, since each one's model load is most of the wait.
"""
from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from launch.process import RouterServer, http
from tests.server_fixtures import REPO, START_TIMEOUT_S, ServerUnderTest, model_dir, server_log


class PDCluster:
    """Named engines (`atomd serve` with their own flags) and routers; stop() ends them all."""

    def __init__(self, model: str | os.PathLike | None = None):
        self.engines: dict[str, ServerUnderTest] = {}
        self.routers: list[RouterServer] = []
        self.model = model or model_dir()

    def start_engines(self, **flags: list[str]) -> None:
        """name=[flags] for each engine; all load at once, then wait for every /ready."""
        for name, extra in flags.items():
            self.engines[name] = ServerUnderTest(self.model, *extra)
        for name in flags:
            self.engines[name].wait_ready()

    def start_router(self, prefill: str, decode: str) -> RouterServer:
        router = RouterServer([self.engines[prefill].url], [self.engines[decode].url], "--health-interval-s", "0.5",
                              log=server_log(), cwd=REPO)
        self.routers.append(router)
        return router.wait_ready(START_TIMEOUT_S)

    def start_ref_and_pd(self, *extra: str) -> "PDCluster":
        """A colocated reference engine `ref` and a prefill / decode pair `P`, `D` behind a
        router (`self.router`), all with the `extra` flags; `self.baseline` is each pool."""
        self.start_engines(ref=[*extra], P=[*extra, "--kv-role", "producer"], D=[*extra, "--kv-role", "consumer"])
        self.router = self.start_router("P", "D")
        self.baseline = {name: e.stats()["num_total_blocks"] for name, e in self.engines.items()}
        return self

    def assert_settled(self) -> None:
        """Every engine idle with its whole pool free, and P holding no pinned block."""
        for name, engine in self.engines.items():
            engine.wait_idle(self.baseline[name])
        assert metric(self["P"], "atomd:kv_blocks_pinned") == 0

    def __getitem__(self, name: str) -> ServerUnderTest:
        return self.engines[name]

    def stop(self) -> None:
        for proc in [*self.routers, *self.engines.values()]:
            proc.stop()


@contextlib.contextmanager
def ref_and_pd(*extra: str, model: str | os.PathLike | None = None):
    """`PDCluster.start_ref_and_pd(*extra)` serving `model` (default: the built-in one),
    stopped on exit (a module fixture's body)."""
    cluster = PDCluster(model)
    try:
        yield cluster.start_ref_and_pd(*extra)
    finally:
        cluster.stop()


def kill_engine(server: ServerUnderTest) -> None:
    """SIGKILL the engine core, then its API server: the engine vanishes as in a crash."""
    core = server.engine_pid()
    os.kill(core, signal.SIGKILL)
    server.proc.kill()
    server.proc.wait(10)
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{core}") and time.monotonic() < deadline:
        time.sleep(0.05)  # reaped by init once its parent is gone


def metrics(server) -> dict[tuple[str, tuple], float]:
    """Every sample of GET /metrics, parsed by prometheus_client: {(name, labels): value}."""
    status, body = http("GET", server.url + "/metrics")
    assert status == 200, body
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "dp_rank")))
            out[(s.name, labels)] = s.value
    return out


def metric(server, name: str, **labels: str) -> float:
    return metrics(server).get((name, tuple(sorted(labels.items()))), 0.0)


def block_bytes(model: os.PathLike | None = None, value_bytes: int = 4) -> int:
    """Bytes of one KV block (16 tokens) of `model` (default: the built-in one), from its
    config.json: k and v of every KV head, or MLA's one latent row (DeepSeek) a token and layer;
    `value_bytes` a value (4: float32, 2: bfloat16, 1: an fp8 cache)."""
    cfg = json.loads((pathlib.Path(model or model_dir()) / "config.json").read_text())
    if "kv_lora_rank" in cfg:
        return cfg["num_hidden_layers"] * 16 * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * value_bytes
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return cfg["num_hidden_layers"] * 2 * 16 * cfg.get("num_key_value_heads", heads) * head_dim * value_bytes


def sse_events(body: bytes) -> list:
    """The JSON payloads of an SSE body, without the final [DONE]."""
    events = []
    for line in body.decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[6:]))
    return events


@pytest.fixture(scope="module")
def pd():
    """The reference engine and a PD pair behind a router (ref_and_pd), for a module's tests;
    a module imports it with `settled`, which checks after each test that nothing is left."""
    with ref_and_pd() as cluster:
        yield cluster


@pytest.fixture(autouse=True)  # autouse where imported: pd_fixtures is no plugin
def settled(pd):
    yield
    pd.assert_settled()
