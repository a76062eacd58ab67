"""helm/atomd without a cluster (`make helm-check`; tests/helm_tools.py has the tools).

A real helm lints, renders (Kubernetes 1.29 and 1.37) and dry-run installs the chart with
its default values and with ci/all-features-values.yaml; kubernetes-validate --strict
checks every object; semantic_problems() checks what an API server or a controller would
reject and a schema does not; values.schema.json refuses bad values with a clear message.
Consistency with the code, not with literals copied from the templates: every rendered
command line parses with the real argument parsers, the probes hit routes the servers
register, the ConfigMap parses with the servers' config classes, the schema's enums are
the code's choices. tests/test_helm_render_run.py runs the rendered pods.
"""
from __future__ import annotations

import asyncio
import base64
import copy
import json
import pathlib
import re
import tomllib

import pytest
import yaml

from tests.helm_tools import (ALL_FEATURES, CHART, KUBE_VERSIONS, REPO, SECRET_FLAG, Pod, by_kind,
                              dashboard_metric_names, engine_parser, flag_value, helm, load_manifest, local_argv,
                              one, pod_labels, render, render_text, secret_flag_known, selects, semantic_problems,
                              strip_flag, template_args)

MONITORING = "monitoring.coreos.com/v1"
# Secrets and claims the all-features values name as existing outside the release.
EXTERNAL = {"Secret": {"atomd-openai-key", "platform-admin-key"}, "PersistentVolumeClaim": {"llm-checkpoints"}}
EXTERNAL_SECRETS = {"atomd-openai-key": {"token": b"sk-external-key"},
                    "platform-admin-key": {"token": b"admin-external"}}
VARIANTS = {
    "default": dict(values=()),
    "all-features": dict(values=(ALL_FEATURES,), api_versions=(MONITORING,)),
}


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request) -> tuple[str, list[dict]]:
    return request.param, render(**VARIANTS[request.param])


# ---------------------------------------------------------------------- chart metadata and values


@pytest.mark.unit
def test_app_version_is_the_package_version():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == pyproject()["project"]["version"]
    assert chart["apiVersion"] == "v2" and chart["name"] == "atomd"


@pytest.mark.unit
def test_values_have_the_documented_names():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for dotted in ("prefill.replicas", "decode.replicas", "prefill.dataParallelSize", "decode.dataParallelSize",
                   "prefill.expertParallel", "decode.expertParallel", "engine.lora.enabled", "engine.lora.maxLoras",
                   "engine.lora.maxLoraRank", "engine.lora.modules", "prefill.loraModules", "decode.loraModules",
                   "prefill.tensorParallelSize", "decode.tensorParallelSize",
                   "prefill.numThreads", "prefill.resources", "prefill.extraArgs", "prefill.nodeSelector",
                   "prefill.tolerations", "prefill.affinity", "router.replicas", "router.policy", "ingress.enabled",
                   "ingress.host", "apiKey.existingSecret", "adminApiKey.enabled", "adminApiKey.existingSecret",
                   "kvParamsSecret.existingSecret", "model.pvc", "engine.kvCacheDtype",
                   "model.path", "serviceMonitor.enabled", "networkPolicy.enabled", "image.repository", "image.tag",
                   "image.pullPolicy", "router.autoscaling.enabled", "grafanaDashboard.enabled"):
        node = values
        for part in dotted.split("."):
            assert isinstance(node, dict) and part in node, f"values.yaml has no {dotted}"
            node = node[part]


@pytest.mark.unit
def test_schema_choices_are_the_codes_choices():
    from atomd.config import DTYPE_CHOICES, KV_CACHE_DTYPES, KV_TRANSFER_BACKENDS
    from router.policies import POLICIES

    props = json.loads((CHART / "values.schema.json").read_text())["properties"]
    assert props["router"]["properties"]["policy"]["enum"] == sorted(POLICIES)
    # the transports the chart wires (ports, NetworkPolicy): some of the code's, never another
    backends = props["kvTransfer"]["properties"]["backend"]["enum"]
    assert "zmq" in backends and set(backends) <= set(KV_TRANSFER_BACKENDS)
    assert props["engine"]["properties"]["dtype"]["enum"] == list(DTYPE_CHOICES)
    assert props["engine"]["properties"]["kvCacheDtype"]["enum"] == list(KV_CACHE_DTYPES)


