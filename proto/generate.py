"""Regenerate the Python modules of the wire contract from ``proto/pdserve.proto``.

    python proto/generate.py           # write proto/pdserve_proto/pdserve_pb2{,_grpc}.py{,i}
    python proto/generate.py --check   # regenerate into a temp dir and diff; exit 1 if stale

The generated modules are committed so that installing pdserve needs no protoc. protoc emits
``import pdserve_pb2`` in the gRPC module, which only works with ``proto/pdserve_proto`` itself on
``sys.path``; we rewrite it to a package-relative import so the modules load as the package
``pdserve_proto`` (installed, or with ``proto/`` on ``sys.path``).

``--check`` compares byte for byte, so it also flags output of a different grpcio-tools version
(the generated code records it). tests/test_proto.py does a version-independent staleness check
on the descriptor instead.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
import tempfile
from importlib import resources
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
PROTO_FILE = PROTO_DIR / "pdserve.proto"
PACKAGE_DIR = PROTO_DIR / "pdserve_proto"
GENERATED = ("pdserve_pb2.py", "pdserve_pb2.pyi", "pdserve_pb2_grpc.py")

# protoc writes `import pdserve_pb2 as pdserve__pb2` at the start of a line.
_ABSOLUTE_IMPORT = re.compile(r"^import (pdserve_pb2) as (\w+)$", re.MULTILINE)


def _protoc(args: list[str]) -> None:
    """Run the protoc bundled with grpcio-tools; raise RuntimeError on failure."""
    from grpc_tools import protoc  # grpcio-tools is a dev/test dependency, not a runtime one

    # The bundled well-known types (google/protobuf/*.proto), in case the contract imports them.
    well_known = str(resources.files("grpc_tools") / "_proto")
    if protoc.main(["grpc_tools.protoc", f"-I{PROTO_DIR}", f"-I{well_known}", *args]) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")


def _fix_imports(path: Path) -> None:
    """Make protoc's top-level ``import pdserve_pb2`` package-relative, in place."""
    text = path.read_text()
    path.write_text(_ABSOLUTE_IMPORT.sub(r"from . import \1 as \2", text))


def generate(out_dir: Path) -> list[Path]:
    """Generate the three modules into ``out_dir`` (created if missing); return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    _protoc(
        [
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(PROTO_FILE),
        ]
    )
    paths = [out_dir / name for name in GENERATED]
    for path in paths:
        _fix_imports(path)
    return paths


def descriptor_set(out_file: Path) -> bytes:
    """Compile the .proto to a serialized FileDescriptorSet (no source info) and return it."""
    _protoc([f"--descriptor_set_out={out_file}", str(PROTO_FILE)])
    return out_file.read_bytes()


def check(package_dir: Path = PACKAGE_DIR) -> list[str]:
    """Regenerate into a temp dir; return a unified diff per stale file (empty: up to date)."""
    diffs: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        for fresh in generate(Path(tmp)):
            committed = package_dir / fresh.name
            old = committed.read_text().splitlines(keepends=True) if committed.exists() else []
            new = fresh.read_text().splitlines(keepends=True)
            if old != new:
                diff = difflib.unified_diff(old, new, str(committed), f"regenerated/{fresh.name}")
                diffs.append("".join(diff))
    return diffs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="diff instead of writing; 1 if stale")
    args = parser.parse_args(argv)
    if not args.check:
        for path in generate(PACKAGE_DIR):
            print(f"wrote {path.relative_to(PROTO_DIR.parent)}")
        return 0
    diffs = check()
    for diff in diffs:
        sys.stdout.write(diff)
    if diffs:
        print("generated modules are stale: run `python proto/generate.py`", file=sys.stderr)
        return 1
    print("generated modules are up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
