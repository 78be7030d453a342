"""StoreConnector end to end: a producer engine saves, a consumer engine continues from the first
token, and the output equals one colocated engine — also when the store misbehaves."""

from __future__ import annotations

import functools
import os
import random

import pytest
import torch

from common.config import EngineConfig
from common.engine import EngineCore
from common.sampling_params import SamplingParams
from kv_store.entry import make_key
from kv_transfer.connector import create_store_connector
from kv_transfer.loader import InPlaceLoader

BS = 16
PROMPT_LENS = (5, 16, 100)  # shorter than a block, exactly a block, many blocks
ENGINE_ARGS = dict(model="tiny-llama", block_size=BS, max_num_batched_tokens=256, num_blocks=256)


@pytest.fixture(autouse=True, scope="module")
def _offline_cache(tmp_path_factory):
    os.environ.setdefault("PDSERVE_CACHE_DIR", str(tmp_path_factory.mktemp("pdserve-cache")))


def prompts(lens=PROMPT_LENS, seed=0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(n)] for n in lens]


def params(max_tokens: int, greedy: bool) -> SamplingParams:
    if greedy:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return SamplingParams(
        temperature=0.9, top_p=0.95, seed=11, max_tokens=max_tokens, ignore_eos=True
    )


def run(engine: EngineCore, requests) -> dict[str, dict]:
    """Run (request_id, prompt, params, output_token_ids[, kv_handle[, lora]]) to completion."""
    for rid, prompt, p, outs, *rest in requests:
        handle, lora = (*rest, None, None)[:2]
        engine.add_request(rid, prompt, p, output_token_ids=outs, kv_handle=handle, lora=lora)
    res = {r[0]: {"tokens": [], "handle": None, "loaded": 0} for r in requests}
    while engine.has_unfinished():
        for out in engine.step():
            res[out.request_id]["tokens"] += out.new_token_ids
            if out.finish_reason:
                res[out.request_id].update(handle=out.kv_handle, loaded=out.num_external_tokens)
    engine.check_integrity()
    assert engine.num_free_blocks() == engine.runner.num_blocks
    return res


def engine(url: str | None = None, role: str | None = None, **connector_options) -> EngineCore:
    config = EngineConfig.from_kwargs(**ENGINE_ARGS, kv_store=url, kv_role=role)
    factory = functools.partial(create_store_connector, **connector_options)
    return EngineCore(config, factory if url else None)


@pytest.fixture(scope="module")
def colocated():
    return engine()


def disaggregated(url, ps, greedy, corrupt=None, consumer=None, handles=True):
    """Producer (max_tokens=1) → optional fault → consumer, given the producer's KV handles as a
    decode node is (``handles=False``: the consumer asks the store what it holds); returns
    (full tokens, results)."""
    producer = engine(url, "producer")
    first = run(producer, [(str(i), p, params(1, greedy), None) for i, p in enumerate(ps)])
    producer.close()
    if corrupt is not None:
        corrupt(first)
    consumer = consumer or engine(url, "consumer")
    rest = run(
        consumer,
        [
            (str(i), p, params(12, greedy), first[str(i)]["tokens"], first[str(i)]["handle"])
            if handles
            else (str(i), p, params(12, greedy), first[str(i)]["tokens"])
            for i, p in enumerate(ps)
        ],
    )
    tokens = {k: first[k]["tokens"] + rest[k]["tokens"] for k in first}
    return tokens, first, rest, consumer


def reference(colocated, ps, greedy):
    res = run(colocated, [(f"ref{i}", p, params(12, greedy), None) for i, p in enumerate(ps)])
    return {str(i): res[f"ref{i}"]["tokens"] for i in range(len(ps))}


def entry_keys(handle) -> list[str]:
    n, bs = handle.num_tokens, handle.block_size
    return [
        make_key(handle.fingerprint, h, None if min(bs, n - i * bs) == bs else n - i * bs)
        for i, h in enumerate(handle.block_hashes)
    ]


@pytest.fixture(params=["redis", "file"])
def store_url(request, tmp_path):
    if request.param == "file":
        return f"file://{tmp_path}/kv"
    return request.getfixturevalue("redis_server").url


