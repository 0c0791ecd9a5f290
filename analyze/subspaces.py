"""Factor subspaces: class-conditional means and their SVD per layer, principal angles between the
subspaces of every pair of factors and with each head's read subspaces, bootstrap intervals.

One streaming pass over the site sums, per layer, factor, class and bootstrap group of samples,
the token vectors (float64) and counts; everything else is small linear algebra on those sums.
Bootstrap replicates resample the groups (samples hashed into `bootstrap_groups` groups by a
seeded hash of their index) with multinomial weights, so intervals need no second pass.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import dask
import numpy as np
import xarray as xr
from scipy import sparse

from .blocks import Packer, sample_block_sums
from .errors import AnalysisError
from .factors import Factor, discover_classes, factor_codes, parse_factors
from .geometry import between_class_svd, choose_rank, column_space, overlap_fraction, principal_angles
from .inputs import (
    D_MODEL_SITES,
    SITES,
    FiniteCheck,
    check_layers,
    layer_data,
    require_site,
    sample_values,
    square_norms,
    token_mask,
)
from .options import as_attrs, check_options

BOUNDS = ("low", "high")


@dataclass
class FactorFit:
    """One factor's subspace at one layer."""

    singular: np.ndarray  # (min(classes - 1, d),) singular values of the weighted centred means
    rank: int
    basis: np.ndarray  # (d, rank) orthonormal
    between_fraction: float  # between-class variance / total variance of the factor's tokens
    replicates: np.ndarray | None = None  # (n_bootstrap, d, rank)

    @property
    def explained(self) -> np.ndarray:
        variance = self.singular**2
        return np.cumsum(variance) / variance.sum() if variance.sum() > 0 else np.full(variance.shape, np.nan)


@dataclass
class Subspaces:
    """Every factor's fit at every layer, and what it was fitted on."""

    site: str
    layers: list[int]
    factors: list[Factor]
    classes: dict[str, np.ndarray]
    n_tokens: dict[str, int]
    fits: dict[int, dict[str, FactorFit]] = field(default_factory=dict)


def bootstrap_group(samples: np.ndarray, seed: int, n_groups: int) -> np.ndarray:
    """A seeded hash (splitmix64) of each sample index into one of n_groups groups."""
    z = (np.uint64(seed) << np.uint64(32)) ^ np.asarray(samples).astype(np.uint64)
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return (z % np.uint64(n_groups)).astype("int64")


def d_model_site(dataset: xr.Dataset, site: str, purpose: str) -> xr.DataArray:
    """A residual-stream site (sample, layer, pos, d_model) of the store."""
    if site not in D_MODEL_SITES and site in SITES:
        raise AnalysisError(f"{purpose} reads a residual-stream site, one of {list(D_MODEL_SITES)}; got {site!r}")
    return require_site(dataset, site, purpose)


def _class_sums(x, groups, *codes, packer, n_classes, n_groups):
    """Per factor: sums of token vectors and counts per (group, class), and the sum of squared norms.
    A (group, class) cell of one block sums few tokens, so float32 sums lose nothing that matters;
    blocks are then accumulated in float64."""
    squares = square_norms(x).ravel()
    vectors = x.reshape(-1, x.shape[-1])
    token_group = np.repeat(groups, x.shape[1])
    out = {"nonfinite": np.count_nonzero(~np.isfinite(squares))}
    for number, (code, classes) in enumerate(zip(codes, n_classes)):
        code = code.ravel()
        rows = np.flatnonzero(code >= 0)
        index = token_group[rows] * classes + code[rows]
        onehot = sparse.csr_matrix((np.ones(rows.size, dtype=vectors.dtype), (index, rows)),
                                   shape=(n_groups * classes, len(vectors)))
        out[f"sums{number}"] = onehot @ vectors
        out[f"counts{number}"] = np.bincount(index, minlength=n_groups * classes)
        out[f"squares{number}"] = squares[rows].sum(dtype="float64")
    return packer.pack(out)


