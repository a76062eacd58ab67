"""The repository's Dockerfile against the Makefile, pyproject.toml, the Helm chart and the
image check, and what `pip install .` really installs.

No image is built here (`make image-check` builds and runs it: tests/test_image.py); what
can drift is checked: the install steps are the Makefile's `venv` steps in the same order
(pip, torch with the same pin, the package), the build arguments default to the official
base and the PyTorch CPU index and are the ones the image check passes, the image stage
has no compiler, the package's directories and metadata are copied, the user is the
chart's runAsUser, the entry points are the project's scripts, .dockerignore keeps nothing
the build needs out; and (marker `image`, with `make image-check`: building every kernel
for every target takes a minute) the wheel built from what the Dockerfile copies ships the
built-in model and every kernel prebuilt, which a fresh environment without a compiler
(no source tree on its path) loads, every one, for every ISA path this CPU can take.
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile

import pytest
import yaml

from benchmarks import image as docker_tools
from tests.helm_tools import CHART, REPO, by_kind, containers, render

DOCKERFILE = (REPO / "Dockerfile").read_text()
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n\s*", " ", "\n".join(ln for ln in DOCKERFILE.splitlines() if not ln.lstrip().startswith("#")))
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1]) for ln in text.splitlines() if ln.strip()]


def simple_commands(commands: list[str]) -> list[list[str]]:
    """Shell command lines -> their simple commands' words (split at && || ; | ( ) outside quotes)."""
    out = []
    for cmd in commands:
        lexer = shlex.shlex(cmd.replace("$(PY)", "python"), posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        words: list[str] = []
        for token in lexer:
            if token and set(token) <= set("();&|"):
                out.append(words)
                words = []
            else:
                words.append(token)
        out.append(words)
    return [w for w in out if w]


def pip_steps(commands: list[str]) -> list[str]:
    """Each `pip install` as what it installs: upgrade-pip, torch==X, project (with or
    without extras: the image takes none, the venv takes the test extras)."""
    steps = []
    for words in simple_commands(commands):
        if "pip" not in words or "install" not in words:
            continue
        args = words[words.index("install") + 1:]
        targets = [a for i, a in enumerate(args) if not a.startswith("-") and args[i - 1] not in ("--index-url",)]
        if "--upgrade" in args and targets == ["pip"]:
            steps.append("upgrade-pip")
        for t in targets:
            if re.fullmatch(r"\.(\[[\w,]+\])?", t):
                steps.append("project")
            elif t != "pip":
                steps.append(t)
    return steps


def makefile_venv_commands() -> list[str]:
    lines = (REPO / "Makefile").read_text().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("$(VENV)/.installed:"))
    recipe = []
    for ln in lines[start + 1:]:
        if not ln.startswith("\t"):
            break
        recipe.append(ln.strip())
    return recipe


def docker_run_commands() -> list[str]:
    return [args for kind, args in instructions() if kind == "RUN"]


def build_args() -> dict[str, str | None]:
    """Every ARG -> its default (None: none)."""
    args = (a.split("=", 1) for kind, a in instructions() if kind == "ARG")
    return {a[0]: (a[1] if len(a) > 1 else None) for a in args}


def stages() -> list[list[tuple[str, str]]]:
    """The instructions of each FROM stage, in order."""
    out: list[list[tuple[str, str]]] = []
    for kind, args in instructions():
        if kind == "FROM":
            out.append([])
        if out:
            out[-1].append((kind, args))
    return out


@pytest.mark.unit
def test_install_steps_are_the_makefiles():
    make, docker = pip_steps(makefile_venv_commands()), pip_steps(docker_run_commands())
    assert make[0] == "upgrade-pip" and make[1].startswith("torch==") and make[-1] == "project", make
    assert docker == make
    torch_step = next(c for c in docker_run_commands() if "torch==" in c)
    assert "--index-url ${TORCH_INDEX}" in torch_step
    assert build_args()["TORCH_INDEX"] == "https://download.pytorch.org/whl/cpu"  # the CPU build, as the venv's
    assert docker_tools.TORCH in torch_step  # the image check's local index holds the same pin


@pytest.mark.unit
def test_build_args_are_the_image_checks():
    """The image check (benchmarks/image.py) builds this file with its own base and index:
    every argument it passes is declared, and the defaults are what a user elsewhere needs."""
    args = build_args()
    assert args["BASE_IMAGE"] == "python:3.11-slim-bookworm"
    assert {"BASE_IMAGE", "TORCH_INDEX", "PIP_INDEX_URL"} <= set(args)
    assert args["PIP_INDEX_URL"] is None  # unset: pip's own default, PyPI
    passed = set(re.findall(r'"--build-arg", f"(\w+)=', (REPO / "benchmarks/image.py").read_text()))
    assert passed == {"BASE_IMAGE", "TORCH_INDEX", "PIP_INDEX_URL"}, passed
    # both stages start from the base: the venv made in one runs in the other
    assert [st[0][1].split()[0] for st in stages()] == ["${BASE_IMAGE}", "${BASE_IMAGE}"]
    # the local base gives what the official one has: `python`, its venv module
    assert {"python-is-python3", "python3-venv"} <= set(docker_tools.BASE_PACKAGES)


@pytest.mark.unit
def test_the_image_stage_has_no_compiler_and_only_the_built_environment():
    build, image = stages()
    assert any("gcc" in a for k, a in build if k == "RUN")  # setup.py compiles the kernels there
    assert not any(re.search(r"\b(gcc|cc|clang|build-essential)\b", a) for k, a in image if k == "RUN")
    copies = [a for k, a in image if k == "COPY"]
    assert copies == ["--from=build /opt/atomd /opt/atomd"], copies
    assert not any("pip" in a for k, a in image if k == "RUN")  # nothing installed twice


@pytest.mark.unit
def test_the_package_is_copied_whole():
    copied = {src for kind, args in instructions() if kind == "COPY" for src in args.split()[:-1]}
    packages = {p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert packages <= copied, f"not copied: {packages - copied}"
    assert {"pyproject.toml", "setup.py", PYPROJECT["project"]["readme"]} <= copied
    ignored = [ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()
               if ln.strip() and not ln.startswith("#")]
    assert not (set(ignored) & copied), "the .dockerignore drops what the Dockerfile copies"
    assert {".venv", ".cache", ".git"} <= set(ignored)


@pytest.mark.unit
def test_base_python_satisfies_requires_python():
    base = build_args()["BASE_IMAGE"]
    m = re.fullmatch(r"python:(\d+)\.(\d+)-slim(-\w+)?", base.split()[0])
    assert m, f"expected a slim Python base, got {base}"
    need = re.fullmatch(r">=(\d+)\.(\d+)", PYPROJECT["project"]["requires-python"])
    assert (int(m.group(1)), int(m.group(2))) >= (int(need.group(1)), int(need.group(2)))


@pytest.mark.integration
def test_user_and_entry_points_are_what_the_chart_runs():
    user = next(args for kind, args in instructions() if kind == "USER")
    uid = int(user.split(":")[0])
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert uid != 0 and uid == values["podSecurityContext"]["runAsUser"]
    entry = next(args for kind, args in instructions() if kind == "ENTRYPOINT")
    scripts = PYPROJECT["project"]["scripts"]
    assert yaml.safe_load(entry)[0] in scripts
    commands = {c["command"][0] for w in by_kind(render(), "Deployment") + by_kind(render(), "StatefulSet")
                for c in containers(w)}
    assert commands == {"atomd", "atomd-router"} and commands <= set(scripts)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
    """What `pip install .` puts in the image: a wheel built from exactly what the
    Dockerfile COPYs (so the copies are enough), outside the repository."""
    tmp_path = tmp_path_factory.mktemp("wheel")
    src = tmp_path / "src"
    src.mkdir()
    for kind, args in instructions():
        if kind == "COPY" and not args.startswith("--from"):
            *sources, dest = args.split()
            for name in sources:
                target = src / (dest if dest not in ("./", ".") else name)
                if (REPO / name).is_dir():
                    shutil.copytree(REPO / name, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
                else:
                    shutil.copy(REPO / name, target)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path), str(src)], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    return next(tmp_path.glob("atomd-*.whl"))


