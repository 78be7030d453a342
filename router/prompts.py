"""Prompts at the router: tokenizer, chat template, context-length and vocabulary checks.

Text prompts are tokenized exactly as the offline ``LLM`` does (``tokenizer.encode(text)``, so
the model's BOS is added); chat messages are rendered with the tokenizer's own chat template and
tokenized without adding special tokens again (the template already holds them).
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.models.preflight import eos_token_ids
from router.errors import invalid_request

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_DEFAULT_MAX_MODEL_LEN = 2048


def keep_torch_out() -> bool:
    """Make this process torch-free; called first thing by the router process.

    The router serves no weights, yet transformers 5 imports torch whenever it is installed
    (``AutoTokenizer`` builds the model's config class, whose module imports torch): seconds
    of start-up and hundreds of MB. Marked absent, torch cannot be imported here, and
    transformers runs in its supported tokenizers-only mode, choosing the same tokenizer.
    Changes nothing and returns False where torch is already loaded (a test process that
    hosts the router beside engines).
    """
    if sys.modules.get("torch") is not None or "transformers" in sys.modules:
        return False
    sys.modules["torch"] = None  # type: ignore[assignment]  # makes ``import torch`` fail
    # transformers then says once that models are unavailable: expected here, not advice
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    return True


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: each byte is one printable character (the printable
    Latin-1 bytes themselves, the others shifted past 255); character → byte."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


class PromptProcessor:
    """Owns the tokenizer; turns client prompts into token ids and validates lengths.

    Stateless after construction: safe to share between concurrent requests.
    """

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoTokenizer  # here: importing the router needs none

        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(model_dir))
        config = _read_json(model_dir / "config.json")
        # The model's own limit (no node serves a longer context); requests are checked against
        # the nodes' max_model_len, which the registry knows.
        self.model_max_len = int(config.get("max_position_embeddings", _DEFAULT_MAX_MODEL_LEN))
        self.vocab_size = int(config.get("vocab_size") or len(self.tokenizer))
        self.eos_token_ids = eos_token_ids(model_dir, config)  # a beam ends on one of them

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a plain-text prompt (with the model's BOS, like the offline LLM)."""
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool,
        template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> str:
        """The chat template applied to ``messages`` (a list of {"role", "content"});
        ``template_kwargs`` (the request's ``chat_template_kwargs``) are the template's
        variables, as in vLLM (``enable_thinking``, …). ``continue_final_message``: the last
        message is left open (no end of turn), so the reply continues it."""
        if not self.tokenizer.chat_template:
            raise invalid_request("this model has no chat template; use /v1/completions")
        kwargs = dict(template_kwargs or {})
        reserved_names = ("tokenize", "add_generation_prompt", "conversation", "messages")
        for reserved in (*reserved_names, "continue_final_message"):
            if reserved in kwargs:
                msg = f"chat_template_kwargs may not set {reserved!r}"
                raise invalid_request(msg, param="chat_template_kwargs")
        try:
            text = self.tokenizer.apply_chat_template(
                list(messages),
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **kwargs,
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

    def resolve_max_tokens(self, prompt_len: int, requested: int | None, max_model_len: int) -> int:
        """The output cap for a prompt of ``prompt_len`` tokens in a context of
        ``max_model_len`` (the nodes'); 400 if it cannot fit.

        ``requested`` None means "until the context is full".
        """
        if prompt_len == 0:
            raise invalid_request("prompt is empty: at least one token is needed", "prompt")
        room = max_model_len - prompt_len
        if room < 1:
            raise invalid_request(
                f"prompt has {prompt_len} tokens; the served context (max_model_len) is"
                f" {max_model_len} tokens, which leaves no room to generate",
                param="prompt",
                code="context_length_exceeded",
            )
        if requested is None:
            return room
        if requested < 1:
            raise invalid_request(f"max_tokens must be >= 1, got {requested}", "max_tokens")
        if requested > room:
            raise invalid_request(
                f"max_tokens={requested} plus the prompt's {prompt_len} tokens exceeds the"
                f" served context (max_model_len) of {max_model_len} tokens",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return requested

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def token_text(self, token_id: int) -> str:
        """One token's surface text, for logprobs: ``bytes:\\xNN…`` (its raw bytes, as vLLM
        writes them) when it is not valid UTF-8 alone (a part of a multi-byte character)."""
        text = str(self.tokenizer.decode([token_id], skip_special_tokens=False))
        if "\ufffd" in text:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in self.token_bytes(token_id))
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for: a byte-level BPE token's characters mapped back
        to bytes (GPT-2's table: Llama 3, Qwen), a byte-fallback piece ``<0xNN>``
        (SentencePiece: Llama 2, Mistral) as that byte, else its text in UTF-8."""
        token = str(self.tokenizer.convert_ids_to_tokens(token_id))
        piece = _BYTE_PIECE.fullmatch(token)
        if piece is not None:
            return bytes([int(piece[1], 16)])
        byte_of = _byte_of_char()
        if all(char in byte_of for char in token):
            return bytes(byte_of[char] for char in token)
        return token.replace("\u2581", " ").encode()


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ValueError(f"{path.parent} has no config.json")
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else {}