def _fit(sums, counts, squares, *, rank_threshold, rank, weights) -> FactorFit:
    n_classes = sums.shape[1]
    singular, directions = between_class_svd(sums.sum(axis=0), counts.sum(axis=0))
    singular = singular[: min(n_classes - 1, sums.shape[2])]
    chosen = choose_rank(singular, n_classes, rank_threshold, rank)
    n = counts.sum()
    grand = sums.sum(axis=(0, 1)) / n
    total = squares - n * grand @ grand
    fit = FactorFit(singular, chosen, directions[:chosen].T, float((singular**2).sum() / total) if total > 0 else np.nan)
    if weights is not None:
        _, replicate_directions = between_class_svd(np.tensordot(weights, sums, axes=(1, 0)), weights @ counts)
        fit.replicates = np.swapaxes(replicate_directions[:, :chosen, :], 1, 2)
    return fit


def fit_subspaces(dataset: xr.Dataset, *, site="resid_pre", factors=None, layers=None, exclude_start=True,
                  rank_threshold=0.95, rank=None, n_bootstrap=0, bootstrap_groups=32, seed=0) -> Subspaces:
    """Fit every factor's subspace at every layer in one streaming pass (plus a cheap pass over the labels)."""
    array = d_model_site(dataset, site, "factor subspaces")
    layers = check_layers(dataset, layers)
    factors = parse_factors(dataset, factors)
    mask = token_mask(dataset, exclude_start)
    classes = discover_classes(dataset, factors, mask)
    codes = [factor_codes(dataset, factor, classes[factor.name], mask) for factor in factors]
    n_groups = bootstrap_groups if n_bootstrap else 1
    n_classes = [len(classes[factor.name]) for factor in factors]
    d_model = array.sizes["d_model"]
    shapes = {"nonfinite": ()}
    for number, size in enumerate(n_classes):
        shapes.update({f"sums{number}": (n_groups, size, d_model), f"counts{number}": (n_groups, size), f"squares{number}": ()})
    packer = Packer(shapes)
    groups = sample_values(dataset, mask).map_blocks(bootstrap_group, seed, n_groups, dtype="int64")
    kernel = partial(_class_sums, packer=packer, n_classes=n_classes, n_groups=n_groups)
    finite = FiniteCheck(dataset)
    lazy = {}
    for layer in layers:
        lazy[layer] = sample_block_sums(kernel, packer.size, layer_data(array, layer), groups, *codes)
        finite.reads(layer, (site, layer))
    (sums,) = dask.compute(lazy)
    finite.check({layer: packer.unpack(vector)["nonfinite"] for layer, vector in sums.items()})
    rng = np.random.default_rng(seed)
    weights = rng.multinomial(n_groups, np.full(n_groups, 1 / n_groups), size=n_bootstrap) if n_bootstrap else None
    counts = packer.unpack(sums[layers[0]])
    n_tokens = {factor.name: int(counts[f"counts{n}"].sum()) for n, factor in enumerate(factors)}
    result = Subspaces(site, layers, factors, classes, n_tokens)
    for layer in layers:
        parts = packer.unpack(sums[layer])
        result.fits[layer] = {
            factor.name: _fit(parts[f"sums{n}"], parts[f"counts{n}"], parts[f"squares{n}"],
                              rank_threshold=rank_threshold, rank=rank, weights=weights)
            for n, factor in enumerate(factors)
        }
    return result


def head_read_spaces(dataset: xr.Dataset, layers: list[int]) -> dict[int, dict[str, list[np.ndarray]]]:
    """Per layer, orthonormal bases of each head's read subspaces in d_model (column spaces of w_q[h],
    w_k[g]); empty without weights."""
    if "w_q" not in dataset.data_vars:
        return {}
    weights = dataset[["w_q", "w_k"]].sel(layer=layers).compute()
    return {
        layer: {name: [column_space(matrix) for matrix in weights[f"w_{name}"].sel(layer=layer).values] for name in "qk"}
        for layer in layers
    }