@pytest.mark.image  # built with every kernel for every target: ~30-70 s, with `make image-check`
@pytest.mark.timeout(360)
def test_pip_install_dot_ships_the_built_in_model_and_kernels(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    checkpoint = {ln.split()[-1].lstrip("*") for ln in
                  (REPO / "atomd/model/default_checkpoint/SHA256SUMS").read_text().splitlines() if ln.strip()}
    assert {f"atomd/model/default_checkpoint/{f}" for f in checkpoint} <= names
    assert {"router/discovery.py", "launch/process.py"} <= names
    # every source and header a kernel built at run time (another shape) needs
    csrc = {f"atomd/kernels/csrc/{p.name}" for p in (REPO / "atomd/kernels/csrc").iterdir() if p.suffix in (".c", ".h")}
    assert csrc <= names and "atomd/kernels/csrc/fast_exp.h" in csrc
    # every shipped kernel for every target, built from these very sources (the name's key)
    from atomd.kernels import cbuild

    shipped = {f"atomd/kernels/prebuilt/{cbuild.prebuilt_path(*k, t, directory=pathlib.Path()).name}"
               for k in cbuild.shipped_kernels() for t in cbuild.TARGETS}
    assert shipped == {n for n in names if n.startswith("atomd/kernels/prebuilt/")}
    assert re.search(r"-cp\d+-cp\d+-linux_x86_64\.whl$", wheel.name)  # shared objects: a platform wheel
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "atomd = atomd.cli:main" in text and "atomd-router = router.__main__:main" in text


# Run in the fresh environment: every kernel for every ISA override this CPU can take, then
# the built-in model's greedy tokens (the engine's own loading path).
INSTALLED_CHECK = """
import json, sys
import atomd
from atomd import LLM, SamplingParams, structured
from atomd.kernels import cbuild, native
from atomd.model import layer_ops
wanted = {}
for isa in native.ISA_FLAGS:
    target, tag = cbuild.best_target(isa), "" if isa == "native" else "-" + isa
    if target is None:
        continue
    for d, g in cbuild.PREBUILT_ATTENTION:
        native.attention_kernels(d, g, isa)
        wanted[f"attention-d{d}-g{g}{tag}"] = "prebuilt " + target
    if isa in cbuild.ISA_FLAGS:
        layer_ops.build_kernels(isa)
        wanted["layer-ops" + tag] = "prebuilt " + target
wanted["bitmask"] = "prebuilt " + cbuild.best_target()
structured.bitmask_kernel()
out = LLM(num_threads=1).generate([sys.argv[1]], SamplingParams(max_tokens=12, temperature=0))
print(json.dumps({"file": atomd.__file__, "paths": cbuild.kernel_paths(), "wanted": wanted,
                  "text": out[0].outputs[0].text}))
"""
PROMPT = "def fibonacci(n):"


@pytest.mark.image
@pytest.mark.timeout(360)
def test_installed_package_loads_every_kernel_prebuilt_without_a_compiler(wheel, tmp_path):
    """The wheel installed into a fresh environment (no source tree on its path, run from an
    empty directory) with no C compiler and an empty cache: every kernel loads prebuilt,
    none falls back, and the built-in model's greedy tokens are the checkout's."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    py = venv / "bin" / "python"
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps",
                           "--no-index", str(wheel)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    # the dependencies (torch, ...) from this environment, appended after the package: its
    # editable atomd is a .pth hook there, which a path added this way never runs
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    deps = subprocess.run([sys.executable, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    pathlib.Path(site, "checkout-deps.pth").write_text(deps + "\n")
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ATOMD_", "PYTHON"))}
    env.update(CC="atomd-no-such-compiler", ATOMD_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run([str(py), "-c", INSTALLED_CHECK, PROMPT], capture_output=True, text=True, timeout=300,
                          cwd=cwd, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert pathlib.Path(result["file"]).is_relative_to(site), result["file"]  # the installed copy
    assert result["wanted"], "this CPU takes none of the shipped targets"
    assert result["paths"] == result["wanted"], proc.stderr[-4000:]  # every one prebuilt, no fallback
    assert not (tmp_path / "cache" / "kernels").exists()  # nothing compiled
    from atomd import LLM, SamplingParams

    greedy = SamplingParams(max_tokens=12, temperature=0)
    assert result["text"] == LLM(num_threads=1).generate([PROMPT], greedy)[0].outputs[0].text