@pytest.mark.parametrize("handles", [True, False], ids=["handle", "lookup"])
@pytest.mark.parametrize("greedy", [True, False])
def test_disaggregated_equals_colocated(store_url, colocated, greedy, handles):
    ps = prompts()
    tokens, first, rest, consumer = disaggregated(store_url, ps, greedy, handles=handles)
    assert tokens == reference(colocated, ps, greedy)
    # everything but the first token's own KV came from the store, and nothing was recomputed:
    # each request computed only the 11 tokens it sampled after the first
    assert [rest[str(i)]["loaded"] for i in range(len(ps))] == list(PROMPT_LENS)
    assert consumer.scheduler.num_scheduled_tokens == 11 * len(ps)
    assert first["2"]["handle"].num_tokens == 100 and len(first["2"]["handle"].block_hashes) == 7
    consumer.close()


def test_prefix_hits_on_both_sides(store_url, colocated):
    shared = prompts((48,), seed=5)[0]
    ps = [shared + p for p in prompts((7, 30), seed=6)]
    tokens, first, _rest, consumer = disaggregated(store_url, ps, greedy=True)
    assert tokens == reference(colocated, ps, greedy=True)
    # a second request on the consumer reuses its local prefix cache, then loads the rest
    again = run(consumer, [("again", ps[1], params(12, True), first["1"]["tokens"])])
    assert first["1"]["tokens"] + again["again"]["tokens"] == tokens["1"]
    consumer.close()


def test_prefix_reuse_across_instances(store_url, colocated):
    """A second prefill instance loads a prefix the first one stored instead of recomputing."""
    base = prompts((64,), seed=9)[0]
    a = engine(store_url, "both")
    run(a, [("a", base, params(1, True), None)])
    a.close()
    b = engine(store_url, "both")
    longer = base + prompts((20,), seed=10)[0]
    res = run(b, [("b", longer, params(12, True), None)])
    assert res["b"]["loaded"] == 64
    assert res["b"]["tokens"] == reference(colocated, [longer], True)["0"]
    b.close()


# -- faults: each must give identical tokens and leak nothing --------------------------------


def test_redis_killed_mid_transfer(redis_server, colocated):
    ps = prompts()
    consumer = engine(redis_server.url, "consumer")
    store = consumer.runner.connector.store
    real_get = store.get_many_into

    def get_after_kill(*args, **kwargs):  # the server dies between lookup and fetch
        redis_server.kill()
        return real_get(*args, **kwargs)

    store.get_many_into = get_after_kill
    tokens, _, rest, _ = disaggregated(redis_server.url, ps, True, consumer=consumer)
    assert tokens == reference(colocated, ps, True)
    assert all(r["loaded"] == 0 for r in rest.values())
    consumer.close()


def test_redis_restarted_empty(redis_server, colocated):
    ps = prompts()
    tokens, _, rest, consumer = disaggregated(
        redis_server.url, ps, True, corrupt=lambda first: redis_server.restart()
    )
    assert tokens == reference(colocated, ps, True)
    assert all(r["loaded"] == 0 for r in rest.values())
    consumer.close()


def test_corrupt_entry_in_redis(redis_server, colocated):
    ps = prompts()

    def corrupt(first):
        key = entry_keys(first["2"]["handle"])[3]  # the 4th block of the long prompt
        with redis_server.client() as client:
            value = client.get(key)
            client.setrange(key, len(value) - 10, b"\x00garbage\x00")

    tokens, _, rest, consumer = disaggregated(redis_server.url, ps, True, corrupt=corrupt)
    assert tokens == reference(colocated, ps, True)
    assert rest["2"]["loaded"] == 3 * BS  # blocks before the corrupt one were used
    recomputed = 100 - 3 * BS  # from the corrupt block on, the long prompt is recomputed
    assert consumer.scheduler.num_scheduled_tokens == 11 * len(ps) + recomputed
    consumer.close()


