"""Prompt logprobs (vLLM's ``prompt_logprobs``): the logprob of every prompt token given the
tokens before it, plus its top k, computed in the prefill forward pass.

NOTE: how they are found. The hidden state at prompt position ``p`` predicts token ``p + 1``, so
a prefill chunk covering positions ``[start, start + n)`` scores prompt tokens ``start + 1 …``
up to the last prompt token (the last position's logits give the first output token instead).
The rows of every request asking for them are gathered from the step's hidden states into one
batch: one ``lm_head``, one ``log_softmax``, one ``gather`` for the prompt tokens and one
``topk``, then one copy to the host. Chunked prefill simply scores each chunk as it runs; the
scheduler (``Request.prompt_logprobs``) places each chunk's scores at their positions.
Positions read from the prefix cache were never computed here: a request asking for prompt
logprobs therefore skips the prefix cache (``KVCacheManager.find_computed_blocks``), as vLLM
does, and is not loaded through the KV connector.

Shapes: ``hidden`` (T, hidden_size) for the step's T tokens; logits rows (R, vocab) fp32.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import NamedTuple

import torch

from common.request import TokenLogprobs
from common.step_outputs import ScheduledRequest


class PromptLogprobsChunk(NamedTuple):
    """Scores of prompt tokens ``first_token, first_token + 1, …`` of one request (one step)."""

    first_token: int
    items: list[TokenLogprobs]


class _Span(NamedTuple):
    request_id: str
    row: int  # first hidden row of the span in the step's flat batch
    first_token: int  # the prompt token that row scores (its position + 1)
    targets: list[int]  # the prompt tokens the span's rows score, in order
    k: int  # top alternatives wanted


_prompt_logprobs = operator.attrgetter("request.sampling_params.prompt_logprobs")


def prompt_spans(scheduled: list[ScheduledRequest]) -> list[_Span]:
    """The hidden rows that score prompt tokens, per request asking for prompt logprobs."""
    asked = list(map(_prompt_logprobs, scheduled))  # at C speed: most steps, nobody asks
    if asked.count(None) == len(asked):
        return []
    spans: list[_Span] = []
    row = 0
    for s in scheduled:
        r, start = s.request, s.num_computed_tokens
        k = r.sampling_params.prompt_logprobs
        end = min(start + s.num_new_tokens, r.num_prompt_tokens - 1)
        if k is not None and end > start:
            targets = r.prompt_token_ids[start + 1 : end + 1]
            spans.append(_Span(r.request_id, row, start + 1, targets, k))
        row += s.num_new_tokens  # drafts included
    return spans


def prompt_rows(scheduled: list[ScheduledRequest]) -> list[int]:
    """The hidden rows scored for prompt logprobs this step, in the order they are scored (a
    tensor-parallel worker runs the LM head on the same rows: ``common/parallel/executor.py``)."""
    return _rows(prompt_spans(scheduled))


def _rows(spans: list[_Span]) -> list[int]:
    return [s.row + j for s in spans for j in range(len(s.targets))]


def compute_prompt_logprobs(
    hidden: torch.Tensor,
    scheduled: list[ScheduledRequest],
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
) -> dict[str, PromptLogprobsChunk]:
    """Request id → the prompt tokens this step scores (empty when none asks). Waits for the
    device once (the results come to the host) when some request asks."""
    spans = prompt_spans(scheduled)
    if not spans:
        return {}
    rows = _rows(spans)
    flat = [t for s in spans for t in s.targets]
    device = hidden.device
    targets = torch.tensor(flat, device=device)
    picked = hidden.index_select(0, torch.tensor(rows, device=device))
    logprobs = torch.log_softmax(compute_logits(picked).float(), dim=-1)  # (R, vocab)
    chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1)  # (R,)
    top_lps, top_ids = logprobs.topk(max(s.k for s in spans), dim=-1)  # (R, K)
    chosen_l, ids_l, lps_l = chosen.tolist(), top_ids.tolist(), top_lps.tolist()  # the sync
    out: dict[str, PromptLogprobsChunk] = {}
    i = 0
    for s in spans:
        items = [
            TokenLogprobs(t, chosen_l[i + j], ids_l[i + j][: s.k], lps_l[i + j][: s.k])
            for j, t in enumerate(s.targets)
        ]
        out[s.request_id] = PromptLogprobsChunk(s.first_token, items)
        i += len(s.targets)
    return out
