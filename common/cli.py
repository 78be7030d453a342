"""The ``pdserve`` console script: one subcommand per role or tool.

Each subcommand lives with its package and exposes ``register(subparsers)``; this module only
collects them, importing lazily so ``pdserve --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# (module, registrar): each module adds its subcommand(s) with a ``func`` default.
_SUBCOMMANDS = [
    ("common.demo", "register"),
    ("kv_store.cli", "register"),
    ("prefill_node.server", "register"),
    ("decode_node.server", "register"),
    ("router.server", "register"),
    ("router.cluster", "register"),
    ("router.bench", "register"),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve", description="Disaggregated prefill/decode LLM serving"
    )
    parser.add_argument("--log-level", default="INFO")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module_name, attr in _SUBCOMMANDS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name and module_name.startswith(e.name):
                continue  # that part of pdserve is not installed in this build
            raise
        getattr(module, attr)(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
