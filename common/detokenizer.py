"""Incremental detokenization: turn a stream of token ids into a stream of text deltas.

NOTE: decoding the whole output after every token is O(n) per token, and decoding each token
alone is wrong: byte-level BPE splits one multi-byte character over several tokens, and
SentencePiece-style decoders drop a leading space at the start of whatever they decode. So we
keep a small window of ids (the prefix_offset / read_offset technique of TGI and vLLM):

    ids:   ... already streamed ... | prefix window | pending (not yet streamed)
                                    ^ 0              ^ read_offset

    delta = decode(prefix + pending)[len(decode(prefix)):]

The prefix gives the decoder its context (spaces, byte pairing) and is cut off from the front
as soon as the pending tokens have been streamed, so each step decodes O(window) ids. While the
decoded tail ends in U+FFFD the pending bytes may be an unfinished character: hold them back
until the character completes (at most 4 byte tokens for valid UTF-8) or `finish()` is called.

Stop strings are applied by the caller on the deltas.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"

# Prompt tokens used as the first prefix window: enough to fix the first output token's
# leading space / byte pairing, as in vLLM.
_PROMPT_CONTEXT_TOKENS = 5


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer the detokenizer uses."""

    @property
    def all_special_ids(self) -> list[int]: ...

    def decode(
        self,
        token_ids: Sequence[int],
        skip_special_tokens: bool = ...,
        clean_up_tokenization_spaces: bool | None = ...,
    ) -> str: ...


class IncrementalDetokenizer:
    """Streams the text of one request's output tokens, delta by delta.

    Contract: once `finish()` has been called, the concatenation of every returned delta
    (`output_text`) equals `tokenizer.decode(output_ids, skip_special_tokens=...,
    clean_up_tokenization_spaces=False)` for byte-level tokenizers (Llama-3, Qwen2, the tiny
    models); with SentencePiece-style decoders it keeps the first token's leading space, which
    the prompt context shows to be there. Before `finish()`, no delta ends inside a multi-byte
    character, so valid text never streams a U+FFFD.

    Cost: O(window) decoding per call, where the window is the last streamed delta's tokens
    plus the held-back ones. Not thread-safe; one instance per request (and per sequence of n).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        # A fast tokenizer's decode without cleanup is its Rust backend's decode; calling that
        # directly skips ~2 us of Python argument handling per call (two calls per token).
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._skip_special_tokens = skip_special_tokens
        # Skipped ids decode to nothing, so dropping them up front changes no text and keeps a
        # run of them (e.g. eos under ignore_eos) from growing the window.
        self._skipped_ids = frozenset(tokenizer.all_special_ids if skip_special_tokens else ())
        self._window = self._prompt_context(prompt_token_ids or ())
        self._read_offset = len(self._window)  # window[:read_offset] is the prefix
        self._deltas: list[str] = []

    @property
    def output_text(self) -> str:
        """All text streamed so far (held-back bytes excluded until they complete)."""
        return "".join(self._deltas)

    def add_tokens(self, token_ids: Iterable[int]) -> str:
        """Append newly generated ids; return the text they complete ("" if none yet)."""
        self._window.extend(t for t in token_ids if t not in self._skipped_ids)
        if len(self._window) == self._read_offset:
            return ""
        return self._stream(final=False)

    def finish(self) -> str:
        """Flush held-back tokens at the end of the request (may contain U+FFFD if the output
        really ends in an incomplete character, exactly as a full decode would)."""
        if len(self._window) == self._read_offset:
            return ""
        return self._stream(final=True)

    def _stream(self, final: bool) -> str:
        prefix_text = self._decode(self._window[: self._read_offset])
        text = self._decode(self._window)
        unfinished = len(text) <= len(prefix_text) or text.endswith(REPLACEMENT_CHAR)
        if unfinished and not final:
            return ""
        delta = text[len(prefix_text) :]
        # The pending tokens become the next prefix; everything before them is no longer needed.
        del self._window[: self._read_offset]
        self._read_offset = len(self._window)
        self._deltas.append(delta)
        return delta

    def _prompt_context(self, prompt_token_ids: Sequence[int]) -> list[int]:
        recent = prompt_token_ids[-4 * _PROMPT_CONTEXT_TOKENS :]  # room for skipped ids
        context = [t for t in recent if t not in self._skipped_ids][-_PROMPT_CONTEXT_TOKENS:]
        # A prompt ending mid-character would glue its bytes onto the output's first token;
        # the output's text must not depend on that, so start without context then.
        if self._decode(context).endswith(REPLACEMENT_CHAR):
            return []
        return context

    def _decode(self, token_ids: Sequence[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(token_ids, skip_special_tokens=self._skip_special_tokens)
        return self._tokenizer.decode(
            token_ids,
            skip_special_tokens=self._skip_special_tokens,
            clean_up_tokenization_spaces=False,  # its " ." → "." rewrite is not local
        )