class AngleTable:
    """Principal angles (degrees, ascending, NaN-padded) with bootstrap intervals, filled pair by pair."""

    def __init__(self, shape: tuple[int, ...], n_angles: int, confidence: float):
        self.angles = np.full(shape + (n_angles,), np.nan)
        self.intervals = np.full(shape + (n_angles, 2), np.nan)
        self.min_interval = np.full(shape + (2,), np.nan)
        self.overlap = np.full(shape, np.nan)
        self.percentiles = [50 * (1 - confidence), 50 * (1 + confidence)]

    def fill(self, index, a: np.ndarray, b: np.ndarray, a_replicates=None, b_replicates=None) -> None:
        angles = principal_angles(a, b)
        self.angles[index][: angles.size] = angles
        self.overlap[index] = overlap_fraction(a, b)
        if a_replicates is None or angles.size == 0:
            return
        replicate_angles = principal_angles(a_replicates, b if b_replicates is None else b_replicates)
        bounds = np.moveaxis(np.percentile(replicate_angles, self.percentiles, axis=0), 0, -1)
        self.intervals[index][: angles.size] = bounds
        self.min_interval[index] = bounds[0]

    @property
    def min_angle(self) -> np.ndarray:
        return self.angles[..., 0]


def _relation(min_angle: np.ndarray, independence_deg: float, orthogonality_deg: float) -> np.ndarray:
    relation = np.where(min_angle >= 90 - orthogonality_deg, "orthogonal",
                        np.where(min_angle >= independence_deg, "independent", "dependent"))
    return np.where(np.isnan(min_angle), "", relation).astype(object)


def subspace_dataset(dataset: xr.Dataset, subspaces: Subspaces, *, confidence: float, independence_deg: float,
                     orthogonality_deg: float) -> xr.Dataset:
    """The results group /subspaces (see the package docstring for its variables)."""
    layers, names = subspaces.layers, [factor.name for factor in subspaces.factors]
    d_model = dataset.sizes["d_model"]
    fits = subspaces.fits
    n_components = max(len(fits[layers[0]][name].singular) for name in names)
    heads = head_read_spaces(dataset, layers)
    max_rank = max(fit.rank for layer in layers for fit in fits[layer].values())
    n_angles = max(1, max_rank)
    shape = (len(layers), len(names))
    pairs = AngleTable(shape + (len(names),), n_angles, confidence)
    n_heads, n_kv_heads = dataset.sizes["head"], dataset.sizes["kv_head"]
    reads = {"q": AngleTable(shape + (n_heads,), n_angles, confidence),
             "k": AngleTable(shape + (n_kv_heads,), n_angles, confidence)}
    singular = np.full(shape + (n_components,), np.nan)
    explained = np.full(shape + (n_components,), np.nan)
    basis = np.full(shape + (d_model, max(max_rank, 1)), np.nan)
    rank = np.zeros(shape, dtype="int64")
    between = np.full(shape, np.nan)
    for i, layer in enumerate(layers):
        for j, name in enumerate(names):
            fit = fits[layer][name]
            singular[i, j, : fit.singular.size] = fit.singular
            explained[i, j, : fit.singular.size] = fit.explained
            basis[i, j, :, : fit.rank] = fit.basis
            rank[i, j] = fit.rank
            between[i, j] = fit.between_fraction
            for m, other in enumerate(names):
                if m != j:
                    partner = fits[layer][other]
                    pairs.fill((i, j, m), fit.basis, partner.basis, fit.replicates, partner.replicates)
            for kind, spaces in heads.get(layer, {}).items():
                for h, space in enumerate(spaces):
                    reads[kind].fill((i, j, h), fit.basis, space, fit.replicates)
    factor_dims = ("layer", "factor")
    data = {
        "n_classes": (("factor",), [len(subspaces.classes[name]) for name in names]),
        "n_tokens": (("factor",), [subspaces.n_tokens[name] for name in names]),
        "subspace_rank": (factor_dims, rank),
        "singular_value": (factor_dims + ("component",), singular),
        "explained": (factor_dims + ("component",), explained),
        "between_fraction": (factor_dims, between),
        "basis": (factor_dims + ("d_model", "basis_vector"), basis),
        "angles": (factor_dims + ("other", "angle"), pairs.angles),
        "angles_ci": (factor_dims + ("other", "angle", "bound"), pairs.intervals),
        "min_angle": (factor_dims + ("other",), pairs.min_angle),
        "min_angle_ci": (factor_dims + ("other", "bound"), pairs.min_interval),
        "overlap": (factor_dims + ("other",), pairs.overlap),
        "relation": (factor_dims + ("other",), _relation(pairs.min_angle, independence_deg, orthogonality_deg)),
    }
    if heads:
        for kind, head_dim in (("q", "head"), ("k", "kv_head")):
            table = reads[kind]
            data.update({
                f"{kind}_angles": (factor_dims + (head_dim, "angle"), table.angles),
                f"{kind}_angles_ci": (factor_dims + (head_dim, "angle", "bound"), table.intervals),
                f"{kind}_min_angle": (factor_dims + (head_dim,), table.min_angle),
                f"{kind}_min_angle_ci": (factor_dims + (head_dim, "bound"), table.min_interval),
                f"{kind}_overlap": (factor_dims + (head_dim,), table.overlap),
            })
    coords = {
        "layer": layers,
        "factor": np.array(names, dtype=object),
        "other": np.array(names, dtype=object),
        "bound": np.array(BOUNDS, dtype=object),
        "head": dataset["head"].values,
        "kv_head": dataset["kv_head"].values,
    }
    attrs = {
        "site": subspaces.site,
        "factors": names,
        "classes": {name: [str(value) for value in subspaces.classes[name]] for name in names},
        "head_angles": "computed from w_q, w_k" if heads else "not computed: the store has no weights",
    }
    return xr.Dataset(data, coords=coords, attrs=attrs)


