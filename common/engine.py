"""The engine core: validate and admit requests, then ``step()`` = schedule → execute → update.

One ``EngineCore`` runs in one process (the offline ``LLM``, or a node's engine-core process).
It works in token ids only; text belongs to the caller (``LLM``'s output processor, the router).

NOTE: the overlapped loop (``async_scheduling``, on by default on CUDA). The host schedules and
prepares step N+1 and launches it while the device still runs step N, and only then waits for
step N's tokens and turns them into outputs:

```
host    | sched N+1 | prep+launch N+1 | wait N, update N | sched N+2 | prep+launch N+2 | wait N+1 …
device  | ········ step N ········ | ·········· step N+1 ·········· | ········ step N+2 …
```

So the host's work hides behind the device's instead of adding to it. ``step()`` then returns the
outputs of the previous step. Tokens are those of the serial loop (see the scheduler's NOTE for
what is scheduled ahead and what waits).
"""

from __future__ import annotations

import logging
import random
import threading
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError

from common.config import EngineConfig
from common.host_kv_tier import HostTierIndex
from common.kv_cache_manager import KVCacheManager, cdiv
from common.kv_interface import KVHandle
from common.lora.adapter import LoraRef
from common.memory_profile import KVReserve
from common.model_runner import ModelRunner, StepResult
from common.models.loader import read_hf_config
from common.models.preflight import eos_token_ids, max_model_len
from common.models.tiny import resolve_model_path
from common.request import Request, RequestStatus
from common.sampling_params import SamplingParams
from common.scheduler import Scheduler
from common.spec_decode.proposer import make_proposer
from common.step_faults import EngineFailure, StepFaults
from common.step_outputs import EngineCoreOutput, EngineStats, SchedulerOutput
from common.structured_prepare import PreparedStructuredOutputs

IDLE_WAIT_S = 0.001  # longest wait of a step that found nothing to run

if TYPE_CHECKING:
    from common.kv_connector import ConnectorFactory
    from common.structured_output import StructuredOutputs

logger = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """The waiting queue is over its bound (``SchedulerConfig.max_waiting``)."""


