"""Shared pytest fixtures. Processes started here are stopped by finalizers."""
from __future__ import annotations

import atexit
import os

import pytest

# first: importing atomd sets OMP_WAIT_POLICY=PASSIVE (atomd/__init__.py), which libgomp reads
# once, when torch loads it; a test module that imports torch before atomd (most do) left this
# process's OpenMP threads spinning at every barrier while the suite's other processes wanted
# the cores
import atomd  # noqa: F401
from launch.process import free_port


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture
def loop():
    """An asyncio loop on a background thread (tests/fake_workers.py) for in-process routers
    and fake engines; closed after the test."""
    from tests.fake_workers import LoopThread

    lt = LoopThread()
    yield lt
    lt.close()


@pytest.fixture
def fresh_kernels(tmp_path, monkeypatch):
    """An empty C-kernel cache (atomd/kernels/cbuild.py) and no kernel loaded yet by this process:
    the attention kernels, the grammar bitmask kernel and the layer ops are built anew."""
    from atomd.kernels import native
    from atomd import structured
    from atomd.model import layer_ops

    caches = (native.attention_kernels, structured.bitmask_kernel, layer_ops.build_kernels)
    monkeypatch.setenv("ATOMD_CACHE_DIR", str(tmp_path))
    for cache in caches:
        cache.cache_clear()
    yield tmp_path
    for cache in caches:
        cache.cache_clear()


# The long cross-host tests (test hosts in network namespaces: shaped links, a cut link, a
# two-node Ray cluster) run with `make e2e-netns` (ATOMD_NETNS_FULL=1); plain `make e2e`
# keeps its time budget and runs only the short cross-host file (tests/test_netns_pd.py).
NETNS_FULL_ENV = "ATOMD_NETNS_FULL"


def pytest_configure(config):
    config.addinivalue_line("markers", "netns: test hosts in network namespaces (root and iproute2; skip without)")
    config.addinivalue_line("markers", "netns_full: a long cross-host test: `make e2e-netns` runs it, `make e2e` and `make test` deselect it")
    # registered here too: a run without pytest-xdist (tests/test_cpu_kinds.py's) keeps --strict-markers
    config.addinivalue_line("markers", "xdist_group(name): tests that share one pytest-xdist worker")
    config.pluginmanager.register(LongestGroupsFirst(), "atomd-longest-groups-first")


# tryfirst: pytest-xdist's worker reads each item's xdist_group mark in its own
# collection_modifyitems (it appends the group to the node id, which --dist loadgroup
# schedules by), so the marks must be on before it runs. (Under pytest 9 that rewrite has no
# effect at all: pyproject.toml pins pytest < 9; a file's tests then went to both workers and
# each started the module's fixtures: test_families_pd's four clusters started eight times.)
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    _group_for_xdist(items)
    if os.environ.get(NETNS_FULL_ENV) == "1":
        return
    # Deselected, not skipped: these run in their own target, they are not missing here.
    long = [item for item in items if "netns_full" in item.keywords]
    if long:
        config.hook.pytest_deselected(items=long)
        items[:] = [item for item in items if "netns_full" not in item.keywords]


RAY_FILES = ("tests/test_ray_e2e.py", "tests/test_ray_autoscale.py")


def _group_for_xdist(items) -> None:
    """`make test` runs on both cores (pytest-xdist, `--dist loadgroup`): a file's tests stay on
    one worker (its module fixtures start once), and the network-namespace tests share one
    worker (each cluster picks a free subnet; two at once could pick the same one), and so do
    the files that start a local Ray (run at once on two workers, the `ray start` head's job API
    did not come up within 180 s: two Ray instances on one host share fixed default ports)."""
    for item in items:
        if item.get_closest_marker("xdist_group"):  # a test that chose its own
            continue
        path = item.nodeid.split("::")[0]
        group = "netns" if "netns" in item.keywords else "ray" if path in RAY_FILES else path
        item.add_marker(pytest.mark.xdist_group(group))


