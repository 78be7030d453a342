"""Batched sampling: one tensor pass for the whole batch, whatever each row asks for.

Randomness is counter-based: the noise for vocabulary entry ``v`` of output position ``i`` of a
request with seed ``s`` is ``hash(s, i, v)``, computed with integer ops on tensors. A row's draw
therefore depends only on its own (seed, position) — never on batch composition, step, process or
machine — which makes colocated, disaggregated and migrated runs sample identical tokens.
Sampling is Gumbel-max in its exponential form: ``argmax(p / E)`` with ``E ~ Exp(1)``.

A step with a random row samples the whole batch with one op, ``torch.ops.pdserve.sample_tokens``
(``kernels/sampler.py``: temperature, top-k, top-p, min-p and the draw in two Triton launches on
CUDA, one native call on the CPU), fed by one upload of every row's parameters; a step of greedy
rows only is one ``argmax``. Penalties are applied inside that op from per-request counts kept on
the device (``common/penalty_counts.py``). The grammar mask and the min-tokens ban run before it,
each only in a step with a row that asks for it.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import NamedTuple

import torch

import kernels.ops  # noqa: F401 - registers torch.ops.pdserve.sample_tokens
from common.penalty_counts import PenaltyCounts, SlotRow, fits
from common.sampling_params import SamplingParams
from kernels.sampler import exponential_noise, pack_columns, pack_params

__all__ = ["SampleRow", "Sampler", "SamplerOutput", "apply_token_bitmask", "exponential_noise"]


@dataclass
class SampleRow:
    """One row of logits to sample: a request's next token."""

    params: SamplingParams
    seed: int
    position: int  # index of the token in the request's output (0 = first generated token)
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_id: int | None
    # the request's id: its penalty counts stay on the device between steps (None: rebuilt)
    request_id: str | None = None


# Fields of every row read at C speed (``map``): the checks below run over each row, each step.
_position = operator.attrgetter("position")
_min_tokens = operator.attrgetter("params.min_tokens")
_greedy = operator.attrgetter("params.greedy")
_logprobs_wanted = operator.attrgetter("params.logprobs")
# RowParams' first six fields: temperature, top_k, top_p, min_p, seed, position
_sample_fields = operator.attrgetter(
    "params.temperature", "params.top_k", "params.top_p", "params.min_p", "seed", "position"
)


class SamplerOutput(NamedTuple):
    token_ids: torch.Tensor  # (B,) int64
    logprobs: torch.Tensor | None  # (B,) fp32 logprob of the chosen token
    top_ids: torch.Tensor | None  # (B, K) int64, best first
    top_logprobs: torch.Tensor | None  # (B, K) fp32


class Sampler:
    """``sample(logits (B, V) fp32, rows) -> SamplerOutput``. Never modifies ``logits``.

    Nothing here waits for the device: per-row parameters travel as host lists and reach the
    device through pinned, non-blocking copies (``to_device``), and every choice that depends on
    them (which rows are random, whether any row has min-p) is made from the host lists.
    Owns the penalty counts of the requests it samples (``common/penalty_counts.py``).
    """

    def __init__(self) -> None:
        self._penalties: PenaltyCounts | None = None  # made at the first step with penalties

    def sample(
        self, logits: torch.Tensor, rows: list[SampleRow], bitmask: object | None = None
    ) -> SamplerOutput:
        """``bitmask``: the step's grammar bitmask (see :func:`apply_token_bitmask`) or None."""
        raw = logits
        if bitmask is not None:
            assert isinstance(bitmask, torch.Tensor)
            logits = apply_token_bitmask(logits, bitmask)
        logits = _mask_min_tokens(logits, rows)
        penalised = [r for r in rows if r.params.needs_penalties]
        if penalised and not fits(penalised):  # a count would overflow its 15 bits
            logits, penalised = _apply_penalties(logits, rows), []
        if not penalised and all(map(_greedy, rows)):
            token_ids = logits.argmax(dim=-1)
        else:
            slots = self._slots(rows, logits) if penalised else [None] * len(rows)
            counts = self._counts(logits)
            params = _params(rows, slots, logits.device)
            token_ids = torch.ops.pdserve.sample_tokens(logits, params, counts)
        return _logprobs(raw, token_ids, rows)

    def _slots(self, rows: list[SampleRow], logits: torch.Tensor) -> list[SlotRow | None]:
        if self._penalties is None:
            self._penalties = PenaltyCounts(logits.shape[1], logits.device, to_device)
        return self._penalties.assign([r if r.params.needs_penalties else None for r in rows])

    def _counts(self, logits: torch.Tensor) -> torch.Tensor:
        if self._penalties is None:  # no request had penalties yet: no slot to read
            return logits.new_empty((0, logits.shape[1]), dtype=torch.int16)
        return self._penalties.counts


