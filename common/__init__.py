"""pdserve's engine library: everything prefill and decode nodes share."""

from common.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "RequestOutput", "SamplingParams", "StructuredOutputsParams"]


def __getattr__(name: str):
    # LLM pulls in torch and transformers; keep ``import common`` light for the CLI and router.
    if name == "LLM":
        from common.llm import LLM

        return LLM
    if name == "RequestOutput":
        from common.output_processor import RequestOutput

        return RequestOutput
    raise AttributeError(name)
