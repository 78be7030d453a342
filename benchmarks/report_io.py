"""What the benchmark scripts share around their measurements: the common flags and writing
their figures."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def parser(doc: str | None) -> argparse.ArgumentParser:
    """A script's parser with the flags every CPU engine benchmark takes."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--cpu-threads", type=int, default=None)
    p.add_argument("--json", type=Path, default=None, help="write the report here")
    p.add_argument("--plot", type=Path, default=None, help="write the figure here (PNG)")
    return p


def pyplot() -> Any:
    """matplotlib's pyplot drawing to files (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)


def write_outputs(report: dict, args: argparse.Namespace, plot: Any) -> None:
    """``--json`` and ``--plot`` (``plot(report, path)``), where asked for."""
    import json

    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    if args.plot:
        plot(report, args.plot)
