"""Penalty counts kept on the device between steps: one slot per request, updated incrementally.

NOTE: a slot is a row of ``counts (slots, V) int16``: the sign bit set where the token is in the
request's prompt, the low 15 bits its count in the output. A slot is built once, when its request
first samples with penalties (zeroed, prompt marked, outputs counted: one upload, three ops); at
each later step the fused sampler is handed only the outputs not counted yet (the token sampled
last step, or the accepted drafts: up to ``NEW_TOKENS``) and adds them as pass 1 reads the slot
(``kernels/sampler.py``). No Python list of the prompt is walked after the first step.

A row with more new tokens than that, or with no request id (a speculative row after the first,
whose outputs end in drafts), is built again. Slots of requests absent from a step are reused,
least recently seen first, when the step needs more than are free; the tensor doubles when one
step needs more slots than it holds. A count saturates at 2**15 - 1: a request with that many
outputs is penalised by the sampler's eager path instead (:func:`fits`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch

from kernels.sampler import NEW_TOKENS

MAX_OUTPUTS = 2**15 - 1  # a count's 15 bits
_PROMPT_MARK = -(2**15)  # the sign bit of an int16


class PenaltyRow(Protocol):
    @property
    def request_id(self) -> str | None: ...

    @property
    def prompt_token_ids(self) -> list[int]: ...

    @property
    def output_token_ids(self) -> list[int]: ...


class SlotRow(NamedTuple):
    """A row's slot in ``counts`` and the outputs the sampler must add to it first."""

    slot: int
    new_tokens: tuple[int, ...]


class _Counted(NamedTuple):
    slot: int
    num_outputs: int  # how many of the request's outputs the slot has counted


Upload = Callable[[list[int], torch.dtype, torch.device], torch.Tensor]


def reserved_bytes(rows: int, vocab: int) -> int:
    """The most device memory the counts can take when a step samples ``rows`` rows with
    penalties: the slots tensor at its largest (doubled from 8 up to ``rows``) and, while it
    doubles the last time, the half it copies from. The GPU memory profile sets this aside
    before it sizes the KV cache (``common/memory_profile.py``), so the first penalised
    requests of a full engine cannot run it out of memory."""
    slots = 8
    while slots < rows:
        slots *= 2
    return (slots + slots // 2) * vocab * 2  # int16


def fits(rows: list[PenaltyRow]) -> bool:
    """Whether every row's output counts fit in a slot's 15 bits."""
    return all(len(r.output_token_ids) < MAX_OUTPUTS for r in rows)


class PenaltyCounts:
    """The slots of one sampler. ``assign`` is its only mutator; ``counts`` is also mutated by
    the fused sampler (new tokens), in stream order after ``assign``'s builds."""

    def __init__(self, vocab: int, device: torch.device, upload: Upload) -> None:
        self.vocab = vocab
        self.counts = torch.zeros(0, vocab, dtype=torch.int16, device=device)
        self._upload = upload
        self._owner: list[str | None] = []  # slot -> request id (None: free)
        self._last_step: list[int] = []  # slot -> the step that last used it
        self._counted: dict[str, _Counted] = {}
        self._step = 0
        self._one = torch.ones((), dtype=torch.int16, device=device)

    def assign(self, rows: list[PenaltyRow | None]) -> list[SlotRow | None]:
        """A slot for each row that has penalties (``None`` rows have none), its new outputs
        counted by the caller's kernel; slots it had to build are built here."""
        self._step += 1
        present = {r.request_id for r in rows if r is not None and r.request_id is not None}
        taken: set[int] = set()
        builds: list[tuple[int, PenaltyRow]] = []
        out: list[SlotRow | None] = []
        for r in rows:
            out.append(None if r is None else self._slot_row(r, present, taken, builds))
        self._build(builds)
        return out

    def _slot_row(
        self,
        r: PenaltyRow,
        present: set[str],
        taken: set[int],
        builds: list[tuple[int, PenaltyRow]],
    ) -> SlotRow:
        n = len(r.output_token_ids)
        known = self._counted.get(r.request_id) if r.request_id is not None else None
        if known is not None and 0 <= n - known.num_outputs <= NEW_TOKENS:
            slot, new = known.slot, tuple(r.output_token_ids[known.num_outputs :])
        else:  # built again in its own slot, or in a free one
            slot = known.slot if known is not None else self._free_slot(present, taken)
            new = ()
            builds.append((slot, r))
        taken.add(slot)
        self._last_step[slot] = self._step
        self._owner[slot] = r.request_id
        if r.request_id is not None:
            self._counted[r.request_id] = _Counted(slot, n)
        return SlotRow(slot, new)

    def _free_slot(self, present: set[str], taken: set[int]) -> int:
        """A free slot, else the least recently used one of a request absent from this step,
        else a new one (the tensor doubles)."""
        spare = [
            s
            for s, owner in enumerate(self._owner)
            if s not in taken and (owner is None or owner not in present)
        ]
        if not spare:
            return self._grow()
        slot = min(spare, key=lambda s: (self._owner[s] is not None, self._last_step[s]))
        owner = self._owner[slot]
        if owner is not None and self._counted.get(owner, _Counted(-1, 0)).slot == slot:
            del self._counted[owner]
        return slot

    def _grow(self) -> int:
        old = self.counts
        size = max(2 * old.shape[0], 8)
        self.counts = torch.zeros(size, self.vocab, dtype=torch.int16, device=old.device)
        self.counts[: old.shape[0]] = old
        first_new = old.shape[0]
        self._owner += [None] * (size - first_new)
        self._last_step += [0] * (size - first_new)
        return first_new

    def _build(self, builds: list[tuple[int, PenaltyRow]]) -> None:
        """Zero the slots, mark their prompts, count their outputs: one upload, three ops."""
        if not builds:
            return
        V = self.vocab
        slots = [slot for slot, _ in builds]
        prompt = [slot * V + t for slot, r in builds for t in r.prompt_token_ids]
        outputs = [slot * V + t for slot, r in builds for t in r.output_token_ids]
        words = self._upload(slots + prompt + outputs, torch.int64, self.counts.device)
        a, b = len(slots), len(slots) + len(prompt)
        flat = self.counts.view(-1)
        self.counts.index_fill_(0, words[:a], 0)
        flat.index_fill_(0, words[a:b], _PROMPT_MARK)
        flat.index_put_((words[b:],), self._one, accumulate=True)

    def check_integrity(self) -> None:
        """Every counted request owns its slot; slot lists have the tensor's length."""
        assert len(self._owner) == len(self._last_step) == self.counts.shape[0]
        for request_id, counted in self._counted.items():
            assert self._owner[counted.slot] == request_id, (request_id, counted)