def _params(rows: list[SampleRow], slots: list[SlotRow | None], device) -> torch.Tensor:
    """Every row's sampling parameters, ``(B, PARAM_WORDS)`` int32, in one upload: read a
    column at a time (``map``) and packed by numpy, as a step samples hundreds of rows."""
    if not rows:
        return to_device(pack_params([]), torch.int32, device)
    columns = list(zip(*map(_sample_fields, rows), strict=True))
    if any(slot is not None for slot in slots):
        columns += zip(*map(_penalty_fields, rows, slots), strict=True)
    return to_device(pack_columns(*columns), torch.int32, device)


def _penalty_fields(r: SampleRow, slot: SlotRow | None) -> tuple:
    """(slot, repetition, frequency, presence, new tokens) of :class:`RowParams`."""
    if slot is None:
        return -1, 1.0, 0.0, 0.0, ()
    p = r.params
    return slot.slot, p.repetition_penalty, p.frequency_penalty, p.presence_penalty, slot.new_tokens


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host values as a tensor on ``device`` without a host sync (pinned, non-blocking copy).

    The pinned block is recycled by torch's caching host allocator only after the copy ran."""
    host = torch.as_tensor(values, dtype=dtype)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Grammar masks for the whole batch in one ``masked_fill`` (on a copy).

    ``bitmask``: (B, ceil(V/32)) int32 on the host, bit ``v % 32`` of word ``v // 32`` set when
    token ``v`` is allowed (xgrammar's layout; a row of all ones leaves its logits alone)."""
    B, V = logits.shape
    words = to_device(bitmask, torch.int32, logits.device)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words[:, :, None] >> shifts) & 1).bool().view(B, -1)[:, :V]
    return logits.masked_fill(~allowed, float("-inf"))


def _mask_min_tokens(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Below ``min_tokens``, EOS and the stop token ids cannot be drawn (on a copy)."""
    if not any(map(operator.lt, map(_position, rows), map(_min_tokens, rows))):
        return logits  # the common step: every row is past its min_tokens
    hit_rows: list[int] = []
    hit_ids: list[int] = []
    for i, r in enumerate(rows):
        if r.position < r.params.min_tokens:
            banned = list(r.params.stop_token_ids)
            if r.eos_token_id is not None and not r.params.ignore_eos:
                banned.append(r.eos_token_id)
            hit_rows += [i] * len(banned)
            hit_ids += banned
    if not hit_rows:
        return logits
    logits = logits.clone()
    flat = [row * logits.shape[1] + t for row, t in zip(hit_rows, hit_ids)]
    logits.view(-1).index_fill_(0, to_device(flat, torch.int64, logits.device), float("-inf"))
    return logits


def _apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Repetition (prompt + output, HF/vLLM semantics), presence and frequency (output only),
    from the rows' whole token lists: the path of a request whose counts outgrow a slot."""
    B, V = logits.shape
    dev = logits.device
    out_rows = [i for i, r in enumerate(rows) for _ in r.output_token_ids]
    out_ids = [t for r in rows for t in r.output_token_ids]
    counts = torch.zeros(B * V, device=dev)
    if out_ids:
        flat = to_device(out_rows, torch.int64, dev) * V + to_device(out_ids, torch.int64, dev)
        counts.index_add_(0, flat, torch.ones(len(out_ids), device=dev))
    counts = counts.view(B, V)
    seen = counts > 0
    prompt = [i * V + t for i, r in enumerate(rows) for t in r.prompt_token_ids]
    if prompt:
        seen.view(-1).index_fill_(0, to_device(prompt, torch.int64, dev), True)
    rep = _column([r.params.repetition_penalty for r in rows], dev)
    pres = _column([r.params.presence_penalty for r in rows], dev)
    freq = _column([r.params.frequency_penalty for r in rows], dev)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    return logits - freq * counts - pres * (counts > 0).float()


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return to_device(values, torch.float32, device)[:, None]


def _logprobs(raw: torch.Tensor, token_ids: torch.Tensor, rows: list[SampleRow]) -> SamplerOutput:
    """Logprobs of the model's own distribution (before penalties and temperature)."""
    wanted = [k for k in map(_logprobs_wanted, rows) if k is not None]
    if not wanted:
        return SamplerOutput(token_ids, None, None, None)
    logprobs = torch.log_softmax(raw, dim=-1)
    chosen = logprobs.gather(-1, token_ids[:, None]).squeeze(-1)
    k = max(wanted)
    if k == 0:
        return SamplerOutput(token_ids, chosen, None, None)
    top_lp, top_ids = logprobs.topk(k, dim=-1)
    return SamplerOutput(token_ids, chosen, top_ids, top_lp)
