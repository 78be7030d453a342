"""Block-table rows kept across steps (``common/block_table.py``, ``InputBuffers``): every
mutation of a request's block ids reaches the rows (appends, trims, frees and new tables under
the same request id, rows taken over), only changed ids are staged, a tensor-parallel worker
rebuilds the same tables from the changes alone, and ``prepare`` costs what the changes cost,
not what the tables hold."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from benchmarks.prepare import BLOCK_SIZE, BUDGET, SteadyDecode, buffers_for
from common.block_table import BlockTableRows
from common.kv_cache_manager import KVCacheManager
from common.request import Request
from common.sampling_params import SamplingParams
from common.step_inputs import BatchLimits, InputBuffers
from common.step_outputs import ScheduledRequest

BS = 4
WIDTH = 8  # blocks per row: 32 tokens


def make_request(rid: str, n: int) -> Request:
    return Request(
        rid,
        list(range(1, n + 1)),
        SamplingParams(max_tokens=64),
        eos_token_id=None,
        block_size=BS,
        seed=0,
        max_tokens=64,
    )


def plan(kv: KVCacheManager, request: Request, num_new: int = 1) -> ScheduledRequest:
    """The scheduler's share for ``request`` (as ``Scheduler._add_scheduled`` builds it)."""
    rid = request.request_id
    return ScheduledRequest(
        request,
        num_new,
        True,
        kv.get_block_ids(rid),
        request.num_computed_tokens,
        block_table_version=kv.table_version(rid),
    )


def staged_pairs(staging: np.ndarray, n: int) -> list[tuple[int, int]]:
    return [(int(staging[2 * i]), int(staging[2 * i + 1])) for i in range(n)]


class Rows:
    """A ``BlockTableRows`` with its staging array, checked against the manager after each
    step."""

    def __init__(self, num_rows: int = 4) -> None:
        self.table = BlockTableRows(num_rows, WIDTH)
        self.staging = np.zeros(2 * num_rows * WIDTH, np.int32)

    def step(self, kv: KVCacheManager, *items: ScheduledRequest) -> list[tuple[int, int]]:
        changes = self.table.update(list(items), self.staging)
        for item, row in zip(items, changes.rows):
            ids = kv.get_block_ids(item.request.request_id)
            assert self.table.host[row, : len(ids)].tolist() == ids
        self.table.check_integrity()
        return staged_pairs(self.staging, changes.num_changes)


def test_appends_stage_only_the_new_ids():
    kv, rows = KVCacheManager(64, BS), Rows()
    a = make_request("a", 6)
    kv.allocate_slots(a, 6)  # blocks 0, 1
    assert rows.step(kv, plan(kv, a, 6)) == [(0, 0), (1, 1)]  # row 0: written whole
    a.num_computed_tokens = 6
    kv.allocate_slots(a, 2)  # 8 tokens: still two blocks
    assert rows.step(kv, plan(kv, a)) == []  # nothing changed, nothing copied
    a.num_computed_tokens = 8
    kv.allocate_slots(a, 1)  # block 2
    assert rows.step(kv, plan(kv, a)) == [(2, 2)]


def test_trim_and_regrow_to_the_same_length_is_seen():
    """Rejected drafts trim the table and the next allocation brings it back to its length
    with another block: a cache keyed by the list (same object) and its length would keep the
    trimmed block's id."""
    kv, rows = KVCacheManager(64, BS), Rows()
    a, b = make_request("a", 4), make_request("b", 4)
    kv.allocate_slots(a, 4 + 5)  # a verifies 5 drafts: 3 blocks (0, 1, 2)
    kv.allocate_slots(b, 4)  # block 3
    rows.step(kv, plan(kv, a, 9), plan(kv, b, 4))
    same_list = kv.get_block_ids("a")
    kv.trim("a", 5)  # one draft accepted: blocks 0, 1 kept, 2 freed
    a.num_computed_tokens = 5
    kv.allocate_slots(a, 4)  # back to 3 blocks, the third from the free list's head (4)
    assert kv.get_block_ids("a") is same_list and len(same_list) == 3
    assert same_list[2] != 2
    pairs = rows.step(kv, plan(kv, a, 4))
    assert pairs == [(0 * WIDTH + i, same_list[i]) for i in range(3)]  # written whole


def test_a_request_freed_and_allocated_again_gets_its_new_table():
    """Preemption (or a roll-back, or a remote load starting over): the same request id, a
    new table of the same length."""
    kv, rows = KVCacheManager(64, BS), Rows()
    a, filler = make_request("a", 8), make_request("filler", 8)
    kv.allocate_slots(a, 8)
    rows.step(kv, plan(kv, a, 8))
    kv.free("a")
    kv.allocate_slots(filler, 8)  # takes a's freed blocks
    kv.allocate_slots(a, 8)
    rows.step(kv, plan(kv, a, 8))


