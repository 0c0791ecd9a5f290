"""The replay's online check: the offline replay's noise draws injected into the model itself.

For each perturbed layer (one at a time, the paper's protocol) and optionally all layers at
once, every noise level and every draw, the model runs forward with q, k and v of the
perturbed layers scaled by (1 + kappa) as they enter the score (``adapter.edit_qkv``; scaling
v scales the message W_O v exactly), with kappa from ``orthosphere.analyze.replay`` for the
same (seed, target, layer, sample, draw). It measures:

- **per-token answer accuracy** under noise: arg-max predictions against the targets at the
  scored positions (the answer tokens), averaged over draws, beside the clean accuracy;
- **online collapse**: in the model's own attention pattern (captured at the measured layers),
  sparse instances of the clean pass whose arg-max moves under the noise, and strict collapses;
- **agreement with the offline replay**: for the perturbed layer, the offline collapse
  indicators recomputed from the store's q and k under the same draws, instance by instance
  (they agree exactly up to float rounding on near-ties; a layer's noise cannot reach its own
  q and k through the forward pass).

Instances (queries with at least the replay's ``min_keys`` allowed keys), sparse heads and collapse
are defined as in ``orthosphere.analyze.replay``.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import xarray as xr

from orthosphere.analyze.attention import ScoreTerms, allowed_keys
from orthosphere.analyze.inputs import check_layers
from orthosphere.analyze.options import FLAG, LAYERS, AnalysisConfig, integer
from orthosphere.analyze.replay import ReplayConfig, ReplayError, check_variables, store_model
from orthosphere.analyze.replay_blocks import DEFINITIONS, HeadBlock, ReplaySettings, collapse_indicators, instance_queries
from orthosphere.errors import ModelMismatchError
from orthosphere.extract.adapters import Adapter, adapter_for
from orthosphere.extract.sources import load_source
from orthosphere.params import Text, parameter
from orthosphere.store import open_store

log = logging.getLogger("orthosphere.online_check")

ALL_LAYERS = "all layers"
DESCRIPTION_KEYS_IGNORED = ("source", "format")
TOKEN_VARIABLES = ("tokens", "valid", "target", "scored")
SAMPLES = integer(1, "(a number of samples)")


@dataclass(frozen=True)
class OnlineCheckConfig(AnalysisConfig):
    """The online check's own parameters (its noise is the replay's configuration, ``settings``)."""

    layers: tuple[int, ...] | None = parameter(None, LAYERS, None, help="layers perturbed one at a time (default: every one stored)")
    all_layers: bool = parameter(False, FLAG, help="also a run with noise in every layer at once")
    max_samples: int | None = parameter(None, SAMPLES, None, help="samples checked (default: every one stored)")
    batch_size: int = parameter(64, SAMPLES, help="samples per forward pass")
    compare_offline: bool = parameter(True, FLAG, help="compare each collapse with the offline replay's, instance by instance")
    device: str = parameter("cpu", Text("a device: cpu, cuda or cuda:N"), help="where the model runs")


def online_check(store, model, *, settings: ReplaySettings | None = None, layers=None, all_layers: bool = False,
                 max_samples: int | None = None, batch_size: int = 64, compare_offline: bool = True,
                 device: str = "cpu") -> xr.Dataset:
    """Accuracy and collapses with the replay's noise (``settings``, the replay's configuration)
    injected into the model's forward pass.

    ``store`` is a store URL or an opened Dataset; ``model`` a model directory / GGUF file (as
    for extraction: loaded on ``device`` in the dtype the store's model description records), a
    loaded model or its adapter. ``layers`` are the layers perturbed one at a time (default: every
    stored layer); ``all_layers`` adds a run with noise in every layer. A refused parameter is a
    ParameterError naming it (``OnlineCheckConfig``).
    """
    config = OnlineCheckConfig(layers=layers, all_layers=all_layers, max_samples=max_samples, batch_size=batch_size,
                               compare_offline=compare_offline, device=device)
    layers, all_layers, max_samples, batch_size = config.layers, config.all_layers, config.max_samples, config.batch_size
    ds = store if isinstance(store, xr.Dataset) else open_store(store)
    settings = settings or ReplaySettings()
    model_attrs = store_model(ds)
    adapter, description = _adapter(model, config.device, model_attrs.get("dtype"))
    check_model_matches(model_attrs, description)
    if not description.get("lm_head", True):
        raise ReplayError(f"the model {description.get('architecture')} has no language-model head, and the online "
                          "check scores its predictions under noise: replay the store offline only")
    check_variables(ds, settings)
    missing = [name for name in TOKEN_VARIABLES if name not in ds.variables]
    if missing:
        raise ReplayError(f"the store lacks {missing}: the online check feeds the stored tokens and scores the targets")
    layers = check_layers(ds, layers)
    n_samples = ds.sizes["sample"] if max_samples is None else min(max_samples, ds.sizes["sample"])
    runs = [(f"layer {layer}", (layer,), (layer,)) for layer in layers]
    if all_layers:
        runs.append((ALL_LAYERS, tuple(range(adapter.n_layers)), tuple(layers)))
    tally = _Tally(runs, layers, settings, model_attrs["n_heads"], n_samples)
    terms = {layer: ScoreTerms.of_layer(model_attrs, layer) for layer in layers}
    for start in range(0, n_samples, batch_size):
        batch = ds.isel(sample=slice(start, min(start + batch_size, n_samples)))
        _check_batch(adapter, batch, runs, layers, settings, terms, tally, config.compare_offline)
    return tally.result(ds, adapter, all_layers)


def with_online_check(tree: xr.DataTree, store, model, replay: ReplayConfig, **options) -> xr.DataTree:
    """The results tree of `orthosphere analyze` with the online check of its replay added as the
    group /replay/online: `replay` is the replay's configuration (``ReplayConfig``: its levels, layers,
    seed, draws, distribution, targets, sparse threshold and minimum of allowed keys); `options` are
    ``online_check``'s."""
    tree["replay/online"] = xr.DataTree(online_check(store, model, settings=replay, layers=replay.layers, **options))
    return tree


