"""`pdserve kv-store {stats,clear}`: inspect or empty a KV store.

    pdserve kv-store stats --url redis://127.0.0.1:6379/0 [--fingerprint FP] [--json]
    pdserve kv-store clear --url file:///dev/shm/pdserve [--fingerprint FP]
    pdserve kv-store stats --url shm://            # arenas in /dev/shm/pdserve

Without `--fingerprint` the action covers every namespace found at the URL. An arena (`shm://`)
is opened with the geometry its file records; one that does not exist is an error, not created.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from typing import Any

from kv_store.base import StoreStats
from kv_store.url import list_fingerprints, open_store

DEFAULT_URL = "file://"


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Add the `kv-store` subcommand; its handler is `args.func(args) -> exit code`."""
    parser = subparsers.add_parser("kv-store", help="inspect or clear a KV store")
    parser.add_argument("action", choices=("stats", "clear"))
    parser.add_argument("--url", default=DEFAULT_URL, help=f"store URL (default {DEFAULT_URL})")
    parser.add_argument(
        "--fingerprint", default=None, help="one namespace (default: every namespace)"
    )
    parser.add_argument("--json", action="store_true", help="stats as JSON lines")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the action; 0 on success, 1 if the store could not be reached or the URL is bad."""
    try:
        fingerprints = (
            [args.fingerprint] if args.fingerprint is not None else list_fingerprints(args.url)
        )
        for fingerprint in fingerprints:
            _run_one(args, fingerprint)
    except Exception as exc:  # an operator tool: report the failure, do not dump a traceback
        print(f"kv-store {args.action} failed: {exc}", file=sys.stderr)
        return 1
    if not fingerprints:
        print(f"no KV store namespaces at {args.url}", file=sys.stderr)
    return 0


def _run_one(args: argparse.Namespace, fingerprint: str) -> None:
    with open_store(args.url, fingerprint) as store:
        if args.action == "clear":
            print(f"{fingerprint}: deleted {store.clear()} entries")
        elif args.json:
            print(json.dumps({"fingerprint": fingerprint, **_stats_dict(store.stats())}))
        else:
            print(_stats_line(fingerprint, store.stats()))


def _stats_dict(stats: StoreStats) -> dict[str, Any]:
    return {**asdict(stats), "shared_hit_rate": stats.shared_hit_rate}


def _stats_line(fingerprint: str, stats: StoreStats) -> str:
    rate = stats.shared_hit_rate
    return (
        f"{fingerprint}: entries={stats.entries} bytes={stats.bytes}"
        f" ({stats.bytes / 2**20:.1f} MiB) evictions={_or_unknown(stats.evictions)}"
        f" hit_rate={'unknown' if rate is None else f'{rate:.3f}'}"
    )


def _or_unknown(value: int | None) -> str:
    return "unknown" if value is None else str(value)