# The xdist groups of 6 s or more, longest first (seconds of one worker in a `make test` on the
# Intel Xeon with AMX, 2026-12-05, load ~3.7; the cpu-* groups are test_cpu_kinds.py's
# narrowings). `--dist loadgroup` hands the groups to the workers in collection order (Makefile:
# --no-loadscope-reorder; xdist's own order is by test count, which left the single-test groups
# for the end, one worker running them while the other had nothing left). Only the order of the
# run changes: a group missing here (renamed, or a CPU kind without that narrowing) runs after
# them, by test count as before.
LONG_GROUPS = (
    "tests/test_pd_e2e.py",  # 101
    "tests/test_tensor_parallel.py",  # 75
    "ray",  # 51: tests/test_ray_autoscale.py, tests/test_ray_e2e.py
    "tests/test_router_kv_aware.py",  # 39
    "netns",  # 38: tests/test_netns_cluster.py, tests/test_netns_pd.py
    "cpu-avx512-vnni-0",  # 34
    "tests/test_families_pd.py",  # 32
    "tests/test_sim_plan.py",  # 31
    "cpu-avx512-bf16-1",  # 30
    "cpu-avx512-vnni-1",  # 28
    "tests/test_soak.py",  # 24
    "tests/test_expert_parallel.py",  # 22
    "tests/test_chaos.py",  # 19
    "tests/test_models.py",  # 18
    "tests/test_layer_ops.py",  # 17
    "cpu-avx2-0",  # 16
    "cpu-avx512-bf16-0",  # 16
    "tests/test_lora_serve.py",  # 14
    "tests/test_pd_pair_sh.py",  # 14
    "tests/test_zmq_transport.py",  # 13
    "tests/test_bf16.py",  # 13
    "tests/test_autoscale.py",  # 12
    "tests/test_helm_render_run.py",  # 12
    "tests/test_fuzz_api.py",  # 11
    "tests/test_tokenize_api.py",  # 11
    "tests/test_dp_serve.py",  # 11
    "tests/test_router_hostile.py",  # 10
    "tests/test_engine_stall.py",  # 9
    "tests/test_expert_parallel_pd.py",  # 9
    "tests/test_structured_e2e.py",  # 9
    "tests/test_lora.py",  # 9
    "tests/test_responses_api.py",  # 9
    "tests/test_deepseek_lora.py",  # 9
    "cpu-no-compiler-0",  # 8
    "tests/test_pd_adaptive_e2e.py",  # 8
    "tests/test_quant_engine.py",  # 8
    "tests/test_startup_errors.py",  # 8
    "tests/test_tensor_parallel_quant.py",  # 7
    "tests/test_spec_decode.py",  # 7
    "tests/test_embeddings.py",  # 7
    "tests/test_gguf.py",  # 7
    "tests/test_reasoning_e2e.py",  # 7
    "tests/test_tp_collective.py",  # 7
    "tests/test_dp_collective.py",  # 6
    "tests/test_kv_trust.py",  # 6
    "tests/test_deepseek_mtp_pd.py",  # 6
    "tests/test_sampling_e2e.py",  # 6
    "tests/test_sim.py",  # 6
    "tests/test_bench_serve.py",  # 6
    "tests/test_helm_chart.py",  # 6
    "tests/test_sliding_window.py",  # 6
)


class LongestGroupsFirst:
    """Orders the collection by xdist group: LONG_GROUPS first in their order, then the others by
    test count (most first), each group's tests together and in pytest's order. trylast: after
    pytest has ordered the tests by fixture (a module's parametrized fixtures start once)."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items):
        groups: dict[str, list] = {}
        for item in items:
            mark = item.get_closest_marker("xdist_group")  # every test has one (_group_for_xdist)
            groups.setdefault(mark.args[0] if mark.args else mark.kwargs["name"], []).append(item)
        rank = {name: i for i, name in enumerate(LONG_GROUPS)}
        order = sorted(groups, key=lambda name: (rank.get(name, len(rank)), -len(groups[name])))
        items[:] = [item for name in order for item in groups[name]]


def _silence_stderr_at_exit() -> None:
    """Mooncake's C++ destructors log INFO lines to stderr while the interpreter exits, after
    pytest's closing summary line (the line CI reads); nothing of the run is left to report."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)


atexit.register(_silence_stderr_at_exit)
