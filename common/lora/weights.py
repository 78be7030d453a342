"""An adapter's tensors, checked against the model and laid out for its fused projections.

Our projections are fused (q|k|v, gate|up: ``common/models/llama.py``), PEFT's are not. A fused
projection with ``n`` slices gets one LoRA of rank ``n·R`` (``R`` = ``--max-lora-rank``): the
slices' A matrices stacked, their B matrices block-diagonal, each padded with zeros to ``R``::

      A (n·R, K)            B (N, n·R)                 y[:, slice j] += (x A_jᵀ) B_jᵀ · scaling
    ┌──────────┐      ┌──────┬──────┬──────┐
    │ A_q  (r) │      │ B_q  │  0   │  0   │ q rows
    │ 0  (R-r) │      ├──────┼──────┼──────┤
    │ A_k      │      │  0   │ B_k  │  0   │ k rows
    │ A_v      │      ├──────┼──────┼──────┤
    └──────────┘      │  0   │  0   │ B_v  │ v rows
                      └──────┴──────┴──────┘

so a projection's delta is two GEMMs whatever the slices (shrink ``x Aᵀ``, expand ``s Bᵀ``),
and a slice an adapter does not target is zeros. PEFT's ``scaling`` (alpha / r) is folded into B.
Shapes are checked from the safetensors header before a byte is read (``check_shapes``), so a
request naming an adapter for another model is refused at admission, never inside a step.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open

from common.lora.adapter import MLP_TARGETS, TARGETS, WEIGHTS_FILE, AdapterConfig

_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)


class Projection(NamedTuple):
    """One fused projection of one layer: its input width and its slices' output widths."""

    in_features: int
    slices: tuple[int, ...]

    @property
    def out_features(self) -> int:
        return sum(self.slices)

    def rows(self, j: int) -> slice:
        """Output rows of slice ``j``."""
        begin = sum(self.slices[:j])
        return slice(begin, begin + self.slices[j])


# (layer, projection name) → its shape; only the projections an adapter may target
ModelProjections = dict[tuple[int, str], Projection]


def _entries(names: list[str], projections: ModelProjections):
    """Yield (key, layer, module, 'A'|'B') for each tensor, refusing any the model cannot take."""
    for key in names:
        m = _KEY.match(key)
        if m is None:
            raise ValueError(f"adapter tensor {key!r} is not a LoRA A/B of a decoder projection")
        layer, module, which = int(m[1]), m[2], m[3]
        if module not in TARGETS:
            raise ValueError(f"adapter tensor {key!r}: module {module!r} is not supported")
        if (layer, TARGETS[module][0]) not in projections:
            where = "a mixture-of-experts layer" if module in MLP_TARGETS else "no such layer"
            raise ValueError(f"adapter tensor {key!r} targets {where}")
        yield key, layer, module, which


def check_shapes(path: str, config: AdapterConfig, projections: ModelProjections) -> None:
    """Every tensor of the adapter fits the model (read from the header only)."""
    with safe_open(str(Path(path) / WEIGHTS_FILE), framework="pt") as f:
        for key, layer, module, which in _entries(list(f.keys()), projections):
            shape = tuple(f.get_slice(key).get_shape())
            _check(key, shape, which, projections[layer, TARGETS[module][0]],
                   TARGETS[module][1], config.rank)  # fmt: skip


def _check(key: str, shape: tuple, which: str, proj: Projection, j: int, rank: int) -> None:
    want = (rank, proj.in_features) if which == "A" else (proj.slices[j], rank)
    if shape != want:
        raise ValueError(f"adapter tensor {key!r} has shape {shape}, the model needs {want}")


def read_weights(
    path: str, config: AdapterConfig, projections: ModelProjections, max_rank: int
) -> Iterator[tuple[tuple[int, str], torch.Tensor, torch.Tensor]]:
    """``((layer, projection), A (n·R, K), B (N, n·R))`` in fp32 on the CPU, for every projection
    the adapter targets (scaling folded into B)."""
    found: dict[tuple[int, str], dict[tuple[int, str], torch.Tensor]] = {}
    with safe_open(str(Path(path) / WEIGHTS_FILE), framework="pt") as f:
        for key, layer, module, which in _entries(list(f.keys()), projections):
            proj_name, j = TARGETS[module]
            tensor = f.get_tensor(key)
            _check(key, tuple(tensor.shape), which, projections[layer, proj_name], j,
                   config.rank)  # fmt: skip
            found.setdefault((layer, proj_name), {})[j, which] = tensor.float()
    r, scaling = config.rank, config.scaling
    for where, parts in found.items():
        proj = projections[where]
        n = len(proj.slices)
        a = torch.zeros(n * max_rank, proj.in_features)
        b = torch.zeros(proj.out_features, n * max_rank)
        for j in range(n):
            if (j, "A") in parts and (j, "B") in parts:
                cols = slice(j * max_rank, j * max_rank + r)
                a[cols] = parts[j, "A"]
                b[proj.rows(j), cols] = parts[j, "B"] * scaling
            elif (j, "A") in parts or (j, "B") in parts:
                raise ValueError(f"adapter {path}: layer {where[0]} has lora_A without lora_B")
        yield where, a, b
