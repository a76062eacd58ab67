"""`--model` as a hub id resolved offline through the local Hugging Face cache
(atomd/model/hub.py): the layout huggingface_hub writes (refs/main -> snapshots/<commit>,
files as links into blobs/), its environment variables, and the errors when it is not there."""
from __future__ import annotations

import pathlib

import pytest

from atomd.config import EngineConfig
from atomd.llm import LLM
from atomd.model.hub import model_path
from atomd.api.server import load_tokenizer
from tests.test_model_hf import assert_equals_hf, engine_greedy, make_checkpoint, prompts_of

pytestmark = pytest.mark.unit
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_model(hub: pathlib.Path, repo_id: str, checkpoint: pathlib.Path, commit: str = COMMIT,
                ref: bool = True) -> pathlib.Path:
    """checkpoint's files into hub as huggingface_hub caches repo_id at `commit`."""
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for f in checkpoint.iterdir():
        blob = repo / "blobs" / f"{commit[:8]}-{f.name}"
        blob.write_bytes(f.read_bytes())
        (snapshot / f.name).symlink_to(blob)
    if ref:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> pathlib.Path:
    return make_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3", seed=41)


def test_a_cached_hub_id_serves_like_its_directory(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    snapshot = cache_model(tmp_path / "hf" / "hub", "acme/tiny-qwen3", checkpoint)
    assert model_path("acme/tiny-qwen3") == snapshot
    llm = LLM("acme/tiny-qwen3", num_threads=1, max_model_len=128)
    assert llm.engine.model_name == "acme/tiny-qwen3"  # served under the id, as vLLM does
    prompts = prompts_of([20, 3], seed=2)
    assert_equals_hf(checkpoint, prompts, engine_greedy(llm, prompts))
    # the API process's tokenizer, torch-free, resolves it the same way
    assert load_tokenizer(EngineConfig(model="acme/tiny-qwen3")).encode("import os") == \
        llm.engine.tokenizer.encode("import os")


def test_hub_cache_variables_and_snapshots(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "unused"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # wins over HF_HOME
    only = cache_model(tmp_path / "hub", "acme/one", checkpoint, ref=False)
    assert model_path("acme/one") == only  # no refs/main: the only snapshot
    cache_model(tmp_path / "hub", "acme/two", checkpoint, commit="a" * 40, ref=False)
    cache_model(tmp_path / "hub", "acme/two", checkpoint, commit="b" * 40, ref=False)
    with pytest.raises(ValueError, match="several snapshots and no refs/main"):
        model_path("acme/two")
    assert model_path(str(checkpoint)) == checkpoint  # a directory is itself


def test_an_uncached_hub_id_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ValueError, match=r"'Qwen/Qwen3-0.6B'.*not in the Hugging Face cache.*models--Qwen--Qwen3-0.6B"):
        EngineConfig(model="Qwen/Qwen3-0.6B")
    with pytest.raises(ValueError, match="local Hugging Face checkpoint directory or a hub id"):
        EngineConfig(model=str(tmp_path / "no" / "such" / "dir"))
