"""Synthetic stores with planted structure and known answers, written through orthosphere.store.

`write_store` writes any arrays as a complete store; the `plant_*` functions build arrays whose
geometry is known exactly (factor subspaces at chosen angles, spheres of chosen radius spread,
norms with a chosen spread, sequences with a chosen rank collapse and angular step). The labels
of planted factors follow a crossed design over the tokens after each start token (every
combination of classes and levels equally often), so class means carry no trace of other
factors and planted values are recovered exactly up to float32 rounding.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from orthosphere.store import create_store
from orthosphere.store.schema import label_missing_value

NOT_APPLICABLE = label_missing_value("int16")
"""The int16 label value of a token where a label does not apply."""

WEIGHT_SHAPES = {
    "w_q": ("layer", "head", "d_model", "d_head"),
    "w_k": ("layer", "kv_head", "d_model", "d_head"),
    "w_v": ("layer", "kv_head", "d_model", "d_head"),
    "w_o": ("layer", "head", "d_head", "d_model"),
    "b_q": ("layer", "head", "d_head"),
    "b_k": ("layer", "kv_head", "d_head"),
    "b_v": ("layer", "kv_head", "d_head"),
    "b_o": ("layer", "d_model"),
}


def write_store(url, sites: dict[str, np.ndarray], *, labels: dict[str, np.ndarray] | None = None, valid=None,
                weights: dict[str, np.ndarray] | None = None, model: dict | None = None, samples_per_chunk=None,
                with_weights: bool = True, dtype: str = "float32", seed: int = 0,
                label_dtypes: dict[str, str] | None = None) -> str:
    """Write a complete store holding `sites` (name -> (sample, layer, ...) array) and `labels`
    (name -> (sample, pos) str or int array; int16 unless `label_dtypes` names another integer type).
    Sizes come from the arrays (n_heads = n_kv_heads = 2, d_head = 4 unless q, k or `model` say
    otherwise); weights not given are seeded random ones."""
    first = next(iter(sites.values()))
    n_samples, n_layers, n_pos = first.shape[:3]
    sizes = {"n_layers": n_layers, "n_heads": 2, "n_kv_heads": 2, "d_head": 4, "d_model": 8}
    for name, array in sites.items():
        if name in ("resid_pre", "resid_mid", "resid_post", "attn_in"):
            sizes["d_model"] = array.shape[-1]
        if name == "q":
            sizes.update(n_heads=array.shape[3], d_head=array.shape[4])
        if name in ("k", "v"):
            sizes["n_kv_heads"] = array.shape[3]
        if name == "pattern":
            sizes["n_heads"] = array.shape[2]
    if "k" not in sites and "v" not in sites:
        sizes["n_kv_heads"] = sizes["n_heads"]
    description = {"family": "synthetic", "source": "planted", "norm_placement": "none", "norm_type": "layer",
                   "attn_scale": 1 / np.sqrt(sizes["d_head"]), "causal": True, **sizes, **(model or {})}
    labels = labels or {}
    label_types = {name: "str" if np.asarray(v).dtype.kind in "UTO" else "int16" for name, v in labels.items()}
    label_types.update(label_dtypes or {})
    writer = create_store(url, model=description, task={"name": "planted"}, n_samples=n_samples, n_pos=n_pos,
                          sites=tuple(sites), labels=label_types, samples_per_chunk=samples_per_chunk,
                          with_weights=with_weights, dtype=dtype)
    valid = np.ones((n_samples, n_pos), bool) if valid is None else np.asarray(valid, bool)
    arrays = {"valid": valid, "scored": valid, **{name: np.asarray(v, dtype) for name, v in sites.items()},
              **{name: np.asarray(v) for name, v in labels.items()}}
    writer.write(0, {name: np.asarray(value) for name, value in arrays.items()})
    if with_weights:
        dims = {"layer": n_layers, "head": description["n_heads"], "kv_head": description["n_kv_heads"],
                "d_model": description["d_model"], "d_head": description["d_head"]}
        rng = np.random.default_rng(seed)
        planted = dict(weights or {})
        writer.write_weights({
            name: np.asarray(planted[name], "float32") if name in planted
            else rng.normal(size=tuple(dims[d] for d in shape)).astype("float32")
            for name, shape in WEIGHT_SHAPES.items()
        })
    writer.mark_shard_complete(0)
    writer.finish()
    return str(url)


def crossed_design(n_samples: int, n_pos: int, sizes: list[int]) -> list[np.ndarray]:
    """Mixed-radix digits (sample, pos) of the token index over positions 1.. (position 0, the start
    token, gets -1): digit i cycles through sizes[i] values, every combination equally often when
    n_samples * (n_pos - 1) is a multiple of prod(sizes)."""
    index = np.arange(n_samples * (n_pos - 1)).reshape(n_samples, n_pos - 1)
    digits = []
    for size in sizes:
        digit = np.full((n_samples, n_pos), -1, dtype="int64")
        digit[:, 1:] = index % size
        index = index // size
        digits.append(digit)
    return digits


def circle(n_classes: int) -> np.ndarray:
    """n_classes unit vectors (class, 2) equally spaced on a circle: they sum to zero and span the plane."""
    angles = 2 * np.pi * np.arange(n_classes) / n_classes
    return np.stack([np.cos(angles), np.sin(angles)], axis=1)


def plane(d_model: int, dims=(0, 1), angle_deg: float = 0.0, towards=(2, 3)) -> np.ndarray:
    """Orthonormal basis (d_model, 2) of the plane spanned by axes `dims`, tilted by angle_deg towards
    axes `towards`: its principal angles with the untilted plane are both angle_deg."""
    basis = np.zeros((d_model, 2))
    theta = np.radians(angle_deg)
    for column, (axis, target) in enumerate(zip(dims, towards)):
        basis[axis, column] = np.cos(theta)
        basis[target, column] += np.sin(theta)
    return basis


def levels(n_levels: int, cv: float) -> np.ndarray:
    """n_levels evenly spaced radius factors with mean 1 and coefficient of variation cv."""
    if n_levels == 1:
        return np.ones(1)
    step = cv / np.sqrt((n_levels**2 - 1) / 12)
    return 1 + step * (np.arange(n_levels) - (n_levels - 1) / 2)


@dataclass(frozen=True)
class PlantedFactor:
    """A factor planted on a circle of `radius` in the plane `basis` (d_model, 2), its radius varying
    over the design's levels with coefficient of variation `radius_cv`; labels "c0", "c1", ... when
    as_strings, else integers."""

    name: str
    n_classes: int
    basis: np.ndarray
    radius: float = 1.0
    radius_cv: float = 0.0
    as_strings: bool = False


def plant_factors(n_samples: int, n_pos: int, factors: list[PlantedFactor], *, n_levels: int = 1,
                  noise: float = 0.0, start_norm: float = 50.0, seed: int = 0):
    """Token vectors x = sum_a radius_a * level_a * circle_a[class_a] + isotropic noise, one layer.

    Returns (x (sample, pos, d_model), labels (name -> (sample, pos)), components (name -> (sample, pos,
    d_model)) without noise). The start token (position 0) holds a vector of norm start_norm and no
    label. Classes and the n_levels radius levels (shared by all factors) follow one crossed design."""
    d_model = factors[0].basis.shape[0]
    digits = crossed_design(n_samples, n_pos, [f.n_classes for f in factors] + [n_levels])
    level_digit = np.maximum(digits[-1], 0)
    rng = np.random.default_rng(seed)
    x = np.zeros((n_samples, n_pos, d_model))
    labels, components = {}, {}
    for number, factor in enumerate(factors):
        classes = digits[number]
        level = levels(n_levels, factor.radius_cv)[level_digit]
        points = circle(factor.n_classes)[np.maximum(classes, 0)] @ factor.basis.T
        component = factor.radius * level[..., None] * points
        component[:, 0] = 0.0
        components[factor.name] = component
        x += component
        label = np.where(classes >= 0, classes, NOT_APPLICABLE).astype("int16")
        labels[factor.name] = np.where(label >= 0, np.char.add("c", label.astype(str)), "") if factor.as_strings else label
    x[:, 1:] += noise * rng.normal(size=(n_samples, n_pos - 1, d_model))
    x[:, 0, -1] = start_norm
    return x, labels, components


def plant_norm_spread(n_samples: int, n_pos: int, d_model: int, half_widths, *, median: float = 3.0,
                      start_norm: float = 100.0, seed: int = 0) -> np.ndarray:
    """Vectors (sample, pos, d_model) in random directions whose norm at position p is median * (1 + s),
    s evenly spaced over [-half_widths[p], half_widths[p]] across samples (shuffled per position);
    a uniform spread of half-width w holds 90 % of the mass within +-0.9 w. Position 0 has norm start_norm."""
    rng = np.random.default_rng(seed)
    directions = rng.normal(size=(n_samples, n_pos, d_model))
    directions /= np.linalg.norm(directions, axis=-1, keepdims=True)
    grid = (np.arange(n_samples) + 0.5) / n_samples * 2 - 1
    norms = np.empty((n_samples, n_pos))
    for position in range(n_pos):
        norms[:, position] = median * (1 + half_widths[position] * rng.permutation(grid))
    norms[:, 0] = start_norm
    return directions * norms[..., None]


def weighted_median(values: np.ndarray, weights: np.ndarray) -> float:
    """Reference answer by sorting: the first value (ascending) at which the cumulative weight reaches half."""
    values, weights = np.ravel(values), np.ravel(weights).astype(float)
    order = np.argsort(values)
    cumulative = np.cumsum(weights[order]) / weights.sum()
    return float(values[order][np.searchsorted(cumulative, 0.5)])


def weighted_band(values: np.ndarray, weights: np.ndarray, mass: float = 0.9, centre: float | None = None) -> float:
    """Reference answer by sorting: the smallest p such that |value / centre - 1| <= p holds `mass` of the
    weight, centre the weighted median unless given."""
    values, weights = np.ravel(values), np.ravel(weights).astype(float)
    keep = weights > 0
    values, weights = values[keep], weights[keep]
    centre = weighted_median(values, weights) if centre is None else centre
    deviation = np.abs(values / centre - 1)
    order = np.argsort(deviation)
    cumulative = np.cumsum(weights[order]) / weights.sum()
    return float(deviation[order][np.searchsorted(cumulative, mass)])


def pooled_ratio_band(groups, mass: float = 0.9) -> float:
    """Reference answer by sorting: the band around 1 holding `mass` of the pooled ratios of (values,
    weights) groups, each group's values divided by its own weighted median, weighted by its weights."""
    ratios = [np.ravel(values) / weighted_median(values, weights) for values, weights in groups]
    weights = [np.ravel(weights) for _, weights in groups]
    return weighted_band(np.concatenate(ratios), np.concatenate(weights), mass, centre=1.0)


