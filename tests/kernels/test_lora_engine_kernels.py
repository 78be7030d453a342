"""The engine's LoRA path through ``kernels/lora.py`` (the CUDA path, interpreted here) gives
the tokens of the CPU's grouped GEMMs, in a step mixing two adapters and the base model."""

from __future__ import annotations

from common import LLM, SamplingParams
from common.models.names import resolve_model_path
from tests.engine.hf_reference import random_prompts
from tests.lora.adapters import ADAPTERS, write_adapter


def test_kernel_path_equals_the_cpu_path(tmp_path):
    model = resolve_model_path("tiny-llama")
    dirs = {
        n: write_adapter(model, tmp_path / n, i, **a) for i, (n, a) in enumerate(ADAPTERS.items())
    }
    prompts = random_prompts(1000, 3, (18, 24), seed=21)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    tokens = []
    for kernels in (False, True):
        with LLM("tiny-llama", enable_lora=True, max_loras=2, num_blocks=256) as llm:
            manager = llm.engine.runner.lora
            assert manager is not None
            manager.kernels = kernels
            loras = [
                None,
                llm.lora("alpha", str(dirs["alpha"])),
                llm.lora("beta", str(dirs["beta"])),
            ]
            outs = llm.generate(prompts, greedy, use_tqdm=False, lora_request=loras)
            tokens.append([o.outputs[0].token_ids for o in outs])
    assert tokens[0] == tokens[1]