def test_unversioned_plans_are_written_whole_every_time():
    rows = Rows()
    a = make_request("a", 8)
    first = ScheduledRequest(a, 8, True, [5, 6], 0)
    rows.table.update([first], rows.staging)
    second = ScheduledRequest(a, 8, True, [7, 9], 0)  # a plan built by hand, no version
    changes = rows.table.update([second], rows.staging)
    assert staged_pairs(rows.staging, changes.num_changes) == [(0, 7), (1, 9)]


def test_rows_go_to_newcomers_least_recently_used_first():
    kv, rows = KVCacheManager(64, BS), Rows(num_rows=2)
    reqs = {rid: make_request(rid, 4) for rid in "abc"}
    for r in reqs.values():
        kv.allocate_slots(r, 4)
    rows.step(kv, plan(kv, reqs["a"], 4))
    rows.step(kv, plan(kv, reqs["b"], 4))
    rows.step(kv, plan(kv, reqs["a"], 4))  # b is now the least recently used
    rows.step(kv, plan(kv, reqs["c"], 4))
    assert rows.table.row_of("b") is None and rows.table.row_of("c") == 1
    rows.step(kv, plan(kv, reqs["b"], 4), plan(kv, reqs["c"], 4))  # a's row goes to b
    assert rows.table.row_of("a") is None
    with pytest.raises(AssertionError, match="more sequences"):
        rows.step(kv, *(plan(kv, r, 4) for r in reqs.values()))


def test_a_table_wider_than_the_rows_changes_nothing():
    kv, rows = KVCacheManager(64, BS), Rows()
    a = make_request("a", 8)
    kv.allocate_slots(a, 8)
    rows.step(kv, plan(kv, a, 8))
    wide = ScheduledRequest(a, 1, True, list(range(WIDTH + 1)), 8, block_table_version=99)
    with pytest.raises(ValueError, match="rows hold"):
        rows.table.update([wide], rows.staging)
    assert rows.step(kv, plan(kv, a)) == []  # the row still holds a's table


# -- the step's inputs: rank 0 and a tensor-parallel worker ---------------------------------------
def assert_tables(tables: torch.Tensor, items: list[ScheduledRequest]) -> None:
    """Each row starts with its request's block ids (past them: whatever the row held before,
    which no kernel reads: seq lens bound every read), and is as wide as the widest."""
    assert tables.shape == (len(items), max(len(i.block_ids) for i in items))
    for row, item in zip(tables.tolist(), items):
        assert row[: len(item.block_ids)] == item.block_ids


def buffers() -> InputBuffers:
    return InputBuffers(BatchLimits(64, 4, WIDTH), BS, torch.device("cpu"))


def adopt_on_worker(rank0: InputBuffers, worker: InputBuffers, shape) -> torch.Tensor:
    """What a tensor-parallel worker does with rank 0's broadcast: the used prefixes into its
    next host set, then ``adopt``."""
    used64, used32 = rank0.used_prefixes(shape)
    src64, src32 = rank0.last_host
    dst64, dst32 = worker.next_host()
    dst64[:used64] = src64[:used64]
    dst32[:used32] = src32[:used32]
    return worker.adopt(shape).meta.block_tables


