"""Fixtures for the kernel tests: device choice, paged-cache builders, dtype tolerances.

Without CUDA the kernels run in Triton's interpreter. Triton reads ``TRITON_INTERPRET`` when
``@triton.jit`` decorates a function: for our kernels when a ``kernels`` module is imported, and
for Triton's own ``tl.*`` helpers (``tl.zeros``, ``tl.cdiv``...) when ``triton.language`` is. So
the variable must be set before anything in the process imports ``triton``. This conftest sets
it at its import, which pytest does before it imports any test module of this directory; that
is early enough unless a test collected earlier imported ``triton`` (set ``TRITON_INTERPRET=1``
in the environment or in ``tests/conftest.py`` to be immune). If it came too late the kernel
tests fail with that explanation instead of an obscure interpreter error.
With CUDA the variable is left alone: the tests then run the compiled kernels on the GPU
(``TRITON_INTERPRET=1`` still forces the interpreter on CPU tensors).
``PDSERVE_TEST_DEVICE=cuda`` (set by ``benchmarks/gpu_check.py``) makes that a requirement: every
test fails, saying why, when there is no CUDA device or the interpreter is on.

``tests/__init__.py`` must stay: it makes this package ``tests.kernels``; without it pytest's
default import mode would name it ``kernels`` and shadow the real ``kernels`` package.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

CUDA_REQUIRED = os.environ.get("PDSERVE_TEST_DEVICE") == "cuda"
if not torch.cuda.is_available() and not CUDA_REQUIRED:
    os.environ["TRITON_INTERPRET"] = "1"


def _triton_imported_too_early() -> bool:
    """True when ``triton.language`` was decorated for compiled mode despite the variable."""
    language = sys.modules.get("triton.language")
    if language is None or os.environ.get("TRITON_INTERPRET") != "1":
        return False
    import triton

    return isinstance(language.standard.zeros, triton.runtime.JITFunction)


_TOO_EARLY = _triton_imported_too_early()

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cpu" if INTERPRETING else "cuda")

# (atol, rtol) against the fp32 reference. fp32 is held tight; half types lose ~3 significant
# digits to rounding the output and the probabilities fed to the P @ V product.
TOLERANCES = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-2, 2e-2),
    torch.bfloat16: (2e-2, 2e-2),
}


@pytest.fixture(autouse=True)
def _interpreter_in_time() -> None:
    if _TOO_EARLY:
        pytest.fail(
            "triton was imported before tests/kernels/conftest.py set TRITON_INTERPRET=1, so "
            "its kernels are in compiled mode and cannot run on CPU: set TRITON_INTERPRET=1 in "
            "the environment or at the top of tests/conftest.py"
        )


@pytest.fixture(autouse=True)
def _cuda_when_required() -> None:
    if CUDA_REQUIRED and (INTERPRETING or not torch.cuda.is_available()):
        pytest.fail(
            "PDSERVE_TEST_DEVICE=cuda asks for the compiled kernels on a GPU, but "
            + ("TRITON_INTERPRET=1 is set" if INTERPRETING else "torch sees no CUDA device")
        )


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def device() -> torch.device:
    return DEVICE


@pytest.fixture
def assert_close() -> Callable[[torch.Tensor, torch.Tensor], None]:
    """``assert_close(actual, expected)`` with the tolerance of ``actual``'s dtype."""

    def check(actual: torch.Tensor, expected: torch.Tensor) -> None:
        atol, rtol = TOLERANCES[actual.dtype]
        torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)

    return check


@dataclass
class PagedContext:
    """A paged cache layer holding each sequence's context, plus the same K/V unpaged."""

    kv_cache_layer: torch.Tensor  # (2, N, bs, Hkv, D)
    block_tables: torch.Tensor  # (S, max_blocks) int32, scattered ids, padded with 0
    seq_lens: torch.Tensor  # (S,) int32
    keys: list[torch.Tensor]  # per sequence (seq_len, Hkv, D)
    values: list[torch.Tensor]


def build_paged_context(
    seq_lens: list[int],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> PagedContext:
    """Random K/V for each sequence, stored in shuffled blocks of a random cache.

    Unused blocks keep random values, so a kernel that reads past a sequence shows up.
    """
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    max_blocks = max(blocks_per_seq, default=0) + 1  # one padding column
    num_blocks = sum(blocks_per_seq) + 3
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    cache = torch.randn(shape, device=device).to(dtype)
    ids = torch.randperm(num_blocks, device=device)
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32, device=device)
    keys, values, used = [], [], 0
    for s, (n, nb) in enumerate(zip(seq_lens, blocks_per_seq, strict=True)):
        block_tables[s, :nb] = ids[used : used + nb].int()
        used += nb
        flat = cache[:, ids[used - nb : used]].flatten(1, 2)[:, :n]  # (2, n, Hkv, D)
        keys.append(flat[0])
        values.append(flat[1])
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return PagedContext(cache, block_tables, seq_lens_t, keys, values)


@pytest.fixture
def paged_context(device: torch.device) -> Callable[..., PagedContext]:
    """``paged_context(seq_lens, block_size, num_kv_heads, head_dim, dtype)``."""

    def make(
        seq_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> PagedContext:
        return build_paged_context(seq_lens, block_size, num_kv_heads, head_dim, dtype, device)

    return make


def sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Independent oracle: q ``(n, H, D)`` are the last ``n`` positions of k, v ``(L, Hkv, D)``.

    fp32 ``scaled_dot_product_attention`` on contiguous K/V with an explicit causal mask.
    """
    n, num_heads, _ = q.shape
    context_len = k.shape[0]
    group = num_heads // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # (H, L, D)
    v = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    q_pos = torch.arange(context_len - n, context_len, device=q.device)
    mask = torch.arange(context_len, device=q.device)[None, :] <= q_pos[:, None]  # (n, L)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(0, 1), k, v, attn_mask=mask, scale=scale
    )
    return out.transpose(0, 1)  # (n, H, D)


@pytest.fixture
def oracle() -> Callable[..., torch.Tensor]:
    """:func:`sdpa_causal`, for tests that check the ``ref_*`` functions themselves."""
    return sdpa_causal
