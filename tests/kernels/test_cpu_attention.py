"""The native CPU decode attention (kernels/cpu_attention.py) against the PyTorch reference.

The kernel is built by the test run itself (gcc on these machines and on CI); a machine without
a compiler would fail ``test_library_builds`` rather than skip, since the engine then silently
loses its fast path. Head sizes 32/64/128 run the specialised copies, 80 the generic loop.
"""

from __future__ import annotations

import random
import subprocess

import pytest
import torch

from common import LLM, SamplingParams
from common.attention import AttentionMetadata, CpuAttentionBackend, get_attention_backend
from kernels import cpu_attention, native
from kernels.paged_decode_attention import ref_paged_decode_attention
from tests.kernels.conftest import TOLERANCES, build_paged_context

CPU = torch.device("cpu")

CASES = [  # (dtype, block_size, head_dim, num_heads, num_kv_heads)
    pytest.param(torch.float32, 16, 32, 4, 2, id="fp32-bs16-d32-gqa2"),
    pytest.param(torch.float32, 16, 64, 4, 4, id="fp32-bs16-d64-gqa1"),
    pytest.param(torch.float32, 32, 128, 8, 1, id="fp32-bs32-d128-gqa8"),
    pytest.param(torch.float32, 16, 80, 6, 2, id="fp32-bs16-d80-generic"),
    pytest.param(torch.bfloat16, 16, 128, 8, 2, id="bf16-bs16-d128-gqa4"),
    pytest.param(torch.bfloat16, 32, 80, 4, 1, id="bf16-bs32-d80-generic"),
]


def _decode_call(q, ctx, out=None, query_start_loc=None, scale=0.125):
    num_seqs = ctx.seq_lens.shape[0]
    if query_start_loc is None:
        query_start_loc = torch.arange(num_seqs + 1, dtype=torch.int32)
    out = torch.zeros_like(q) if out is None else out
    max_len = int(ctx.seq_lens.max()) if num_seqs else 0
    return cpu_attention.paged_decode_attention(
        q, ctx.kv_cache_layer, ctx.block_tables, ctx.seq_lens, query_start_loc, max_len, scale, out
    )


def test_library_builds() -> None:
    assert cpu_attention.load_library() is not None, cpu_attention.load_error()


@pytest.mark.parametrize(("dtype", "block_size", "head_dim", "num_heads", "num_kv_heads"), CASES)
def test_matches_ref(dtype, block_size, head_dim, num_heads, num_kv_heads) -> None:
    # one token, exactly one block, a ragged length, several blocks plus a ragged tail
    seq_lens = [1, block_size, 37, 5 * block_size + 3]
    ctx = build_paged_context(seq_lens, block_size, num_kv_heads, head_dim, dtype, CPU)
    q = torch.randn(len(seq_lens), num_heads, head_dim).to(dtype)
    out = _decode_call(q, ctx, scale=head_dim**-0.5)
    expected = ref_paged_decode_attention(
        q, ctx.kv_cache_layer, ctx.block_tables, ctx.seq_lens, head_dim**-0.5
    )
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("partition_size", [16, 48, 0])
def test_split_contexts_match_ref(dtype, partition_size) -> None:
    """Contexts cut into partitions (forced sizes, and the automatic choice for one long MQA
    sequence on few threads) merge to the same output; short rows stay whole beside them."""
    seq_lens = [1, 16, 47, 700, 1500]
    ctx = build_paged_context(seq_lens, 16, 1, 64, dtype, CPU)
    q = torch.randn(len(seq_lens), 4, 64).to(dtype)
    out = torch.zeros_like(q)
    starts = torch.arange(len(seq_lens) + 1, dtype=torch.int32)
    cpu_attention.paged_decode_attention(
        q,
        ctx.kv_cache_layer,
        ctx.block_tables,
        ctx.seq_lens,
        starts,
        1500,
        0.125,
        out,
        partition_size=partition_size,
    )
    expected = ref_paged_decode_attention(
        q, ctx.kv_cache_layer, ctx.block_tables, ctx.seq_lens, 0.125
    )
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)


