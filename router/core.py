"""What both front doors share: the served model, request preparation, admission, measuring.

``RouterCore.prepare`` turns a prompt (text, token ids or rendered chat) and engine
SamplingParams into a ``GenerateSpec``: token ids checked against the vocabulary, floats rounded
as the wire rounds them, ``max_tokens`` resolved against the nodes' context (their
``max_model_len``, from the registry), and a seed always set (random when the client gave none)
so a decode resumed on another instance continues identically. ``RouterCore.run`` admits the request
(``max_inflight``, else 429), runs the flow and meters it.

NOTE (the event loop never blocks). Heartbeats, every stream and every other request share the
router's one event loop, so a request's CPU-heavy part (parsing a large JSON body, the chat
template, tokenizing) runs on a bounded thread pool (``RouterCore.offload``; the tokenizer
releases the GIL while it works). Before tokenizing, a text that cannot fit is refused by its
length alone (``check_text``): a token covers at most the longest piece of the vocabulary, so
``len(text) / longest`` tokens is a lower bound. A 3.9 MB prompt once held the loop for 20 s and
the router dropped every node for silence.
"""

from __future__ import annotations

import asyncio
import functools
import random
import uuid
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import ParamSpec, TypeVar

from pdserve_proto.convert import wire_rounded

from common.beam_search import BeamSearchParams
from common.sampling_params import SamplingParams
from router.errors import RouterError, invalid_request, no_instance, overloaded
from router.flow import GenerateSpec, RequestFlow, Usage
from router.limits import Limits, check_beam_width, check_params, check_prompt_length
from router.metrics import RouterMetrics
from router.openai_models import param_of
from router.prompts import PromptProcessor
from router.sample import SampleDelta

_SEED_BITS = 63
_CPU_WORKERS = 4  # threads for request parsing and tokenizing (bounded: the rest queue)
P = ParamSpec("P")
T = TypeVar("T")


@dataclass(frozen=True)
class ServedModel:
    """The model the router serves: the public name and the names it also answers to."""

    name: str
    aliases: frozenset[str] = frozenset()
    created: int = 0

    def matches(self, requested: str | None) -> bool:
        return not requested or requested == self.name or requested in self.aliases


class RouterCore:
    """Shared request machinery; one per router process."""

    def __init__(
        self,
        served: ServedModel,
        prompts: PromptProcessor,
        flow: RequestFlow,
        metrics: RouterMetrics,
        limits: Limits,
        max_inflight: int,
    ) -> None:
        self.served = served
        self.prompts = prompts
        self.flow = flow
        self.metrics = metrics
        self.limits = limits
        self.max_inflight = max_inflight
        self.inflight = 0
        self._seeds = random.SystemRandom()
        self._cpu = ThreadPoolExecutor(_CPU_WORKERS, thread_name_prefix="router-cpu")
        vocab = prompts.tokenizer.get_vocab()
        self._longest_piece = max((len(piece) for piece in vocab), default=1) or 1

    async def offload(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """``fn(*args, **kwargs)`` on the router's bounded CPU pool, off the event loop."""
        call = functools.partial(fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._cpu, call)

    def check_text(self, text: str) -> None:
        """400 when ``text`` cannot fit whatever its tokens (see the module NOTE); cheap, so
        it runs on the loop before the text is tokenized off it."""
        limit = self.limits.max_prompt_tokens or self.max_model_len()
        at_least = len(text) // self._longest_piece
        if at_least > limit:
            raise invalid_request(
                f"the prompt's {len(text)} characters are at least {at_least} tokens, over the"
                f" limit of {limit}",
                param="prompt",
                code="context_length_exceeded",
            )

    def check_model(self, requested: str | None) -> str:
        """The LoRA adapter ``requested`` names ("": the served model, also for an empty name);
        404 unless it names the served model or an adapter some node serves."""
        if self.served.matches(requested):
            return ""
        adapters = self.flow.registry.lora_adapters()
        if requested and requested in adapters:
            return requested
        also = f" and the LoRA adapters {sorted(adapters)}" if adapters else ""
        raise RouterError(
            f"the model {requested!r} does not exist; this router serves"
            f" {self.served.name!r}{also}",
            status=404,
            param="model",
            code="model_not_found",
        )

    def max_model_len(self) -> int:
        """The context requests must fit: the nodes' (``Registry.max_model_len``). 503 while
        no node has registered: until one says, the router cannot know it."""
        limit = self.flow.registry.max_model_len()
        if limit is None:
            raise no_instance("no node has registered yet, so the context length is unknown")
        return limit

    def prepare(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        request_id: str | None = None,
        beam: tuple[int, float] | None = None,
        lora_name: str = "",
    ) -> GenerateSpec:
        """A runnable spec; raises RouterError (400) when the prompt cannot be served, 503
        while no node has registered.

        ``params.max_tokens`` None means "up to the context"; ``params`` is not modified. The
        spec's float parameters are rounded as the wire rounds them (``wire_rounded``).
        """
        check_params(params, self.limits)  # the one table: gRPC's requests meet it here
        if beam is not None:
            check_beam_width(beam[0], self.limits)
        check_prompt_length(len(prompt_token_ids), self.limits)
        self.prompts.check_token_ids(prompt_token_ids)
        self.prompts.check_token_ids(params.stop_token_ids, param="stop_token_ids")
        try:
            params = wire_rounded(params)  # hold exactly what the nodes will run
        except ValueError as exc:  # "temperature must be a finite number, got nan"
            raise invalid_request(str(exc), param=param_of(str(exc))) from None
        max_tokens = self.prompts.resolve_max_tokens(
            len(prompt_token_ids), params.max_tokens, self.max_model_len()
        )
        if params.min_tokens > max_tokens:
            raise invalid_request(
                f"min_tokens={params.min_tokens} exceeds max_tokens", "min_tokens"
            )
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(_SEED_BITS)
        search = None
        if beam is not None:  # (width, length_penalty): params.n of its hypotheses come back
            search = BeamSearchParams(beam[0], max_tokens, beam[1], params.ignore_eos)
        return GenerateSpec(
            request_id=request_id or f"cmpl-{uuid.uuid4().hex}",
            prompt_token_ids=prompt_token_ids,
            params=replace(params, max_tokens=max_tokens, seed=seed),
            priority=priority,
            beam=search,
            lora_name=lora_name,
        )

    async def run(
        self, spec: GenerateSpec, usage: Usage, endpoint: str
    ) -> AsyncGenerator[SampleDelta, None]:
        """The request's deltas; raises RouterError (429 when over ``max_inflight``).

        Closing the iterator early aborts the request upstream.
        """
        meter = self.metrics.start(endpoint)
        if self.inflight >= self.max_inflight:
            error = overloaded(f"the router has {self.inflight} requests in flight (its limit)")
            error.metered = True
            meter.finish(error.kind, len(spec.prompt_token_ids), 0)
            raise error
        self.inflight += 1
        status = "aborted"
        try:
            async with aclosing(self.flow.generate(spec, usage)) as deltas:
                async for delta in deltas:
                    meter.tokens(len(delta.token_ids))
                    yield delta
            status = "ok"
        except RouterError as exc:
            status, exc.metered = exc.kind, True
            raise
        except Exception:
            status = "internal_error"
            raise
        finally:
            self.inflight -= 1
            meter.finish(
                status,
                usage.prompt_tokens,
                usage.completion_tokens,
                usage.retries,
                usage.migrations,
            )
