"""Sphere structure: how far the representation is from orthogonal spheres (the paper's Theorem 2).

With the factor subspaces of a layer (bases U_a of a fitted ``FactorSubspaces``: by default the
joint, demixed fit, so that correlated labels do not tilt the bases), every analysed token x
splits uniquely into components x_a = U_a c_a in the factor subspaces and
a rest x_r orthogonal to all of them (c = pinv([U_1 ... U_k]) x; x_a is the orthogonal projection
P_a x when the subspaces are orthogonal). Then |x|^2 = sum_a |x_a|^2 + |x_r|^2 + c, with cross
terms c = 2 sum_{a<b} x_a . x_b. Orthogonal spheres mean every |x_a| (and |x_r|) is constant and
c = 0, so the deviation

    D = sqrt(sum_parts Var(|x_part|^2) + E[c^2]) / E[|x|^2]

is 0 for a perfect orthogonal-spheres representation; radius_share and cross_term_share split its
square into the parts' radius variation and the cross terms. Per factor also: the radius |x_a|
(mean, coefficient of variation, band holding `mass` around the median, quantiles, histogram) and
an algebraic sphere fit of the points c_a (centre, radius, residual, centre offset from the origin).
The analysed tokens are those on which every factor is read (their restrictions intersected).

The components depend on bases fitted from all the tokens, so the spheres read their site once
more after the fit: given fitted subspaces (``subspaces=``, as ``run_analyses`` passes those of
the same run), in one pass; else the fit is a first pass of their own.
"""
from __future__ import annotations

from functools import partial

import numpy as np
import xarray as xr

from .blocks import Packer, sample_block_sums
from .errors import AnalysisError
from .factors import factor_tokens, parse_factors
from .histogram import N_SLOTS, log_histogram, spread_variables
from .inputs import FiniteCheck, layer_data, square_norms, store_url, token_mask
from .norms import QUANTILES
from .options import as_attrs, check_options
from .plan import Plan, planned
from .subspaces import FactorSubspaces, d_model_site


def _fitted_subspaces(subspaces, fit: dict):
    """The given fitted subspaces, checked against the fit options the spheres were given (None: unset)."""
    if not isinstance(subspaces, FactorSubspaces) or not hasattr(subspaces, "fits_"):
        raise AnalysisError(
            f"spheres take fitted subspaces (FactorSubspaces(...).fit(dataset)), got {type(subspaces).__name__}: "
            "fit them first, or pass none and let the spheres fit their own"
        )
    given = {name: value for name, value in fit.items() if value is not None}
    fitted = subspaces.fit_options
    different = {name: (value, fitted[name]) for name, value in as_attrs(given).items() if fitted[name] != value}
    if different:
        raise AnalysisError(
            "the spheres were given subspaces fitted otherwise than they were asked for ("
            + "; ".join(f"{name}: asked {asked!r}, fitted {found!r}" for name, (asked, found) in different.items())
            + "): give those options to both analyses (a plain option, not spheres.OPTION), or pass no subspaces"
        )
    return subspaces


class LayerGeometry:
    """One layer's stacked bases U = [U_1 ... U_k] = W S V^T: an orthonormal basis W of their span
    (the projection of a token), the map from W-coordinates to the coordinates c = pinv(U) x of the
    factors (float32, like the activations), and the Gram blocks U_a^T U_b between factors."""

    def __init__(self, bases: list[np.ndarray]):
        self.ranks = [basis.shape[1] for basis in bases]
        self.stops = np.cumsum(self.ranks)
        self.starts = self.stops - self.ranks
        stacked = np.concatenate(bases, axis=1)
        left, singular, right = np.linalg.svd(stacked, full_matrices=False)
        kept = singular > 1e-6 * singular.max() if singular.size else singular.astype(bool)
        self.span = left[:, kept].astype("float32")
        self.to_coordinates = (right[kept].T / singular[kept]).T.astype("float32")
        self.gram = stacked.T @ stacked

    def part(self, coordinates, a):
        return coordinates[:, self.starts[a]: self.stops[a]]

    def block(self, a, b):
        return self.gram[self.starts[a]: self.stops[a], self.starts[b]: self.stops[b]].astype("float32")


def _pairs(n_factors: int) -> list[tuple[int, int]]:
    return [(a, b) for a in range(n_factors) for b in range(a + 1, n_factors)]


