"""A sparse MoE MLP's decode step on the CPU in one native call (``csrc/moe_cpu.c``): router,
top-k, the chosen experts' SwiGLU MLPs and their weighted sum, for steps of few tokens.

``common/models/moe.py`` takes it on the CPU for up to ``GATHER_MAX_ASSIGNMENTS`` (token,
expert) assignments, one device, weights in the model dtype (fp32 or bf16): one dispatched op
for the whole sparse MLP where the PyTorch path takes 12. :func:`ref_moe_decode` is that path
(``route`` + ``gathered_experts``); the kernel rounds at its points and sums in its own order
(``tests/kernels/test_moe_cpu.py`` holds it to the ref within fp32 reassociation).
"""

from __future__ import annotations

import torch

from kernels import native


def moe_decode_cpu(
    x: torch.Tensor,
    router: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    top_k: int,
    renormalize: bool,
    fp32_weights: bool,
) -> torch.Tensor:
    """``(T, H)``: Σ over each token's ``top_k`` experts of routing weight × expert MLP.

    ``x (T, H)``, ``router (E, H)``, ``gate_up (E, 2 I, H)`` (gate rows, then up rows), ``down
    (E, H, I)``, one dtype (fp32 or bf16; another, or no compiler: the ref). ``renormalize``:
    the top-k weights divided by their sum; ``fp32_weights``: they multiply in fp32 (Mixtral),
    else rounded to the model dtype first (Qwen3-MoE). Mutates no input."""
    native.check_cpu(x)
    lib = native.library_for(x.dtype)
    same = all(t.dtype == x.dtype for t in (router, gate_up, down))
    if lib is None or not same:
        return ref_moe_decode(x, router, gate_up, down, top_k, renormalize, fp32_weights)
    x, router = x.contiguous(), router.contiguous()
    gate_up, down = gate_up.contiguous(), down.contiguous()
    num_experts, two_inter, hidden = gate_up.shape
    out = x.new_empty(x.shape[0], hidden)
    status = lib.pdserve_moe_decode(
        out.data_ptr(), x.data_ptr(), router.data_ptr(), gate_up.data_ptr(), down.data_ptr(),
        x.shape[0], hidden, two_inter // 2, num_experts, top_k, int(renormalize),
        int(fp32_weights), native.DTYPE_CODES[x.dtype], torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise MemoryError("moe_decode: no memory for its scratch rows")
    return out


def ref_moe_decode(
    x: torch.Tensor,
    router: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    top_k: int,
    renormalize: bool,
    fp32_weights: bool,
) -> torch.Tensor:
    """:func:`moe_decode_cpu` in PyTorch: HF's router, then the gathered experts."""
    from common.models.moe import route
    from common.models.moe_experts import gathered_experts

    logits = torch.nn.functional.linear(x, router)
    dtype = torch.float32 if fp32_weights else logits.dtype
    weights, ids = route(logits, top_k, renormalize, dtype)
    return gathered_experts(x, gate_up, down, weights, ids)