def test_single_long_sequence_is_split_automatically() -> None:
    """One sequence, one kv head: without partitions only one thread could work on it."""
    ctx = build_paged_context([3000], 16, 1, 128, torch.float32, CPU)
    q = torch.randn(1, 8, 128)
    starts = torch.arange(2, dtype=torch.int32)
    expected = ref_paged_decode_attention(
        q, ctx.kv_cache_layer, ctx.block_tables, ctx.seq_lens, 0.1
    )
    for threads in (1, 2, 4):
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            out = cpu_attention.paged_decode_attention(
                q,
                ctx.kv_cache_layer,
                ctx.block_tables,
                ctx.seq_lens,
                starts,
                3000,
                0.1,
                torch.zeros_like(q),
            )
        finally:
            torch.set_num_threads(previous)
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_mixed_batch_leaves_prefill_rows_and_handles_many_sequences() -> None:
    """Rows of sequences with a longer query stay untouched; 40 sequences spread over threads."""
    rng = random.Random(0)
    query_lens = [rng.choice([1, 1, 1, 3]) for _ in range(40)]
    seq_lens = [rng.randint(q, 300) for q in query_lens]
    ctx = build_paged_context(seq_lens, 16, 2, 64, torch.float32, CPU)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(starts[-1]), 8, 64)
    sentinel = torch.full_like(q, 7.0)
    out = _decode_call(q, ctx, out=sentinel.clone(), query_start_loc=starts)
    decode = [s for s, n in enumerate(query_lens) if n == 1]
    rows = starts[decode].long()
    expected = ref_paged_decode_attention(
        q[rows], ctx.kv_cache_layer, ctx.block_tables[decode], ctx.seq_lens[decode], 0.125
    )
    torch.testing.assert_close(out[rows], expected, atol=1e-4, rtol=1e-4)
    untouched = torch.ones(q.shape[0], dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(out[untouched], sentinel[untouched])


def test_zero_length_rows_are_left_alone() -> None:
    ctx = build_paged_context([33, 0, 9], 16, 1, 64, torch.float32, CPU)
    q = torch.randn(3, 2, 64)
    out = _decode_call(q, ctx, out=torch.full_like(q, 3.0))
    assert torch.equal(out[1], torch.full_like(out[1], 3.0))


BAD_ARGUMENTS = [
    (lambda a: a.update(q=a["q"].half(), out=a["out"].half()), "dtypes"),
    (lambda a: a.update(kv=a["kv"].double()), "dtypes"),
    (lambda a: a.update(tables=a["tables"].long()), "block_tables must be torch.int32"),
    (lambda a: a.update(lens=a["lens"].long()), "seq_lens must be torch.int32"),
    (lambda a: a.update(starts=a["starts"][:2]), "query_start_loc"),
    (lambda a: a.update(tables=a["tables"][:1]), "block_tables"),
    (lambda a: a.update(q=a["q"][:, :3], out=a["out"][:, :3]), "does not fit"),
    (lambda a: a.update(out=a["out"][:1]), "out"),
    (lambda a: a.update(tables=a["tables"].t().contiguous().t()), "contiguous"),
    (lambda a: a.update(lens=a["lens"][:, None]), "seq_lens must have shape"),
    (lambda a: a.update(q=a["q"].to("meta"), out=a["out"].to("meta")), "CPU tensors"),
]


@pytest.mark.parametrize(("change", "message"), BAD_ARGUMENTS)
def test_rejects_bad_arguments(change, message) -> None:
    ctx = build_paged_context([20, 41], 16, 2, 64, torch.float32, CPU)
    q = torch.randn(2, 4, 64)
    args = {
        "q": q,
        "kv": ctx.kv_cache_layer,
        "tables": ctx.block_tables,
        "lens": ctx.seq_lens,
        "starts": torch.arange(3, dtype=torch.int32),
        "out": torch.zeros_like(q),
    }
    change(args)
    with pytest.raises(ValueError, match=message):
        cpu_attention.paged_decode_attention(
            args["q"],
            args["kv"],
            args["tables"],
            args["lens"],
            args["starts"],
            41,
            0.1,
            args["out"],
        )


def test_lengths_beyond_max_seq_len_are_refused_not_overrun() -> None:
    ctx = build_paged_context([20, 41], 16, 2, 64, torch.float32, CPU)
    q = torch.randn(2, 4, 64)
    starts = torch.arange(3, dtype=torch.int32)
    call = cpu_attention.paged_decode_attention
    with pytest.raises(ValueError, match="longer than max_seq_len 30"):
        call(q, ctx.kv_cache_layer, ctx.block_tables, ctx.seq_lens, starts, 30, 0.1, q.clone())
    with pytest.raises(ValueError, match="block tables' reach"):
        call(q, ctx.kv_cache_layer, ctx.block_tables, ctx.seq_lens, starts, 99, 0.1, q.clone())


def test_backend_matches_torch_backend_on_a_mixed_batch() -> None:
    """The backend (kernel for decodes, SDPA for prefill chunks) equals the PyTorch backend."""
    query_lens, seq_lens = [1, 5, 1, 16, 1], [30, 5, 1, 40, 65]
    ctx = build_paged_context(seq_lens, 16, 2, 32, torch.float32, CPU)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(
        query_start_loc=starts,
        seq_lens=ctx.seq_lens,
        block_tables=ctx.block_tables,
        slot_mapping=torch.zeros(int(starts[-1]), dtype=torch.long),
        query_lens=query_lens,
        seq_lens_cpu=seq_lens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
    q = torch.randn(int(starts[-1]), 4, 32)
    got = CpuAttentionBackend().attend(q, ctx.kv_cache_layer, meta, 0.2)
    want = get_attention_backend("torch", CPU).attend(q, ctx.kv_cache_layer, meta, 0.2)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_auto_picks_the_native_kernel_on_cpu() -> None:
    assert get_attention_backend("auto", CPU).name == "cpu"


def test_build_failure_falls_back_to_torch(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "_library", None)
    monkeypatch.setattr(native, "_load_error", None)
    monkeypatch.setattr(native, "_compiler", lambda: "/bin/false")
    assert cpu_attention.load_library() is None
    assert "failed" in (cpu_attention.load_error() or "")
    assert get_attention_backend("auto", CPU).name == "torch"
    with pytest.raises(RuntimeError, match="native CPU attention unavailable"):
        get_attention_backend("cpu", CPU)
    assert not list(tmp_path.glob("kernels/*/*.so"))  # nothing half-built was published


def test_fresh_build_is_published_once(monkeypatch, tmp_path) -> None:
    """A cold cache compiles into a temp dir and publishes it; a second load reuses it."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    calls: list[list[str]] = []
    real_run = subprocess.run

    def counting_run(cmd, **kwargs):
        calls.append(cmd)
        return real_run(cmd, **kwargs)

    monkeypatch.setattr(native.subprocess, "run", counting_run)
    first = native._build()
    assert first.exists() and first.parent.parent == tmp_path / "kernels"
    builds = len(native.SOURCES) + 1  # one compile per source, one link
    assert len(calls) == builds
    assert native._build() == first and len(calls) == builds
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no object file left
    assert first.parent.stat().st_mode & 0o777 == 0o755  # loadable by other users of the cache


def test_engine_greedy_matches_torch_backend() -> None:
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (1, 16, 17, 45, 70, 130)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    args = dict(model="tiny-llama", max_num_batched_tokens=48, num_blocks=96, max_model_len=512)
    args["device"] = "cpu"  # the cpu backend needs a CPU engine, also on a CUDA host
    native = LLM(attention_backend="cpu", **args)
    assert native.engine.runner.backend.name == "cpu"
    reference = LLM(attention_backend="torch", **args)
    want = [o.outputs[0].token_ids for o in reference.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in native.generate(prompts, params, use_tqdm=False)]
    assert got == want
    native.check_integrity()
