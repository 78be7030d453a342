"""The staging rings never deadlock and never leak: a step that saves more blocks than the save
ring holds, loaded requests that end while a fetched part waits to land (the staged path, which
CUDA and tensor parallelism take, forced on the CPU), and saves that skip what the store gave."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

import kv_transfer.saver as saver
from common import LLM, SamplingParams
from common.kv_interface import ConnectorMetadata, KVCacheSpec, LoadSpec, SaveSpec
from kv_store import FileStore
from kv_transfer.worker import StoreConnectorWorker

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)
FP = "staging-test"
NUM_BLOCKS = 32


def _worker(tmp_path, read_in_place: bool = True) -> StoreConnectorWorker:
    """One entry per staging slot, one slot per direction: the smallest ring."""
    store = FileStore(tmp_path / "kv", FP, capacity_bytes=64 * SPEC.bytes_per_block)
    return StoreConnectorWorker(
        store,
        SPEC,
        torch.device("cpu"),
        staging_slots=1,
        slot_bytes=SPEC.bytes_per_block,
        read_in_place=read_in_place,
    )


def _cache(fill: float = 0.0) -> torch.Tensor:
    shape = (SPEC.num_layers, 2, NUM_BLOCKS, SPEC.block_size, SPEC.num_kv_heads, SPEC.head_dim)
    return torch.full(shape, fill)


def _bounded(fn, timeout_s: float = 20.0) -> None:
    """Run ``fn`` on a thread; fail (instead of hanging the suite) if it does not return."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # re-raised on the test thread
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"{fn.__name__} did not return within {timeout_s} s: a hang"
    if errors:
        raise errors[0]


def _save_step(worker: StoreConnectorWorker, cache: torch.Tensor, spec: SaveSpec) -> None:
    """One producer step as the runner drives it: bind, a layer at a time, wait, clear."""
    worker.bind_connector_metadata(ConnectorMetadata(saves=[spec]))
    for layer in range(SPEC.num_layers):
        worker.save_kv_layer(layer, cache[layer])
    worker.wait_for_save()
    worker.clear_connector_metadata()


def test_a_step_saving_more_blocks_than_the_ring_holds_completes(tmp_path, caplog):
    """Six blocks, one slot of one entry: the step used to wait in ``acquire`` for a slot only
    its own writes (after the forward pass) could free."""
    worker = _worker(tmp_path)
    cache = torch.randn(_cache().shape)
    keys = [f"k{i}" for i in range(6)]
    spec = SaveSpec("r", keys, list(range(6)), [SPEC.block_size] * 6, final=True)
    with caplog.at_level(logging.WARNING, logger=saver.__name__):
        _bounded(lambda: _save_step(worker, cache, spec))
    assert "grew to 6 slots" in caplog.text
    assert worker.store.contains_many(keys) == [True] * 6
    out = torch.zeros(_cache().shape)
    load = ConnectorMetadata(loads=[LoadSpec("c", keys, list(range(6)), [SPEC.block_size] * 6)])
    _load_all(worker, out, load)
    assert torch.equal(out[:, :, :6], cache[:, :, :6])
    worker.close()


def _load_all(worker: StoreConnectorWorker, cache: torch.Tensor, meta: ConnectorMetadata) -> None:
    """Start loads and drain until every one of them is reported done (bounded)."""
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(cache)
    worker.clear_connector_metadata()
    wanted = {spec.request_id for spec in meta.loads}
    done: set[str] = set()

    def drain() -> None:
        while not wanted <= done:
            done.update(worker.get_finished(set())[1])
            if worker.loader.layer_work_pending():  # a forward pass lands them (staged)
                for layer in range(SPEC.num_layers):
                    worker.wait_for_layer_load(layer)

    _bounded(drain)


