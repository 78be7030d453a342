"""Batched sampling: one tensor pass for the whole batch, whatever each row asks for.

Randomness is counter-based: the noise for vocabulary entry ``v`` of output position ``i`` of a
request with seed ``s`` is ``hash(s, i, v)``, computed with integer ops on tensors. A row's draw
therefore depends only on its own (seed, position) — never on batch composition, step, process or
machine — which makes colocated, disaggregated and migrated runs sample identical tokens.
Sampling is Gumbel-max in its exponential form: ``argmax(p / E)`` with ``E ~ Exp(1)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from common.sampling_params import SamplingParams

_M32 = 0xFFFFFFFF


@dataclass
class SampleRow:
    """One row of logits to sample: a request's next token."""

    params: SamplingParams
    seed: int
    position: int  # index of the token in the request's output (0 = first generated token)
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_id: int | None


class SamplerOutput(NamedTuple):
    token_ids: torch.Tensor  # (B,) int64
    logprobs: torch.Tensor | None  # (B,) fp32 logprob of the chosen token
    top_ids: torch.Tensor | None  # (B, K) int64, best first
    top_logprobs: torch.Tensor | None  # (B, K) fp32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser on int64 tensors holding values in [0, 2**32)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32  # int64 products wrap mod 2**64; the low 32 bits stay exact
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def exponential_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """``Exp(1)`` noise ``(B, vocab)`` that is a pure function of (seed, position, token id)."""
    lo, hi = seeds & _M32, (seeds >> 32) & _M32
    key = _fmix32(lo ^ _fmix32(hi ^ _fmix32((positions * 0x9E3779B1 + 0x7F4A7C15) & _M32)))
    idx = _fmix32((torch.arange(vocab, device=seeds.device) * 0x27D4EB2F + 0x165667B1) & _M32)
    bits = _fmix32(key[:, None] ^ idx[None, :])
    uniform = ((bits >> 8).float() + 0.5) * (1.0 / (1 << 24))  # in (0, 1), never 0 or 1
    return -torch.log(uniform)


class Sampler:
    """``sample(logits (B, V) fp32, rows) -> SamplerOutput``. Never modifies ``logits``.

    Nothing here waits for the device: per-row parameters travel as host lists and reach the
    device through pinned, non-blocking copies (``to_device``), and every choice that depends on
    them (which rows are random, whether any row has min-p) is made from the host lists.
    """

    def sample(
        self, logits: torch.Tensor, rows: list[SampleRow], bitmask: object | None = None
    ) -> SamplerOutput:
        """``bitmask``: the step's grammar bitmask (see :func:`apply_token_bitmask`) or None."""
        raw = logits
        if bitmask is not None:
            assert isinstance(bitmask, torch.Tensor)
            logits = apply_token_bitmask(logits, bitmask)
        logits = _mask_min_tokens(logits, rows)
        if any(r.params.needs_penalties for r in rows):
            logits = _apply_penalties(logits, rows)
        token_ids = logits.argmax(dim=-1)
        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        if random_rows:
            picked = [rows[i] for i in random_rows]
            if len(random_rows) == len(rows):
                token_ids = _sample_random(logits, picked)
            else:
                idx = to_device(random_rows, torch.int64, logits.device)
                token_ids[idx] = _sample_random(logits.index_select(0, idx), picked)
        return _logprobs(raw, token_ids, rows)


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
    """Repetition (prompt + output, HF/vLLM semantics), presence and frequency (output only)."""
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


def _sample_random(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    dev = logits.device
    temp = _column([r.params.temperature for r in rows], dev)
    probs = torch.softmax(_top_k_top_p(logits / temp, rows), dim=-1)
    min_ps = [r.params.min_p for r in rows]
    if any(p > 0 for p in min_ps):
        min_p = _column(min_ps, dev)
        probs = torch.where(probs < min_p * probs.amax(-1, keepdim=True), 0.0, probs)
    seeds = to_device([r.seed for r in rows], torch.int64, dev)
    positions = to_device([r.position for r in rows], torch.int64, dev)
    noise = exponential_noise(seeds, positions, logits.shape[-1])
    return (probs / noise).argmax(dim=-1)


def _top_k_top_p(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    V = logits.shape[-1]
    top_k = [r.params.top_k if r.params.top_k > 0 else V for r in rows]
    top_p = [r.params.top_p for r in rows]
    if all(k >= V for k in top_k) and all(p >= 1.0 for p in top_p):
        return logits
    dev = logits.device
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(V, device=dev)[None, :]
    drop = rank >= to_device(top_k, torch.int64, dev)[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly ahead of each token
    drop |= before >= _column(top_p, dev)
    drop[:, 0] = False  # the best token always survives
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _logprobs(raw: torch.Tensor, token_ids: torch.Tensor, rows: list[SampleRow]) -> SamplerOutput:
    """Logprobs of the model's own distribution (before penalties and temperature)."""
    wanted = [r.params.logprobs for r in rows if r.params.logprobs is not None]
    if not wanted:
        return SamplerOutput(token_ids, None, None, None)
    logprobs = torch.log_softmax(raw, dim=-1)
    chosen = logprobs.gather(-1, token_ids[:, None]).squeeze(-1)
    k = max(wanted)
    if k == 0:
        return SamplerOutput(token_ids, chosen, None, None)
    top_lp, top_ids = logprobs.topk(k, dim=-1)
    return SamplerOutput(token_ids, chosen, top_ids, top_lp)
