"""The names the router serves, as vLLM's ``--served-model-name``: a list, the first in
responses; once given, the model's path is not one of them (vLLM answers 404)."""

from __future__ import annotations

import argparse

from router.config import RouterConfig, add_arguments
from router.server import build_router


def _router(*argv: str):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return build_router(RouterConfig.from_args(parser.parse_args(["--model", "tiny-llama", *argv])))


def test_served_names_replace_the_models() -> None:
    served = _router("--served-model-name", "chat", "chat-v2").core.served
    assert served.name == "chat"
    assert [served.matches(n) for n in ("chat", "chat-v2", "tiny-llama", "other")] == [
        True, True, False, False,
    ]  # fmt: skip


def test_without_a_served_name_the_model_answers_to_its_name_and_path() -> None:
    served = _router().core.served
    assert served.name == "tiny-llama" and served.matches("tiny-llama") and not served.matches("x")
