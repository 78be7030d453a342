"""The ``torch.ops.pdserve.*`` ops on CPU tensors (the native kernels of csrc/fused_ops_cpu.c)
against their refs, which the other kernel tests hold bit-exact to HF transformers.

The native kernels repeat the refs' PyTorch computation bit for bit on x86 with AVX2 (where
PyTorch's CPU kernels run their AVX2 code, on AVX-512 machines too), so float32 and bfloat16
are compared with ``torch.equal``: the RMSNorm sum of squares is added in PyTorch's cascade
order, SiLU's exp is SLEEF's, every model-dtype op rounds where HF's does. Elsewhere (another
ISA: another vector width, another exp) the sum's order and the exp may differ, which moves a
result by an ulp: float32 is then held to 4 ulps (2^-21 relative), bfloat16 to 1 ulp (2^-7).
SiLU widths that are not a multiple of PyTorch's vector step (32) get that tolerance anyway:
PyTorch computes the remainder of a row with libm's exp. float16 runs the refs themselves.
"""

from __future__ import annotations

import importlib
import subprocess
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import kernels.ops
from kernels import cpu_attention, native
from kernels.activation import ref_silu_and_mul, silu_and_mul_cpu
from kernels.paged_decode_attention import ref_paged_decode_attention
from kernels.rms_norm import (
    fused_add_rms_norm_cpu,
    ref_fused_add_rms_norm,
    ref_rms_norm,
    rms_norm_cpu,
)
from kernels.rotary import ref_rotary_embedding_and_cache, rotary_embedding_and_cache_cpu
from tests.kernels.conftest import build_paged_context
from tests.kernels.test_rotary import rotary_inputs

CPU = torch.device("cpu")
OPS = torch.ops.pdserve
EPS = 1e-5
EXACT = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
DTYPES = [torch.float32, torch.bfloat16]


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, exact: bool = EXACT) -> None:
    if exact:
        assert torch.equal(actual, expected)
    else:
        rtol = 2**-21 if actual.dtype == torch.float32 else 2**-7
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol, equal_nan=True)


def test_one_library_holds_all_native_kernels() -> None:
    lib = native.load_library()
    assert lib is not None, native.load_error()
    assert lib is cpu_attention.load_library()
    assert lib.pdserve_paged_decode and lib.pdserve_rms_norm and lib.pdserve_silu_and_mul


ROWS = [  # (num_tokens, hidden): decode batches of a tiny and a Llama-3.2-1B width; odd widths
    (1, 256),
    (16, 256),
    (64, 256),
    (1, 2048),
    (64, 2048),  # above the kernel's threshold: rows spread over threads
    (3, 7),  # below one vector: PyTorch sums element by element
    (5, 100),  # whole vectors and a remainder
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_tokens", "hidden"), ROWS)
def test_rms_norm(num_tokens, hidden, dtype) -> None:
    x = (3 * torch.randn(num_tokens, hidden + 8)).to(dtype)[:, :hidden]  # strided rows
    residual = torch.randn(num_tokens, hidden).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden)).to(dtype)
    assert_matches(OPS.rms_norm(x, weight, EPS), ref_rms_norm(x, weight, EPS))
    out, residual_out = OPS.fused_add_rms_norm(x, residual, weight, EPS)
    expected_out, expected_residual = ref_fused_add_rms_norm(x, residual, weight, EPS)
    assert torch.equal(residual_out, expected_residual)  # one rounded add
    assert_matches(out, expected_out)


