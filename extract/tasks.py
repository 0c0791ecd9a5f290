"""The arithmetic task: multi-number addition and subtraction, one character a token.

An example is written in the paper's format, most significant digit first::

    [53+6-N17=76]        53 + 6 - (-17) = 76
    [8-41+N9=N42]        8 - 41 + (-9) = -42
    [3-7+N2-N1=N5]       the shipped models' task: one-digit numbers

``N`` marks a negative number (operand or answer), ``[`` opens and ``]`` closes the
sequence. The model reads the whole sequence causally; only the answer is scored.

Splits (the paper's structure, scaled down; the default spec is used by the shipped models):

- ``train`` and ``test`` (in distribution): number counts ``train_counts``;
- ``interpolation``: counts inside the gap of the trained counts, never trained on;
- ``extrapolation``: counts beyond every trained one.

Every split draws each number's digit count limit L from ``digit_lengths`` per example;
each number is uniform on [0, 10**L). Example ``i`` of ``(split, seed)`` depends only on
``(seed, split, i)``, so any batch size or shard of indices gives the same examples.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from orthosphere.errors import ConfigError
from orthosphere.params import POSITIVE_INTEGER, Config, Items, parameter

CHARACTERS = "0123456789+-N[=]"
"""The 16 characters; a character's token id is its index, so digit d has id d."""
PAD_ID = len(CHARACTERS)
"""Padding id, after the characters: the vocabulary has 17 ids."""
VOCAB_SIZE = len(CHARACTERS) + 1
TOKEN_ID = {char: index for index, char in enumerate(CHARACTERS)}

SPLITS = ("train", "test", "interpolation", "extrapolation")
"""Split names; ``test`` is the in-distribution test split."""
SPLIT_ID = {name: index for index, name in enumerate(SPLITS)}

ROLES = ("bos", "digit", "operator", "sign", "equals", "answer", "eos", "pad")
"""Token roles: ``digit`` and ``sign`` belong to operands; every token after ``=`` up to
``]`` (its digits and its ``N``) has role ``answer``; ``]`` is ``eos``."""
SCORED_ROLES = ("answer", "eos")
"""A position is scored when its *target* (the next token) has one of these roles: the
positions from ``=`` to the last answer digit, which predict the answer and the ``]``."""

LABEL_NAMES = ("token_str", "role", "operand", "digit_place", "digit_value", "carry")
MISSING = int(np.iinfo(np.int16).min)
"""Value of the integer labels where they do not apply (the store's missing value for int16;
-1 is a real value: a borrow in ``carry``)."""


def token_ids(text: str) -> list[int]:
    """Token ids of a string of task characters."""
    unknown = sorted(set(text) - set(CHARACTERS))
    if unknown:
        raise ConfigError(f"text {text!r} holds characters {unknown} outside the task's "
                          f"vocabulary {CHARACTERS!r}; write examples with those characters only")
    return [TOKEN_ID[char] for char in text]


def token_text(ids) -> str:
    """The string of a sequence of token ids; padding is dropped."""
    return "".join(CHARACTERS[int(i)] for i in ids if int(i) != PAD_ID)


def parse_split(name: str) -> str:
    """Check a split name; raise ConfigError naming the valid ones."""
    if name not in SPLIT_ID:
        raise ConfigError(f"unknown split {name!r}; expected one of {', '.join(SPLITS)}")
    return name


COUNTS = Items(POSITIVE_INTEGER, single=True)
"""A count or a non-empty list of counts (kept sorted, each once)."""


