"""The router process imports no torch: it serves no weights, and torch costs seconds and memory.

Each check runs in a fresh interpreter (this one has long imported torch for other tests).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from common.models import names

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "matplotlib")


def modules_after(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running ``code`` (from the repo root)."""
    script = f"{code}\nimport json, sys\nprint(json.dumps(sorted(k for k, v in sys.modules.items() if v is not None)))"
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True
    )
    return set(json.loads(done.stdout.splitlines()[-1]))


def test_importing_the_router_imports_no_torch() -> None:
    loaded = modules_after("import router.server")
    assert not loaded & set(HEAVY)
    # It shares the wire conversion with the nodes (pdserve_proto.convert), no node module.
    assert "pdserve_proto.convert" in loaded
    assert not {m for m in loaded if m.startswith("node_frontend")}


def test_pdserve_router_help_imports_no_torch() -> None:
    run_help = (
        "import contextlib, io, pdserve_cli\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "    try:\n"
        "        pdserve_cli.main(['router', '--help'])\n"
        "    except SystemExit as exc:\n"
        "        assert exc.code == 0, exc.code\n"
        "assert out.getvalue().startswith('usage: pdserve router'), out.getvalue()"
    )
    loaded = modules_after(run_help)
    assert "router.server" in loaded
    assert "torch" not in loaded


def test_built_in_model_names_match_the_generator() -> None:
    from common.models import tiny

    assert tuple(tiny.TINY_MODELS) == names.TINY_MODEL_NAMES


def test_a_missing_built_in_model_is_generated_by_the_given_builder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    asked: list[str] = []

    def generate(name: str) -> Path:
        asked.append(name)
        target = names.tiny_model_dir(name)
        target.mkdir(parents=True)
        (target / "config.json").write_text("{}")
        (target / "tokenizer.json").write_text("{}")
        return target

    target = tmp_path / "models" / f"tiny-llama-{names.TINY_VERSION}"
    assert names.resolve_model_path("tiny-llama", generate) == target
    assert names.resolve_model_path("tiny-llama", generate) == target  # now cached
    assert asked == ["tiny-llama"]
    with pytest.raises(ValueError, match="unknown model"):
        names.resolve_model_path(str(tmp_path / "nowhere"), generate)


def test_the_default_builder_generates_in_a_child_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    loaded = modules_after(
        "from common.models.names import resolve_model_path\n"
        "assert (resolve_model_path('tiny-llama') / 'model.safetensors').is_file()"
    )
    assert "torch" not in loaded


def test_a_running_router_holds_no_torch() -> None:
    """``pdserve router``'s own entry point, up to serving: tokenizer loaded, app built."""
    loaded = modules_after(
        "import asyncio, pdserve_cli, router.server as server\n"
        "async def built(config, autoscale):\n"
        "    router = server.build_router(config)\n"
        "    assert router.core is not None and server.Router is type(router)\n"
        "    assert server.PromptProcessor(server.resolve_model_path(config.model)).encode_text('hi')\n"
        "server.serve = built\n"
        "assert pdserve_cli.main(['router', '--model', 'tiny-qwen2']) == 0"
    )
    assert "router.server" in loaded and "transformers" in loaded
    assert "torch" not in loaded


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2"])
def test_a_torch_free_tokenizer_is_the_same_tokenizer(model: str) -> None:
    """With torch kept out, transformers picks the same tokenizer class and gives the same ids
    and chat text as in a process with torch (the nodes', the offline LLM's)."""
    probe = (
        "from router.prompts import PromptProcessor\n"
        "from common.models.names import resolve_model_path\n"
        f"p = PromptProcessor(resolve_model_path({model!r}))\n"
        "chat = [{'role': 'user', 'content': 'Hi there ünï'}]\n"
        "print(json.dumps([type(p.tokenizer).__name__, p.encode_text('Hello, world  1 2'),\n"
        "                  p.render_chat(chat, True), p.vocab_size]))"
    )
    results = []
    for first in (
        "from router.prompts import keep_torch_out; assert keep_torch_out()",
        "import torch",
    ):
        script = f"import json\n{first}\n{probe}\nimport sys; print(sys.modules.get('torch') is not None)"
        done = subprocess.run(
            [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True
        )
        *_, result, has_torch = done.stdout.splitlines()
        results.append(json.loads(result))
        assert has_torch == str(first == "import torch")
    assert results[0] == results[1]
