"""launch/ray_config.py: the shipped configs load, bad input names its field, the fit check names what is missing."""
from __future__ import annotations

import typing
from pathlib import Path

import pytest

from launch.ray_config import ClusterConfig, KVCacheDtype, check_fits, load_config, parse_config
from router.policies import POLICIES

CONFIGS = Path(__file__).resolve().parents[1] / "launch" / "configs"

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("name, prefill, decode, decode_dp, decode_nodes", [
    ("1p1d", 1, 1, 1, 1), ("2p1d", 2, 1, 1, 1), ("1p1d-dp2", 1, 1, 2, 1), ("1p1d-2nodes", 1, 1, 1, 1),
    ("1p1d-ep-2nodes", 1, 1, 2, 2)])
def test_shipped_configs_load(name, prefill, decode, decode_dp, decode_nodes):
    c = load_config(CONFIGS / f"{name}.yaml")
    assert (c.prefill.count, c.decode.count, c.decode.data_parallel_size) == (prefill, decode, decode_dp)
    assert c.decode.nodes == decode_nodes
    assert c.router.policy in POLICIES


def test_empty_config_is_one_prefill_one_decode():
    c = parse_config(None)
    assert c == ClusterConfig()
    assert (c.prefill.count, c.decode.count, c.model) == (1, 1, None)


@pytest.mark.parametrize("data, field", [
    ({"prefill": {"count": 0}}, "prefill.count"),
    ({"decode": {"count": "two"}}, "decode.count"),
    ({"decode": {"data_parallel_size": 0}}, "decode.data_parallel_size"),
    ({"prefill": {"num_cpus": 0}}, "prefill.num_cpus"),
    ({"prefill": {"num_threads": 0}}, "prefill.num_threads"),
    ({"decode": {"max_restarts": -2}}, "decode.max_restarts"),
    ({"prefill": {"resources": {"CPU": 2}}}, "prefill.resources.CPU"),
    ({"prefill": {"resources": {"fast_nic": 0}}}, "prefill.resources.fast_nic"),
    ({"prefill": {"cuont": 1}}, "prefill.cuont"),
    ({"modle": "x"}, "modle"),
    ({"kv_transfer_backend": "carrier-pigeon"}, "kv_transfer_backend"),
    ({"kv_cache_dtype": "int8"}, "kv_cache_dtype"),
    ({"router": {"port": 70000}}, "router.port"),
    ({"router": {"policy": "least_loved"}}, "router.policy"),
    ({"router": {"health_interval_s": 0}}, "router.health_interval_s"),
    ({"timeouts": {"placement_s": -1}}, "timeouts.placement_s"),
    ({"prefill": {"extra_args": "--max-num-seqs 8"}}, "prefill.extra_args"),
    ({"lora": {"max_loras": 0}}, "lora.max_loras"),
    ({"lora": {"enabled": True, "modules": {"bad name": "/a"}}}, "lora.modules"),
    ({"lora": {"enabled": True, "modules": {"sql": ""}}}, "lora.modules"),
    ({"decode": {"lora_modules": {"sql": "/a"}}}, "decode.lora_modules"),
    ({"lora": {"enabled": "yes"}}, "lora.enabled"),
    ({"decode": {"data_parallel_size": 4, "data_parallel_size_local": 3}}, "decode.data_parallel_size_local"),
    ({"decode": {"data_parallel_size": 4, "data_parallel_size_local": 0}}, "decode.data_parallel_size_local"),
])
def test_bad_field_is_named(data, field):
    with pytest.raises(ValueError) as e:
        parse_config(data)
    assert str(e.value).startswith(f"{field}: "), str(e.value)


