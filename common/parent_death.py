"""Dying with one's parent (Linux ``PR_SET_PDEATHSIG``), for children that must not outlive it.

Two fine points. The signal follows the *thread* that forked the child, so start children from
a thread that lives as long as the process. And the parent may die before the child asks: then
no signal will ever come, which the child sees as a new parent pid, and it kills itself.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _prctl() -> Callable[..., int] | None:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def _arm(prctl: Callable[..., int], parent_pid: int) -> None:
    prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before we asked: no signal will come
        os.kill(os.getpid(), signal.SIGKILL)


def die_with(parent_pid: int) -> None:
    """Called in a child: SIGKILL this process when its parent exits (at once if ``parent_pid``
    is gone already). A no-op where ``prctl`` does not exist."""
    prctl = _prctl()
    if prctl is not None:
        _arm(prctl, parent_pid)


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` making the child get SIGKILL when this process dies; None where
    ``prctl`` does not exist. Everything is resolved before the fork: the child only calls into
    libc."""
    prctl = _prctl()
    if prctl is None:
        return None
    return functools.partial(_arm, prctl, os.getpid())
