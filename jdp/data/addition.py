"""The built-in `addition` task: character-level addition for the language model.

Example "347+85=234$": the question `a+b=`, then the sum's digits least-significant
first (432 reversed), then the end token. Reversed answers let the model emit each
digit after the digits that decide its carry, so small Transformers learn the task
much faster than with the sum written normally. Every example is padded to one
length, and only the answer and its end token are weighted in the loss, so a
sequence is right (exact match) when every weighted target is predicted.

Examples are pure functions of (seed, index) and need no network: this is the
language-model task that always works. Train and eval draw independently: for
small operands (there are only 100 one-digit pairs) eval problems may also occur
in training, so eval accuracy measures the task, not strictly generalisation.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

# One character per token: digits have their own value as id, then '+', '=', and
# the padding and end tokens, which `decode` writes as '_' and '$'.
_CHARACTERS = "0123456789+=_$"
_IDS = {character: i for i, character in enumerate(_CHARACTERS)}
PAD = _IDS["_"]
EOS = _IDS["$"]
VOCAB_SIZE = len(_CHARACTERS)

# Operands are drawn as int64: 10**18 is the largest power of ten below 2**63.
_MAX_DIGITS_LIMIT = 18
# The eval seed is the train seed plus this large prime, so that nearby train
# seeds (0, 1, 2, ...) never share a stream with each other's eval split.
_EVAL_SEED_OFFSET = 1_000_003


def encode(text: str) -> list[int]:
    """Token ids of `text`, one per character of "0123456789+=" (and '_' PAD, '$' EOS)."""
    unknown = sorted(set(text) - set(_IDS))
    if unknown:
        raise ValueError(
            f"Cannot encode {text!r}: characters {unknown} are not in the vocabulary "
            f"{_CHARACTERS!r}"
        )
    return [_IDS[character] for character in text]


def decode(ids: Iterable[int]) -> str:
    """The text of token `ids`, one character each; PAD is written '_' and EOS '$'."""
    return "".join(_CHARACTERS[int(i)] for i in ids)


def problem_text(a: int, b: int) -> str:
    """The text of the problem a + b: "a+b=" then the sum's digits least-significant first."""
    return f"{a}+{b}=" + str(a + b)[::-1]


def sequence_length(max_digits: int) -> int:
    """The length of `inputs` and `targets` (the model's max_len) for operands of max_digits.

    The longest example has two max_digits operands, '+', '=', a sum of max_digits + 1
    digits and EOS: 3 * max_digits + 4 tokens. Inputs drop its last token and targets
    its first, so both have 3 * max_digits + 3 (12 for max_digits=3).
    """
    return 3 * max_digits + 3


def make_example(a: int, b: int, *, max_digits: int) -> dict[str, np.ndarray]:
    """The padded next-token example of a + b for a source of operands up to max_digits.

    Returns int32 `inputs` and `targets` (the tokens shifted by one) and float32
    `weights`, 1.0 exactly where the target is an answer digit or the EOS after them.
    """
    text = problem_text(a, b)
    tokens = encode(text) + [EOS]
    num_tokens = sequence_length(max_digits) + 1
    if len(tokens) > num_tokens:
        raise ValueError(
            f"{a}+{b} needs {len(tokens)} tokens, more than max_digits={max_digits} allows "
            f"({num_tokens}); raise `max_digits`"
        )
    tokens = np.array(tokens + [PAD] * (num_tokens - len(tokens)), np.int32)
    # Target j is token j + 1: weighted from the first answer digit to the EOS at len(text).
    target_positions = np.arange(1, num_tokens)
    answer_start = text.index("=") + 1
    weights = (target_positions >= answer_start) & (target_positions <= len(text))
    return {"inputs": tokens[:-1], "targets": tokens[1:], "weights": weights.astype(np.float32)}


def _operand(rng: np.random.Generator, max_digits: int) -> int:
    """A number whose digit count is uniform in 1..max_digits, then uniform among those."""
    num_digits = int(rng.integers(1, max_digits + 1))
    low = 0 if num_digits == 1 else 10 ** (num_digits - 1)
    return int(rng.integers(low, 10**num_digits))


class AdditionSource:
    """A random-access source of `num_examples` addition examples (see `make_example`).

    Example `index` is drawn from its own generator seeded by (seed, index), so it
    does not depend on which examples were read before or by which process.
    """

    def __init__(self, num_examples: int, *, seed: int, max_digits: int = 3) -> None:
        if num_examples < 1:
            raise ValueError(f"num_examples ({num_examples}) must be at least 1")
        if seed < 0:
            raise ValueError(f"seed ({seed}) must be non-negative (numpy seeds are)")
        if not 1 <= max_digits <= _MAX_DIGITS_LIMIT:
            raise ValueError(
                f"max_digits ({max_digits}) must be between 1 and {_MAX_DIGITS_LIMIT}"
            )
        self.num_examples = num_examples
        self.seed = seed
        self.max_digits = max_digits
        self.sequence_length = sequence_length(max_digits)

    def __len__(self) -> int:
        return self.num_examples

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if not 0 <= index < self.num_examples:
            raise IndexError(f"index {index} out of range for {self.num_examples} examples")
        rng = np.random.default_rng([self.seed, int(index)])
        a, b = _operand(rng, self.max_digits), _operand(rng, self.max_digits)
        return make_example(a, b, max_digits=self.max_digits)

    def __repr__(self) -> str:
        return (
            f"AdditionSource(num_examples={self.num_examples}, seed={self.seed}, "
            f"max_digits={self.max_digits})"
        )


def sources(
    *, seed: int, max_digits: int, num_train: int, num_eval: int
) -> tuple[AdditionSource, AdditionSource]:
    """The train and eval sources: train seeded by `seed`, eval by `seed + 1_000_003`."""
    train = AdditionSource(num_train, seed=seed, max_digits=max_digits)
    eval_ = AdditionSource(num_eval, seed=seed + _EVAL_SEED_OFFSET, max_digits=max_digits)
    return train, eval_