# ---------------------------------------------------------------------- helm itself


@pytest.mark.integration
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_lint_strict(name):
    args = ["lint", "--strict", str(CHART)]
    for f in VARIANTS[name]["values"]:
        args += ["-f", str(f)]
    out = helm(*args)
    assert "0 chart(s) failed" in out.stdout and "[WARNING]" not in out.stdout and "[ERROR]" not in out.stdout


@pytest.mark.integration
@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_every_object_validates_strictly(name, kube_version, tmp_path):
    from tests.helm_tools import kubernetes_validate

    text = render_text(kube_version=kube_version, **VARIANTS[name])
    objs = load_manifest(text)
    manifest = tmp_path / "release.yaml"
    manifest.write_text(text)
    proc = kubernetes_validate(manifest, kube_version)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    passed = re.findall(r"^INFO .* passed for resource (\S+) against version", proc.stdout, re.M)
    skipped = re.findall(r"^WARN .*Couldn't find schema for kind (\S+) with api version (\S+)", proc.stdout, re.M)
    assert sorted(passed) == sorted(f"{o['kind'].lower()}/{o['metadata']['name']}" for o in objs
                                    if o["apiVersion"] != MONITORING)
    assert all(api == MONITORING for _, api in skipped)  # only the CRD kind has no schema here
    assert len(skipped) == (name == "all-features")


@pytest.mark.integration
def test_strict_validation_is_live(tmp_path):
    """The validator rejects an unknown field and a wrong type (so the passes above mean something)."""
    from tests.helm_tools import kubernetes_validate

    objs = render()
    sts = copy.deepcopy(one(objs, "StatefulSet", "-prefill"))
    sts["spec"]["template"]["spec"]["containers"][0]["startupprobe"] = {}
    svc = copy.deepcopy(one(objs, "Service", "-router"))
    svc["spec"]["ports"][0]["port"] = "eighty"
    manifest = tmp_path / "bad.yaml"
    manifest.write_text(yaml.safe_dump_all([sts, svc]))
    proc = kubernetes_validate(manifest, KUBE_VERSIONS[-1])
    assert proc.returncode != 0
    assert proc.stdout.count("ERROR") == 2, proc.stdout


@pytest.mark.integration
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_install_dry_run_client(name):
    args = ["install", "atomd", str(CHART), "--dry-run=client", "--namespace", "serving"]
    for f in VARIANTS[name]["values"]:
        args += ["-f", str(f)]
    out = helm(*args)
    assert "STATUS: pending-install" in out.stdout and "NOTES:" in out.stdout
    assert "kubectl -n serving" in out.stdout


@pytest.mark.integration
@pytest.mark.parametrize("set_values,message", [
    ({"prefill.replicas": -1}, "at '/prefill/replicas': minimum: got -1, want 0"),
    ({"decode.dataParallelSize": 0}, "at '/decode/dataParallelSize': minimum: got 0, want 1"),
    ({"prefill.tensorParallelSize": 0}, "at '/prefill/tensorParallelSize': minimum: got 0, want 1"),
    ({"kvTransfer.backend": "rdma"}, "at '/kvTransfer/backend': value must be 'zmq'"),
    ({"image.repository": None}, "at '/image': missing property 'repository'"),
    ({"image.repository": ""}, "at '/image/repository': minLength: got 0, want 1"),
    ({"adminApiKey.secretKey": ""}, "at '/adminApiKey/secretKey': minLength: got 0, want 1"),
    ({"router.policy": "fastest"}, "at '/router/policy': value must be one of"),
    ({"ingress.enabled": True}, "at '/ingress/host': minLength: got 0, want 1"),
    ({"prefill.replica": 2}, "at '/prefill': additional properties 'replica' not allowed"),
    ({"prefill.resources": {"limits": {"cpu": "2cores"}}}, "at '/prefill/resources/limits/cpu'"),
    ({"model.pvc": "ckpts", "model.path": "/data/m"}, 'model.path "/data/m" must lie under model.mountPath'),
    ({"decode.loraModules": {"sql": "/models/sql"}}, "decode.loraModules / engine.lora.modules need engine.lora.enabled"),
    ({"engine.lora.modules": {"bad name": "/models/x"}}, "invalid propertyName 'bad name'"),
    ({"engine.lora.maxLoras": 0}, "at '/engine/lora/maxLoras': minimum: got 0, want 1"),
    ({"decode.podsPerEngine": 0}, "at '/decode/podsPerEngine': minimum: got 0, want 1"),
    ({"engine.ports.dpMaster": 70000}, "at '/engine/ports/dpMaster': maximum: got 70,000, want 65,535"),
    ({"decode.podsPerEngine": 2, "autoscaler.enabled": True},
     "decode.podsPerEngine > 1 does not go with autoscaler.enabled"),
])
def test_bad_values_are_refused_with_a_clear_message(set_values, message):
    proc = helm("template", *template_args(set_values=set_values), check=False)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr


# ---------------------------------------------------------------------- what an API server would check


@pytest.mark.integration
def test_no_semantic_problems(variant):
    name, objs = variant
    assert semantic_problems(objs, EXTERNAL if name == "all-features" else None) == []


@pytest.mark.integration
def test_the_semantic_checks_catch_what_they_claim():
    objs = render()

    def problems(mutate) -> str:
        broken = copy.deepcopy(objs)
        mutate(broken)
        return "\n".join(semantic_problems(broken))

    def engine(o):
        return one(o, "StatefulSet", "-prefill")

    def container(o):
        return engine(o)["spec"]["template"]["spec"]["containers"][0]

    assert "not an IANA_SVC_NAME" in problems(lambda o: container(o)["ports"][1].update(name="kv-side-channel-0"))
    assert "startupProbe uses port 'http'" in problems(lambda o: container(o)["ports"][0].update(name="web"))
    assert "spec.selector does not match" in problems(
        lambda o: engine(o)["spec"]["selector"]["matchLabels"].update({"app.kubernetes.io/component": "x"}))
    assert "is not headless" in problems(lambda o: one(o, "Service", "-prefill")["spec"].pop("clusterIP"))
    assert "is not a Kubernetes quantity" in problems(
        lambda o: container(o)["resources"]["limits"].update(memory="4 GB"))
    assert "above the limit" in problems(lambda o: container(o)["resources"]["requests"].update(cpu="3"))
    assert "$(POD_IPS) in the command line is not defined" in problems(
        lambda o: container(o)["args"].append("$(POD_IPS)"))
    assert "neither rendered nor given as existing" in problems(
        lambda o: o.remove(one(o, "Secret", "-api-key")))
    assert "selects no pod" in problems(
        lambda o: one(o, "NetworkPolicy", "-decode")["spec"]["podSelector"]["matchLabels"].update(x="y"))
    assert "not a valid label value" in problems(
        lambda o: one(o, "ConfigMap", "-config")["metadata"]["labels"].update(bad="a b"))
    with pytest.raises(yaml.constructor.ConstructorError, match="duplicate key"):
        load_manifest("kind: ConfigMap\nmetadata:\n  labels:\n    a: x\n    a: y\n")


# ---------------------------------------------------------------------- consistency with the code


def scripts_entry(name: str) -> str:
    return pyproject()["project"]["scripts"][name]


def pods(objs: list[dict], tmp_path: pathlib.Path) -> dict[str, Pod]:
    """{component: Pod} of the release's router Deployment and engine StatefulSets."""
    claim = tmp_path / "claim"
    (claim / "qwen2-0.5b").mkdir(parents=True, exist_ok=True)  # the all-features model.path, as a directory
    out = {}
    for w in by_kind(objs, "Deployment") + by_kind(objs, "StatefulSet"):
        component = pod_labels(w)["app.kubernetes.io/component"]
        out[component] = Pod(objs, w, tmp_path, pod_ip="10.1.2.3", secrets=EXTERNAL_SECRETS,
                             claims={"llm-checkpoints": claim})
    assert sorted(out) == ["decode", "prefill", "router"]
    return out