def _packer(ranks: list[int]) -> Packer:
    n, n_pairs = len(ranks), len(_pairs(len(ranks)))
    shapes = {
        "nonfinite": (), "count": (), "part_sum": (n + 1,), "part_square_sum": (n + 1,), "radius_sum": (n,),
        "cross_sum": (n_pairs,), "cross_square_sum": (n_pairs,), "total_cross_square_sum": (),
        "norm_sq_sum": (), "norm_sq_square_sum": (), "histogram": (n, N_SLOTS),
    }
    for a, rank in enumerate(ranks):
        shapes[f"fit_zz{a}"] = (rank + 1, rank + 1)
        shapes[f"fit_za{a}"] = (rank + 1,)
    return Packer(shapes)


def _sphere_moments(x, tokens, *, geometry: LayerGeometry, packer: Packer):
    """One block's moment sums of the parts |x_a|^2, the rest, the cross terms, the sphere fits and
    the radius histograms, over its analysed tokens."""
    every_square = square_norms(x).ravel()
    selected = tokens.ravel()
    norm_sq = every_square[selected].astype("float64")
    projected = x.reshape(-1, x.shape[-1])[selected] @ geometry.span
    coordinates = projected @ geometry.to_coordinates
    n_factors = len(geometry.ranks)
    parts = [geometry.part(coordinates, a) for a in range(n_factors)]
    radii = np.sqrt(np.stack([square_norms(part) for part in parts], axis=1))
    squares = np.concatenate([radii.astype("float64") ** 2, (norm_sq - square_norms(projected))[:, None]], axis=1)
    cross = np.zeros((len(norm_sq), len(_pairs(n_factors))))
    for pair, (a, b) in enumerate(_pairs(n_factors)):
        cross[:, pair] = np.einsum("nr,nr->n", parts[a] @ geometry.block(a, b), parts[b])
    total_cross = 2 * cross.sum(axis=1)
    out = {
        "nonfinite": np.count_nonzero(~np.isfinite(every_square)), "count": len(norm_sq),
        "part_sum": squares.sum(0), "part_square_sum": np.einsum("np,np->p", squares, squares),
        "radius_sum": radii.sum(0, dtype="float64"), "cross_sum": cross.sum(0),
        "cross_square_sum": np.einsum("np,np->p", cross, cross), "total_cross_square_sum": total_cross @ total_cross,
        "norm_sq_sum": norm_sq.sum(), "norm_sq_square_sum": norm_sq @ norm_sq,
        "histogram": log_histogram(radii, np.ones(radii.shape), np.broadcast_to(np.arange(n_factors), radii.shape), n_factors),
    }
    for a, part in enumerate(parts):
        # z = [2 y, 1] for the algebraic fit |y|^2 = 2 c . y + k, in float64: the residual is a small difference
        part = part.astype("float64")
        rank = part.shape[1]
        zz = np.empty((rank + 1, rank + 1))
        zz[:rank, :rank] = 4 * part.T @ part
        zz[:rank, rank] = zz[rank, :rank] = 2 * part.sum(axis=0)
        zz[rank, rank] = len(part)
        out[f"fit_zz{a}"] = zz
        out[f"fit_za{a}"] = np.append(2 * part.T @ squares[:, a], squares[:, a].sum())
    return packer.pack(out)


def _sphere_fit(zz, za, square_sum, count, basis):
    """Algebraic fit |y - centre|^2 = radius^2 to a factor's coordinates y: centre (in d_model), radius,
    relative residual sqrt(mean (|y|^2 - 2 centre . y - k)^2) / radius^2, centre offset |centre| / radius."""
    theta = np.linalg.lstsq(zz, za, rcond=None)[0]
    centre, k = theta[:-1], theta[-1]
    radius = np.sqrt(max(k + centre @ centre, 0.0))
    mean_square = (square_sum - 2 * theta @ za + theta @ zz @ theta) / count
    residual = np.sqrt(max(mean_square, 0.0)) / radius**2 if radius > 0 else np.nan
    offset = np.linalg.norm(centre) / radius if radius > 0 else np.nan
    return basis @ centre, radius, residual, offset


