"""Build C sources into a shared library on first use, cached per machine (torch-free).

A :class:`NativeLibrary` names its sources (each with its own flags), the headers they include
and the link flags. :func:`build` compiles it with the machine's C compiler (``$CC``, else
``cc``/``gcc``/``clang``) into ``<cache root>/<cache_subdir>/<key>/<name>`` through
``common.cache_dir.build_once`` (built once, published atomically, safe from several processes
at once). The key hashes the compiler, the flags, the sources and headers and the CPU's feature
flags, so a cache shared between machines never hands one a library built for another's
instruction set. The native CPU kernels (``kernels/native.py``) and the shm arena's slot
protocol (``kv_store/arena_slots.py``) are built this way; loading and binding are theirs.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from common.cache_dir import build_once, default_cache_root


class Source(NamedTuple):
    path: Path
    flags: tuple[str, ...]


@dataclass(frozen=True)
class NativeLibrary:
    """What to build: `sources` compiled with `-I include_dir`, linked with `link_flags`
    (+ `libs`, not part of the cache key) into `name` under `<cache root>/<cache_subdir>/`."""

    name: str
    cache_subdir: str
    sources: tuple[Source, ...]
    include_dir: Path
    headers: tuple[Path, ...] = ()
    link_flags: tuple[str, ...] = ("-shared",)
    libs: tuple[str, ...] = ()


def compiler() -> str:
    """The C compiler: ``$CC``, else the first of cc, gcc, clang on the PATH."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        path = shutil.which(name) if name else None
        if path:
            return path
    raise RuntimeError("no C compiler found (set $CC, or install gcc)")


def cpu_flags() -> str:
    """The CPU's feature flags line (``/proc/cpuinfo``), else the processor name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def cache_key(library: NativeLibrary, cc: str) -> str:
    """16 hex digits over the compiler, flags, CPU, sources and headers."""
    parts = [cc, " ".join(library.link_flags), cpu_flags(), platform.machine()]
    for source in library.sources:
        parts += [source.path.read_text(), " ".join(source.flags)]
    parts += [header.read_text() for header in library.headers]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def build(library: NativeLibrary, cc: str) -> Path:
    """The path of `library` built with `cc`, compiling it unless the cache has it already.
    Raises RuntimeError (with the compiler's message) or OSError when it cannot be built."""

    def compile_into(out: Path) -> None:
        objects = [out / source.path.with_suffix(".o").name for source in library.sources]
        include = ["-I", str(library.include_dir)]
        commands = [
            [cc, *source.flags, *include, "-c", str(source.path), "-o", str(obj)]
            for source, obj in zip(library.sources, objects, strict=True)
        ]
        link = [*library.link_flags, *map(str, objects), "-o", str(out / library.name)]
        commands.append([cc, *link, *library.libs])
        for cmd in commands:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr.strip()}")
        for obj in objects:
            obj.unlink()

    target = default_cache_root() / library.cache_subdir / cache_key(library, cc)
    return build_once(target, compile_into, lambda d: (d / library.name).is_file()) / library.name