def engine_args(pod: Pod):
    """The engine container's command line, parsed by `atomd serve`'s parser."""
    argv = pod.argv()
    assert argv[:2] == ["atomd", "serve"]
    args = local_argv(pod, argv[2:])
    if not secret_flag_known(pod.local_path("/etc/atomd/kv-params-secret/key")):
        args = strip_flag(args, SECRET_FLAG)
    return engine_parser().parse_args(args)


def parse_engine(pod: Pod):
    from atomd.config import EngineConfig

    parsed = engine_args(pod)
    return parsed, EngineConfig.from_args(parsed)


@pytest.mark.integration
def test_engine_command_lines_parse_with_atomd_serve(variant, tmp_path):
    from atomd.cli import COMMANDS

    name, objs = variant
    assert scripts_entry("atomd") == "atomd.cli:main" and COMMANDS["serve"][0] == "atomd.api.serve"
    for role, p in pods(objs, tmp_path).items():
        if role == "router":
            continue
        args, cfg = parse_engine(p)
        assert cfg.kv_role == {"prefill": "producer", "decode": "consumer"}[role]
        assert args.port == p.port("http")
        assert args.api_key == p.env["ATOMD_API_KEY"] and args.api_key
        assert args.admin_api_key == p.env["ATOMD_ADMIN_API_KEY"] and args.admin_api_key != args.api_key
        dp = cfg.data_parallel_size
        events = [p.port(f"kv-events-{r}") for r in range(dp)]
        assert cfg.kv_events_endpoint == f"tcp://*:{events[0]}" and events == list(range(events[0], events[0] + dp))
        if role == "prefill":
            assert cfg.kv_side_channel_host == "10.1.2.3"  # the pod IP, from the downward API
            sides = [p.port(f"kv-side-{r}") for r in range(dp)]
            assert cfg.kv_side_channel_port == sides[0] and sides == list(range(sides[0], sides[0] + dp))
        cpu = p.container["resources"]["limits"]["cpu"]
        tp = cfg.tensor_parallel_size  # TP with the chart: test_tensor_parallel_size_per_role_is_the_engine_flag...
        assert tp == 1  # (neither values file sets TP)
        here = len(cfg.local_dp_ranks)  # the pod's own ranks (all of them unless the engine spans pods)
        assert cfg.num_threads * here * tp <= float(cpu), f"{role}: {here} x {tp} x {cfg.num_threads} threads > {cpu} CPUs"
        if name == "all-features":
            assert cfg.model.endswith("/qwen2-0.5b") and args.served_model_name == "qwen2-0.5b"
            assert cfg.dtype == "bfloat16" and cfg.max_model_len == 4096 and args.max_num_seqs == 64
        assert cfg.kv_cache_dtype == ("fp8" if name == "all-features" else "auto")  # both roles alike
        assert cfg.enable_expert_parallel == (name == "all-features" and role == "decode")
        values = yaml.safe_load(ALL_FEATURES.read_text()) if name == "all-features" else {}
        lora = values.get("engine", {}).get("lora", {})
        assert cfg.enable_lora == bool(lora.get("enabled"))
        if cfg.enable_lora:  # every engine's adapters and the role's own, each flag repeated per adapter
            assert (cfg.max_loras, cfg.max_lora_rank) == (lora["maxLoras"], lora["maxLoraRank"])
            assert dict(cfg.lora_adapters()) == {**lora["modules"], **values[role].get("loraModules", {})}