def plant_neighbours(n_samples: int, n_pos: int, d_model: int, collapse: float, step_deg: float, seed: int = 0):
    """(resid_pre, resid_post) of one layer: per sequence, tokens m + e_t with sum_t e_t = 0 and e_t
    orthogonal to m, scaled so that ||X - 1 xbar^T|| / ||X|| = collapse over positions 1..; resid_post
    turns every token by step_deg in a plane of its own, keeping its norm."""
    rng = np.random.default_rng(seed)
    pre = np.zeros((n_samples, n_pos, d_model))
    post = np.zeros_like(pre)
    n = n_pos - 1
    for sample in range(n_samples):
        mean = rng.normal(size=d_model)
        mean /= np.linalg.norm(mean)
        spread = rng.normal(size=(n, d_model))
        spread -= spread.mean(axis=0)
        spread -= np.outer(spread @ mean, mean)
        # ||E||^2 / (n |m|^2 + ||E||^2) = collapse^2
        scale = np.sqrt(collapse**2 * n / (1 - collapse**2)) / np.linalg.norm(spread)
        tokens = mean + scale * spread
        turn = rng.normal(size=(n, d_model))
        turn -= (np.einsum("td,td->t", turn, tokens) / np.einsum("td,td->t", tokens, tokens))[:, None] * tokens
        turn *= (np.linalg.norm(tokens, axis=1) / np.linalg.norm(turn, axis=1))[:, None]
        theta = np.radians(step_deg)
        pre[sample, 1:] = tokens
        post[sample, 1:] = np.cos(theta) * tokens + np.sin(theta) * turn
        pre[sample, 0] = post[sample, 0] = 10.0
    return pre, post


