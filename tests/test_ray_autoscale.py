"""The online planner's Ray launcher (launch/ray_cluster.py `RayLauncher`): on one local Ray
instance (ray.init in this process, on 127.0.0.1, shut down after), a 1P1D cluster of
simulated engines; the planner adds a decode engine (a new placement group and actor, which
registers with the router), then drains and removes it while a stream runs on it: the
stream ends whole, the engine went with its whole KV pool free, and its actor, placement
group and router entry are gone."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading

import msgspec
import pytest

from launch.autoscale import Autoscaler, PoolPolicy
from launch.process import free_port, http
from tests.pd_fixtures import sse_events
from tests.server_fixtures import ENGINE_ARGS
from tests.sim_fixtures import default_model_profile, sim_flags

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray")
    temp_dir = tempfile.mkdtemp(prefix="atomd-ray-", dir="/tmp")  # short: Ray's socket paths
    # no token auth: a local ray.init with the mode unset writes ~/.ray/auth_token, which then
    # turns token auth on for every later Ray on this machine (test_ray_e2e's head answered 401)
    auth_mode = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    ray.init(address="local", num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1",
             _temp_dir=temp_dir, object_store_memory=100 << 20, log_to_driver=False,
             configure_logging=False)
    try:
        yield ray
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
        if auth_mode is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = auth_mode


def workers(router_url: str, role: str) -> list[str]:
    return sorted(w["url"] for w in json.loads(http("GET", router_url + "/workers")[1])["workers"]
                  if w["role"] == role)


def test_the_planner_adds_and_drains_ray_engine_actors(local_ray, tmp_path):
    from launch.ray_cluster import RayCluster, RayLauncher
    from launch.ray_config import ClusterConfig
    from ray.util import placement_group_table

    profile = default_model_profile(tmp_path / "profile.json")
    engine = {"count": 1, "num_cpus": 1, "extra_args": [*ENGINE_ARGS[:2], "--max-num-seqs", "8",
                                                         *sim_flags(profile)]}
    config = msgspec.convert({"engine_host": "127.0.0.1", "prefill": engine, "decode": engine,
                              "router": {"host": "127.0.0.1", "port": free_port(), "health_interval_s": 0.5},
                              "timeouts": {"placement_s": 60, "ready_s": 240, "shutdown_s": 5},
                              "check_resources": False}, ClusterConfig)
    cluster = RayCluster(config)
    try:
        infos = cluster.start()
        router = cluster.router_url
        scaler = Autoscaler(router, RayLauncher(cluster), PoolPolicy(1, 1, 1.0), PoolPolicy(1, 2, 0.05))
        for info in infos:
            scaler.pools[info["role"]].urls.append(info["url"])
        first = scaler.pools["decode"].urls[0]
        scaler._add("decode")
        new = scaler.pools["decode"].urls[-1]
        assert workers(router, "decode") == sorted([first, new]) and len(cluster.engines) == 3
        # two streams, round robin over two decode engines: one runs on the new one
        results = []

        def stream(i):
            status, body = http("POST", router + "/v1/completions",
                                {"prompt": list(range(10, 40 + i)), "max_tokens": 150, "stream": True,
                                 "ignore_eos": True}, timeout=120)
            results.append((status, body))

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        while sum(json.loads(http("GET", u + "/debug/stats")[1])["num_running"] for u in (first, new)) < 2:
            pass  # both streams decoding
        scaler._drain("decode")
        for t in threads:
            t.join(120)
        assert len(results) == 2
        for status, body in results:  # whole: every event a completion chunk, then [DONE]
            assert status == 200 and body.rstrip().endswith(b"data: [DONE]")
            events = sse_events(body)
            assert events and all("error" not in e for e in events)
            assert events[-1]["choices"][0]["finish_reason"] == "length"
        (drained,) = scaler.drained
        assert drained.url == new and drained.free_blocks == drained.total_blocks
        assert workers(router, "decode") == [first] and len(cluster.engines) == 2
        live_pgs = [pg for pg in placement_group_table().values() if pg["state"] != "REMOVED"]
        assert len(live_pgs) == 2
    finally:
        cluster.stop()


def test_atomd_autoscale_drives_a_ray_cluster_and_stops_it(local_ray, tmp_path, capsys, monkeypatch):
    """`atomd-autoscale --launcher ray`: it starts the config's cluster (router, 1P1D), brings
    the prefill pool to --prefill-min 2 through the Ray launcher (the new engine registers with
    the router), reports its windows, and on exit stops every engine, actor and group."""
    import yaml
    from launch import autoscale_cli
    from ray.util import placement_group_table

    profile = default_model_profile(tmp_path / "profile.json")
    engine = {"count": 1, "num_cpus": 1, "extra_args": [*ENGINE_ARGS[:2], "--max-num-seqs", "8", *sim_flags(profile)]}
    config = tmp_path / "cluster.yaml"
    config.write_text(yaml.safe_dump({"engine_host": "127.0.0.1", "prefill": engine, "decode": engine,
                                      "router": {"host": "127.0.0.1", "port": free_port(), "health_interval_s": 0.5},
                                      "timeouts": {"placement_s": 60, "ready_s": 240, "shutdown_s": 5},
                                      "check_resources": False}))
    seen = {}
    real_tick = Autoscaler.tick

    def tick(self):  # what the router lists while the cluster runs
        seen["prefill"] = workers(self.router_url, "prefill")
        real_tick(self)

    monkeypatch.setattr(Autoscaler, "tick", tick)
    rc = autoscale_cli.main(["--launcher", "ray", "--ray-config", str(config), "--prefill-min", "2",
                             "--prefill-max", "2", "--windows", "1", "--interval-s", "0.2"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert len(seen["prefill"]) == 2
    assert "scaled prefill up to 2" in err and "window: prefill 2 engines" in err
    assert "stopping after 1 windows with 2 prefill and 1 decode engines" in err
    assert [pg for pg in placement_group_table().values() if pg["state"] != "REMOVED"] == []
