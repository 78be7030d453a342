"""IncrementalDetokenizer: streamed deltas add up to the full decode, never split a character,
and cost O(window) per token."""

from __future__ import annotations

import random
import socket
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from common.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from common.models.tiny import TINY_MODELS, ensure_tiny_model

NAMES = sorted(TINY_MODELS)
VALID_TEXT = (
    "Hello, world! café naïve Zürich crème brûlée 中文字符：你好，世界！ こんにちは "
    "emoji 😀😂🚀 family 👩‍💻 math 𝔘𝔫𝔦 and plain ASCII again.\n"
)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("pdserve_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setattr(socket, "getaddrinfo", _refuse_network)
        yield {n: AutoTokenizer.from_pretrained(ensure_tiny_model(n, root)) for n in NAMES}


def _refuse_network(*args: object, **kwargs: object) -> None:
    raise OSError("network access attempted by an offline test")


def _full_decode(tokenizer: Any, ids: Sequence[int], skip: bool) -> str:
    return tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def _stream(detok: IncrementalDetokenizer, ids: Sequence[int], chunks: Sequence[int]) -> list[str]:
    """Feed `ids` in chunks of the given sizes; return every delta, finish() last."""
    deltas, start = [], 0
    for size in chunks:
        deltas.append(detok.add_tokens(ids[start : start + size]))
        start += size
    assert start >= len(ids)
    return [*deltas, detok.finish()]


class CountingTokenizer:
    """Wraps a tokenizer and records how many ids each decode call was given."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.decode_lengths: list[int] = []

    @property
    def all_special_ids(self) -> list[int]:
        return self.inner.all_special_ids

    def decode(self, token_ids: Sequence[int], **kwargs: Any) -> str:
        self.decode_lengths.append(len(token_ids))
        return self.inner.decode(token_ids, **kwargs)


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("name", NAMES)
def test_stream_equals_full_decode_for_random_ids(tokenizers: dict, name: str, skip: bool) -> None:
    """Random ids hit special tokens, lone byte tokens and invalid UTF-8 mid-stream."""
    tokenizer = tokenizers[name]
    rng = random.Random(f"{name}-{skip}")
    special = tokenizer.all_special_ids
    for _ in range(400):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 40))]
        ids += rng.choices(special, k=rng.randrange(3))
        rng.shuffle(ids)
        prompt = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(12))]
        chunks = [rng.randrange(1, 5) for _ in range(len(ids))]
        detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
        streamed = "".join(_stream(detok, ids, chunks))
        assert streamed == detok.output_text == _full_decode(tokenizer, ids, skip), ids


@pytest.mark.parametrize("name", NAMES)
def test_valid_text_never_streams_replacement_char(tokenizers: dict, name: str) -> None:
    tokenizer = tokenizers[name]
    ids = tokenizer.encode(VALID_TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Prompt: "))
    deltas = [detok.add_tokens([t]) for t in ids]
    assert not any(REPLACEMENT_CHAR in d for d in deltas)
    assert "".join(deltas) == VALID_TEXT and detok.finish() == ""
    # The test means something only if some characters did span several tokens.
    assert any(d == "" for d in deltas)
    assert any(ord(c) > 127 for d in deltas for c in d)


@pytest.mark.parametrize("name", NAMES)
def test_decode_window_stays_small(tokenizers: dict, name: str) -> None:
    """O(window) per token: decode calls never see more than a handful of ids, however long
    the output (1500+ tokens here), including a long run of skipped eos tokens."""
    counting = CountingTokenizer(tokenizers[name])
    text = VALID_TEXT * 30
    ids = counting.inner.encode(text, add_special_tokens=False)
    eos = counting.inner.eos_token_id
    detok = IncrementalDetokenizer(counting)
    streamed = [detok.add_tokens([t]) for t in ids[:500]]
    streamed += [detok.add_tokens([eos]) for _ in range(1000)]  # e.g. ignore_eos
    streamed += [detok.add_tokens([t]) for t in ids[500:]]
    assert "".join(streamed) + detok.finish() == text
    assert len(ids) > 1500
    assert max(counting.decode_lengths) <= 12
    assert len(counting.decode_lengths) <= 2 * len(ids) + 2  # eos tokens cost no decode


@pytest.mark.parametrize("name", NAMES)
def test_special_tokens_skipped_or_kept(tokenizers: dict, name: str) -> None:
    tokenizer = tokenizers[name]
    eos = tokenizer.eos_token
    ids = tokenizer.encode(f"Hi there{eos} more", add_special_tokens=False)
    assert tokenizer.eos_token_id in ids
    for skip, expected in ((True, "Hi there more"), (False, f"Hi there{eos} more")):
        detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
        assert "".join(_stream(detok, ids, [1] * len(ids))) == expected


@pytest.mark.parametrize("name", NAMES)
def test_split_character_is_held_back_then_completed(tokenizers: dict, name: str) -> None:
    tokenizer = tokenizers[name]
    # Byte-level BPE spells byte 0xC3 as "Ã" and 0xA9 as "©": together they are "é".
    lead, cont = tokenizer.convert_tokens_to_ids(["Ã", "©"])
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.add_tokens([lead]) == ""
    assert detok.add_tokens([cont]) == "é"
    # An output that really ends mid-character is flushed by finish(), as decode would show it.
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.add_tokens(tokenizer.encode("ok", add_special_tokens=False)) == "ok"
    assert detok.add_tokens([lead]) == ""
    assert detok.finish() == REPLACEMENT_CHAR == _full_decode(tokenizer, [lead], True)
    assert detok.output_text == "ok" + REPLACEMENT_CHAR


@pytest.mark.parametrize("name", NAMES)
def test_prompt_ending_mid_character_does_not_leak_into_output(tokenizers: dict, name: str) -> None:
    tokenizer = tokenizers[name]
    lead, cont = tokenizer.convert_tokens_to_ids(["Ã", "©"])
    prompt = [*tokenizer.encode("say", add_special_tokens=False), lead]
    detok = IncrementalDetokenizer(tokenizer, prompt)
    output = [cont, *tokenizer.encode(" ok", add_special_tokens=False)]
    assert "".join(_stream(detok, output, [1] * len(output))) == _full_decode(
        tokenizer, output, True
    )


def test_sentencepiece_style_leading_space_uses_prompt_context(tmp_path: Path) -> None:
    """Metaspace decoders drop the space of whatever comes first; the prompt context keeps the
    space that separates the first output word from the prompt."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    detok = IncrementalDetokenizer(tokenizer)
    assert "".join(_stream(detok, [1, 2, 3], [1, 1, 1])) == "Hello world!"
    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=[1])
    assert "".join(_stream(detok, [2, 3], [1, 1])) == " world!"
