"""``pdserve up`` refuses what a model's config rules out before it starts anything, in one
line; a child that fails at start-up is one line too (its last error and its log)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from common.models.tiny import resolve_model_path
from launcher.processes import last_error
from tests.launcher.cluster_harness import REPO


def _up(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pdserve_cli", "up", "--port", "0", "--grpc-port", "0",
         "--state-dir", str(tmp_path / "state"), "--log-dir", str(tmp_path / "logs"), *argv],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def _gpt2_dir(tmp_path: Path) -> Path:
    model = tmp_path / "gpt2"
    shutil.copytree(resolve_model_path("tiny-llama"), model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"architectures": ["GPT2LMHeadModel"]}))
    return model


@pytest.mark.parametrize(
    "argv, reason",
    [
        (("--model", "{gpt2}"), "unsupported architecture 'GPT2LMHeadModel'"),
        (("--max-model-len", "100000"), "max_model_len 100000 exceeds the model's limit"),
        (("--speculative-config", "{not json"), "--speculative-config is not JSON"),
        (
            ("--speculative-config", '{"method": "draft_model", "model": "{gpt2}"}'),
            "unsupported architecture 'GPT2LMHeadModel'",
        ),
    ],
)
def test_what_the_config_rules_out_is_one_line_before_anything_starts(tmp_path, argv, reason):
    gpt2 = str(_gpt2_dir(tmp_path))
    done = _up(tmp_path, *(a.replace("{gpt2}", gpt2) for a in argv))
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pdserve up: ") and reason in lines[0], lines
    assert done.stdout == ""
    assert not (tmp_path / "state").exists() and not (tmp_path / "logs").exists()


TRACEBACK = """\
Traceback (most recent call last):
  File "x.py", line 3, in <module>
    main()
  File "x.py", line 2, in main
    raise ValueError("KV cache has 3 blocks but one request needs 32")
ValueError: KV cache has 3 blocks but one request needs 32
INFO shutting down
"""


def test_a_childs_failure_is_its_last_error_line() -> None:
    assert last_error(TRACEBACK) == "ValueError: KV cache has 3 blocks but one request needs 32"
    assert last_error("starting\nbind: address in use\n") == "bind: address in use"
    assert last_error("") == "no output"
    nested = "grpc.aio._call.AioRpcError: <AioRpcError of RPC that terminated with: UNAVAILABLE>"
    assert last_error(f"x\n{nested}\n") == nested