def check_model_matches(stored: dict, live: dict) -> None:
    """Raise ModelMismatchError unless every attribute both descriptions hold is the same."""
    differences = [
        f"{key}: store {stored[key]!r}, model {live[key]!r}"
        for key in live
        if key in stored and key not in DESCRIPTION_KEYS_IGNORED and not _same(stored[key], live[key])
    ]
    if differences:
        raise ModelMismatchError(
            "the model does not match the store's model description (" + "; ".join(differences) + "): "
            "load the model the store was extracted from"
        )


def noise_edit(settings: ReplaySettings, layers, samples, draw: int, level: float):
    """fn(layer, q, k, v) for adapter.edit_qkv: the replay's draws applied to the given layers."""
    layers = set(layers)

    def edit(layer, q, k, v):
        if layer not in layers:
            return q, k, v
        return tuple(
            _scaled(x, level * settings.kappa(target, layer, samples, draw, x.shape[1], x.shape[2]))
            if target in settings.targets else x
            for target, x in zip(("q", "k", "m"), (q, k, v)))

    return edit


def _scaled(x: torch.Tensor, kappa: np.ndarray) -> torch.Tensor:
    return x * torch.as_tensor(1.0 + kappa, dtype=x.dtype, device=x.device)[..., None]


def _same(a, b) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(a, b, rel_tol=1e-9)
    return a == b


def _adapter(model, device, model_dtype) -> tuple[Adapter, dict]:
    if isinstance(model, (str, Path)):
        loaded = load_source(model, device, model_dtype)
        return loaded.adapter, loaded.describe()
    adapter = model if isinstance(model, Adapter) else adapter_for(model)
    return adapter, adapter.describe()


class _Clean:
    """The clean pass of one batch: predictions and each measured layer's sparse instances."""

    def __init__(self, pattern: np.ndarray, valid: np.ndarray, terms: list[ScoreTerms], settings: ReplaySettings):
        instance = np.stack([instance_queries(valid, allowed_keys(valid, layer_terms).sum(axis=-1), settings.min_keys)
                             for layer_terms in terms], axis=1)[:, :, None, :]  # (sample, layer, 1, qpos)
        self.sparse = instance & (pattern.max(axis=-1) >= settings.sparse_threshold)  # (sample, layer, head, qpos)
        self.winner = pattern.argmax(axis=-1)


def _forward(adapter, tokens, valid, layers):
    """Predictions and the pattern (sample, layer, head, qpos, kpos) of the measured layers."""
    with torch.no_grad(), adapter.capture(("pattern",), layers) as recording:
        logits = adapter.forward(tokens, valid)
        pattern = recording.take()["pattern"]
    return logits.argmax(dim=-1).cpu().numpy(), pattern.float().numpy()


def _check_batch(adapter, batch, runs, layers, settings, terms, tally, compare_offline) -> None:
    device = adapter.device
    tokens = torch.as_tensor(batch["tokens"].values, dtype=torch.long, device=device)
    valid = batch["valid"].values.astype(bool)
    valid_tensor = torch.as_tensor(valid, device=device)
    samples = batch["sample"].values
    target, scored = batch["target"].values, batch["scored"].values.astype(bool)
    pred, pattern = _forward(adapter, tokens, valid_tensor, tuple(layers))
    clean = _Clean(pattern, valid, [terms[layer] for layer in layers], settings)
    tally.add_clean(pred, target, scored, clean, batch["pred"].values if "pred" in batch else None)
    offline_blocks = {
        layer: HeadBlock(batch["q"].sel(layer=layer).values, batch["k"].sel(layer=layer).values, valid,
                         terms[layer], settings.sparse_threshold, min_keys=settings.min_keys)
        for layer in layers
    } if compare_offline else {}
    for name, perturbed, measured in runs:
        for draw in range(settings.n_draws):
            for index, level in enumerate(settings.levels):
                with adapter.edit_qkv(noise_edit(settings, perturbed, samples, draw, level)):
                    noisy_pred, noisy_pattern = _forward(adapter, tokens, valid_tensor, measured)
                tally.add_noisy(name, index, noisy_pred, target, scored)
                for slot, layer in enumerate(measured):
                    row = layers.index(layer)
                    winner = noisy_pattern[:, slot].argmax(axis=-1)
                    collapse = clean.sparse[:, row] & (winner != clean.winner[:, row])
                    strict = collapse & (noisy_pattern[:, slot].max(axis=-1) >= settings.sparse_threshold)
                    tally.add_collapses(name, index, row, collapse, strict)
                    if compare_offline and name != ALL_LAYERS:
                        offline = collapse_indicators(offline_blocks[layer], samples=samples, layer=layer,
                                                      draw=draw, level=level, settings=settings)
                        tally.add_comparison(draw, index, row, clean.sparse[:, row], offline, collapse)


