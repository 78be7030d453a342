"""Prompts at the router: tokenizer, chat template, context-length and vocabulary checks.

Text prompts are tokenized exactly as the offline ``LLM`` does (``tokenizer.encode(text)``, so
the model's BOS is added); chat messages are rendered with the tokenizer's own chat template and
tokenized without adding special tokens again (the template already holds them).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from router.errors import invalid_request

_DEFAULT_MAX_MODEL_LEN = 2048


class PromptProcessor:
    """Owns the tokenizer; turns client prompts into token ids and validates lengths.

    Stateless after construction: safe to share between concurrent requests.
    """

    def __init__(self, model_dir: Path, max_model_len: int | None = None) -> None:
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(model_dir))
        config = _read_json(model_dir / "config.json")
        limit = int(config.get("max_position_embeddings", _DEFAULT_MAX_MODEL_LEN))
        if max_model_len is not None and max_model_len > limit:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's limit {limit}")
        self.max_model_len = max_model_len or limit
        self.vocab_size = int(config.get("vocab_size") or len(self.tokenizer))

    def encode_text(self, text: str) -> list[int]:
        """Token ids of a plain-text prompt (with the model's BOS, like the offline LLM)."""
        return list(self.tokenizer.encode(text))

    def render_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool) -> str:
        """The chat template applied to ``messages`` (a list of {"role", "content"})."""
        if not self.tokenizer.chat_template:
            raise invalid_request("this model has no chat template; use /v1/completions")
        try:
            text = self.tokenizer.apply_chat_template(
                list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as exc:  # jinja errors: the template rejected these messages
            raise invalid_request(f"chat template failed: {exc}", param="messages") from None
        return str(text)

    def encode_chat(self, rendered: str) -> list[int]:
        """Token ids of a rendered chat prompt (no extra special tokens)."""
        return list(self.tokenizer.encode(rendered, add_special_tokens=False))

    def check_token_ids(self, token_ids: Sequence[int], param: str = "prompt") -> None:
        """Every id inside the vocabulary; raises a 400 otherwise."""
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise invalid_request(
                f"token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}", param
            )

    def resolve_max_tokens(self, prompt_len: int, requested: int | None) -> int:
        """The output cap for a prompt of ``prompt_len`` tokens; 400 if it cannot fit.

        ``requested`` None means "until the context is full".
        """
        if prompt_len == 0:
            raise invalid_request("prompt is empty: at least one token is needed", "prompt")
        room = self.max_model_len - prompt_len
        if room < 1:
            raise invalid_request(
                f"prompt has {prompt_len} tokens; this model's context is {self.max_model_len}",
                param="prompt",
                code="context_length_exceeded",
            )
        if requested is None:
            return room
        if requested < 1:
            raise invalid_request(f"max_tokens must be >= 1, got {requested}", "max_tokens")
        if requested > room:
            raise invalid_request(
                f"max_tokens={requested} plus the prompt's {prompt_len} tokens exceeds this "
                f"model's context of {self.max_model_len} tokens",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return requested

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def token_text(self, token_id: int) -> str:
        """One token's surface text, for logprobs ("bytes:\\xNN" when not valid UTF-8 alone)."""
        text = str(self.tokenizer.decode([token_id], skip_special_tokens=False))
        if "\ufffd" in text:
            token = self.tokenizer.convert_ids_to_tokens(token_id)
            return f"bytes:{token}"
        return text


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ValueError(f"{path.parent} has no config.json")
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else {}
