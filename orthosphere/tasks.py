"""The arithmetic task as data for ``orthosphere.extract``: the Python form of ``arithmetic:...``."""
from __future__ import annotations

from orthosphere.extract.data import ArithmeticData
from orthosphere.extract.data import arithmetic as _arithmetic


def arithmetic(split: str = "test", seed: int = 0, *, train_counts: list[int] | None = None,
               interpolation_counts: list[int] | None = None, extrapolation_counts: list[int] | None = None,
               digit_lengths: list[int] | None = None) -> ArithmeticData:
    """Samples of one split (train, test, interpolation, extrapolation) drawn with `seed`; the counts
    and digit lengths default to the shipped models' task (``orthosphere.extract.tasks.TaskSpec``)."""
    return _arithmetic(split, seed, train_counts=train_counts, interpolation_counts=interpolation_counts,
                       extrapolation_counts=extrapolation_counts, digit_lengths=digit_lengths)
