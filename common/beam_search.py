"""Beam search as HF transformers scores it, over an engine that only ever runs one-token requests.

NOTE on the approach (vLLM's ``LLM.beam_search``): the engine knows nothing of beams. Each round,
every live beam of every prompt becomes one engine request, ``prompt + beam tokens``, with
``max_tokens=1`` and the top-K logprobs of its next position; this module turns those logprobs
into the next round's beams. The beams' shared blocks are the prefix cache's: a beam's request
hits every full block its parent's request computed in the round before (the parent's tokens
are the child's prefix), so a round computes at most ``block_size`` tokens per beam (the last,
partial block and the new token; exactly one at ``block_size=1``), whatever the length. A beam
that drops out holds nothing: its request ended with its round, and its blocks are free,
evictable cache blocks that the next round's beams may still hit.

```
round t    beam a: [p p p p][p p a1 a2]  ── top-K logprobs ──┐
           beam b: [p p p p][p p b1 b2]                       ├─▶ search: beams a', a'', b'
round t+1  beam a': [p p p p][p p a1 a2][a3]  (hits 1 block, computes 3 tokens)
           beam a'':[p p p p][p p a1 a2][a3']  (the same hit; beam b dropped out)
```

The search follows ``GenerationMixin._beam_search`` of transformers (``early_stopping=False``):
scores are float32 sums of logprobs (HF's rounding), the top ``K = max(2, 1 + #eos) * width``
candidates over all beams are kept, a candidate that ends (an EOS id, or ``max_tokens``) is a
hypothesis only when it ranks in the top ``width``, scored ``sum / generated_len **
length_penalty``, and the search stops when no running beam can beat the worst of ``width``
hypotheses. Width 1 is greedy search, as ``generate(num_beams=1)`` is: the best token each
step, ending at the first EOS. Ties rank the lower (beam, token id) first.

Nothing here touches tensors or the engine: ``LLM.beam_search`` runs the rounds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

f32 = np.float32


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's ``BeamSearchParams`` (greedy beams: no temperature). ``length_penalty`` is HF's
    exponent of the generated length that a finished hypothesis's log-probability sum is
    divided by (> 0 favours longer outputs). ``ignore_eos``: EOS ids do not end a beam."""

    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be >= 1, got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


@dataclass
class BeamSearchSequence:
    """One finished hypothesis. ``tokens`` holds the prompt and the output (vLLM's); ``text`` is
    the output's. ``score`` is what hypotheses are ranked by (``cum_logprob`` over the generated
    length to the ``length_penalty``), as HF's ``sequences_scores``."""

    tokens: list[int]
    num_prompt_tokens: int
    logprobs: list[float]  # of each output token
    cum_logprob: float
    score: float
    finish_reason: str  # "stop" (an EOS id, kept as the last token) or "length"
    text: str = ""

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens :]


@dataclass
class BeamSearchOutput:
    """A prompt's hypotheses, best first (``beam_width`` of them)."""

    prompt_token_ids: list[int]
    sequences: list[BeamSearchSequence] = field(default_factory=list)


class TopLogprobs(NamedTuple):
    """A beam's next-token candidates: token ids and their logprobs, best first."""

    token_ids: list[int]
    logprobs: list[float]


class _Beam(NamedTuple):
    output: tuple[int, ...]
    logprobs: tuple[float, ...]
    score: np.float32  # float32 sum of ``logprobs``, added in HF's order


class _Candidate(NamedTuple):
    score: np.float32
    beam: int  # index into the running beams
    token_id: int
    logprob: float


class _Hypothesis(NamedTuple):
    beam: _Beam
    score: np.float32  # length-penalised
    finish_reason: str


def length_penalised(score: np.float32, length: int, length_penalty: float) -> np.float32:
    """HF's hypothesis score: the float32 sum divided by the Python float ``length **
    length_penalty``, which torch casts to float32 before it divides."""
    return f32(score / f32(float(length) ** length_penalty))