@dataclass(frozen=True)
class TaskSpec(Config):
    """Which number counts and digit lengths each split uses.

    The defaults are the shipped models' task: the paper's number counts (train N in
    {3,4,6}, interpolation N = 5, extrapolation N in {7,8,9}) with numbers of one digit
    instead of L in {2,3}, so that a small model learns the task on one CPU core in
    minutes (with numbers of one or two digits it stays far below 95 % per-token accuracy
    in the same budget).
    """

    train_counts: tuple[int, ...] = parameter((3, 4, 6), COUNTS, help="numbers per example of the train and test splits")
    interpolation_counts: tuple[int, ...] = parameter((5,), COUNTS, help="numbers per example of interpolation")
    extrapolation_counts: tuple[int, ...] = parameter((7, 8, 9), COUNTS, help="numbers per example of extrapolation")
    digit_lengths: tuple[int, ...] = parameter((1,), COUNTS, help="digits per number")

    def check(self) -> None:
        for name in self.parameters():
            object.__setattr__(self, name, tuple(sorted(set(getattr(self, name)))))
        trained = set(self.train_counts)
        if trained & set(self.interpolation_counts):
            raise ConfigError(f"task interpolation_counts {list(self.interpolation_counts)} "
                              f"overlap train_counts {list(self.train_counts)}; interpolation "
                              f"counts must never be trained on")
        if not all(min(trained) < n < max(trained) for n in self.interpolation_counts):
            raise ConfigError(f"task interpolation_counts {list(self.interpolation_counts)} "
                              f"must lie strictly between the smallest and largest of "
                              f"train_counts {list(self.train_counts)}")
        if min(self.extrapolation_counts) <= max(trained):
            raise ConfigError(f"task extrapolation_counts {list(self.extrapolation_counts)} "
                              f"must all exceed every train count {list(self.train_counts)}")

    def to_dict(self) -> dict:
        return {key: list(value) for key, value in asdict(self).items()}

    def counts(self, split: str) -> tuple[int, ...]:
        """Number counts N of a split."""
        split = parse_split(split)
        if split in ("train", "test"):
            return self.train_counts
        return self.interpolation_counts if split == "interpolation" else self.extrapolation_counts

    def max_length(self, split: str) -> int:
        """Padded sequence length of a split: its longest possible example."""
        n = max(self.counts(split))
        digits = max(self.digit_lengths)
        answer = 1 + len(str(n * (10 ** digits - 1)))  # sign and digits
        return 1 + n * (1 + digits) + (n - 1) + 1 + answer + 1

    def describe(self, split: str, seed: int) -> dict:
        """JSON-able description of a generated data set, for a store's ``task`` attribute."""
        return {"name": "arithmetic", "split": parse_split(split), "seed": int(seed),
                "counts": list(self.counts(split)), "digit_lengths": list(self.digit_lengths),
                "max_length": self.max_length(split), "characters": CHARACTERS,
                "pad_id": PAD_ID, "spec": self.to_dict(), "factors": self.semantic_factors(), "intercepts": "role"}

    def semantic_factors(self) -> list[str]:
        """The factors the analyses read by default: what a digit token carries (its value, its
        place in its number when numbers have several digits, its operand), read on digits, where
        they mean something, and its position, read on every token; the store's ``intercepts``
        (role) give each kind of token its own mean, so that the position does not take the kinds'
        differences for its own."""
        places = ["digit_place[role=digit]"] if max(self.digit_lengths) > 1 else []
        return ["digit_value[role=digit]", *places, "operand[role=digit]", "pos"]


DEFAULT_SPEC = TaskSpec()


@dataclass
class ArithmeticBatch:
    """Examples of one split as fixed-width numpy arrays, shape (sample, pos).

    ``target[:, t]`` is the token at ``t + 1`` (PAD past the end); ``scored[:, t]`` marks
    positions whose target is an answer token or the closing ``]``. ``labels`` describe the
    token *at* each position (see ``LABEL_NAMES``, ``MISSING``).
    """

    split: str
    seed: int
    start: int
    tokens: np.ndarray
    valid: np.ndarray
    target: np.ndarray
    scored: np.ndarray
    labels: dict[str, np.ndarray]

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def text(self, sample: int) -> str:
        """The example as a string."""
        return token_text(self.tokens[sample])


@dataclass
class _Example:
    chars: list[str]
    roles: list[str]
    operand: list[int]
    digit_place: list[int]
    digit_value: list[int]
    carry: list[int]

    def add(self, char, role, operand=MISSING, place=MISSING, value=MISSING, carry=MISSING):
        self.chars.append(char)
        self.roles.append(role)
        self.operand.append(operand)
        self.digit_place.append(place)
        self.digit_value.append(value)
        self.carry.append(carry)


