"""The model's own accuracy on the stored data: how often its arg-max prediction is the target.

Per-token accuracy is over the scored positions (the answer tokens of the arithmetic task, every
next-token prediction of text); whole-answer accuracy is the share of samples whose scored
positions are all right. Read from `pred`, `target`, `scored` and `valid`, lazily, computed once.
"""
from __future__ import annotations

from dataclasses import dataclass

import dask
import numpy as np
import xarray as xr

from .errors import AnalysisError
from .inputs import store_url
from .options import AnalysisConfig
from .registry import Analysis


@dataclass(frozen=True)
class AccuracyConfig(AnalysisConfig):
    """``accuracy`` has no options."""


DESCRIPTIONS = {
    "token_accuracy": "share of the scored valid tokens (the answer tokens of the arithmetic task, every next-token "
                      "prediction of text) whose arg-max prediction (pred) equals the target, in [0, 1]",
    "answer_accuracy": "share of the answers (samples with at least one scored valid token) whose scored tokens are all "
                       "right, in [0, 1]; NaN without answers",
    "n_scored_tokens": "scored valid tokens counted by token_accuracy",
    "n_answers": "samples with at least one scored valid token, counted by answer_accuracy",
}
"""The attrs description of each result variable."""


def compute_accuracy(dataset: xr.Dataset, config: AccuracyConfig) -> xr.Dataset:
    """Per-token and whole-answer accuracy of the model's predictions over the scored tokens."""
    if "pred" not in dataset.variables:
        architecture = dataset.attrs.get("model", {}).get("architecture", "its model")
        raise AnalysisError(f"store {store_url(dataset)} holds no predictions (pred): {architecture} has no "
                            "language-model head; leave accuracy out of the analyses (the default does)")
    scored = dataset.scored & dataset.valid
    right = (dataset.pred == dataset.target) & scored
    answered = scored.any("pos")
    all_right = (right | ~scored).all("pos") & answered
    n_scored, n_right, n_answers, n_all_right = dask.compute(
        scored.sum().data, right.sum().data, answered.sum().data, all_right.sum().data
    )
    if n_scored == 0:
        raise AnalysisError("no scored token in the store: accuracy needs a task that marks scored positions")
    values = {
        "token_accuracy": float(n_right) / float(n_scored),
        "answer_accuracy": float(n_all_right) / float(n_answers) if n_answers else np.nan,
        "n_scored_tokens": int(n_scored),
        "n_answers": int(n_answers),
    }
    return xr.Dataset(
        {name: ((), value, {"description": DESCRIPTIONS[name]}) for name, value in values.items()},
        attrs={"definition": "arg-max prediction == target over scored valid tokens; answers: every scored token right"},
    )




accuracy = Analysis("accuracy", AccuracyConfig, compute_accuracy, reads=("pred", "target", "scored", "valid"),
                    needs=("pred",), summary="the model's own accuracy on the stored data")
