"""The chart's autoscaler (helm/atomd/templates/autoscaler.yaml, values `autoscaler.*`) without
a cluster: a real helm renders and lints it, kubernetes-validate --strict checks every object;
its container's command line parses with the real `atomd-autoscale` parser and names the
release's router Service, StatefulSets and ports; and its Role grants exactly what that
command line does: the command runs against the recorded stand-in API server
(tests/test_autoscale_launchers.py) through adoption, scale-ups to each pool's max and a
drained scale-down, and the RBAC rules derived from the recorded calls equal the Role's."""
from __future__ import annotations

import re
import tomllib
from urllib.parse import urlsplit

import pytest

from launch import autoscale
from tests.helm_tools import (CHART, KUBE_VERSIONS, REPO, Pod, by_kind, helm, kubernetes_validate, load_manifest, one,
                              pod_labels, render, render_text, selects, semantic_problems, template_args)
from tests.test_autoscale_launchers import NS, FakeAPI, RouterStandIn

pytestmark = pytest.mark.integration

VALUES = CHART / "ci" / "autoscaler-values.yaml"
RENDER = dict(values=(VALUES,), namespace=NS)


@pytest.fixture(scope="module")
def objs() -> list[dict]:
    return render(**RENDER)


def autoscaler_pod(objs: list[dict], tmp_path) -> Pod:
    return Pod(objs, one(objs, "Deployment", "-autoscaler"), tmp_path)


def sets_by_role(objs: list[dict]) -> dict[str, dict]:
    return {pod_labels(s)["atomd.dev/role"]: s for s in by_kind(objs, "StatefulSet")}


def test_lints_validates_and_has_no_semantic_problems(objs, tmp_path):
    out = helm("lint", "--strict", str(CHART), "-f", str(VALUES))
    assert "0 chart(s) failed" in out.stdout and "[WARNING]" not in out.stdout
    assert semantic_problems(objs) == []
    for kube_version in KUBE_VERSIONS:
        text = render_text(kube_version=kube_version, **RENDER)
        manifest = tmp_path / f"release-{kube_version}.yaml"
        manifest.write_text(text)
        proc = kubernetes_validate(manifest, kube_version)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        passed = re.findall(r"^INFO .* passed for resource (\S+) against version", proc.stdout, re.M)
        assert sorted(passed) == sorted(f"{o['kind'].lower()}/{o['metadata']['name']}" for o in load_manifest(text))


def test_the_planner_owns_the_pools(objs, tmp_path):
    """The sets leave replicas to it, the router finds engines by its registrations (not DNS),
    and the engines' NetworkPolicies let it read their /debug/stats."""
    default = render(namespace=NS)
    assert all("replicas" in s["spec"] for s in by_kind(default, "StatefulSet"))
    assert not by_kind(default, "Role") and not [d for d in by_kind(default, "Deployment")
                                                  if d["metadata"]["name"].endswith("-autoscaler")]
    assert all("replicas" not in s["spec"] for s in by_kind(objs, "StatefulSet"))
    router = Pod(objs, one(objs, "Deployment", "-router"), tmp_path).argv()
    assert "--prefill-dns" not in router and "--decode-dns" not in router and "--dns-refresh-s" not in router
    assert "--prefill-dns" in Pod(default, one(default, "Deployment", "-router"), tmp_path / "d").argv()
    labels = pod_labels(one(objs, "Deployment", "-autoscaler"))
    for role, sts in sets_by_role(objs).items():
        policy = one(objs, "NetworkPolicy", f"-{role}")
        assert selects(policy["spec"]["podSelector"], pod_labels(sts))
        allowed = [rule for rule in policy["spec"]["ingress"]
                   if any("podSelector" in peer and selects(peer["podSelector"], labels) for peer in rule["from"])]
        assert [[p["port"] for p in rule["ports"]] for rule in allowed] == [["http"]]


