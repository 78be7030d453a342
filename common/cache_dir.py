"""The pdserve cache directory: built-in models, dummy shapes, the compiled CPU kernel, and
Triton's compiled GPU kernels (``triton/``, see :func:`use_triton_cache_dir`).

Root: ``$PDSERVE_CACHE_DIR``, else ``~/.cache/pdserve``. Everything in it is built once per
machine and shared by every process, several of which may start at once on a cold cache, so
entries are directories built by :func:`build_once`: each builder works in a private temp
directory beside the target and publishes it with one atomic ``rename``; a loser discards its
copy and uses the winner's. A directory at the target path is therefore complete.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

CACHE_ENV = "PDSERVE_CACHE_DIR"
TRITON_CACHE_ENV = "TRITON_CACHE_DIR"


def default_cache_root() -> Path:
    """The pdserve cache root: `$PDSERVE_CACHE_DIR`, else `~/.cache/pdserve`."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pdserve"


def use_triton_cache_dir() -> Path:
    """Where Triton keeps compiled kernels: ``$TRITON_CACHE_DIR`` when set, else set to
    ``<root>/triton``. Returns it. Call before Triton first compiles (it reads the variable at
    every compile): a restarted engine, or a container whose root is a volume, then loads its
    kernels in milliseconds instead of compiling them again (Triton keys each entry by source,
    options, target and version, and writes it atomically, so processes may share it)."""
    return Path(os.environ.setdefault(TRITON_CACHE_ENV, str(default_cache_root() / "triton")))


def build_once(
    target: Path, build: Callable[[Path], None], is_complete: Callable[[Path], bool]
) -> Path:
    """``target``, after ``build(tmp_dir)`` has made it if it was not ``is_complete`` yet."""
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        build(tmp)
        # mkdtemp (and safetensors) create owner-only modes; a shared cache should be readable
        tmp.chmod(0o755)
        for path in tmp.iterdir():
            path.chmod(0o644)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return publish(tmp, target, is_complete)


def publish(tmp: Path, target: Path, is_complete: Callable[[Path], bool]) -> Path:
    """Atomically move the finished `tmp` to `target`; if another process won, use its copy."""
    try:
        os.rename(tmp, target)  # atomic; fails if target is a non-empty directory
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not is_complete(target):
            raise
    return target