# Correlated labels: random (not axis-aligned) subspaces, unequal class counts, a factor that one
# label partly determines, a factor read on a subset of tokens.

def random_basis(d_model: int, rank: int, rng: np.random.Generator, exclude: np.ndarray | None = None) -> np.ndarray:
    """A random orthonormal basis (d_model, rank), orthogonal to the columns of `exclude` if given."""
    matrix = rng.normal(size=(d_model, rank))
    if exclude is not None:
        matrix -= exclude @ (exclude.T @ matrix)
    return np.linalg.qr(matrix)[0]


def bases_at_angles(d_model: int, rank_a: int, rank_b: int, angles_deg, rng: np.random.Generator):
    """Random bases (d_model, rank_a) and (d_model, rank_b) whose principal angles are angles_deg
    (ascending, one per column of b; len(angles_deg) == rank_b <= rank_a)."""
    a = random_basis(d_model, rank_a, rng)
    away = random_basis(d_model, rank_b, rng, exclude=a)
    theta = np.radians(np.asarray(angles_deg, float))
    return a, a[:, :rank_b] * np.cos(theta) + away * np.sin(theta)


def balanced_effects(probabilities: np.ndarray, basis: np.ndarray, scale: float, rng: np.random.Generator) -> np.ndarray:
    """Class effects (class, d_model) in the span of `basis` whose spread, weighted by the class
    probabilities, is scale^2 along every basis vector: their subspace has rank basis.shape[1] at
    any rank_threshold, and every class differs (classes > rank)."""
    coefficients = rng.normal(size=(len(probabilities), basis.shape[1]))
    coefficients -= probabilities @ coefficients
    spread = coefficients.T @ (probabilities[:, None] * coefficients)
    values, vectors = np.linalg.eigh(spread)
    return scale * coefficients @ vectors / np.sqrt(values) @ vectors.T @ basis.T


def sphere_points(n_classes: int, basis: np.ndarray, radius: float, rng: np.random.Generator) -> np.ndarray:
    """n_classes points (class, d_model) of norm `radius` in random directions of the span of `basis`."""
    directions = rng.normal(size=(n_classes, basis.shape[1]))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    return radius * directions @ basis.T


def skewed(n_classes: int, rng: np.random.Generator, spread: float = 1.0) -> np.ndarray:
    """Unequal class probabilities (log-normal weights)."""
    weights = np.exp(spread * rng.normal(size=n_classes))
    return weights / weights.sum()


def correlated_labels(n_tokens: int, probabilities: list[np.ndarray], determined: float, rng: np.random.Generator):
    """Labels (token,) of factors drawn with the given class probabilities, except that on a share
    `determined` of the tokens the second factor's class is a function of the first's (c_b = c_a mod K_b)."""
    labels = [rng.choice(len(p), size=n_tokens, p=p) for p in probabilities]
    tied = rng.random(n_tokens) < determined
    labels[1] = np.where(tied, labels[0] % len(probabilities[1]), labels[1])
    return labels