def carry_into(place: int, signed_values: list[int]) -> int:
    """Carry into ``place`` (0 = units) when the answer's magnitude is written column by
    column: floor(sum of the operands' lower places / 10**place), the operands' signs taken
    relative to the answer's sign. Negative values are borrows; with several operands the
    carry can exceed 1."""
    total = sum(signed_values)
    answer_sign = -1 if total < 0 else 1
    modulus = 10 ** place
    lower = sum(answer_sign * (1 if v >= 0 else -1) * (abs(v) % modulus) for v in signed_values)
    return lower // modulus


def _example(spec: TaskSpec, split: str, seed: int, index: int) -> _Example:
    rng = np.random.default_rng([seed, SPLIT_ID[split], index])
    counts = spec.counts(split)
    n = int(counts[rng.integers(len(counts))])
    digits = int(spec.digit_lengths[rng.integers(len(spec.digit_lengths))])
    values = rng.integers(0, 10 ** digits, size=n)
    negative = rng.random(n) < 0.5
    subtract = rng.random(n) < 0.5  # subtract[0] unused: the first number has no operator
    return written_example([int(v) for v in values], negative.tolist(), subtract.tolist())


def written_example(values: list[int], negative: list[bool], subtract: list[bool]) -> _Example:
    """The tokens and labels of ``values[0] +- values[1] ...``: number ``i`` is written with
    ``N`` when ``negative[i]`` and follows ``-`` when ``subtract[i]`` (``subtract[0]`` is
    ignored), then ``=`` and the answer."""
    example = _Example([], [], [], [], [], [])
    example.add("[", "bos")
    signed = []
    for i, value in enumerate(values):
        if i > 0:
            example.add("-" if subtract[i] else "+", "operator", operand=i)
        if negative[i]:
            example.add("N", "sign", operand=i)
        text = str(value)
        for j, char in enumerate(text):
            example.add(char, "digit", operand=i, place=len(text) - 1 - j, value=int(char))
        sign = (-1 if negative[i] else 1) * (-1 if (i > 0 and subtract[i]) else 1)
        signed.append(sign * value)
    example.add("=", "equals")
    total = sum(signed)
    if total < 0:
        example.add("N", "answer")
    text = str(abs(total))
    for j, char in enumerate(text):
        place = len(text) - 1 - j
        example.add(char, "answer", place=place, value=int(char), carry=carry_into(place, signed))
    example.add("]", "eos")
    return example


def generate(split: str, n_samples: int, seed: int, spec: TaskSpec = DEFAULT_SPEC,
             start: int = 0) -> ArithmeticBatch:
    """Examples ``start .. start + n_samples - 1`` of ``(split, seed)``, padded to the
    split's fixed length."""
    split = parse_split(split)
    if n_samples < 0 or start < 0:
        raise ConfigError(f"n_samples={n_samples} and start={start} must be non-negative")
    length = spec.max_length(split)
    tokens = np.full((n_samples, length), PAD_ID, dtype=np.int32)
    role = np.full((n_samples, length), "pad", dtype=f"<U{max(map(len, ROLES))}")
    token_str = np.full((n_samples, length), "", dtype="<U1")
    ints = {name: np.full((n_samples, length), MISSING, dtype=np.int16)
            for name in ("operand", "digit_place", "digit_value")}
    carry = np.full((n_samples, length), MISSING, dtype=np.int16)
    for row in range(n_samples):
        example = _example(spec, split, seed, start + row)
        width = len(example.chars)
        tokens[row, :width] = token_ids("".join(example.chars))
        token_str[row, :width] = example.chars
        role[row, :width] = example.roles
        ints["operand"][row, :width] = example.operand
        ints["digit_place"][row, :width] = example.digit_place
        ints["digit_value"][row, :width] = example.digit_value
        carry[row, :width] = example.carry
    valid = tokens != PAD_ID
    target = np.full_like(tokens, PAD_ID)
    target[:, :-1] = tokens[:, 1:]
    target_role = np.full_like(role, "pad")
    target_role[:, :-1] = role[:, 1:]
    scored = np.isin(target_role, SCORED_ROLES)
    labels = {"token_str": token_str, "role": role, **ints, "carry": carry}
    return ArithmeticBatch(split, int(seed), int(start), tokens, valid, target, scored, labels)
