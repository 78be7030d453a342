"""benchmarks/request_path.py on a live cluster: the counts it reports are the path's own.

The block-hash counts double as the check of issue 15's "hashes once per process that needs
them": the router (its prefix-affinity balancer) hashes the full blocks, each engine the full
blocks once plus the final partial block once (its store name), and nothing else hashes.
"""

import argparse

from benchmarks.request_path import run


def test_one_request_path_counted():
    prompt_tokens, max_tokens, block = 40, 8, 16  # 2 full blocks + 1 partial (default block)
    report = run(argparse.Namespace(prompt_tokens=prompt_tokens, max_tokens=max_tokens, idle_s=0.5))
    assert report["stream_events"] >= max_tokens
    processes = report["processes"]
    assert set(processes) == {
        "router", "prefill", "decode", "prefill engine core", "decode engine core"
    }  # fmt: skip
    full = prompt_tokens // block
    assert processes["router"]["block_hashes"] == full
    assert processes["prefill"]["block_hashes"] == processes["decode"]["block_hashes"] == 0
    assert processes["prefill engine core"]["block_hashes"] == full + 1
    # + the block the decoded tokens fill (40 + 8 tokens: a third full block)
    grown = (prompt_tokens + max_tokens) // block - full
    assert processes["decode engine core"]["block_hashes"] == full + 1 + grown
    # the decode node loads what the handle names in one batch, asking the store nothing first
    assert processes["decode engine core"]["store_calls"] == {"get_many_into": 1}
    assert processes["prefill engine core"]["store_calls"].get("put_many") == 1
    assert not [f for f in processes["decode"]["files"] if f.startswith("kv_transfer/")]