def test_loads_of_ended_requests_give_their_staging_slots_back(tmp_path):
    """Staged path: four loaded requests end between their last part arriving and the next
    forward pass; their slots used to stay taken, and every later load waited forever."""
    worker = _worker(tmp_path, read_in_place=False)
    worker.loader.ring.ensure_slots(4)
    cache = torch.randn(_cache().shape)
    keys = [f"e{i}" for i in range(5)]
    spec = SaveSpec("p", keys, list(range(5)), [SPEC.block_size] * 5, final=True)
    _bounded(lambda: _save_step(worker, cache, spec))
    target = _cache(fill=-1.0)
    ended = [LoadSpec(f"gone{i}", [keys[i]], [10 + i], [SPEC.block_size]) for i in range(4)]
    worker.bind_connector_metadata(ConnectorMetadata(loads=ended))
    worker.start_load_kv(target)
    worker.clear_connector_metadata()

    def until_all_fetched() -> None:
        done: set[str] = set()
        while len(done) < 4:
            done.update(worker.get_finished(set())[1])

    _bounded(until_all_fetched)
    assert len(worker.loader.landing) == 4  # all four wait for a forward pass that never comes
    worker.get_finished({f"gone{i}" for i in range(4)})  # they end (abort, disconnect)
    assert worker.loader.landing == []
    assert torch.equal(target[:, :, 10:14], _cache(fill=-1.0)[:, :, 10:14])  # never landed
    # a fifth load needs a slot: it must complete, into its own block only
    fifth = ConnectorMetadata(loads=[LoadSpec("new", [keys[4]], [20], [SPEC.block_size])])
    _load_all(worker, target, fifth)
    assert torch.equal(target[:, :, 20], cache[:, :, 4])
    worker.close()


@pytest.mark.slow
def test_producer_with_a_tiny_staging_ring_finishes_many_short_prompts(tmp_path, monkeypatch):
    """At the ``LLM`` level: one entry per slot and 40 short prompts finishing in one step."""
    defaults = StoreConnectorWorker.__init__.__kwdefaults__ | {"staging_slots": 1, "slot_bytes": 1}
    monkeypatch.setattr(StoreConnectorWorker.__init__, "__kwdefaults__", defaults)  # 1 entry
    producer = LLM(
        model="tiny-llama", kv_store=f"file://{tmp_path}/kv", kv_role="producer", num_blocks=256
    )
    prompts = [[5 + i, 6, 7, 8, 9] for i in range(40)]
    params = SamplingParams(temperature=0.0, max_tokens=1)
    outs: list = []
    _bounded(lambda: outs.extend(producer.generate(prompts, params, use_tqdm=False)), 120)
    assert len(outs) == 40
    assert producer.engine.connector[1].num_saved_blocks == 40


def test_saves_start_after_the_blocks_the_store_gave(tmp_path):
    """A "both" engine that loads a prompt's blocks from the store saves only what it computes
    (it used to gather, copy and then skip them as present)."""
    url = f"file://{tmp_path}/kv"
    args = dict(model="tiny-llama", kv_store=url, num_blocks=256, enable_prefix_caching=False)
    prompt = list(range(10, 10 + 70))  # 4 full blocks of 16 and a partial one
    params = SamplingParams(temperature=0.0, max_tokens=1)
    first = LLM(**args, kv_role="producer")
    first.generate([prompt], params, use_tqdm=False)
    saved_first = first.engine.connector[1].num_saved_blocks
    both = LLM(**args, kv_role="both")
    worker = both.engine.connector[1]
    staged: list[int] = []
    bind = worker.bind_connector_metadata

    def recording_bind(meta: ConnectorMetadata) -> None:
        staged.extend(len(save.keys) for save in meta.saves)
        bind(meta)

    worker.bind_connector_metadata = recording_bind  # type: ignore[method-assign]
    both.generate([prompt + [99] * 20], params, use_tqdm=False)
    assert saved_first == 5
    # 4 full blocks came from the store; only the 2 blocks computed (64-79, 80-89) are staged
    assert worker.num_loaded_blocks == 4
    assert sum(staged) == 2
    assert worker.num_saved_blocks == 2