@pytest.mark.parametrize("threads", [1, 2])
def test_threads_split_rows_without_changing_them(threads) -> None:
    x, weight = torch.randn(64, 2048), torch.randn(2048)
    gate_up = torch.randn(64, 2 * 2048)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert_matches(OPS.rms_norm(x, weight, EPS), ref_rms_norm(x, weight, EPS))
        assert_matches(OPS.silu_and_mul(gate_up), ref_silu_and_mul(gate_up))
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_tokens", "intermediate"), [(1, 1024), (16, 1024), (64, 8192)])
def test_silu_and_mul(num_tokens, intermediate, dtype) -> None:
    x = (4 * torch.randn(num_tokens, 2 * intermediate + 32)).to(dtype)[:, : 2 * intermediate]
    assert_matches(OPS.silu_and_mul(x), ref_silu_and_mul(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_special_values(dtype) -> None:
    """SLEEF's exp saturates below -104 and above 100; infinities, NaN, zeros, subnormals."""
    special = [0.0, -0.0, 1e-40, -1e-40, 88.0, 89.0, 99.9, 100.5, 103.9, 104.5, 1e4]
    special += [-88.0, -89.0, -99.9, -100.5, -103.9, -104.5, -1e4, float("inf"), -float("inf")]
    gate = torch.randn(2, 64)
    gate[0, : len(special)] = torch.tensor(special)
    gate[1, 0] = float("nan")
    x = torch.cat((gate, torch.randn(2, 64)), dim=-1).to(dtype)
    got, want = OPS.silu_and_mul(x), ref_silu_and_mul(x)
    assert torch.equal(got.isnan(), want.isnan())
    assert_matches(got.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_width_with_a_remainder(dtype) -> None:
    x = (4 * torch.randn(5, 2 * 100)).to(dtype)
    assert_matches(OPS.silu_and_mul(x), ref_silu_and_mul(x), exact=False)


ROTARY_CASES = [  # (dtype, block_size, num_heads, num_kv_heads, head_dim)
    (torch.float32, 16, 32, 8, 64),  # Llama-3.2-1B
    (torch.bfloat16, 32, 32, 8, 64),
    (torch.bfloat16, 16, 8, 2, 128),
    (torch.float32, 32, 4, 4, 128),
]


@pytest.mark.parametrize(
    ("dtype", "block_size", "num_heads", "num_kv_heads", "head_dim"), ROTARY_CASES
)
def test_rotary_embedding_and_cache(dtype, block_size, num_heads, num_kv_heads, head_dim) -> None:
    """Exact on every ISA (no reduction anywhere). The layer is the middle one of a three-layer
    cache: the padding tokens' (and everyone's) writes stay inside it."""
    args = rotary_inputs(dtype, block_size, num_heads, num_kv_heads, head_dim, CPU, row_padding=8)
    cache = torch.stack([torch.randn_like(args.kv_cache_layer), args.kv_cache_layer] * 2)[:3]
    args = args._replace(kv_cache_layer=cache[1])
    expected_cache = cache.clone()
    expected = ref_rotary_embedding_and_cache(*args._replace(kv_cache_layer=expected_cache[1]))
    assert torch.equal(OPS.rotary_embedding_and_cache(*args), expected)
    assert torch.equal(cache, expected_cache)


def test_rotary_refuses_positions_and_slots_out_of_range() -> None:
    args = rotary_inputs(torch.float32, 16, 4, 2, 64, CPU)
    num_slots = args.kv_cache_layer.shape[1] * 16
    before = args.kv_cache_layer.clone()
    bad = [
        args._replace(positions=args.positions.clone().fill_(args.cos_sin_cache.shape[0])),
        args._replace(positions=args.positions.clone().fill_(-1)),
        args._replace(slot_mapping=torch.full_like(args.slot_mapping, num_slots)),
    ]
    for case in bad:
        with pytest.raises(ValueError, match="nothing was written"):
            OPS.rotary_embedding_and_cache(*case)
        assert torch.equal(args.kv_cache_layer, before)


def test_empty_batches() -> None:
    x, weight = torch.randn(0, 64), torch.randn(64)
    assert OPS.rms_norm(x, weight, EPS).shape == (0, 64)
    assert [t.shape for t in OPS.fused_add_rms_norm(x, x, weight, EPS)] == [(0, 64)] * 2
    assert OPS.silu_and_mul(x).shape == (0, 32)
    args = rotary_inputs(torch.float32, 16, 4, 2, 64, CPU)
    none = torch.empty(0, dtype=torch.int64)
    args = args._replace(qkv=args.qkv[:0], positions=none, slot_mapping=none)
    assert OPS.rotary_embedding_and_cache(*args).shape == (0, 4, 64)


def test_float16_runs_the_refs() -> None:
    x, weight = torch.randn(4, 64).half(), torch.randn(64).half()
    assert torch.equal(OPS.rms_norm(x, weight, EPS), ref_rms_norm(x, weight, EPS))
    assert torch.equal(OPS.silu_and_mul(x), ref_silu_and_mul(x))


def test_paged_decode_attention_op() -> None:
    """The op wraps cpu_attention into a fresh output: decode rows computed, others unwritten."""
    ctx = build_paged_context([33, 5, 70], 16, 2, 64, torch.float32, CPU)
    q = torch.randn(3, 4, 64)
    starts = torch.arange(4, dtype=torch.int32)
    out = OPS.paged_decode_attention_cpu(
        q, ctx.kv_cache_layer, ctx.block_tables, ctx.seq_lens, starts, 70, 0.125
    )
    direct = torch.zeros_like(q)
    cpu_attention.paged_decode_attention(
        q, ctx.kv_cache_layer, ctx.block_tables, ctx.seq_lens, starts, 70, 0.125, direct
    )
    assert torch.equal(out, direct)
    expected = ref_paged_decode_attention(
        q, ctx.kv_cache_layer, ctx.block_tables, ctx.seq_lens, 0.125
    )
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def _bad_rms_norm(change):
    args = {"x": torch.randn(3, 64), "weight": torch.randn(64), "eps": EPS}
    change(args)
    return lambda: OPS.rms_norm(**args)


def _bad_fused_add(change):
    x = torch.randn(3, 64)
    args = {"x": x, "residual": torch.randn(3, 64), "weight": torch.randn(64), "eps": EPS}
    change(args)
    return lambda: OPS.fused_add_rms_norm(**args)


def _bad_silu(change):
    args = {"x": torch.randn(3, 64)}
    change(args)
    return lambda: OPS.silu_and_mul(**args)


def _rope_args():
    return rotary_inputs(torch.float32, 16, 4, 2, 64, CPU)


def _bad_rotary(change):
    args = _rope_args()._asdict()
    change(args)
    return lambda: OPS.rotary_embedding_and_cache(*args.values())


BAD_ARGUMENTS = [
    (_bad_rms_norm, lambda a: a.update(x=a["x"][0]), "x must have shape"),
    (_bad_rms_norm, lambda a: a.update(x=a["x"].int()), "x must have dtype"),
    (_bad_rms_norm, lambda a: a.update(x=a["x"].t().contiguous().t()), "x must be contiguous"),
    (_bad_rms_norm, lambda a: a.update(weight=a["weight"][:32]), "weight must have shape"),
    (_bad_rms_norm, lambda a: a.update(weight=a["weight"].half()), "weight must have dtype"),
    (_bad_fused_add, lambda a: a.update(residual=a["residual"][:2]), "residual must have shape"),
    (_bad_fused_add, lambda a: a.update(residual=a["residual"].double()), "residual must have"),
    (_bad_silu, lambda a: a.update(x=a["x"][:, :63]), "even width"),
    (_bad_silu, lambda a: a.update(x=a["x"].long()), "x must have dtype"),
    (_bad_silu, lambda a: a.update(x=a["x"][None]), "x must have shape"),
    (_bad_rotary, lambda a: a.update(num_kv_heads=3), "kv_cache_layer must have shape"),
    (_bad_rotary, lambda a: a.update(num_heads=3), "positive multiple of num_kv_heads"),
    (_bad_rotary, lambda a: a.update(qkv=a["qkv"][:, :-64]), "qkv must have shape"),
    (_bad_rotary, lambda a: a.update(qkv=a["qkv"][None]), "qkv must have shape"),
    (_bad_rotary, lambda a: a.update(qkv=a["qkv"].double()), "qkv must have dtype"),
    (_bad_rotary, lambda a: a.update(positions=a["positions"].int()), "positions must have dtype"),
    (_bad_rotary, lambda a: a.update(slot_mapping=a["slot_mapping"][:3]), "slot_mapping must"),
    (_bad_rotary, lambda a: a.update(cos_sin_cache=a["cos_sin_cache"][:, :32]), "cos_sin_cache"),
    (_bad_rotary, lambda a: a.update(cos_sin_cache=a["cos_sin_cache"][0]), "cos_sin_cache must"),
    (
        _bad_rotary,
        lambda a: a.update(kv_cache_layer=a["kv_cache_layer"].transpose(2, 3).contiguous()),
        "kv_cache_layer must have shape",
    ),
    (
        _bad_rotary,
        lambda a: a.update(kv_cache_layer=a["kv_cache_layer"][:, :, ::2]),
        "kv_cache_layer must be contiguous",
    ),
]


@pytest.mark.parametrize(("make", "change", "message"), BAD_ARGUMENTS)
def test_rejects_bad_arguments(make, change, message) -> None:
    call = make(change)
    with pytest.raises(ValueError, match=message):
        call()


def test_native_launchers_refuse_other_devices() -> None:
    """Called directly (not through the dispatcher, which routes only CPU tensors to them), the
    launchers refuse a device whose memory the C code cannot read."""
    x, weight = torch.randn(3, 64, device="meta"), torch.randn(64, device="meta")
    rope = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in _rope_args()]
    calls = [
        lambda: rms_norm_cpu(x, weight, EPS),
        lambda: fused_add_rms_norm_cpu(x, x, weight, EPS),
        lambda: silu_and_mul_cpu(x),
        lambda: rotary_embedding_and_cache_cpu(*rope),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="need CPU tensors, got meta"):
            call()


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_each_op_is_one_dispatched_op() -> None:
    x, residual, weight = torch.randn(4, 64), torch.randn(4, 64), torch.randn(64)
    rope = rotary_inputs(torch.float32, 16, 4, 2, 64, CPU)
    with _OpCounter() as counter:
        OPS.rms_norm(x, weight, EPS)
        OPS.fused_add_rms_norm(x, residual, weight, EPS)
        OPS.silu_and_mul(x)
        OPS.rotary_embedding_and_cache(*rope)
    assert counter.ops == [
        "pdserve.rms_norm.default",
        "pdserve.fused_add_rms_norm.default",
        "pdserve.silu_and_mul.default",
        "pdserve.rotary_embedding_and_cache.default",
    ]
    with _OpCounter() as counter:
        ref_rms_norm(x, weight, EPS)
    assert len(counter.ops) >= 5  # what one op replaces


def test_fake_impls_give_shapes() -> None:
    rope = rotary_inputs(torch.bfloat16, 16, 4, 2, 64, CPU)
    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.randn(4, 96))
        weight = mode.from_tensor(torch.randn(96))
        fake_rope = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in rope]
        assert OPS.rms_norm(x, weight, EPS).shape == (4, 96)
        assert [t.shape for t in OPS.fused_add_rms_norm(x, x, weight, EPS)] == [(4, 96)] * 2
        assert OPS.silu_and_mul(x).shape == (4, 48)
        q = OPS.rotary_embedding_and_cache(*fake_rope)
        assert q.shape == (9, 4, 64) and q.dtype == torch.bfloat16