def plan_sphere_structure(dataset: xr.Dataset, *, site: str | None = None, factors=None, layers=None,
                          exclude_start: bool | None = None, estimator: str | None = None,
                          rank_threshold: float | None = None, rank: int | None = None,
                          max_classes: int | None = None, mass: float = 0.9, quantiles=QUANTILES,
                          ratio_max: float = 2.0, ratio_bins: int = 100,
                          subspaces: FactorSubspaces | None = None) -> Plan:
    """Radii, sphere fits, cross terms and the deviation from orthogonal spheres, per layer.

    subspaces: fitted FactorSubspaces whose bases (and site, factors, layers) the spheres use; then
    site, factors, layers, exclude_start, estimator, rank_threshold, rank and max_classes, when
    given, must agree with its fit. Without it, the spheres fit their own subspaces with these
    (None: FactorSubspaces' defaults; no bootstrap, no null). mass, quantiles, ratio_max,
    ratio_bins: as for norm_spread, applied to each radius |x_a|.
    """
    spread = check_options(mass=mass, quantiles=quantiles, ratio_max=ratio_max, ratio_bins=ratio_bins)
    fit = {"site": site, "factors": factors, "layers": layers, "exclude_start": exclude_start, "estimator": estimator,
           "rank_threshold": rank_threshold, "rank": rank, "max_classes": max_classes}
    if subspaces is not None:
        return _moments_plan(dataset, _fitted_subspaces(subspaces, fit), spread, "from the subspaces results")
    own = FactorSubspaces(**{name: value for name, value in fit.items() if value is not None}, n_bootstrap=0, n_null=0)
    d_model_site(dataset, own.site, "sphere structure")
    first = own.plan(dataset)
    return Plan(first.lazy, lambda computed: _moments_plan(dataset, first.finish(computed), spread, "fitted here"))


def _moments_plan(dataset: xr.Dataset, subspaces: FactorSubspaces, spread: dict, source: str) -> Plan:
    """The pass over the site that projects every analysed token onto the fitted subspaces."""
    site, layers, names = subspaces.site_, subspaces.layers_, subspaces.factors_
    array = d_model_site(dataset, site, "sphere structure")
    factors = parse_factors(dataset, names)
    mask = token_mask(dataset, subspaces.exclude_start)
    tokens = factor_tokens(dataset, factors[0], mask)  # each factor's tokens lie inside the mask already
    for factor in factors[1:]:
        tokens = tokens & factor_tokens(dataset, factor, mask)
    bases = {layer: dict(zip(names, subspaces.bases(layer))) for layer in layers}
    finite = FiniteCheck(dataset)
    lazy, packers = {}, {}
    for layer in layers:
        geometry = LayerGeometry(subspaces.bases(layer))
        packers[layer] = _packer(geometry.ranks)
        kernel = partial(_sphere_moments, geometry=geometry, packer=packers[layer])
        lazy[layer] = sample_block_sums(kernel, packers[layer].size, layer_data(array, layer), tokens)
        finite.reads(layer, (site, layer))

    def finish(sums):
        finite.check({layer: packers[layer].unpack(vector)["nonfinite"] for layer, vector in sums.items()})
        count = packers[layers[0]].unpack(sums[layers[0]])["count"]
        if count == 0:
            raise AnalysisError(
                f"no token of store {store_url(dataset)} is read by every factor {names}: their restrictions do not "
                "intersect; choose factors that apply to common tokens"
            )
        result = _sphere_dataset(layers, names, bases, {layer: packers[layer].unpack(sums[layer]) for layer in layers},
                                 spread)
        result.attrs.update({"site": site, "factors": names, "bases": source, "estimator": subspaces.estimator,
                             "mass": spread["mass"], "exclude_start": subspaces.exclude_start})
        return result

    return Plan(lazy, finish)


sphere_structure = planned(plan_sphere_structure)