def test_the_command_line_parses_with_atomd_autoscale_and_names_the_release(objs, tmp_path):
    from launch.autoscale_cli import parser, policies

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    pod = autoscaler_pod(objs, tmp_path)
    argv = pod.argv()
    assert argv[0] == "atomd-autoscale" and scripts[argv[0]] == "launch.autoscale_cli:main"
    args = parser().parse_args(argv[1:])
    assert args.launcher == "kubernetes" and args.namespace == NS and not args.dry_run
    sets = sets_by_role(objs)
    assert (args.prefill_statefulset, args.decode_statefulset) == (sets["prefill"]["metadata"]["name"],
                                                                   sets["decode"]["metadata"]["name"])
    engine_http = {p["name"]: p["containerPort"] for p in sets["decode"]["spec"]["template"]["spec"]["containers"][0]
                   ["ports"]}["http"]
    assert args.engine_port == engine_http
    svc = one(objs, "Service", "-router")
    router = urlsplit(args.router_url)
    assert router.hostname == f"{svc['metadata']['name']}.{NS}.svc.cluster.local"
    assert router.port == next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "http")
    router_pod = Pod(objs, one(objs, "Deployment", "-router"), tmp_path / "router")
    assert args.admin_api_key == router_pod.env["ATOMD_ADMIN_API_KEY"] and args.admin_api_key
    prefill, decode = policies(args)
    assert (prefill.min, prefill.max, prefill.slo_s, decode.min, decode.max, decode.slo_s) == (1, 3, 1.5, 2, 5, 0.05)
    assert (decode.up, decode.down, decode.up_windows, decode.down_windows, decode.cooldown_s) == (0.8, 0.25, 2, 4, 45)
    # the ramp knobs (benchmarks/autoscale_diurnal.py's policy) reach both pools
    for pool in (prefill, decode):
        assert (pool.up_cooldown_s, pool.learn_rates) == (5, True)
    assert args.rate_windows == 8
    assert args.interval_s == 15


def test_the_ramp_knobs_stay_off_by_default(tmp_path):
    """Chart defaults: no --up-cooldown-s (a scale-up waits the whole cooldown) and no learnt
    rates, as `atomd-autoscale` without the flags."""
    from launch.autoscale_cli import parser, policies

    objs = render(namespace=NS, set_values={"autoscaler.enabled": True})
    argv = autoscaler_pod(objs, tmp_path).argv()
    assert "--up-cooldown-s" not in argv and "--learn-rates" not in argv and "--rate-windows" not in argv
    args = parser().parse_args(argv[1:])
    for pool in policies(args):
        assert (pool.up_cooldown_s, pool.learn_rates, pool.cooldown_s) == (None, False, 60)
    # a zero up-cooldown is a value, not "unset"
    objs = render(namespace=NS, set_values={"autoscaler.enabled": True, "autoscaler.policy.upCooldownSeconds": 0})
    argv = autoscaler_pod(objs, tmp_path / "zero").argv()
    assert argv[argv.index("--up-cooldown-s") + 1] == "0"


@pytest.mark.parametrize("keys,env", [({"adminApiKey.enabled": False}, "ATOMD_API_KEY"),
                                      ({"adminApiKey.enabled": False, "apiKey.enabled": False}, None)])
def test_without_an_admin_key_it_sends_what_the_admin_routes_then_take(tmp_path, keys, env):
    """No admin key: the router's /workers and the engines' /debug/stats take the API key (or
    nothing at all)."""
    from launch.autoscale_cli import parser

    objs = render(values=(VALUES,), namespace=NS, set_values=keys)
    assert semantic_problems(objs) == []
    pod = autoscaler_pod(objs, tmp_path)
    args = parser().parse_args(pod.argv()[1:])
    engine = Pod(objs, sets_by_role(objs)["decode"], tmp_path / "engine")
    assert args.admin_api_key == (engine.env[env] if env else None)
    assert "ATOMD_ADMIN_API_KEY" not in engine.env


def rbac_of(method: str, path: str) -> tuple[str, str, str, str]:
    """(apiGroup, resource[/subresource], verb, name) of one call on a named object."""
    parts = path.strip("/").split("/")
    group, rest = ("", parts[2:]) if parts[0] == "api" else (parts[1], parts[3:])
    assert rest[0] == "namespaces" and rest[1] == NS, path
    resource, name, sub = rest[2], rest[3], rest[4:]
    verb = {"GET": "get", "PATCH": "patch"}[method]  # a named object: get, not list
    return group, "/".join([resource, *sub]), verb, name


