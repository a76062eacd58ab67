"""The repository's Dockerfile against the Makefile, pyproject.toml and the Helm chart.

No image is built here (no Docker daemon on these machines); what can drift is checked:
the install steps are the Makefile's `venv` steps in the same order (pip, torch with the
same pin, the package), the package's directories and metadata are copied, the user is
the chart's runAsUser, the entry points are the project's scripts, .dockerignore keeps
nothing the build needs out, and `pip install .` really ships the built-in model.
"""
from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile

import pytest
import yaml

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


@pytest.mark.unit
def test_install_steps_are_the_makefiles():
    make, docker = pip_steps(makefile_venv_commands()), pip_steps(docker_run_commands())
    assert make[0] == "upgrade-pip" and make[1].startswith("torch==") and make[-1] == "project", make
    assert docker == make
    torch_step = next(c for c in docker_run_commands() if "torch==" in c)
    assert "--index-url https://download.pytorch.org/whl/cpu" in torch_step  # the CPU build, as the venv's


@pytest.mark.unit
def test_the_package_is_copied_whole():
    copied = {src for kind, args in instructions() if kind == "COPY" for src in args.split()[:-1]}
    packages = {p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert packages <= copied, f"not copied: {packages - copied}"
    assert {"pyproject.toml", PYPROJECT["project"]["readme"]} <= copied
    ignored = [ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()
               if ln.strip() and not ln.startswith("#")]
    assert not (set(ignored) & copied), "the .dockerignore drops what the Dockerfile copies"
    assert {".venv", ".cache", ".git"} <= set(ignored)


@pytest.mark.unit
def test_base_python_satisfies_requires_python():
    base = next(args for kind, args in instructions() if kind == "FROM")
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


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_pip_install_dot_ships_the_built_in_model_and_kernels(tmp_path):
    """What `pip install .` puts in the image: a wheel built from exactly what the
    Dockerfile COPYs (so the copies are enough), outside the repository."""
    src = tmp_path / "src"
    src.mkdir()
    for kind, args in instructions():
        if kind == "COPY":
            *sources, dest = args.split()
            for name in sources:
                target = src / (dest if dest not in ("./", ".") else name)
                if (REPO / name).is_dir():
                    shutil.copytree(REPO / name, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
                else:
                    shutil.copy(REPO / name, target)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path), str(src)], capture_output=True, text=True, timeout=170,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    wheel = next(tmp_path.glob("atomd-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    checkpoint = {ln.split()[-1].lstrip("*") for ln in
                  (REPO / "atomd/model/default_checkpoint/SHA256SUMS").read_text().splitlines() if ln.strip()}
    assert {f"atomd/model/default_checkpoint/{f}" for f in checkpoint} <= names
    assert {"atomd/csrc/attention.c", "router/discovery.py", "launch/process.py"} <= names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "atomd = atomd.cli:main" in text and "atomd-router = router.__main__:main" in text
