"""The ``pdserve`` console script: one subcommand per role or tool.

Each subcommand lives with its program and exposes ``register(subparsers)``; this module only
names them. A subcommand's module is imported only when that subcommand runs, so ``pdserve
--help`` imports none of them (no torch, transformers or matplotlib) and ``pdserve router``
imports only the router. ``python -m pdserve_cli ...`` is the same as ``pdserve ...``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Iterable, Sequence
from typing import NamedTuple


class Subcommand(NamedTuple):
    """Where a subcommand lives, and its one-line help for ``pdserve --help`` (the module's own
    ``register`` gives the same line when it adds the real sub-parser)."""

    module: str
    help: str


SUBCOMMANDS: dict[str, Subcommand] = {
    "demo": Subcommand("launcher.demo", "offline generation demo on a built-in tiny model"),
    "kv-store": Subcommand("kv_store.cli", "inspect or clear a KV store"),
    "prefill": Subcommand(
        "prefill_node.server", "prefill node: prompt → KV store + first token (gRPC)"
    ),
    "decode": Subcommand(
        "decode_node.server", "decode node: KV store + first token → streamed tokens (gRPC)"
    ),
    "router": Subcommand("router.server", "gRPC + OpenAI HTTP front door"),
    "up": Subcommand("launcher.cluster", "start a whole cluster on this machine"),
    "down": Subcommand(
        "launcher.down", "stop orphaned clusters of pdserve up; --all or --pid for running ones"
    ),
    "health": Subcommand("launcher.health_check", "probe a node (gRPC) or the router (HTTP)"),
    "bench": Subcommand("bench.load", "load-test a pdserve endpoint"),
}


def build_parser(commands: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The ``pdserve`` parser. The subcommands in ``commands`` (default: all) get their real
    sub-parsers, importing their modules; the others are placeholders that only list their
    name and help. A subcommand whose package is not installed stays a placeholder."""
    real = set(SUBCOMMANDS if commands is None else commands)
    parser = argparse.ArgumentParser(
        prog="pdserve", description="Disaggregated prefill/decode LLM serving"
    )
    parser.add_argument("--log-level", default="INFO")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name, command in SUBCOMMANDS.items():
        if not (name in real and _register(command.module, subparsers)):
            subparsers.add_parser(name, help=command.help, add_help=False)
    return parser


def _register(module_name: str, subparsers: argparse._SubParsersAction) -> bool:
    """Add ``module_name``'s sub-parser; False if that part of pdserve is not installed."""
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):
            return False
        raise
    module.register(subparsers)
    return True


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """The sub-parser of ``command`` in ``parser``."""
    for action in parser._actions:  # argparse keeps its sub-parsers only here
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[command]
    raise LookupError(command)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # First pass on placeholders only: finds the subcommand (or prints ``pdserve --help``).
    command = build_parser(commands=()).parse_known_args(argv)[0].command
    parser = build_parser(commands=[command])
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the subcommand's usage, not pdserve's, says what it takes
        _subparser(parser, command).error(f"unrecognized arguments: {' '.join(unknown)}")
    if not hasattr(args, "func"):
        parser.error(f"{command}: not installed in this build ({SUBCOMMANDS[command].module})")
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