class BeamSearch:
    """One prompt's search. Each round: ``beams()`` are the token ids to score, ``advance``
    takes their top ``num_logprobs`` candidates; once ``done``, ``sequences()``."""

    def __init__(
        self, prompt: list[int], params: BeamSearchParams, eos_token_ids: list[int], max_tokens: int
    ) -> None:
        """``max_tokens``: the params' bound after the context limit (it may be smaller)."""
        self.prompt = prompt
        self.width = params.beam_width
        self.length_penalty = params.length_penalty
        self.eos = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        self.max_tokens = max_tokens
        # width 1 is greedy: the best token only, and its end is the search's end
        self.num_logprobs = 1 if self.width == 1 else max(2, 1 + len(self.eos)) * self.width
        self.running: list[_Beam] = [_Beam((), (), f32(0.0))]
        self.finished: list[_Hypothesis] = []  # best first, at most ``width``
        self.num_generated = 0
        self.done = False

    def beams(self) -> list[list[int]]:
        """Each running beam's whole sequence (prompt + output), in running order."""
        return [self.prompt + list(beam.output) for beam in self.running]

    def advance(self, tops: list[TopLogprobs]) -> None:
        """One step: ``tops[i]`` are running beam ``i``'s candidates (at least
        ``num_logprobs``, best first). Updates the running beams, the hypotheses and ``done``."""
        assert not self.done and len(tops) == len(self.running)
        candidates = self._top_candidates(tops)
        length = self.num_generated + 1
        ends = [self._ends(c.token_id, length) for c in candidates]
        top = zip(candidates[: self.width], ends[: self.width])
        self._add_hypotheses([c for c, end in top if end], length)
        self.running = [self._extend(c) for c, end in zip(candidates, ends) if not end]
        self.running = self.running[: self.width]
        self.num_generated = length
        self.done = all(ends) or not self._can_improve()

    def sequences(self) -> list[BeamSearchSequence]:
        """The hypotheses, best first (``text`` left empty: the caller holds the tokenizer)."""
        return [
            BeamSearchSequence(
                tokens=self.prompt + list(h.beam.output),
                num_prompt_tokens=len(self.prompt),
                logprobs=list(h.beam.logprobs),
                cum_logprob=float(h.beam.score),
                score=float(h.score),
                finish_reason=h.finish_reason,
            )
            for h in self.finished
        ]

    def _top_candidates(self, tops: list[TopLogprobs]) -> list[_Candidate]:
        """HF's top-K over the flattened (beam, vocabulary) scores."""
        candidates = [
            _Candidate(f32(beam.score + f32(lp)), i, int(token_id), float(lp))
            for i, (beam, top) in enumerate(zip(self.running, tops))
            for token_id, lp in zip(top.token_ids[: self.num_logprobs], top.logprobs)
        ]
        candidates.sort(key=lambda c: (-c.score, c.beam, c.token_id))
        return candidates[: self.num_logprobs]

    def _ends(self, token_id: int, length: int) -> bool:
        return token_id in self.eos or length >= self.max_tokens

    def _extend(self, c: _Candidate) -> _Beam:
        beam = self.running[c.beam]
        return _Beam((*beam.output, c.token_id), (*beam.logprobs, c.logprob), c.score)

    def _add_hypotheses(self, ended: list[_Candidate], length: int) -> None:
        new = [
            _Hypothesis(
                self._extend(c),
                length_penalised(c.score, length, self.length_penalty),
                "stop" if c.token_id in self.eos else "length",
            )
            for c in ended
        ]
        merged = sorted(self.finished + new, key=lambda h: -h.score)  # stable: older first
        self.finished = merged[: self.width]

    def _can_improve(self) -> bool:
        """HF's stopping heuristic (``early_stopping=False``): the best running beam, scored at
        the current length, still beats the worst of ``width`` hypotheses."""
        if not self.running:
            return False
        if len(self.finished) < self.width:
            return True
        best = length_penalised(self.running[0].score, self.num_generated, self.length_penalty)
        return bool(best > self.finished[-1].score)
