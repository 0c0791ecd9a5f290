"""The arithmetic task as data for ``orthosphere.extract``: the Python form of ``arithmetic:...``.

``arithmetic(split="test", seed=0, **counts)``: samples of one split (train, test, interpolation,
extrapolation) drawn with `seed`; `counts` are the parameters of ``orthosphere.extract.tasks.TaskSpec``
(train_counts, interpolation_counts, extrapolation_counts, digit_lengths: each a count or a list of
counts), the shipped models' task by default.
"""
from __future__ import annotations

from orthosphere.extract.data import arithmetic

__all__ = ["arithmetic"]