def test_the_role_grants_exactly_the_calls_the_command_makes(objs, tmp_path, monkeypatch):
    from launch import autoscale_cli

    sets = sets_by_role(objs)
    api = FakeAPI({sets["prefill"]["metadata"]["name"]: 1, sets["decode"]["metadata"]["name"]: 1},
                  polls_until_ready=0)
    # hot until each pool is at its max (prefill 1 -> 3, decode 2 -> 5), then cold: one drain each
    router = RouterStandIn({"prefill": [9.0, 9.0, 9.0, 0.001], "decode": [9.0, 9.0, 9.0, 0.001]})
    monkeypatch.setattr(autoscale, "http", router.http)
    monkeypatch.setattr(autoscale_cli, "http", router.http)
    built = []

    class Recorded(autoscale.Autoscaler):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            built.append(self)

    monkeypatch.setattr(autoscale_cli, "Autoscaler", Recorded)
    argv = autoscaler_pod(objs, tmp_path).argv()[1:] + [
        "--kubernetes-api", api.url, "--router-timeout-s", "0", "--interval-s", "0.01", "--cooldown-s", "0", "--up-cooldown-s", "0",
        "--up-windows", "1", "--down-windows", "1", "--windows", "4"]
    try:
        assert autoscale_cli.main(argv) == 0
    finally:
        api.close()
    assert api.replicas == {sets["prefill"]["metadata"]["name"]: 2, sets["decode"]["metadata"]["name"]: 4}
    assert len(built) == 1 and built[0].rate_windows == 8  # the chart's rateWindows reaches the running scaler
    used = {rbac_of(c[0], c[1]) for c in api.calls}
    role = one(objs, "Role", "-autoscaler")
    granted = {(g, r, v, n) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
               for v in rule["verbs"] for n in rule["resourceNames"]}
    assert {u[:3] for u in used} == {g[:3] for g in granted} == {
        ("apps", "statefulsets/scale", "get"), ("apps", "statefulsets/scale", "patch"), ("", "pods", "get")}
    assert used == granted  # every pod ordinal below max was read, each set read and patched
    assert role["metadata"]["namespace"] == NS
    assert not by_kind(objs, "ClusterRole") and not by_kind(objs, "ClusterRoleBinding")
    assert [r["metadata"]["name"] for r in by_kind(objs, "Role")] == [role["metadata"]["name"]]
    binding = one(objs, "RoleBinding", "-autoscaler")
    spec = one(objs, "Deployment", "-autoscaler")["spec"]["template"]["spec"]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": spec["serviceAccountName"], "namespace": NS}]
    assert spec["automountServiceAccountToken"] is True
    # nothing else mounts a token: the router and engines keep calling no API
    others = [w for w in by_kind(objs, "Deployment") + by_kind(objs, "StatefulSet")
              if not w["metadata"]["name"].endswith("-autoscaler")]
    assert all(w["spec"]["template"]["spec"]["automountServiceAccountToken"] is False for w in others)


@pytest.mark.parametrize("set_values,message", [
    ({"router.replicas": 2}, "autoscaler.enabled needs one router (router.replicas 1"),
    ({"router.autoscaling.enabled": True}, "autoscaler.enabled needs one router"),
    ({"autoscaler.decode.min": 6}, "autoscaler.decode: min 6 is above max 5"),
    ({"autoscaler.policy.down": 0.9}, "autoscaler.policy: down 0.9 must be below up 0.8"),
    ({"autoscaler.prefill.max": 0}, "at '/autoscaler/prefill/max': minimum: got 0, want 1"),
    ({"autoscaler.replicas": 2}, "at '/autoscaler': additional properties 'replicas' not allowed"),
    ({"autoscaler.policy.rateWindows": 0}, "at '/autoscaler/policy/rateWindows': minimum: got 0, want 1"),
    ({"autoscaler.policy.upCooldownSeconds": -1}, "at '/autoscaler/policy/upCooldownSeconds': minimum: got -1"),
])
def test_bad_autoscaler_values_are_refused_with_a_clear_message(set_values, message):
    proc = helm("template", *template_args(values=(VALUES,), set_values=set_values), check=False)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr
