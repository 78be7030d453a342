"""The router's side of LoRA: only nodes listing an adapter get its requests, the adapters
the pool serves are what ``model`` may name, and prefix affinity never pairs an adapter's
prompt with the base model's cache."""

from __future__ import annotations

from pdserve_proto.nodes import NodeLoad

from router.registry import Role
from tests.router.test_registry import INFO, Clock, make


def _pool():
    registry = make(Clock())
    registry.register("p0", Role.PREFILL, "h:1", INFO)
    registry.register("p1", Role.PREFILL, "h:2", INFO)
    registry.register("d0", Role.DECODE, "h:3", INFO)
    registry.heartbeat("p0", NodeLoad(lora_adapters=("alpha",)))
    registry.heartbeat("p1", NodeLoad(lora_adapters=("alpha", "beta")))
    registry.heartbeat("d0", NodeLoad(lora_adapters=("beta",)))
    return registry


def test_only_nodes_serving_the_adapter_are_candidates() -> None:
    registry = _pool()
    ids = lambda role, lora: [i.instance_id for i in registry.candidates(role, lora=lora)]  # noqa: E731
    assert ids(Role.PREFILL, "") == ["p0", "p1"]
    assert ids(Role.PREFILL, "alpha") == ["p0", "p1"]
    assert ids(Role.PREFILL, "beta") == ["p1"]
    assert ids(Role.DECODE, "alpha") == []  # no decode node has it: no path, never base weights
    assert ids(Role.DECODE, "beta") == ["d0"]
    assert registry.lora_adapters() == {"alpha", "beta"}


def test_affinity_hashes_are_salted_by_the_adapter() -> None:
    from router.flow import RequestFlow

    class _Flow:
        registry = _pool()

    prompt = list(range(3, 60))
    base = RequestFlow.prompt_info(_Flow(), prompt)  # type: ignore[arg-type]
    alpha = RequestFlow.prompt_info(_Flow(), prompt, "alpha")  # type: ignore[arg-type]
    beta = RequestFlow.prompt_info(_Flow(), prompt, "beta")  # type: ignore[arg-type]
    assert len(base.block_hashes) == 3
    assert not set(base.block_hashes) & set(alpha.block_hashes)
    assert not set(alpha.block_hashes) & set(beta.block_hashes)
