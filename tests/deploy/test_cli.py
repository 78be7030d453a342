"""The ``pdserve`` console script: every subcommand parses, and each is imported only when run."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest

import pdserve_cli

REPO = Path(__file__).resolve().parents[2]


def test_pdserve_help_imports_no_subcommand() -> None:
    script = (
        "import contextlib, io, json, sys, pdserve_cli\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):\n"
        "    pdserve_cli.main(['--help'])\n"
        "print(json.dumps([out.getvalue(), sorted(sys.modules)]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True
    )
    text, loaded = json.loads(done.stdout)
    for name, command in pdserve_cli.SUBCOMMANDS.items():
        assert name in text
        assert command.module not in loaded
    assert not {"torch", "transformers", "matplotlib"} & set(loaded)


def test_the_listed_help_is_each_subcommands_own() -> None:
    parser = pdserve_cli.build_parser()  # every subcommand real (imports them all)
    (subparsers,) = [a for a in parser._actions if a.dest == "command"]
    helps = {action.dest: action.help for action in subparsers._choices_actions}
    assert helps == {name: c.help for name, c in pdserve_cli.SUBCOMMANDS.items()}


@pytest.mark.parametrize("name", list(pdserve_cli.SUBCOMMANDS))
def test_every_subcommand_prints_its_help(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        pdserve_cli.main([name, "--help"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: pdserve {name} ")


def test_a_missing_or_unknown_subcommand_is_a_usage_error() -> None:
    for argv in ([], ["bogus"]):
        with pytest.raises(SystemExit) as exc:
            pdserve_cli.main(argv)
        assert exc.value.code == 2


def test_the_console_script_is_pdserve_cli_main() -> None:
    scripts = importlib.metadata.entry_points(group="console_scripts", name="pdserve")
    # the README's test command installs pdserve (pip install -e '.[test]')
    assert [s.value for s in scripts] == ["pdserve_cli:main"], "pdserve is not installed"


# What `--help` may import: none of the heavy libraries (each costs seconds on a loaded box; the
# wall time itself is a benchmark's business, docs/BENCHMARKS.md, not a test's).
HEAVY = {"torch", "transformers", "matplotlib", "xgrammar", "triton", "safetensors", "tokenizers"}


@pytest.mark.parametrize("command", ["", *pdserve_cli.SUBCOMMANDS])
def test_help_imports_nothing_heavy(command: str) -> None:
    argv = [*([command] if command else []), "--help"]
    script = (
        "import contextlib, io, json, sys, pdserve_cli\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):\n"
        f"    pdserve_cli.main({argv!r})\n"
        "print(json.dumps([out.getvalue(), sorted({m.split('.')[0] for m in sys.modules})]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True
    )
    text, loaded = json.loads(done.stdout)
    assert text.startswith(f"usage: pdserve {command}".rstrip())
    assert not HEAVY & set(loaded), f"pdserve {command} --help imports {HEAVY & set(loaded)}"


def test_the_old_entry_point_still_works_with_a_notice() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "common.cli", "health", "--help"],
        cwd=REPO, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0
    assert done.stdout.startswith("usage: pdserve health ")
    (notice,) = done.stderr.splitlines()
    assert notice.startswith("DeprecationWarning: 'python -m common.cli' is deprecated")
    assert "pdserve" in notice
