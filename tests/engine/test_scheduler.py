"""Scheduler with a fake runner: budget, chunking, mixing, preemption, priority, abort."""

from common.config import SchedulerConfig
from common.kv_cache_manager import KVCacheManager
from common.request import Request, RequestStatus
from common.sampling_params import SamplingParams
from common.scheduler import Scheduler
from common.step_outputs import SampledToken, SchedulerOutput

BS = 4


def make_scheduler(num_blocks=64, budget=16, max_seqs=8, policy="fcfs", chunked=True):
    cfg = SchedulerConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=max_seqs,
        policy=policy,
        enable_chunked_prefill=chunked,
    )
    return Scheduler(cfg, KVCacheManager(num_blocks, BS), max_model_len=1024)


def make_request(rid, n_prompt, max_tokens=4, priority=0, arrival=0.0, first=0):
    return Request(
        rid,
        list(range(first, first + n_prompt)),
        SamplingParams(max_tokens=max_tokens),
        eos_token_id=None,
        block_size=BS,
        seed=0,
        priority=priority,
        arrival_time=arrival,
        max_tokens=max_tokens,
    )


def fake_run(sched: Scheduler, out: SchedulerOutput, token: int = 7):
    """A runner that 'samples' ``token`` for every row that needs one."""
    sampled = {s.request.request_id: SampledToken(token) for s in out.scheduled if s.samples}
    return sched.update_from_output(out, sampled)


def plan(out: SchedulerOutput) -> dict[str, int]:
    return {s.request.request_id: s.num_new_tokens for s in out.scheduled}


def test_budget_and_chunked_prefill_mixed_with_decodes():
    sched = make_scheduler(budget=16)
    sched.add_request(make_request("a", 6, arrival=0))
    sched.add_request(make_request("b", 30, arrival=1, first=100))
    out = sched.schedule()
    assert plan(out) == {"a": 6, "b": 10}  # b is chunked to what is left of the budget
    assert out.num_batched_tokens == 16
    fake_run(sched, out)
    out = sched.schedule()
    assert plan(out) == {"a": 1, "b": 15}  # a decodes (running first), b continues its prompt
    assert [s.samples for s in out.scheduled] == [True, False]
    fake_run(sched, out)
    out = sched.schedule()
    assert plan(out) == {"a": 1, "b": 5}  # b's last chunk yields its first token
    assert [s.samples for s in out.scheduled] == [True, True]


def test_no_chunking_waits_for_budget():
    sched = make_scheduler(budget=8, chunked=False)
    sched.add_request(make_request("a", 12))
    assert sched.schedule().is_empty  # can never fit in one step without chunking


def test_max_num_seqs():
    sched = make_scheduler(budget=100, max_seqs=2)
    for i in range(3):
        sched.add_request(make_request(str(i), 3, arrival=i))
    assert list(plan(sched.schedule())) == ["0", "1"]


def test_prefix_hit_skips_compute():
    sched = make_scheduler(budget=64)
    sched.add_request(make_request("a", 10, max_tokens=1))
    fake_run(sched, sched.schedule())  # a finishes; its 2 full blocks stay cached
    sched.add_request(make_request("b", 10, max_tokens=1, arrival=1))
    out = sched.schedule()
    assert plan(out) == {"b": 2}
    assert out.scheduled[0].request.num_cached_tokens == 8


def test_request_finishes_on_max_tokens_and_frees_blocks():
    sched = make_scheduler()
    sched.add_request(make_request("a", 3, max_tokens=2))
    outs = fake_run(sched, sched.schedule())
    assert outs[0].new_token_ids == [7] and outs[0].finish_reason is None
    outs = fake_run(sched, sched.schedule())
    assert outs[0].finish_reason == "length"
    assert not sched.has_unfinished()
    sched.check_integrity()
    assert sched.kv.num_free_blocks == 64


def test_preemption_by_recompute_never_deadlocks():
    # 6 blocks of 4 tokens; two requests of 8-token prompts growing to 16 tokens each
    sched = make_scheduler(num_blocks=6, budget=64)
    sched.add_request(make_request("a", 8, max_tokens=8, arrival=0))
    sched.add_request(make_request("b", 8, max_tokens=8, arrival=1, first=100))
    preempted, finished, steps = [], [], 0
    while sched.has_unfinished() and steps < 100:
        out = sched.schedule()
        preempted += out.preempted_ids
        finished += [o.request_id for o in fake_run(sched, out) if o.finish_reason]
        sched.check_integrity()
        steps += 1
    assert sorted(finished) == ["a", "b"]
    assert preempted and preempted[0] == "b"  # FCFS: the newest request goes first
    assert sched.kv.num_free_blocks == 6


