"""The prompt every decode bench feeds: eight ids of a Qwen3 tokenizer's sentence, folded into a smaller
vocabulary where a test preset has one (so the same bench runs on every preset)."""

from __future__ import annotations

PROMPT = (785, 3974, 13876, 38835, 34208, 916, 279, 15678)


def prompt_for(vocab_size: int) -> list[int]:
    return [i % vocab_size for i in PROMPT]