class EngineCore:
    """One engine. ``connector_factory`` builds its KV connector when ``config.kv_store`` is set
    (the engine is handed it; it does not know the store implementations)."""

    def __init__(
        self, config: EngineConfig, connector_factory: ConnectorFactory | None = None
    ) -> None:
        self.config = config
        self.model_dir = resolve_model_path(config.model.model)
        self.hf_config = read_hf_config(self.model_dir)
        self.max_model_len = self._max_model_len()
        if config.cpu_threads is not None:
            torch.set_num_threads(config.cpu_threads)  # process-wide: one engine per process
        self.runner = self._make_runner()
        self.block_size = config.cache.block_size
        try:
            self._check_cache_fits()
        except ValueError:
            self.runner.close()  # tensor-parallel workers must not outlive a refused start
            raise
        host = self.runner.host_tier
        self.kv_cache_manager = KVCacheManager(
            self.runner.num_blocks,
            self.block_size,
            config.cache.enable_prefix_caching,
            HostTierIndex(host.num_slots) if host is not None else None,
        )
        # set from the connector's threads when a lookup answers or a load part arrives: a
        # step with nothing to run waits for it (``_step``) instead of spinning a core
        self._wakeup = threading.Event()
        self.connector = self._make_connector(connector_factory)
        self.scheduler = Scheduler(
            config.scheduler,
            self.kv_cache_manager,
            self.max_model_len,
            self.connector[0] if self.connector else None,
            max_loras=config.lora.max_loras if config.lora.enable_lora else None,
        )
        self.vocab_size = self.runner.vocab_size
        self.eos_token_ids = eos_token_ids(self.model_dir, self.hf_config)
        self._seeds = random.Random(config.model.seed)
        overlap = config.async_scheduling
        self.async_scheduling = self.runner.device.type == "cuda" if overlap is None else overlap
        self.proposer = make_proposer(
            config.speculative_config, config, self.max_model_len, self.runner.num_blocks
        )
        if self.proposer is not None:
            check_vocab = getattr(self.proposer, "check_vocab", None)
            if check_vocab is not None:
                check_vocab(self.vocab_size)
            # proposals need each step's tokens on the host before the next step is scheduled
            self.async_scheduling = False
        self._in_flight: tuple[SchedulerOutput, StepResult | None] | None = None
        self._structured: PreparedStructuredOutputs | None = None  # at the first grammar
        if config.prepare_structured_outputs:  # a node: ready before the first grammar comes
            self._structured_outputs().start()
        self._refused: list[tuple[str, str]] = []  # (request id, reason) after add_request
        self._faults = StepFaults()  # requests of failed steps (common/step_faults.py)
        self._failed: list[tuple[str, str]] = []  # (request id, reason): failed in a step
        self._scheduled: SchedulerOutput | None = None  # the step being run

    # -- set-up ------------------------------------------------------------------------------
    def _make_runner(self) -> ModelRunner:
        """One device, or rank 0 of a tensor-parallel group with its worker processes."""
        args: dict[str, Any] = dict(
            config=self.config.runner_config(),
            cache_config=self.config.cache,
            max_model_len=self.max_model_len,
            reserve=self._draft_reserve(),
        )
        size = self.config.tensor_parallel_size
        if size == 1:
            return ModelRunner(self.model_dir, self.hf_config, **args)
        from common.parallel.executor import start_tensor_parallel

        return start_tensor_parallel(
            size, self.model_dir, self.hf_config, cpu_threads=self.config.cpu_threads, **args
        )

    def _draft_reserve(self) -> KVReserve | None:
        """A draft model's share of the device, reserved before the target sizes its cache
        (the draft loads after it, beside rank 0, with as many blocks)."""
        spec = self.config.speculative_config
        if spec is None or spec.method != "draft_model":
            return None
        from common.spec_decode.draft_model import draft_footprint

        return draft_footprint(spec, self.config)

    def _max_model_len(self) -> int:
        return max_model_len(self.hf_config, self.config.model.max_model_len)

    def _check_cache_fits(self) -> None:
        need = cdiv(self.max_model_len, self.block_size)
        if self.runner.num_blocks < need:
            raise ValueError(
                f"KV cache has {self.runner.num_blocks} blocks but one request of max_model_len="
                f"{self.max_model_len} needs {need}: raise the cache budget or lower max_model_len"
            )

    def _make_connector(self, factory: ConnectorFactory | None):
        """(scheduler half, worker half) of the KV store connector, when one is configured."""
        if self.config.kv_store is None:
            return None
        if factory is None:
            raise ValueError(
                "kv_store is set but no connector factory was handed to the engine"
                " (kv_transfer.connector.create_store_connector is the store's)"
            )
        role = self.config.kv_role or "both"
        runner, exchange = self.runner, None
        if runner.tp is not None:  # rank 0 of a group: the store reaches every rank through it
            from common.parallel.executor import ParallelModelRunner

            assert isinstance(runner, ParallelModelRunner)
            exchange = runner
        sched, worker = factory(
            self.config.kv_store, role, self.model_dir, runner.store_spec, runner.device, exchange
        )
        self.runner.set_connector(worker)
        sched.set_wakeup(self._wakeup.set)
        worker.set_wakeup(self._wakeup.set)
        return sched, worker

    # -- requests ----------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        output_token_ids: list[int] | None = None,
        kv_handle: KVHandle | None = None,
        lora: LoraRef | None = None,
    ) -> None:
        """Validate and queue. Raises ValueError on bad input, QueueFullError when over bound.

        One sample per request (``params.n == 1``): ``common/parallel_sampling.py`` splits a
        request with ``n`` samples into ``n`` requests before they reach the engine.
        ``output_token_ids`` resumes a request elsewhere: they count as already generated.
        ``kv_handle``: where the prompt's KV is (a prefill node's answer); the connector checks
        it against the prompt and then loads exactly what it names. ``lora``: the adapter it
        runs under (``enable_lora``; its shapes are checked against the model here).
        """
        self._validate(request_id, prompt_token_ids, params, output_token_ids or [])
        self._check_lora(lora)
        if self.scheduler.num_waiting >= self.config.scheduler.max_waiting:
            raise QueueFullError(f"waiting queue is full ({self.scheduler.num_waiting} requests)")
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        request = self._make_request(
            request_id, prompt_token_ids, params, seed, priority, arrival_time, output_token_ids,
            lora,
        )  # fmt: skip
        if kv_handle is not None:
            self._attach_handle(request, kv_handle)
        if params.structured_outputs is not None:
            self._structured_outputs().add(request)
        self.scheduler.add_request(request)

    def _structured_outputs(self) -> PreparedStructuredOutputs:
        """The matchers (and the tokenizer's grammar cache), prepared on a worker thread from
        the first grammar on (or from start-up: ``prepare_structured_outputs``); never on the
        engine loop (``common/structured_prepare.py``)."""
        if self._structured is None:
            self._structured = PreparedStructuredOutputs(self._build_structured_outputs)
        return self._structured

    def _build_structured_outputs(self) -> StructuredOutputs:
        """Worker thread: xgrammar imported, the tokenizer's grammar data built."""
        from common.structured_output import GrammarCache, StructuredOutputs

        cache = GrammarCache(self.model_dir, self.vocab_size, self.eos_token_ids)
        return StructuredOutputs(cache)

    def take_refused(self) -> list[tuple[str, str]]:
        """Requests refused after ``add_request`` accepted them (a grammar that does not
        compile), as (request id, reason), each once. They are already ended (aborted)."""
        refused, self._refused = self._refused, []
        return refused

    def _check_lora(self, lora: LoraRef | None) -> None:
        """ValueError for an adapter this engine cannot run (LoRA off, another model's)."""
        if lora is None:
            return
        if self.runner.lora is None:
            raise ValueError(f"adapter {lora.name!r} asked for, but LoRA is not enabled")
        try:
            self.runner.lora.check(lora)
        except (OSError, RuntimeError, SafetensorError) as e:  # files gone, or not safetensors
            raise ValueError(f"adapter {lora.name!r} cannot be read: {e}") from None

    def _attach_handle(self, request: Request, handle: KVHandle) -> None:
        if self.connector is None:
            raise ValueError("a KV handle was given but this engine has no KV store")
        self.connector[0].check_handle(request, handle)  # ValueError: not this prompt's KV
        request.kv_transfer = handle

    def _make_request(
        self, request_id, prompt, params, seed, priority, arrival, outputs, lora
    ) -> Request:
        extra_eos = self.eos_token_ids[1:]
        if extra_eos and not params.ignore_eos:
            stop_ids = list(dict.fromkeys([*params.stop_token_ids, *extra_eos]))
            params = SamplingParams(**{**params.__dict__, "stop_token_ids": stop_ids})
        room = self.max_model_len - len(prompt)
        max_tokens = min(params.max_tokens or room, room)
        return Request(
            request_id,
            prompt,
            params,
            eos_token_id=self.eos_token_ids[0] if self.eos_token_ids else None,
            block_size=self.block_size,
            seed=seed,
            priority=priority,
            arrival_time=arrival,
            max_tokens=max_tokens,
            output_token_ids=outputs,
            lora=lora,
        )

    def _validate(self, request_id, prompt, params: SamplingParams, outputs: list[int]) -> None:
        if not isinstance(params, SamplingParams):
            raise ValueError("sampling params must be a SamplingParams")
        if params.n != 1:
            raise ValueError(
                f"the engine runs one sample per request, got n={params.n}:"
                " split it first (common.parallel_sampling.split_samples)"
            )
        if request_id in self.scheduler.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt:
            raise ValueError("prompt is empty: at least one token is needed")
        for name in ("logprobs", "prompt_logprobs"):  # top-k over the vocabulary, at most
            k = getattr(params, name)
            if k is not None and k > self.vocab_size:
                raise ValueError(f"{name}={k} exceeds the vocabulary size ({self.vocab_size})")
        bad = [t for t in (*prompt, *outputs) if not 0 <= int(t) < self.vocab_size]
        if bad:
            raise ValueError(f"token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        total = len(prompt) + len(outputs)
        if total >= self.max_model_len:
            raise ValueError(
                f"prompt of {total} tokens leaves no room to generate: max_model_len is"
                f" {self.max_model_len}"
            )

    def abort(self, request_ids: list[str]) -> None:
        """Abort in any state; blocks are freed at once."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        if self._structured is not None:
            self._structured.drop(request_ids)

    def finish_stopped(self, request_ids: list[str]) -> None:
        """End requests the caller found finished (stop strings)."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED)
        if self._structured is not None:
            self._structured.drop(request_ids)

    # -- the loop ----------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        """One turn of the loop. Serial: schedule, run, return this step's outputs. Overlapped:
        schedule and launch this step, then return the outputs of the one before it.

        A step that raises fails the request that caused it (see ``common/step_faults``; the
        others go on, and ``take_failed`` says which failed and why); the engine stays up. An
        exception no request of a step can be blamed for is raised."""
        self._requeue_held()
        outputs: list[EngineCoreOutput] = []
        suspects = self._in_flight[0].scheduled if self._in_flight is not None else []
        self._scheduled = None
        try:
            self._step(outputs)
        except EngineFailure:  # the engine itself is gone (a TP rank): nobody to blame
            raise
        except Exception as error:
            if self._scheduled is not None:
                suspects = [*suspects, *self._scheduled.scheduled]
            self._contain(error, [item.request for item in suspects])
            return outputs
        if self._scheduled is not None:
            self._faults.passed(item.request.request_id for item in self._scheduled.scheduled)
        return outputs

    def _step(self, outputs: list[EngineCoreOutput]) -> None:
        """The step's phases; its outputs are appended to ``outputs`` as they are made."""
        self._wakeup.clear()  # news from here on wakes an idle wait below
        if self.connector is not None:
            self._poll_connector()
        if self._structured is not None:
            self._poll_grammars(self._structured)
        if self._in_flight is not None and self.scheduler.must_sync(self._in_flight[0]):
            outputs += self._finish_in_flight()
        if self.proposer is not None:
            self.proposer.propose(self.scheduler.running)
        sched_out = self._scheduled = self.scheduler.schedule()
        if sched_out.host_copies is not None:  # before any load or write of the step
            self.runner.copy_host_tier(sched_out.host_copies)
        if sched_out.is_empty:
            if sched_out.connector_meta is not None:
                self.runner.start_loads(sched_out.connector_meta)
            outputs += self._finish_in_flight()
            if not outputs and self.scheduler.has_unfinished():
                # only store lookups, loads or grammar compiles are in flight: wait for the
                # connector's news (a grammar has no bell: the timeout bounds its wait, and
                # a new request's, which arrives between steps)
                self._wakeup.wait(IDLE_WAIT_S)
            return
        if self._structured is not None:
            sched_out.grammar_bitmask = self._structured.bitmask(sched_out)
        result = self.runner.execute(sched_out)
        if not self.async_scheduling:
            outputs += self._accepted(self._update(sched_out, result))
            return
        outputs += self._finish_in_flight()
        self._in_flight = (sched_out, result)

    # -- a step that failed ------------------------------------------------------------------
    def _contain(self, error: Exception, suspects: list[Request]) -> None:
        """Judge the requests of a failed step (``common/step_faults``): fail the culprit,
        roll back and hold the others. Raises ``error`` when there is nobody to blame."""
        self._in_flight = None  # its tokens are not known: its requests recompute them
        suspects = list({id(r): r for r in suspects if not r.is_finished}.values())
        if not suspects:
            raise error
        logger.exception("a step failed (%d requests in it)", len(suspects), exc_info=error)
        verdict = self._faults.judge(suspects)
        for request in suspects:
            self.scheduler.roll_back(request)
        # the failed forward may have left its blocks half written: no cache hit may read them
        self.kv_cache_manager.reset_prefix_cache()
        ids = [request.request_id for request in verdict.failed]
        self.abort(ids)
        reason = f"the request failed in the engine: {type(error).__name__}: {error}"
        self._failed += [(request_id, reason) for request_id in ids]

    def _requeue_held(self) -> None:
        """Return the next held request to the scheduler when the one on trial is cleared."""
        request = self._faults.next_trial(set(self.scheduler.requests))
        if request is not None:
            self.scheduler.requeue(request)

    def take_failed(self) -> list[tuple[str, str]]:
        """Requests a failed step ended, as (request id, reason), each once."""
        failed, self._failed = self._failed, []
        return failed

    def _finish_in_flight(self) -> list[EngineCoreOutput]:
        if self._in_flight is None:
            return []
        sched_out, result = self._in_flight
        self._in_flight = None
        return self._accepted(self._update(sched_out, result))

    def _update(self, sched_out: SchedulerOutput, result: StepResult | None):
        if result is None:
            return self.scheduler.update_from_output(sched_out, {})
        return self.scheduler.update_from_output(
            sched_out, result.tokens(), result.verified_tokens(), result.prompt_logprobs
        )

    def _accepted(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """Outputs of a finished step, once every matcher has accepted their tokens."""
        if self._structured is not None:
            self._structured.accept(outputs)
        return outputs

    def _poll_grammars(self, structured: PreparedStructuredOutputs) -> None:
        refused = structured.poll()
        if refused:
            ids = [request_id for request_id, _ in refused]
            self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
            self._refused += refused

    def _num_compiling(self) -> int:
        return self._structured.num_pending if self._structured is not None else 0

    def _poll_connector(self) -> None:
        worker = self.connector[1]
        _, done_loading = worker.get_finished(self.scheduler.take_ended_ids())
        if done_loading:
            self.scheduler.update_from_connector(done_loading, worker.get_failed_blocks())

    def close(self) -> None:
        """Release what the engine holds: the grammar compiler, the connector's threads and
        staging memory, the draft model's engine, and the runner (tensor-parallel workers and
        process groups). Idempotent; the engine is not stepped afterwards."""
        self._in_flight = None
        if self._structured is not None:
            self._structured.close()
            self._structured = None
        if self.connector is not None:
            self.connector[1].close()
            self.connector[0].close()
            self.connector = None
        close_proposer = getattr(self.proposer, "close", None)  # a draft model's engine
        if close_proposer is not None:
            close_proposer()
        self.runner.close()

    def stats(self) -> EngineStats:
        """Queue, batch and cache figures now (between steps)."""
        return self.scheduler.stats()

    def request_status(self, request_id: str) -> RequestStatus | None:
        """Status of a request the engine holds (None once it ended or if unknown)."""
        request = self.scheduler.requests.get(request_id)
        return None if request is None else request.status

    def request_ids(self) -> list[str]:
        """Every request the engine holds."""
        return list(self.scheduler.requests)

    def has_unfinished(self) -> bool:
        """Requests not yet finished (a step in flight only holds tokens for them)."""
        return self.scheduler.has_unfinished()

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    def num_free_blocks(self) -> int:
        return self.kv_cache_manager.num_free_blocks