def test_load_config_names_file_and_field(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("decode:\n  count: -1\n")
    with pytest.raises(ValueError, match=rf"^{path}: decode.count: must be >= 1"):
        load_config(path)
    path.write_text("prefill: [1, 2\n")
    with pytest.raises(ValueError, match=str(path)):
        load_config(path)


def test_demand_sums_engines_and_router():
    c = parse_config({"prefill": {"count": 2, "num_cpus": 1.5, "resources": {"nic": 1}},
                      "decode": {"count": 1, "num_cpus": 2}, "router": {"num_cpus": 0.5}})
    assert c.demand() == {"CPU": 2 * 1.5 + 2 + 0.5, "nic": 2.0}


def test_fits_on_a_cluster_with_room():
    check_fits(load_config(CONFIGS / "1p1d.yaml"), {"CPU": 4.0}, [{"CPU": 4.0}])


def test_too_many_cpus_names_the_missing_amount():
    c = parse_config({"prefill": {"count": 3, "num_cpus": 1}, "decode": {"num_cpus": 1}})
    with pytest.raises(ValueError) as e:
        check_fits(c, {"CPU": 4.0}, [{"CPU": 4.0}])
    # 3 + 1 + router 0.5 = 4.5 wanted, 4 free.
    assert "missing CPU=0.5" in str(e.value) and "needs CPU=4.5" in str(e.value)


def test_missing_custom_resource_is_named():
    c = parse_config({"decode": {"resources": {"decode_node": 1}}})
    with pytest.raises(ValueError, match="decode engine needs CPU=1, decode_node=1 on a single node"):
        check_fits(c, {"CPU": 8.0}, [{"CPU": 8.0}])


def test_engine_bigger_than_any_node_fails_even_when_the_sum_fits():
    c = parse_config({"decode": {"data_parallel_size": 2, "num_cpus": 6}})
    with pytest.raises(ValueError, match=r"^decode: .*CPU=6 on a single node.*CPU=4; CPU=4"):
        check_fits(c, {"CPU": 8.0}, [{"CPU": 4.0}, {"CPU": 4.0}])


def test_expert_parallel_reaches_the_engine_flags_and_needs_two_ranks():
    from launch.ray_cluster import engine_flags
    from tests.helm_tools import engine_parser

    c = parse_config({"decode": {"data_parallel_size": 2, "num_cpus": 2, "enable_expert_parallel": True}})
    flags = {role: engine_parser().parse_args(["--model", "m", *engine_flags(role, c, "10.0.0.1")])
             for role in ("prefill", "decode")}
    assert (flags["prefill"].enable_expert_parallel, flags["decode"].enable_expert_parallel) == (False, True)
    assert flags["decode"].data_parallel_size == 2
    with pytest.raises(ValueError, match="enable_expert_parallel: needs data_parallel_size >= 2"):
        parse_config({"prefill": {"enable_expert_parallel": True}})


def test_lora_reaches_the_engine_flags_per_role(tmp_path):
    """lora.modules on every engine, a role's lora_modules on its own: the flags parse with
    `atomd serve`'s parser into the EngineConfig an engine would run."""
    from atomd.config import EngineConfig
    from launch.ray_cluster import engine_flags
    from tests.helm_tools import engine_parser

    data = {"lora": {"enabled": True, "max_loras": 3, "max_lora_rank": 32, "modules": {"sql": "/adapters/sql"}},
            "decode": {"lora_modules": {"poet": "/adapters/poet", "sql": "/adapters/sql-v2"}}}
    c = parse_config(data)
    for role, want in (("prefill", {"sql": "/adapters/sql"}), ("decode", {"sql": "/adapters/sql-v2",
                                                                          "poet": "/adapters/poet"})):
        args = engine_parser().parse_args(["--model", str(tmp_path), *engine_flags(role, c, "10.0.0.1")])
        cfg = EngineConfig.from_args(args)
        assert cfg.enable_lora and (cfg.max_loras, cfg.max_lora_rank) == (3, 32)
        assert dict(cfg.lora_adapters()) == want
    off = engine_parser().parse_args(["--model", "m", *engine_flags("decode", parse_config({}), "10.0.0.1")])
    assert not off.enable_lora and off.lora_modules == []


def test_tensor_parallel_size_per_role_reaches_the_flags_and_scales_the_cpu_bundle():
    from launch.ray_cluster import engine_flags
    from tests.helm_tools import engine_parser

    c = parse_config({"prefill": {"tensor_parallel_size": 2, "num_cpus": 1.5, "resources": {"nic": 1}},
                      "decode": {"count": 2, "tensor_parallel_size": 4, "num_cpus": 1}})
    flags = {role: engine_parser().parse_args(["--model", "m", *engine_flags(role, c, "10.0.0.1")])
             for role in ("prefill", "decode")}
    assert (flags["prefill"].tensor_parallel_size, flags["decode"].tensor_parallel_size) == (2, 4)
    assert "--tensor-parallel-size" not in engine_flags("prefill", parse_config({}), "10.0.0.1")
    # num_cpus is per TP process; custom resources mark nodes and stay as given
    assert c.prefill.bundle() == {"CPU": 3.0, "nic": 1} and c.decode.bundle() == {"CPU": 4.0}
    assert c.demand() == {"CPU": 3.0 + 2 * 4.0 + 0.5, "nic": 1.0}
    with pytest.raises(ValueError, match=r"^decode: .*CPU=4 on a single node"):  # one engine, one node
        check_fits(c, {"CPU": 12.0}, [{"CPU": 3.0, "nic": 1}, {"CPU": 3.0}, {"CPU": 3.0}, {"CPU": 3.0}])
    with pytest.raises(ValueError, match="decode.tensor_parallel_size"):
        parse_config({"decode": {"tensor_parallel_size": 0}})


def test_every_engine_kv_backend_is_a_ray_config_choice():
    from atomd.config import KV_TRANSFER_BACKENDS

    for backend in KV_TRANSFER_BACKENDS:
        assert parse_config({"kv_transfer_backend": backend}).kv_transfer_backend == backend


def test_kv_cache_dtype_reaches_both_roles_engine_flags():
    from launch.ray_cluster import engine_flags
    from tests.helm_tools import engine_parser
    from atomd.config import KV_CACHE_DTYPES

    assert set(typing.get_args(KVCacheDtype)) == set(KV_CACHE_DTYPES)
    c = parse_config({"kv_cache_dtype": "fp8_e5m2"})
    for role in ("prefill", "decode"):
        assert engine_parser().parse_args(["--model", "m", *engine_flags(role, c, "10.0.0.1")]).kv_cache_dtype == "fp8_e5m2"


def test_router_host_and_port_from_the_command_line(tmp_path):
    """launch.ray_cluster --router-host / --router-port: no copy of the YAML to change them, and
    they are validated like the file's."""
    c = load_config(CONFIGS / "1p1d.yaml", {"host": "127.0.0.1", "port": 18000})
    assert (c.router.host, c.router.port, c.router.policy) == ("127.0.0.1", 18000, "round_robin")
    assert load_config(CONFIGS / "1p1d.yaml").router.port == 8000
    with pytest.raises(ValueError, match="port"):
        load_config(CONFIGS / "1p1d.yaml", {"port": 70000})
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_config(empty, {"port": 18001}).router.port == 18001
    assert load_config(empty, top={"engine_host": "127.0.0.1"}).engine_host == "127.0.0.1"


def test_an_engine_over_nodes_gets_a_bundle_a_node_and_each_nodes_flags_its_ranks():
    """decode.data_parallel_size_local: the engine's ranks over data_parallel_size / local nodes,
    a bundle each on different nodes; each node's `atomd serve` flags parse into the EngineConfig
    of its ranks, every node with rank 0's address and the group's port; fits only where that
    many nodes can each hold a bundle."""
    from atomd.config import EngineConfig
    from launch.ray_cluster import engine_flags
    from tests.helm_tools import engine_parser

    c = parse_config({"decode": {"count": 2, "data_parallel_size": 4, "data_parallel_size_local": 2,
                                 "enable_expert_parallel": True, "num_cpus": 2, "resources": {"decode_node": 1}}})
    assert (c.prefill.nodes, c.decode.nodes) == (1, 2)
    assert c.demand() == {"CPU": 1 + 2 * 2 * 2 + 0.5, "decode_node": 4.0}  # 2 engines x 2 nodes
    assert c.prefill.places("10.0.0.1", 29500) == []  # one node: no group flags
    assert "--data-parallel-start-rank" not in engine_flags("prefill", c, "10.0.0.1")
    places = c.decode.places("10.0.0.1", 29517)
    ranks = []
    for node, (place, ip) in enumerate(zip(places, ("10.0.0.1", "10.0.0.2"))):
        args = engine_parser().parse_args(["--model", "m", *engine_flags("decode", c, ip, place)])
        cfg = EngineConfig.from_kwargs(**{k: v for k, v in vars(args).items() if k in {
            "data_parallel_size", "data_parallel_size_local", "data_parallel_start_rank", "data_parallel_address",
            "dp_master_port", "kv_side_channel_host"}})  # the DP group's own checks (start + local <= size)
        assert (cfg.data_parallel_address, cfg.dp_master_port, cfg.data_parallel_size) == ("10.0.0.1", 29517, 4)
        assert args.enable_expert_parallel and cfg.kv_side_channel_host == ip
        ranks += list(cfg.local_dp_ranks)
        assert list(cfg.local_dp_ranks) == [2 * node, 2 * node + 1]
    assert ranks == [0, 1, 2, 3]  # every rank on exactly one node
    nodes = [{"CPU": 4.0, "decode_node": 1}, {"CPU": 4.0, "decode_node": 1}, {"CPU": 4.0}]
    check_fits(parse_config({"decode": {"data_parallel_size": 4, "data_parallel_size_local": 2, "num_cpus": 2,
                                        "resources": {"decode_node": 1}}}), {"CPU": 12.0, "decode_node": 2.0}, nodes)
    with pytest.raises(ValueError, match=r"^decode: one decode engine spans 2 nodes .* only 1 node\(s\) have that"):
        check_fits(c, {"CPU": 12.0, "decode_node": 2.0}, nodes[1:])


def test_the_online_planner_does_not_scale_an_engine_over_nodes():
    from types import SimpleNamespace

    from launch.ray_cluster import RayLauncher

    cluster = SimpleNamespace(config=parse_config({"decode": {"data_parallel_size": 2, "data_parallel_size_local": 1}}))
    with pytest.raises(ValueError, match="decode: an engine over 2 nodes .* is not scaled online"):
        RayLauncher(cluster).start("decode")
