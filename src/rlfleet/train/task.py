"""The verifiable task: after a chat-style prompt, write `length` tokens; the reward is the
fraction of them that are the digit "7". It is computed from the generated token IDs alone."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Tokenizer

from rlfleet.models.tokenizer import IM_END_ID, IM_START_ID

DIGIT_IDS = tuple(range(15, 25))  # "0".."9"
SEVEN_ID = 22

#: The user turn; the three digits vary, so every prompt has the same number of tokens.
TEMPLATE = "Write {length} digits. Seed {a} {b} {c}."


@dataclass
class SevensTask:
    tokenizer_dir: Path
    length: int = 8
    target: int = SEVEN_ID
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    def __post_init__(self) -> None:
        self.tokenizer = Tokenizer.from_file(str(Path(self.tokenizer_dir) / "tokenizer.json"))

    def prompt(self, a: int, b: int, c: int) -> list[int]:
        """`<|im_start|>user\\n... <|im_end|>\\n<|im_start|>assistant\\n` as token IDs."""
        text = TEMPLATE.format(length=self.length, a=a, b=b, c=c)
        nl = self.tokenizer.encode("\n").ids
        return ([IM_START_ID, *self.tokenizer.encode("user").ids, *nl,
                 *self.tokenizer.encode(text).ids, IM_END_ID, *nl,
                 IM_START_ID, *self.tokenizer.encode("assistant").ids, *nl])

    def prompts(self, count: int) -> list[list[int]]:
        """`count` different prompts drawn at random (varied a little from step to step)."""
        seeds = self.rng.sample(range(1000), count)
        return [self.prompt(s // 100, s // 10 % 10, s % 10) for s in seeds]

    def reward(self, completion: list[int]) -> float:
        if not completion:
            return 0.0
        return sum(t == self.target for t in completion) / len(completion)

    def random_digits(self) -> list[int]:
        """A warm-up target: `length` digits drawn uniformly."""
        return [self.rng.choice(DIGIT_IDS) for _ in range(self.length)]

    @property
    def chance(self) -> float:
        """Expected reward of a policy that writes uniformly random digits."""
        return 1 / len(DIGIT_IDS)