def test_priority_policy_orders_and_preempts_lowest_priority():
    sched = make_scheduler(budget=100, max_seqs=1, policy="priority")
    sched.add_request(make_request("low", 3, priority=5, arrival=0))
    sched.add_request(make_request("high", 3, priority=0, arrival=1))
    assert list(plan(sched.schedule())) == ["high"]


def test_priority_preemption_victim():
    sched = make_scheduler(num_blocks=5, budget=64, policy="priority")
    sched.add_request(make_request("low", 8, max_tokens=8, priority=9, arrival=0))
    sched.add_request(make_request("high", 8, max_tokens=8, priority=0, arrival=1, first=50))
    preempted = []
    while sched.has_unfinished():
        out = sched.schedule()
        preempted += out.preempted_ids
        fake_run(sched, out)
    assert preempted and set(preempted) == {"low"}


def test_abort_in_every_state_frees_blocks():
    sched = make_scheduler(budget=8)
    sched.add_request(make_request("run", 4, max_tokens=50))
    sched.add_request(make_request("chunk", 20, max_tokens=50, arrival=1, first=100))
    sched.add_request(make_request("wait", 4, max_tokens=50, arrival=2, first=200))
    fake_run(sched, sched.schedule())  # run: prefilled; chunk: partly prefilled; wait: waiting
    assert sched.requests["chunk"].num_computed_tokens == 4
    assert sched.requests["wait"].status == RequestStatus.WAITING
    sched.finish_requests(["run", "chunk", "wait"], RequestStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished() and sched.num_waiting == 0
    sched.check_integrity()
    assert sched.kv.num_free_blocks == 64
    assert sched.schedule().is_empty


def test_n_samples_arriving_together_compute_the_prompt_once():
    """The samples of an ``n > 1`` request (split before the engine) prefill once: the first
    computes the prompt, its siblings hit its full blocks in the same step and compute only the
    last partial block."""
    sched = make_scheduler(budget=64)
    for i in range(4):
        sched.add_request(make_request(f"p#{i}", 10, max_tokens=3))  # 2 full blocks + 2 tokens
    out = sched.schedule()
    assert plan(out) == {"p#0": 10, "p#1": 2, "p#2": 2, "p#3": 2}
    first = sched.kv.get_block_ids("p#0")
    assert first == [0, 1, 2]
    assert [sched.kv.get_block_ids(f"p#{i}") for i in (1, 2, 3)] == [
        [0, 1, 3],
        [0, 1, 4],
        [0, 1, 5],
    ]
    assert [sched.kv.pool.blocks[b].ref_cnt for b in first] == [4, 4, 1]
    assert sched.kv.num_free_blocks == 64 - 6  # one prompt's 3 blocks + one partial block each
    while sched.has_unfinished():
        fake_run(sched, out)
        sched.check_integrity()
        out = sched.schedule()
    assert sched.kv.num_free_blocks == 64


def test_n_samples_wait_for_a_chunked_prompt():
    """A prompt over the budget is chunked by the first sample; running requests go first, so
    its siblings are admitted only with its last chunk, and hit every full block of it."""
    sched = make_scheduler(budget=16)
    for i in range(3):
        sched.add_request(make_request(f"p#{i}", 30, max_tokens=2))  # 7 full blocks + 2 tokens
    out = sched.schedule()
    assert plan(out) == {"p#0": 16}
    fake_run(sched, out)
    out = sched.schedule()
    assert plan(out) == {"p#0": 14, "p#1": 2}  # p#1 hits 28 tokens
    fake_run(sched, out)
    out = sched.schedule()
    assert plan(out) == {"p#0": 1, "p#1": 1, "p#2": 2}
    assert sched.num_scheduled_tokens == 30 + 2 + 2 + 2  # the prompt once, + decodes
    while sched.has_unfinished():
        fake_run(sched, out)
        out = sched.schedule()
    sched.check_integrity()
    assert sched.kv.num_free_blocks == 64
