"""``--model`` as a Hugging Face Hub id: found in a local HF cache (written here, in the layout
huggingface_hub writes: blobs, snapshot symlinks, ``refs/main``), downloaded only when missing and
allowed, served under the id. Nothing here touches the network: downloads are faked."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import pytest

from common import LLM, SamplingParams
from common.models import names
from common.models.tiny import resolve_model_path

REPO = Path(__file__).resolve().parents[2]
REPO_ID = "pdserve-test/tiny-qwen3-hub"
REVISION = "0123456789abcdef0123456789abcdef01234567"


def write_hf_cache(hub: Path, repo_id: str, source: Path, revision: str = REVISION) -> Path:
    """Put the files of model directory ``source`` into HF cache ``hub`` as huggingface_hub
    does: ``models--org--name/blobs/<sha256>``, ``snapshots/<revision>/<file>`` symlinks to
    them, ``refs/main`` naming the revision. Returns the snapshot directory."""
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for file in sorted(source.iterdir()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(Path("../../blobs") / blob.name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    return snapshot


@pytest.fixture
def no_download(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Any download attempt fails the test (and is recorded)."""
    attempts: list[str] = []

    def refuse(repo_id: str, **kwargs: object) -> str:
        attempts.append(repo_id)
        raise AssertionError(f"download of {repo_id} attempted")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    return attempts


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An HF cache holding REPO_ID (tiny-qwen3's files), named by HF_HUB_CACHE, offline."""
    cache = tmp_path / "hf-hub"
    write_hf_cache(cache, REPO_ID, resolve_model_path("tiny-qwen3"))
    monkeypatch.delenv("HF_HOME", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_hub_id_shapes() -> None:
    for name in ("Qwen/Qwen3-0.6B", "meta-llama/Llama-3.2-1B", "gpt2", "org/name.v2"):
        assert names.is_hub_id(name), name
    for name in ("/abs/dir", "./dir", "a/b/c", "org--x/y", "org/x..y", "org/x.git", "", "a b"):
        assert not names.is_hub_id(name), name


def test_resolved_from_the_cache_offline(hub: Path, no_download: list[str]) -> None:
    snapshot = names.resolve_model_path(REPO_ID)
    assert snapshot == hub / "models--pdserve-test--tiny-qwen3-hub" / "snapshots" / REVISION
    assert (snapshot / "config.json").is_file() and (snapshot / "model.safetensors").is_file()
    assert no_download == []


def test_hf_home_locates_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_download: list[str]
) -> None:
    write_hf_cache(tmp_path / "home" / "hub", REPO_ID, resolve_model_path("tiny-qwen3"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert names.hf_hub_cache() == tmp_path / "home" / "hub"
    snapshot = names.resolve_model_path(REPO_ID)
    assert (
        snapshot == tmp_path / "home/hub/models--pdserve-test--tiny-qwen3-hub/snapshots" / REVISION
    )


def test_unknown_id_offline_names_where_it_looked(hub: Path, no_download: list[str]) -> None:
    with pytest.raises(ValueError) as caught:
        names.resolve_model_path("pdserve-test/not-there")
    message = str(caught.value)
    assert "not a built-in model" in message and "not a directory" in message
    assert str(hub / "models--pdserve-test--not-there" / "snapshots") in message
    assert "HF_HUB_OFFLINE" in message and "hf download pdserve-test/not-there" in message
    assert no_download == []


def test_a_snapshot_without_config_is_not_a_model(hub: Path, no_download: list[str]) -> None:
    snapshot = names.resolve_model_path(REPO_ID)
    (snapshot / "config.json").unlink()
    with pytest.raises(ValueError, match="not in the Hugging Face cache"):
        names.resolve_model_path(REPO_ID)


def test_downloaded_only_when_missing_and_allowed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Online, a missing model is fetched once (serving files only) into the cache the
    environment names; then it is served from the cache with no further request."""
    cache = tmp_path / "hf-hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    calls: list[dict[str, object]] = []

    def fake_download(repo_id: str, **kwargs: object) -> str:
        calls.append({"repo_id": repo_id, **kwargs})
        source = resolve_model_path("tiny-qwen3")
        return str(write_hf_cache(Path(str(kwargs["cache_dir"])), repo_id, source))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    first = names.resolve_model_path(REPO_ID)
    assert [c["repo_id"] for c in calls] == [REPO_ID]
    assert calls[0]["cache_dir"] == cache
    patterns = calls[0]["allow_patterns"]
    assert isinstance(patterns, list) and "*.safetensors" in patterns and "*.bin" not in patterns
    assert names.resolve_model_path(REPO_ID) == first and len(calls) == 1  # cached now
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="downloads are off"):
        names.resolve_model_path("pdserve-test/other")
    assert len(calls) == 1


def test_a_failed_download_is_one_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-hub"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)

    def unreachable(repo_id: str, **kwargs: object) -> str:
        raise OSError("Name or service not known")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    with pytest.raises(ValueError, match="downloading it failed: OSError: Name or service"):
        names.resolve_model_path(REPO_ID)


def test_the_engine_runs_a_hub_id(hub: Path, no_download: list[str]) -> None:
    """Same weights, same greedy tokens as the built-in model the snapshot was made from."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [[5, 6, 7, 8], list(range(3, 40))]
    by_id = LLM(model=REPO_ID, num_blocks=64, max_model_len=256)
    built_in = LLM(model="tiny-qwen3", num_blocks=64, max_model_len=256)
    got = [o.outputs[0].token_ids for o in by_id.generate(prompts, params, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in built_in.generate(prompts, params, use_tqdm=False)]
    assert got == want


def test_the_router_serves_it_under_the_id(hub: Path, no_download: list[str]) -> None:
    """The OpenAI model name is the id, not the snapshot path; resolving imports no torch."""
    script = (
        "import asyncio, json, sys, httpx\n"
        "from router.prompts import keep_torch_out; keep_torch_out()  # as `pdserve router`\n"
        "from router.config import RouterConfig\n"
        "from router.server import build_router\n"
        f"router = build_router(RouterConfig(model={REPO_ID!r}))\n"
        "async def models():\n"
        "    transport = httpx.ASGITransport(app=router.http_app)\n"
        "    async with httpx.AsyncClient(transport=transport, base_url='http://r') as c:\n"
        "        return (await c.get('/v1/models')).json()\n"
        "print(json.dumps([asyncio.run(models()), sys.modules.get('torch') is not None]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    listing, has_torch = json.loads(done.stdout.splitlines()[-1])
    assert [card["id"] for card in listing["data"]] == [REPO_ID]
    assert not has_torch
