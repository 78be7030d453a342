"""HF transformers greedy reference, and the near-tie rule for accepting a divergence."""

from __future__ import annotations

import random

import torch

NEAR_TIE = 1e-3  # logit gap under which fp32 reordering may legitimately flip the argmax


def random_prompts(vocab: int, n: int, lengths: tuple[int, int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(*lengths))] for _ in range(n)]


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def assert_same_greedy(model, prompt: list[int], ours: list[int], theirs: list[int]) -> None:
    """Equal token for token; a divergence passes only at a proven near-tie of HF's logits."""
    assert len(ours) == len(theirs), (len(ours), len(theirs))
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a == b:
            continue
        with torch.no_grad():
            logits = model(torch.tensor([prompt + theirs[:i]])).logits[0, -1].float()
        gap = (logits[b] - logits[a]).item()
        assert gap < NEAR_TIE, f"diverged at output {i}: ours {a}, HF {b}, logit gap {gap:.2e}"
        return  # after a tie the continuations legitimately differ
