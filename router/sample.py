"""One sample's output at the router: tokens in, text deltas and finish state out.

``SampleState`` is the single place where tokens become client output. It feeds tokens to the
shared ``TextStream`` (incremental detokenization + stop strings) one at a time, so a stop
string is found at the very token that completes it, exactly as the offline ``LLM`` (one token
per step) finds it; tokens after that one are dropped. ``token_ids`` is therefore precisely
what the client has been sent: a migrated decode resumes from it with no duplicate and no gap.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto.convert import logprobs_from_proto, sampling_params_to_proto

from common.output_processor import TextStream
from common.request import TokenLogprobs
from common.sampling_params import SamplingParams, child_seed

# Node finishes that end the sample; "abort" and "error" leave it to be resumed elsewhere.
_FINISHING = ("stop", "length")


@dataclass(frozen=True)
class SampleDelta:
    """New output of sample ``index``: tokens, their text, and the finish when it is the last.

    ``stop_reason`` is the stop string or stop token id that ended the sample (None for EOS
    or length), as in vLLM. ``prompt_logprobs`` come with the sample's first delta.
    """

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # the first delta of a sample whose request asked for them: one entry per prompt token,
    # None for the first (nothing precedes it)
    prompt_logprobs: list[TokenLogprobs | None] | None = None


def sample_seed(seed: int, index: int) -> int:
    """Seed of sample ``index``: the request's seed for 0, the engine's child seed after.

    Matching the engine's derivation makes a disaggregated ``n > 1`` request sample exactly
    what the offline ``LLM`` samples for the same seed.
    """
    return seed if index == 0 else child_seed(seed, index)


def to_proto_sampling(params: SamplingParams, seed: int) -> pb.SamplingParams:
    """The node-level sampling parameters of one sample (stop strings and n stay here)."""
    return sampling_params_to_proto(dataclasses.replace(params, seed=seed, n=1))


class SampleState:
    """Output so far of one sample; ``push`` turns node output into a client delta."""

    def __init__(
        self, index: int, tokenizer: object, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        self.index = index
        self.stream = TextStream(tokenizer, prompt_token_ids, params)
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def push(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[pb.TokenLogprob] = (),
        finish_reason: str | None = None,
        stop_token_id: int | None = None,
    ) -> SampleDelta:
        """Accept node output (``finish_reason`` as ``pdserve_proto.convert`` names it). A
        node's "abort" or "error" leaves the sample unfinished (the caller resumes it
        elsewhere); "stop" and "length" finish it."""
        if self.finished:
            return SampleDelta(self.index, [], "")
        finishing = finish_reason in _FINISHING
        accepted: list[int] = []
        text = ""
        for position, token in enumerate(token_ids):
            last = position == len(token_ids) - 1
            text += self.stream.add([int(token)], final=finishing and last)
            accepted.append(int(token))
            if self.stream.stopped is not None:
                self.finish_reason, self.stop_reason = "stop", self.stream.stopped
                break
        if not self.finished and finishing:
            if not token_ids:
                text += self.stream.add([], final=True)
            self.finish_reason = finish_reason
            self.stop_reason = stop_token_id
        self.token_ids += accepted
        kept = logprobs_from_proto(logprobs[: len(accepted)]) if logprobs else []
        return SampleDelta(self.index, accepted, text, kept, self.finish_reason, self.stop_reason)