def factor_subspaces(dataset: xr.Dataset, *, site: str = "resid_pre", factors=None, layers=None,
                     exclude_start: bool = True, rank_threshold: float = 0.95, rank: int | None = None,
                     n_bootstrap: int = 200, bootstrap_groups: int = 32, confidence: float = 0.9, seed: int = 0,
                     independence_deg: float = 10.0, orthogonality_deg: float = 10.0) -> xr.Dataset:
    """Factor subspaces at a residual-stream site, their explained variance and rank, and principal
    angles (between factors and with each head's read subspaces) with bootstrap intervals.

    factors: factor specs (default: every label of the store, and pos); rank: a fixed rank, else the
    fewest directions holding rank_threshold of the between-class variance; n_bootstrap replicates
    over bootstrap_groups seeded groups of samples give `confidence` intervals; a pair whose smallest
    angle is below independence_deg is "dependent", within orthogonality_deg of 90 "orthogonal",
    else "independent".
    """
    fit = check_options(site=site, factors=factors, layers=layers, exclude_start=exclude_start,
                        rank_threshold=rank_threshold, rank=rank)
    check_options(n_bootstrap=n_bootstrap, bootstrap_groups=bootstrap_groups, confidence=confidence, seed=seed,
                  independence_deg=independence_deg, orthogonality_deg=orthogonality_deg)
    subspaces = fit_subspaces(dataset, **fit, n_bootstrap=n_bootstrap, bootstrap_groups=bootstrap_groups, seed=seed)
    result = subspace_dataset(dataset, subspaces, confidence=confidence, independence_deg=independence_deg,
                              orthogonality_deg=orthogonality_deg)
    result.attrs["fit"] = as_attrs(fit | {"layers": subspaces.layers, "factors": [f.name for f in subspaces.factors]})
    result.attrs.update({"n_bootstrap": n_bootstrap, "bootstrap_groups": bootstrap_groups, "seed": seed,
                         "confidence": confidence, "independence_deg": independence_deg,
                         "orthogonality_deg": orthogonality_deg})
    return result