def test_random_lives_give_the_tables_of_the_lists():
    """Requests arrive, decode, verify drafts (trimmed after), are preempted or abort and come
    back under the same id, over more requests than rows; each step's tables and slots, and a
    worker's tables (rebuilt from the staged changes alone), equal those of the manager's
    lists."""
    rng = random.Random(0)
    kv = KVCacheManager(24, BS)
    rank0, worker = buffers(), buffers()
    live: dict[str, Request] = {}
    steps = 0
    for n in range(400):
        if len(live) < 4 and rng.random() < 0.3:
            rid = f"r{rng.randrange(8)}" if rng.random() < 0.5 else f"new{n}"
            live.setdefault(rid, make_request(rid, WIDTH * BS))
        items = []
        for rid, r in list(live.items()):
            if rng.random() < 0.1:  # finished, aborted or preempted: blocks back to the pool
                kv.free(rid)
                del live[rid]
                continue
            new = rng.choice([1, 1, 1, 3, 5])  # 3, 5: a token and drafts to verify
            if r.num_computed_tokens + new > WIDTH * BS or kv.allocate_slots(r, new) is None:
                continue
            items.append(plan(kv, r, new))
        if not items:
            continue
        inputs = rank0.prepare(items, {})
        assert_tables(inputs.meta.block_tables, items)
        slots = [
            i.block_ids[p // BS] * BS + p % BS
            for i in items
            for p in range(i.num_computed_tokens, i.num_computed_tokens + i.num_new_tokens)
        ]
        assert inputs.meta.slot_mapping.tolist() == slots
        assert_tables(adopt_on_worker(rank0, worker, inputs.shape), items)
        for item in items:
            r = item.request
            r.num_computed_tokens += item.num_new_tokens
            if item.num_new_tokens > 1 and rng.random() < 0.7:  # drafts rejected: trim
                r.num_computed_tokens -= rng.randrange(1, item.num_new_tokens)
                kv.trim(r.request_id, r.num_computed_tokens)
        kv.check_integrity()
        steps += 1
    rank0.table.check_integrity()
    assert steps > 200


def test_slots_come_from_the_rows():
    kv, inputs_ = KVCacheManager(40, BS), buffers()
    a, b = make_request("a", 6), make_request("b", 3)
    kv.allocate_slots(a, 6)
    kv.allocate_slots(b, 3)
    inputs = inputs_.prepare([plan(kv, a, 6), plan(kv, b, 3)], {})
    ia, ib = kv.get_block_ids("a"), kv.get_block_ids("b")
    expected = [ia[p // BS] * BS + p % BS for p in range(6)]
    expected += [ib[p // BS] * BS + p % BS for p in range(3)]
    assert inputs.meta.slot_mapping.tolist() == expected
    assert inputs.num_table_changes == len(ia) + len(ib)


def test_graph_padding_rows_read_the_zero_row():
    kv, inputs_ = KVCacheManager(40, BS), buffers()
    a = make_request("a", 5)
    kv.allocate_slots(a, 5)
    a.num_computed_tokens = 4
    inputs = inputs_.prepare([plan(kv, a)], {}, padded_seqs=3, row_stride=WIDTH)
    tables = inputs.meta.block_tables.numpy()
    assert tables.shape == (3, WIDTH)
    assert tables[0, :2].tolist() == kv.get_block_ids("a") and not tables[1:].any()
    assert inputs.meta.seq_lens.tolist() == [5, 0, 0]


# -- the cost -------------------------------------------------------------------------------------
def test_a_steady_decode_step_at_256_by_4k_changes_at_most_a_block_per_row():
    """What keeps ``prepare`` cheap at 256 sequences x 4k context, as a count (its time is
    ``benchmarks.prepare``'s to measure, not a unit test's): a steady decode step writes only the
    table entries that changed (a row crossing into a new block), never the 256 x 256 tables;
    rebuilding them from the lists cost 1.8-2.4 ms per step."""
    prefill_steps = 2 * (-(-256 * 4096 // BUDGET)) + 8  # decodes run while prompts compute
    run = SteadyDecode(256, 4096, max_tokens=prefill_steps + 40)
    buffers = buffers_for(256, run.max_model_len)
    changes = []
    for out in run.steps(40):
        assert len(out.scheduled) == 256 and all(s.num_new_tokens == 1 for s in out.scheduled)
        changes.append(buffers.prepare(out.scheduled, {}).num_table_changes)
    first = changes[0]  # the first step writes every row's table once
    assert first >= 256 * 4096 // BLOCK_SIZE
    assert all(c <= 256 for c in changes[1:]), changes  # at most one new block per row
    # each row crosses into a new block once every 16 tokens: ~39 x 256 / 16 over the steps
    assert 0 < sum(changes[1:]) <= 256 * (39 // BLOCK_SIZE + 1), changes


def test_the_device_rows_apply_and_gather_as_the_host_rows():
    """The CUDA path's torch ops (``index_put_`` of the staged pairs, ``index_select`` into the
    step's table), run here on CPU tensors, give the numpy path's tables."""
    from common.step_inputs import _DeviceRows, _HostRows, _offsets

    limits = BatchLimits(64, 4, WIDTH)
    o = _offsets(limits)
    rng = random.Random(1)
    bufs = [torch.zeros(o.int32_size, dtype=torch.int32) for _ in range(2)]
    host, device = _HostRows(9, WIDTH, bufs[0], o), _DeviceRows(9, WIDTH, bufs[1], o)
    for _ in range(20):
        n = rng.randrange(1, 2 * WIDTH)
        flat = rng.sample(range(9 * WIDTH), n)
        pairs = [v for f in flat for v in (f, rng.randrange(1000))]
        seqs, stride = rng.randrange(1, 5), rng.randrange(1, WIDTH + 1)
        rows = [rng.randrange(9) for _ in range(seqs)]
        for buf in bufs:
            buf[o.table_changes : o.table_changes + 2 * n] = torch.tensor(pairs)
            buf[o.table_rows : o.table_rows + seqs] = torch.tensor(rows)
        for rows_of in (host, device):
            rows_of.apply(n)
            rows_of.gather(seqs, stride)
        span = slice(o.block_tables, o.block_tables + seqs * stride)
        assert torch.equal(bufs[0][span], bufs[1][span])
        assert np.array_equal(host.rows, device.rows.numpy())
