"""``LoraBatch`` on the CPU: each of its three paths (one adapter over the batch, padded
batched GEMMs, one GEMM pair per adapter) adds exactly each row's own adapter delta."""

from __future__ import annotations

import pytest
import torch

from common.lora.batch import LoraBatch

T_K_N_R, SLOTS = (12, 40, 72, 24), 3


def _reference(x, a, b, y, token_slots):
    out = y.clone()
    for t, slot in enumerate(token_slots):
        if slot >= 0:
            out[t] += (x[t] @ a[slot].T) @ b[slot].T
    return out


@pytest.mark.parametrize(
    ("token_slots", "path"),
    [
        ([1] * 12, "whole"),
        ([0, 1, 2, -1] * 3, "padded"),
        ([0] * 10 + [2, -1], "per adapter"),  # unbalanced: padding would triple the rows
        ([-1] * 12, "none"),
    ],
)
def test_each_row_gets_its_own_adapter(token_slots, path):
    torch.manual_seed(0)
    t, k, n, r = T_K_N_R
    x, y = torch.randn(t, k, dtype=torch.float64), torch.randn(t, n, dtype=torch.float64)
    a = {(0, "qkv"): torch.randn(SLOTS, r, k, dtype=torch.float64)}
    b = {(0, "qkv"): torch.randn(SLOTS, n, r, dtype=torch.float64)}
    batch = LoraBatch(token_slots, a, b, kernels=False)
    taken = {
        "whole": len(batch.groups) == 1 and batch.groups[0][1] is None,
        "padded": batch.padded is not None,
        "per adapter": batch.padded is None and len(batch.groups) > 1,
        "none": not batch.groups,
    }
    assert taken[path]
    want = _reference(x, a[0, "qkv"], b[0, "qkv"], y, token_slots)
    batch.apply(0, "qkv", x, y)
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)
    batch.apply(1, "qkv", x, y)  # a projection no adapter may target: untouched
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)
