"""Neighbouring quantities from the same tensors, per layer (cheap streaming passes).

- Rank collapse (Dong et al. 2021): per sequence, ||X - 1 xbar^T|| / ||X|| (Frobenius) over its
  analysed tokens at `site`; 0 when every token is the same vector. Mean and spread over sequences.
- Angular step (Karagodin et al. 2025): per token, the angle between its direction at `site`
  (the stream a block reads) and at `step_site` (the stream it writes), and the log of the ratio of
  their norms; mean and spread over tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import xarray as xr

from orthosphere.params import parameter

from .blocks import Packer, sample_block_sums
from .inputs import D_MODEL_SITES, FiniteCheck, check_layers, layer_data, square_norms, token_mask
from .options import FLAG, LAYERS, SITE, AnalysisConfig
from .plan import Plan
from .registry import Analysis
from .subspaces import d_model_site


@dataclass(frozen=True)
class NeighboursConfig(AnalysisConfig):
    """The options of ``neighbours``."""

    site: str = parameter("resid_pre", SITE, help="the stream a block reads (rank collapse, the step's start)")
    step_site: str = parameter("resid_post", SITE, help="the stream it writes (the step's end)")
    layers: tuple[int, ...] | None = parameter(None, LAYERS, None, help="layers (default: every one stored)")
    exclude_start: bool = parameter(True, FLAG, help="leave out each sequence's start token")

PACKER = Packer({
    "nonfinite": (), "sequences": (), "collapse_sum": (), "collapse_square_sum": (),
    "tokens": (), "angle_sum": (), "angle_square_sum": (), "log_ratio_sum": (), "log_ratio_square_sum": (),
})


def _neighbour_sums(x, y, mask):
    with np.errstate(invalid="ignore", divide="ignore"):  # NaN or Inf: counted, then reported
        return _neighbour_sums_of(x, y, mask)


def _neighbour_sums_of(x, y, mask):
    """One block's sums of the rank collapse per sequence and of the angular step per token."""
    x_sq, y_sq = square_norms(x), square_norms(y)
    weights = mask.astype("float32")
    count = weights.sum(axis=1)
    mean = np.einsum("spd,sp->sd", x, weights) / np.maximum(count, 1)[:, None]
    centred = (x - mean[:, None, :]) * weights[..., None]
    spread = square_norms(centred).sum(axis=1, dtype="float64")
    total = (x_sq * weights).sum(axis=1, dtype="float64")
    sequences = (count > 0) & (total > 0)
    collapse = np.sqrt(spread[sequences] / total[sequences])
    x_norm, y_norm = np.sqrt(x_sq), np.sqrt(y_sq)
    counted = mask & (x_norm > 0) & (y_norm > 0)
    x_unit = x[counted] / x_norm[counted][:, None]
    y_unit = y[counted] / y_norm[counted][:, None]
    # the angle between unit vectors as 2 atan2(|a - b|, |a + b|): accurate at every angle
    angle = np.degrees(2 * np.arctan2(np.sqrt(square_norms(x_unit - y_unit)), np.sqrt(square_norms(x_unit + y_unit))))
    angle = angle.astype("float64")
    log_ratio = np.log(y_norm[counted] / x_norm[counted]).astype("float64")
    return PACKER.pack({
        "nonfinite": np.count_nonzero(~np.isfinite(x_sq)) + np.count_nonzero(~np.isfinite(y_sq)),
        "sequences": sequences.sum(), "collapse_sum": collapse.sum(), "collapse_square_sum": (collapse**2).sum(),
        "tokens": counted.sum(), "angle_sum": angle.sum(), "angle_square_sum": (angle**2).sum(),
        "log_ratio_sum": log_ratio.sum(), "log_ratio_square_sum": (log_ratio**2).sum(),
    })


def _mean_and_spread(total, square_total, count):
    mean = total / count if count else np.nan
    return mean, np.sqrt(max(square_total / count - mean**2, 0.0)) if count else np.nan


def plan_neighbours(dataset: xr.Dataset, config: NeighboursConfig) -> Plan:
    """Rank collapse at `site` (the stream a block reads) and the angular step from `site` to
    `step_site` (the stream it writes), per layer."""
    site, step_site, layers, exclude_start = config.site, config.step_site, config.layers, config.exclude_start
    start = d_model_site(dataset, site, "rank collapse and the angular step")
    end = d_model_site(dataset, step_site, "the angular step")
    layers = check_layers(dataset, layers)
    mask = token_mask(dataset, exclude_start)
    finite = FiniteCheck(dataset)
    lazy = {}
    for layer in layers:
        lazy[layer] = sample_block_sums(_neighbour_sums, PACKER.size, layer_data(start, layer), layer_data(end, layer),
                                        mask)
        finite.reads(layer, (site, layer), (step_site, layer))

    def finish(sums):
        finite.check({layer: PACKER.unpack(vector)["nonfinite"] for layer, vector in sums.items()})
        names = ("rank_collapse", "rank_collapse_std", "angular_step", "angular_step_std", "log_norm_ratio",
                 "log_norm_ratio_std", "n_sequences", "n_tokens")
        values = {name: [] for name in names}
        for layer in layers:
            s = PACKER.unpack(sums[layer])
            collapse = _mean_and_spread(s["collapse_sum"], s["collapse_square_sum"], s["sequences"])
            angle = _mean_and_spread(s["angle_sum"], s["angle_square_sum"], s["tokens"])
            log_ratio = _mean_and_spread(s["log_ratio_sum"], s["log_ratio_square_sum"], s["tokens"])
            for name, value in zip(names, (*collapse, *angle, *log_ratio, int(s["sequences"]), int(s["tokens"]))):
                values[name].append(value)
        return xr.Dataset(
            {name: (("layer",), np.asarray(value), {"description": DESCRIPTIONS[name]}) for name, value in values.items()},
            coords={"layer": layers},
            attrs={"site": site, "step_site": step_site, "angle_unit": "degrees", "exclude_start": exclude_start},
        )

    return Plan(lazy, finish)


DESCRIPTIONS = {
    "rank_collapse": "rank collapse at `site` (Dong et al. 2021): per sequence ||X - 1 xbar^T|| / ||X|| (Frobenius) over "
                     "its analysed tokens, in [0, 1], 0 when every token is the same vector; mean over sequences",
    "rank_collapse_std": "standard deviation of the per-sequence rank collapse over sequences",
    "angular_step": "angular step (Karagodin et al. 2025): per analysed token, the angle in degrees between its vector at "
                    "`site` (the stream the block reads) and at `step_site` (the stream it writes); mean over tokens",
    "angular_step_std": "standard deviation of the angular step over tokens, in degrees",
    "log_norm_ratio": "per analysed token, the natural log of |x at step_site| / |x at site| (above 0: the block grows "
                      "the norm); mean over tokens",
    "log_norm_ratio_std": "standard deviation of log_norm_ratio over tokens",
    "n_sequences": "sequences in rank_collapse: those with an analysed token of non-zero norm",
    "n_tokens": "analysed tokens in angular_step and log_norm_ratio: those of non-zero norm at both sites",
}
"""The attrs description of each result variable."""


neighbours = Analysis("neighbours", NeighboursConfig, plan_neighbours, reads=(*D_MODEL_SITES, "valid"),
                      summary="rank collapse and the angular step of the residual stream, per layer")