def test_corrupt_and_half_written_file_entries(tmp_path, colocated):
    url = f"file://{tmp_path}/kv"
    ps = prompts()
    consumer = engine(url, "consumer")
    store = consumer.runner.connector.store

    def corrupt(first):
        keys = entry_keys(first["2"]["handle"])
        path = store.path_of(keys[2])
        data = bytearray(path.read_bytes())
        data[-5] ^= 0xFF
        path.write_bytes(bytes(data))
        half = store.path_of(entry_keys(first["1"]["handle"])[0])  # truncated mid-payload
        half.write_bytes(half.read_bytes()[: half.stat().st_size // 2])

    tokens, _, rest, _ = disaggregated(url, ps, True, corrupt=corrupt, consumer=consumer)
    assert tokens == reference(colocated, ps, True)
    assert rest["2"]["loaded"] == 2 * BS and rest["1"]["loaded"] == 0
    consumer.close()


def test_entry_evicted_between_save_and_load(store_url, colocated):
    ps = prompts()
    consumer = engine(store_url, "consumer")
    store = consumer.runner.connector.store
    evicted = {}

    def evict(first):
        evicted["keys"] = entry_keys(first["2"]["handle"])
        store.delete_many([evicted["keys"][5]])  # gone before the lookup

    real_get = store.get_many_into

    def evict_during_load(keys, *args, **kwargs):  # and one more gone after the lookup
        if evicted["keys"][1] in keys:
            store.delete_many([evicted["keys"][1]])
        return real_get(keys, *args, **kwargs)

    store.get_many_into = evict_during_load
    tokens, _, rest, _ = disaggregated(store_url, ps, True, corrupt=evict, consumer=consumer)
    assert tokens == reference(colocated, ps, True)
    assert rest["2"]["loaded"] == 1 * BS
    consumer.close()


def test_store_full(redis_server_factory, tmp_path, colocated):
    ps = prompts()
    full_redis = redis_server_factory(maxmemory="1mb", policy="noeviction")
    with full_redis.client() as client:  # fill it up so every KV write is refused
        for i in range(200):
            try:
                client.set(f"filler:{i}", b"x" * 8192)
            except Exception:
                break
    tiny_files = f"file://{tmp_path}/kv?capacity=40kb"  # holds a couple of entries at most
    for url in (full_redis.url, tiny_files):
        tokens, _, _, consumer = disaggregated(url, ps, True)
        assert tokens == reference(colocated, ps, True)
        consumer.close()


def test_offline_llm_knobs(tmp_path):
    """``LLM(kv_store=..., kv_role=...)``: the whole save → load flow in one Python process."""
    from common import LLM

    url = f"file://{tmp_path}/kv"
    ps = prompts((40, 70), seed=21)
    greedy = params(10, True)
    producer = LLM(kv_store=url, kv_role="producer", **ENGINE_ARGS)
    want = [o.outputs[0].token_ids for o in producer.generate(ps, greedy, use_tqdm=False)]
    consumer = LLM(kv_store=url, kv_role="consumer", **ENGINE_ARGS)
    got = [o.outputs[0].token_ids for o in consumer.generate(ps, greedy, use_tqdm=False)]
    assert got == want
    assert consumer.engine.runner.connector.num_loaded_blocks == 2 + 4  # full blocks only
    consumer.check_integrity()
    producer.engine.close()
    consumer.engine.close()


def test_loaded_kv_lands_layer_by_layer(tmp_path, colocated):
    """Staged loads (the CUDA path, run here on CPU): compute starts before the last layer has
    arrived — when layer 0 attends, the loaded blocks are in the paged cache for layer 0 but not
    yet for the last layer."""
    url = f"file://{tmp_path}/kv"
    ps = prompts((64,), seed=31)
    consumer = engine(url, "consumer", read_in_place=False)  # the CPU default reads in place
    worker = consumer.runner.connector
    real_wait = worker.wait_for_layer_load
    seen = []

    def wait(layer):
        landed = [torch.tensor(item.block_ids) for item in worker.loader.landing]
        real_wait(layer)
        if layer == 0 and landed:
            cache = consumer.runner.kv_cache
            ids = torch.cat(landed)
            seen.append((bool(cache[0, :, ids].abs().sum() > 0), bool(cache[-1, :, ids].any())))

    worker.wait_for_layer_load = wait
    tokens, _, rest, _ = disaggregated(url, ps, True, consumer=consumer)
    assert tokens == reference(colocated, ps, True)
    assert rest["0"]["loaded"] == 64
    assert seen == [(True, False)]  # layer 0 in place, the last layer still on its way
    consumer.close()


def test_in_place_load_of_an_aborted_request_stops_before_its_blocks_are_reused(tmp_path):
    """CPU loads read straight into the paged cache. A request aborted mid-load: the next
    ``get_finished`` waits for the read in progress, and no later part of it is read, so the
    blocks freed by the abort are never written by the store afterwards."""
    import threading
    import time

    url = f"file://{tmp_path}/kv"
    ps = prompts((100,), seed=41)
    producer = engine(url, "producer")
    first = run(producer, [("0", ps[0], params(1, True), None)])
    producer.close()
    consumer = engine(url, "consumer")
    worker = consumer.runner.connector
    assert isinstance(worker.loader, InPlaceLoader)
    worker.loader.per_slot = 2  # several reads per request
    store, events = worker.store, []
    real_get, gate = store.get_many_into, threading.Event()

    def slow_get(keys, *args, **kwargs):
        events.append(time.monotonic())
        gate.wait(5)  # the first read waits for the timer; later ones take 50 ms each
        time.sleep(0.05)
        return real_get(keys, *args, **kwargs)

    store.get_many_into = slow_get
    consumer.add_request(
        "0", ps[0], params(4, True), output_token_ids=first["0"]["tokens"],
        kv_handle=first["0"]["handle"],
    )  # fmt: skip
    consumer.step()  # the load starts; the reader sits in its first read
    while not events:
        time.sleep(0.001)
    consumer.abort(["0"])
    threading.Timer(0.2, gate.set).start()
    start = time.monotonic()
    consumer.step()  # get_finished: waits for the read in progress, cancels the rest
    cancelled_at = time.monotonic()
    assert cancelled_at - start >= 0.15
    time.sleep(0.3)
    consumer.step()
    assert all(t < cancelled_at for t in events)  # no read started after the cancel
    assert len(events) < 4  # and the request's last parts were never read
    consumer.check_integrity()
    assert consumer.num_free_blocks() == consumer.runner.num_blocks
    consumer.close()


def test_a_reader_bug_costs_a_recompute_not_a_hang(tmp_path, colocated, monkeypatch):
    """Whatever goes wrong in the reader thread, every load is still reported (as failed)."""
    url = f"file://{tmp_path}/kv"
    ps = prompts()
    consumer = engine(url, "consumer")
    worker = consumer.runner.connector

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in the reader")

    monkeypatch.setattr(worker.loader, "_get_items", broken)
    tokens, _, rest, _ = disaggregated(url, ps, True, consumer=consumer)
    assert tokens == reference(colocated, ps, True)
    assert all(r["loaded"] == 0 for r in rest.values())
    consumer.close()


def test_the_scheduling_path_never_waits_for_the_store(tmp_path, colocated):
    """Existence checks run on the connector's lookup thread (a request without a handle is
    "not known yet" meanwhile, and others go first); a request with a handle loads what the
    handle names without any check."""
    import threading

    url = f"file://{tmp_path}/kv"
    base = prompts((64,), seed=9)[0]
    a = engine(url, "both")
    run(a, [("a", base, params(1, True), None)])
    a.close()
    b = engine(url, "both")
    store, calls = b.connector[0].store, []
    real_contains = store.contains_many

    def contains(keys):
        calls.append(threading.current_thread().name)
        return real_contains(keys)

    store.contains_many = contains
    longer = base + prompts((20,), seed=10)[0]
    res = run(b, [("b", longer, params(12, True), None)])
    assert res["b"]["loaded"] == 64  # the prefix came from the store
    assert calls and all(name.startswith("kv-lookup") for name in calls), calls
    b.close()
    # a decode-side request with the prefill's handle: no existence check at all
    producer = engine(url, "producer")
    first = run(producer, [("p", longer, params(1, True), None)])
    producer.close()
    consumer = engine(url, "consumer")
    store, calls = consumer.connector[0].store, []
    store.contains_many = lambda keys: calls.append(keys) or [True] * len(keys)
    consumer.add_request(
        "p", longer, params(12, True), output_token_ids=first["p"]["tokens"],
        kv_handle=first["p"]["handle"],
    )  # fmt: skip
    out = []
    while consumer.has_unfinished():
        out += [t for o in consumer.step() for t in o.new_token_ids]
    assert first["p"]["tokens"] + out == reference(colocated, [longer], True)["0"]
    assert calls == []
    assert consumer.runner.connector.num_loaded_blocks == -(-len(longer) // BS)
    consumer.close()


@pytest.mark.parametrize("slow_call", ["lookup", "load"])
def test_an_idle_step_waits_for_the_store_and_wakes_on_its_answer(tmp_path, monkeypatch, slow_call):
    """With only a store lookup or a load in flight, a step neither spins (thousands of empty
    turns stealing the GIL from the store's threads) nor sleeps past the answer: it waits on
    the connector's bell, rung from the store's thread."""
    import threading
    import time

    import common.engine

    url = f"file://{tmp_path}/kv"
    prompt = prompts((64,), seed=13)[0]
    producer = engine(url, "producer")
    first = run(producer, [("p", prompt, params(1, True), None)])
    producer.close()
    consumer = engine(url, "consumer")
    half, name = (0, "contains_many") if slow_call == "lookup" else (1, "get_many_into")
    store, release = consumer.connector[half].store, threading.Event()
    real = getattr(store, name)

    def held(*args):
        release.wait(10.0)
        return real(*args)

    setattr(store, name, held)
    monkeypatch.setattr(common.engine, "IDLE_WAIT_S", 30.0)  # only the bell can end a wait
    handle = None if slow_call == "lookup" else first["p"]["handle"]
    consumer.add_request(
        "p", prompt, params(4, True), output_token_ids=first["p"]["tokens"], kv_handle=handle
    )
    threading.Timer(0.3, release.set).start()
    start, steps = time.monotonic(), 0
    while consumer.scheduler.loading or consumer.scheduler.waiting:
        consumer.step()
        steps += 1
    waited = time.monotonic() - start
    assert 0.25 < waited < 5.0, waited  # woken by the answer, not by the 30 s timeout
    assert steps < 20, steps  # no spinning while the store thread works
    while consumer.has_unfinished():
        consumer.step()
    assert consumer.runner.connector.num_loaded_blocks == 4
    consumer.close()


def test_a_handle_of_another_prompt_is_refused(tmp_path):
    url = f"file://{tmp_path}/kv"
    ps = prompts((40, 40), seed=12)
    producer = engine(url, "producer")
    first = run(producer, [(str(i), p, params(1, True), None) for i, p in enumerate(ps)])
    producer.close()
    consumer = engine(url, "consumer")
    with pytest.raises(ValueError, match="another prompt"):
        consumer.add_request(
            "x", ps[0], params(4, True), output_token_ids=first["0"]["tokens"],
            kv_handle=first["1"]["handle"],
        )  # fmt: skip
    assert not consumer.has_unfinished()
    consumer.close()


@pytest.mark.parametrize("handles", [True, False], ids=["handle", "lookup"])
def test_each_engine_hashes_a_prompt_once(tmp_path, colocated, monkeypatch, handles):
    """The prompt's block hashes are computed once per request per engine: full blocks by the
    request (for prefix caching), the final partial block once by the connector, whatever the
    number of chunks, lookups, loads and saves."""
    import common.block_hash as block_hash

    counted = {"hash_block": 0, "hash_partial_block": 0}

    def counting(name):
        real = getattr(block_hash, name)

        def wrapper(*args, **kwargs):
            counted[name] += 1
            return real(*args, **kwargs)

        return wrapper

    for name in counted:
        monkeypatch.setattr(block_hash, name, counting(name))
    ps = [list(range(5, 5 + n)) for n in (37, 21)]  # 2 and 1 full blocks + partial ones
    tokens, first, *_ = disaggregated(f"file://{tmp_path}", ps, greedy=True, handles=handles)
    full = sum(len(p) // BS for p in ps)
    partial = sum(1 for p in ps if len(p) % BS)
    # Full blocks completed by sampled tokens: the prefix cache hashes those too, once each.
    grown = sum(
        (len(p) + len(first[str(i)]["tokens"])) // BS
        + (len(p) + len(tokens[str(i)])) // BS
        - 2 * (len(p) // BS)
        for i, p in enumerate(ps)
    )
    assert counted["hash_partial_block"] == 2 * partial  # producer and consumer, once each
    assert counted["hash_block"] == 2 * full + grown