@pytest.mark.integration
def test_tensor_parallel_size_per_role_is_the_engine_flag_and_scales_the_cpu(tmp_path):
    """prefill.tensorParallelSize / decode.tensorParallelSize: `--tensor-parallel-size` on that
    role's engines; the values' resources are per TP process, the pod's CPU is them x TP."""
    objs = render(set_values={"prefill.tensorParallelSize": 2, "decode.tensorParallelSize": 4,
                              "decode.resources": {"requests": {"cpu": "500m", "memory": "2Gi"},
                                                   "limits": {"cpu": "1.5", "memory": "4Gi"}}})
    assert semantic_problems(objs) == []
    ps = pods(objs, tmp_path)
    for role, tp, requests, limits, memory in (("prefill", 2, "4", "4", "4Gi"), ("decode", 4, "2000m", "6", "4Gi")):
        assert engine_args(ps[role]).tensor_parallel_size == tp
        res = ps[role].container["resources"]
        assert (res["requests"]["cpu"], res["limits"]["cpu"], res["limits"]["memory"]) == (requests, limits, memory)
    default = pods(render(), tmp_path / "default")
    for role in ("prefill", "decode"):  # TP=1: no flag, the resources as given
        assert engine_args(default[role]).tensor_parallel_size == 1
        assert "--tensor-parallel-size" not in default[role].argv()
        assert default[role].container["resources"]["limits"]["cpu"] == "2"