class _Tally:
    """Running counts over batches."""

    def __init__(self, runs, layers, settings, n_heads, n_samples):
        self.runs = [name for name, _, _ in runs]
        self.n_samples = n_samples
        self.layers, self.settings = layers, settings
        n_runs, n_levels, n_layers = len(runs), len(settings.levels), len(layers)
        self.clean_correct = self.scored = self.pred_same = self.pred_total = 0
        self.correct = np.zeros((n_runs, n_levels))
        self.n_sparse = np.zeros((n_layers, n_heads))
        self.collapses = {name: np.zeros((len(DEFINITIONS), n_levels, n_layers, n_heads)) for name in self.runs}
        self.offline_mismatches = np.zeros((n_levels, n_layers), np.int64)
        self.offline_collapses = np.zeros((n_levels, n_layers), np.int64)
        self.sparse_mismatches = np.zeros(n_layers, np.int64)

    def add_clean(self, pred, target, scored, clean, stored_pred):
        self.clean_correct += int(((pred == target) & scored).sum())
        self.scored += int(scored.sum())
        self.n_sparse += clean.sparse.sum(axis=(0, 3))
        if stored_pred is not None:
            self.pred_same += int(((pred == stored_pred) & scored).sum())
            self.pred_total += int(scored.sum())

    def add_noisy(self, name, level_index, pred, target, scored):
        self.correct[self.runs.index(name), level_index] += ((pred == target) & scored).sum()

    def add_collapses(self, name, level_index, row, collapse, strict):
        for d, indicator in enumerate((collapse, strict)):
            self.collapses[name][d, level_index, row] += indicator.sum(axis=(0, 2))

    def add_comparison(self, draw, level_index, row, online_sparse, offline, online_collapse):
        if draw == 0 and level_index == 0:  # the clean sparse instances: once per batch and layer
            self.sparse_mismatches[row] += int((online_sparse != offline["sparse"]).sum())
        self.offline_mismatches[level_index, row] += int((online_collapse != offline["collapse"]).sum())
        self.offline_collapses[level_index, row] += int(offline["collapse"].sum())

    def result(self, ds, adapter, all_layers) -> xr.Dataset:
        draws = self.settings.n_draws
        sparse_draws = self.n_sparse * draws
        with np.errstate(invalid="ignore", divide="ignore"):
            rate = {name: np.where(sparse_draws > 0, counts / sparse_draws, np.nan) for name, counts in self.collapses.items()}
        clean_accuracy = self.clean_correct / self.scored if self.scored else np.nan
        accuracy = self.correct / (self.scored * draws) if self.scored else np.full_like(self.correct, np.nan)
        dims = ("definition", "level", "layer", "head")
        variables = {
            "clean_accuracy": ((), clean_accuracy),
            "accuracy": (("perturbation", "level"), accuracy),
            "accuracy_drop": (("perturbation", "level"), clean_accuracy - accuracy),
            "n_scored": ((), self.scored),
            "n_sparse": (("layer", "head"), self.n_sparse.astype(np.int64)),
            "collapse_rate": (dims, np.stack([rate[f"layer {layer}"][:, :, i] for i, layer in enumerate(self.layers)], axis=2)),
            "offline_mismatches": (("level", "layer"), self.offline_mismatches),
            "offline_collapses": (("level", "layer"), self.offline_collapses),
            "sparse_mismatches": (("layer",), self.sparse_mismatches),
        }
        if self.pred_total:
            variables["clean_pred_agreement"] = ((), self.pred_same / self.pred_total)
        if all_layers:
            variables["collapse_rate_all_layers"] = (dims, rate[ALL_LAYERS])
        result = xr.Dataset(variables, coords={
            "perturbation": np.array(self.runs, dtype=object), "level": list(self.settings.levels),
            "layer": self.layers, "head": np.arange(self.n_sparse.shape[1]),
            "definition": np.array(DEFINITIONS, dtype=object)})
        result.attrs.update({"seed": self.settings.seed, "n_draws": draws, "distribution": self.settings.distribution,
                             "targets": list(self.settings.targets), "sparse_threshold": self.settings.sparse_threshold,
                             "min_keys": self.settings.min_keys,
                             "family": adapter.family, "n_samples": self.n_samples})
        return result