def _sphere_dataset(layers, names, bases, moments, spread) -> xr.Dataset:
    n_factors = len(names)
    per_layer = {name: [] for name in (
        "radius_mean", "radius_cv", "sphere_radius", "fit_residual", "centre_offset", "sphere_centre", "rank",
        "cross_term_mean", "cross_term_rms", "part_norm_sq_mean", "part_norm_sq_variance", "cross_term_second_moment",
        "norm_sq_mean", "norm_sq_variance", "deviation", "cross_term_share", "radius_share")}
    for layer in layers:
        m = moments[layer]
        n = m["count"]
        part_mean = m["part_sum"] / n
        part_variance = np.maximum(m["part_square_sum"] / n - part_mean**2, 0.0)
        radius_mean = m["radius_sum"] / n
        radius_variance = np.maximum(part_mean[:n_factors] - radius_mean**2, 0.0)
        cross_mean, cross_rms = np.full((n_factors, n_factors), np.nan), np.full((n_factors, n_factors), np.nan)
        for pair, (a, b) in enumerate(_pairs(n_factors)):
            cross_mean[a, b] = cross_mean[b, a] = m["cross_sum"][pair] / n
            cross_rms[a, b] = cross_rms[b, a] = np.sqrt(m["cross_square_sum"][pair] / n)
        cross_second = m["total_cross_square_sum"] / n
        norm_sq_mean = m["norm_sq_sum"] / n
        budget = part_variance.sum() + cross_second
        fits = [_sphere_fit(m[f"fit_zz{a}"], m[f"fit_za{a}"], m["part_square_sum"][a], n, bases[layer][name])
                for a, name in enumerate(names)]
        values = {
            "radius_mean": radius_mean,
            "radius_cv": np.divide(np.sqrt(radius_variance), radius_mean, out=np.full(n_factors, np.nan), where=radius_mean > 0),
            "sphere_centre": np.stack([fit[0] for fit in fits]),
            "sphere_radius": np.array([fit[1] for fit in fits]),
            "fit_residual": np.array([fit[2] for fit in fits]),
            "centre_offset": np.array([fit[3] for fit in fits]),
            "rank": np.array([bases[layer][name].shape[1] for name in names]),
            "cross_term_mean": cross_mean,
            "cross_term_rms": cross_rms,
            "part_norm_sq_mean": part_mean,
            "part_norm_sq_variance": part_variance,
            "cross_term_second_moment": cross_second,
            "norm_sq_mean": norm_sq_mean,
            "norm_sq_variance": max(m["norm_sq_square_sum"] / n - norm_sq_mean**2, 0.0),
            "deviation": np.sqrt(budget) / norm_sq_mean,
            "cross_term_share": cross_second / budget if budget > 0 else np.nan,
            "radius_share": part_variance / budget if budget > 0 else np.full(n_factors + 1, np.nan),
        }
        for name, value in values.items():
            per_layer[name].append(value)
    stacked = {name: np.stack(value) for name, value in per_layer.items()}
    lf = ("layer", "factor")
    coords = {
        "layer": layers,
        "factor": np.array(names, dtype=object),
        "other": np.array(names, dtype=object),
        "part": np.array(names + ["rest"], dtype=object),
    }
    data = spread_variables(np.stack([moments[layer]["histogram"] for layer in layers]), group_dims=lf,
                            coords=coords, median_name="radius_median", **spread)
    data.update({
        "n_tokens": ((), int(moments[layers[0]]["count"])),
        "subspace_rank": (lf, stacked["rank"]),
        "radius_mean": (lf, stacked["radius_mean"]),
        "radius_cv": (lf, stacked["radius_cv"]),
        "sphere_radius": (lf, stacked["sphere_radius"]),
        "sphere_centre": (lf + ("d_model",), stacked["sphere_centre"]),
        "centre_offset": (lf, stacked["centre_offset"]),
        "fit_residual": (lf, stacked["fit_residual"]),
        "cross_term_mean": (lf + ("other",), stacked["cross_term_mean"]),
        "cross_term_rms": (lf + ("other",), stacked["cross_term_rms"]),
        "part_norm_sq_mean": (("layer", "part"), stacked["part_norm_sq_mean"]),
        "part_norm_sq_variance": (("layer", "part"), stacked["part_norm_sq_variance"]),
        "cross_term_second_moment": (("layer",), stacked["cross_term_second_moment"]),
        "norm_sq_mean": (("layer",), stacked["norm_sq_mean"]),
        "norm_sq_variance": (("layer",), stacked["norm_sq_variance"]),
        "deviation": (("layer",), stacked["deviation"]),
        "cross_term_share": (("layer",), stacked["cross_term_share"]),
        "radius_share": (("layer", "part"), stacked["radius_share"]),
    })
    return xr.Dataset(data, coords=coords, attrs={"ratio_bin_width": spread["ratio_max"] / spread["ratio_bins"]})