@pytest.mark.integration
def test_an_engine_over_pods_gets_its_ranks_and_rank_0s_address_and_port_per_pod(tmp_path):
    """prefill.podsPerEngine / decode.podsPerEngine: each pod's command line, computed by its own
    shell from its ordinal, parses into the EngineConfig of its share of the group: the engine's
    pods split its ranks without overlap, all meet at the first pod's DNS name under the headless
    Service (published before readiness) on the port that pod declares; the NetworkPolicy lets the
    group's pods reach each other; the KV ports of every rank are declared and allowed."""
    from atomd.config import EngineConfig

    claim = tmp_path / "claim"  # the checkpoint's config is what EngineConfig checks the expert split against
    (claim / "moe").mkdir(parents=True)
    (claim / "moe" / "config.json").write_text(json.dumps({"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 8}))
    objs = render(set_values={"model.pvc": "ckpts", "model.path": "/models/moe",
                              "prefill.replicas": 1, "prefill.podsPerEngine": 3, "prefill.dataParallelSize": 1,
                              "decode.replicas": 2, "decode.podsPerEngine": 2, "decode.dataParallelSize": 2,
                              "decode.expertParallel": True, "decode.numThreads": 1}, namespace="serving")
    assert semantic_problems(objs, {"PersistentVolumeClaim": {"ckpts"}}) == []
    for role, engines, pods_per_engine, local in (("prefill", 1, 3, 1), ("decode", 2, 2, 2)):
        sts = one(objs, "StatefulSet", f"-{role}")
        svc = one(objs, "Service", sts["spec"]["serviceName"])
        assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
        assert sts["spec"]["replicas"] == engines * pods_per_engine
        assert sts["spec"]["podManagementPolicy"] == "Parallel"  # a group's pods start together
        size = local * pods_per_engine
        groups: dict[str, list[range]] = {}
        for i in range(sts["spec"]["replicas"]):
            pod = Pod(objs, sts, tmp_path, pod_ip=f"10.1.2.{i + 1}", ordinal=i, claims={"ckpts": claim})
            cfg = EngineConfig.from_args(engine_args(pod))  # validates start + local <= size, the port
            assert cfg.data_parallel_size == size and len(cfg.local_dp_ranks) == local
            assert cfg.enable_expert_parallel == (role == "decode")
            assert cfg.dp_master_port == pod.port("dp-master") == 29500
            first = f"{sts['metadata']['name']}-{i - i % pods_per_engine}"  # the engine's first pod
            assert cfg.data_parallel_address == f"{first}.{svc['metadata']['name']}.serving.svc.cluster.local"
            groups.setdefault(cfg.data_parallel_address, []).append(cfg.local_dp_ranks)
            ports = "kv-side" if role == "prefill" else "kv-events"
            assert [pod.port(f"{ports}-{r}") for r in range(size)] == \
                [pod.port(f"{ports}-0") + r for r in range(size)]
        assert len(groups) == engines
        for ranks in groups.values():  # every rank of an engine on exactly one of its pods
            assert sorted(r for rr in ranks for r in rr) == list(range(size))
        policy = one(objs, "NetworkPolicy", f"-{role}")
        peers = [rule for rule in policy["spec"]["ingress"] if "ports" not in rule]
        assert len(peers) == 1 and selects(peers[0]["from"][0]["podSelector"], pod_labels(sts))
        if role == "prefill":
            side = next(rule for rule in policy["spec"]["ingress"]
                        if any(p["port"] == "kv-side-0" for p in rule.get("ports", [])))
            assert [p["port"] for p in side["ports"]] == [f"kv-side-{r}" for r in range(size)]
    default = render()
    for role in ("prefill", "decode"):  # one pod an engine: no shell, no group flags, no peer rule
        pod = Pod(default, one(default, "StatefulSet", f"-{role}"), tmp_path / "default")
        assert pod.container["command"] == ["atomd", "serve"]
        assert not {"--data-parallel-start-rank", "--dp-master-port"} & set(pod.argv())
        assert all("ports" in rule for rule in one(default, "NetworkPolicy", f"-{role}")["spec"]["ingress"])


@pytest.mark.integration
def test_router_command_line_parses_and_names_the_headless_services(variant, tmp_path):
    from router.__main__ import parse_args
    from router.discovery import targets_of

    name, objs = variant
    assert scripts_entry("atomd-router") == "router.__main__:main"
    the_pods = pods(objs, tmp_path)
    p = the_pods["router"]
    argv = p.argv()
    assert argv[0] == "atomd-router"
    args = local_argv(p, argv[1:])
    if not secret_flag_known(p.local_path("/etc/atomd/kv-params-secret/key")):
        args = strip_flag(args, SECRET_FLAG)
    cfg = parse_args(args)
    assert cfg.port == p.port("http") and cfg.api_key == p.env["ATOMD_API_KEY"]
    # the router's own admin routes and the aborts it sends the engines: the engines' admin key
    assert cfg.admin_api_key == cfg.engine_admin_api_key == p.env["ATOMD_ADMIN_API_KEY"] != cfg.api_key
    assert all(pod.env["ATOMD_ADMIN_API_KEY"] == cfg.engine_admin_api_key for pod in the_pods.values())
    domain = "cluster.example" if name == "all-features" else "cluster.local"
    for target in targets_of(cfg.prefill_dns, cfg.decode_dns):
        sts = next(s for s in by_kind(objs, "StatefulSet") if pod_labels(s)["atomd.dev/role"] == target.role)
        svc = one(objs, "Service", sts["spec"]["serviceName"])
        assert target.name == f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc.{domain}"
        http = next(port for port in svc["spec"]["ports"] if port["name"] == "http")
        assert target.port == http["port"] == the_pods[target.role].port(http["targetPort"])
    assert len(cfg.prefill_dns) == len(cfg.decode_dns) == 1


@pytest.mark.integration
def test_configmap_parses_with_the_config_classes_and_matches_the_command_lines(variant, tmp_path):
    from atomd.config import EngineConfig
    from router.__main__ import parse_args
    from router.app import RouterConfig

    name, objs = variant
    cm = one(objs, "ConfigMap", "-config")["data"]
    assert sorted(cm) == ["decode.json", "prefill.json", "router.json"]
    the_pods = pods(objs, tmp_path)
    for role in ("prefill", "decode"):
        pod = the_pods[role]
        fields = {k: pod.local_path(v) if isinstance(v, str) and v.startswith("/") else v
                  for k, v in json.loads(cm[f"{role}.json"]).items()}
        if not secret_flag_known(fields["kv_params_secret_file"]):
            fields.pop("kv_params_secret_file")
        from_cm = EngineConfig.from_kwargs(**fields)  # unknown fields and bad values raise
        _, from_argv = parse_engine(pod)
        assert {f: getattr(from_argv, f) for f in fields} == {f: getattr(from_cm, f) for f in fields}
    pod = the_pods["router"]
    fields = {k: pod.local_path(v) if isinstance(v, str) and v.startswith("/") else v
              for k, v in json.loads(cm["router.json"]).items()}
    argv = local_argv(pod, pod.argv()[1:])
    if not secret_flag_known(fields["kv_params_secret_file"]):
        fields.pop("kv_params_secret_file")
        argv = strip_flag(argv, SECRET_FLAG)
    from_cm = RouterConfig(**fields)
    from_argv = parse_args(argv)
    assert {f: getattr(from_argv, f) for f in fields} == {f: getattr(from_cm, f) for f in fields}


@pytest.mark.integration
def test_probes_are_get_routes_the_servers_register(tmp_path):
    from atomd.api.server import Server
    from router.app import Router, RouterConfig

    objs = render()
    the_pods = pods(objs, tmp_path)
    args, cfg = parse_engine(the_pods["prefill"])
    engine_routes = {r.resource.canonical for r in Server(cfg, args).app.router.routes() if r.method == "GET"}

    async def router_routes():
        router = Router(RouterConfig())
        try:
            return {r.resource.canonical for r in router.app.router.routes() if r.method == "GET"}
        finally:
            await router.stop()

    routes = {"prefill": engine_routes, "decode": engine_routes, "router": asyncio.run(router_routes())}
    for component, pod in the_pods.items():
        probes = pod.probes()
        assert sorted(probes) == ["livenessProbe", "readinessProbe", "startupProbe"]
        for kind, (path, port) in probes.items():
            assert path in routes[component], f"{component} {kind}: GET {path} is not a route"
            assert port == int(flag_value(pod.argv(), "--port")), f"{component} {kind} probes port {port}"
        assert probes["readinessProbe"][0] == "/ready" and probes["livenessProbe"][0] == "/health"
        assert probes["startupProbe"][0] == "/health"


@pytest.mark.unit
def test_dashboard_queries_only_atomd_metrics():
    """Each name is checked against the running servers' /metrics in test_helm_render_run."""
    names = dashboard_metric_names()
    assert names and all(n.startswith(("atomd:", "atomd_router:")) for n in names)


# ---------------------------------------------------------------------- the admin key


@pytest.mark.integration
def test_the_admin_key_is_a_generated_secret_distributed_like_the_kv_params_secret():
    objs = render()
    secret = one(objs, "Secret", "-admin-key")
    key = secret["data"]["admin-api-key"]
    assert secret["type"] == "Opaque" and len(base64.b64decode(key)) >= 32
    assert key != one(objs, "Secret", "-api-key")["data"]["api-key"]
    assert render()[objs.index(secret)]["data"]["admin-api-key"] != key  # random per (first) install
    for w in by_kind(objs, "Deployment") + by_kind(objs, "StatefulSet"):
        c = w["spec"]["template"]["spec"]["containers"][0]
        ref = next(e for e in c["env"] if e["name"] == "ATOMD_ADMIN_API_KEY")["valueFrom"]["secretKeyRef"]
        assert ref == {"name": secret["metadata"]["name"], "key": "admin-api-key"}
        assert "$(ATOMD_ADMIN_API_KEY)" in c["args"]
        assert key not in yaml.safe_dump(w)  # only a reference in the pods, never the value


@pytest.mark.integration
def test_the_admin_key_can_come_from_an_existing_secret_or_be_off():
    objs = render(set_values={"adminApiKey.existingSecret": "mine", "adminApiKey.secretKey": "k"})
    assert not [o for o in by_kind(objs, "Secret") if o["metadata"]["name"].endswith("-admin-key")]
    router = one(objs, "Deployment", "-router")["spec"]["template"]["spec"]["containers"][0]
    ref = next(e for e in router["env"] if e["name"] == "ATOMD_ADMIN_API_KEY")["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "mine", "key": "k"}
    assert semantic_problems(objs, {"Secret": {"mine"}}) == []
    objs = render(set_values={"adminApiKey.enabled": False})
    assert not [o for o in by_kind(objs, "Secret") if o["metadata"]["name"].endswith("-admin-key")]
    for w in by_kind(objs, "Deployment") + by_kind(objs, "StatefulSet"):
        c = w["spec"]["template"]["spec"]["containers"][0]
        assert "ATOMD_ADMIN_API_KEY" not in {e["name"] for e in c.get("env", [])}
        assert not {"--admin-api-key", "--engine-admin-api-key"} & set(c["args"])