def test_importing_the_registrations_again_keeps_them() -> None:
    x, weight = torch.randn(2, 32), torch.randn(32)
    importlib.reload(kernels.ops)
    assert torch.equal(OPS.rms_norm(x, weight, EPS), ref_rms_norm(x, weight, EPS))


def test_without_a_compiler_the_ops_run_the_refs(monkeypatch, tmp_path, caplog) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "_library", None)
    monkeypatch.setattr(native, "_load_error", None)
    monkeypatch.setattr(native, "_compiler", lambda: "/bin/false")
    x, weight = torch.randn(3, 64), torch.randn(64)
    assert torch.equal(OPS.rms_norm(x, weight, EPS), ref_rms_norm(x, weight, EPS))
    assert torch.equal(OPS.silu_and_mul(x), ref_silu_and_mul(x))
    assert "failed" in (native.load_error() or "")
    assert "native CPU kernels unavailable" in caplog.text


def test_each_source_compiles_with_its_own_flags(monkeypatch, tmp_path) -> None:
    """The commands of a cold build (not run: test_cpu_attention builds for real): one compile
    per source, the fused ops and the sampler without FMA contraction or fast math (attention and
    the MoE step with it, compiling only), one link of all."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    calls: list[list[str]] = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        Path(cmd[cmd.index("-o") + 1]).touch()
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(native.subprocess, "run", fake_run)
    built = native._build()
    *compiles, link = calls
    assert [cmd[cmd.index("-c") + 1] for cmd in compiles] == [str(s.path) for s in native.SOURCES]
    assert all(cmd[cmd.index("-I") + 1] == str(native.HEADERS[0].parent) for cmd in compiles)
    attention, fused, sampler, moe = compiles
    assert "-ffast-math" in attention and "-ffast-math" in moe  # sums in their own order
    assert "-ffp-contract=off" in fused and "-ffast-math" not in fused
    assert "-ffp-contract=off" in sampler and "-ffast-math" not in sampler  # libm's expf/logf
    assert [c for c in link if c.endswith(".o")] == [cmd[cmd.index("-o") + 1] for cmd in compiles]
    assert "-ffast-math" not in link  # linking it would turn on flush-to-zero process-wide
    assert Path(link[link.index("-o") + 1]).name == built.name  # in a temp dir, then published
    assert built.is_file() and built.parent.parent == tmp_path / "kernels"


def test_a_header_change_is_a_new_build(monkeypatch, tmp_path) -> None:
    """The cache key hashes the headers the sources include, not only the sources."""
    assert "bf16.h" in [h.name for h in native.HEADERS]
    header = tmp_path / "bf16.h"
    header.write_text(native.HEADERS[0].read_text())
    monkeypatch.setattr(native, "HEADERS", (header,))
    key = native._cache_key("cc")
    header.write_text(header.read_text() + "\n/* changed */\n")
    assert native._cache_key("cc") != key
