"""Helpers for the simulated-engine tests: a calibrated profile of the built-in model's shape
(so a simulated engine's KV blocks, compat fingerprint and byte counters are the real
engine's), and the `atomd serve` flags that run one."""
from __future__ import annotations

import json
import pathlib

from atomd.sim.hardware import LINKS, Calibrated, LinearStep, ModelShape, Profile
from tests.server_fixtures import model_dir

# Step times of the order `atomd profile` measures for the built-in model on these CPUs
# (a few ms a step): the tests run fast and the scheduler sees realistic steps.
PREFILL = LinearStep(base_s=2e-3, per_token_s=20e-6, per_attention_s=50e-9)
DECODE = LinearStep(base_s=1.5e-3, per_token_s=50e-6, per_attention_s=100e-9)


def default_model_profile(path: pathlib.Path, link: str = "loopback", prefill: LinearStep = PREFILL,
                          decode: LinearStep = DECODE) -> pathlib.Path:
    """Write a calibrated profile of the built-in model (float32) to `path`."""
    hf = json.loads((model_dir() / "config.json").read_text())
    profile = Profile(name="test-default-model", model=ModelShape.from_hf_config("atomd-default", hf, 4),
                      step=Calibrated(prefill=prefill, decode=decode, source="tests/sim_fixtures.py"),
                      link=LINKS[link])
    path.write_bytes(profile.to_json())
    return path


def sim_flags(profile: pathlib.Path) -> list[str]:
    return ["--model-runner", "simulated", "--hardware", str(profile)]
