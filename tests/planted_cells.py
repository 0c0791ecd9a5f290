"""Planted stores for calibrating the statistics: one cell of the calibration grid is a store of many
replicate layers sharing one design (labels) and one kind of truth, each layer with its own random
subspaces and noise, written through orthosphere.store and analysed like any store. ``score`` turns
the results into error rates against the planted truth. benchmarks/calibration.py runs the grid;
tests/test_calibration.py a small fixed-seed subset.

The planted model of a layer: x = E_a[c_a] + E_b[c_b] + (role offset) + noise, noise N(0, 1) in every
dimension; factor a has `n_classes` classes (uniform or Zipf), b has `b_classes` (4; uniform; with
`confounded`, b = a mod b_classes on half the tokens); a's subspace has rank min(`rank`, n_classes - 1)
(2 by default), b's `rank_b` (2), so that the pair has min(rank_a, rank_b) principal angles. Signal
strength is set against the noise: each planted direction's singular value (of the
sqrt(count)-weighted effects) is `SIGNALS[signal]` times the detection threshold (k d)^(1/4) of
noise alone (Benaych-Georges & Nadakuditi 2012): below it no method can see the direction.

A cell with a ``departure`` keeps one way in which real activations differ from that model (see
DEPARTURES), and its ``twin`` is the same cell without it: same sizes, same effects, same total
variance, so that what the departure alone does to each rate shows.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from orthosphere.analyze import analyze
from orthosphere.store.schema import label_missing_value
from tests.synthetic import NOT_APPLICABLE, bases_at_angles, random_basis, sphere_points, write_store

SIGNALS = {"none": 0.0, "weak": 1.5, "moderate": 3.0, "strong": 8.0}
TRUTHS = {
    "orthogonal": (90.0, 90.0),
    "oblique": (60.0, 60.0),
    "shared": (0.0, 90.0),
    "orthogonal-edge": (80.0, 90.0),  # the least favourable boundary of the claim "orthogonal" (tolerance 10)
    "dependent-edge": (10.0, 10.0),  # the least favourable boundary of the claim "dependent" (tolerance 10)
}
"""Planted principal angles of the pair (a, b): the smallest first; a rank-1 factor a meets b in the first only."""
OFF_SPHERE_SPREAD = 0.4
"""Off-sphere cells spread the class radii to (1 +- 0.4) times their mean, alternately."""
B_CLASSES = 4
DEPARTURES = {
    "documents": "documents spanning DOCUMENT_WINDOWS packed windows, noise shared within a document "
                 "(DOCUMENT_NOISE_SHARE of it), both labels clustered by document (twin: noise independent per token)",
    "bursty": "one document a window, noise shared within it, a's many classes each in few documents "
              "(twin: noise independent per token)",
    "rogue": "ROGUE_DIMS dimensions at ROGUE_SPREAD times the others' spread and SINK_SHARE of the tokens with "
             "huge norms along the first of them (twin: isotropic noise of the same total variance)",
    "float16": "a's classes on a sphere of rank 3, b's on a circle (at the cell's truth: orthogonal, oblique), FLOAT16_NOISE noise, "
               "stored in float16 (twin: float32)",
    "vocabulary": "a Zipf vocabulary of n_classes types (text labels), every type on a sphere of radius "
                  "VOCABULARY_RADIUS, more types than max_classes keeps (twin: TWIN_VOCABULARY types, none pooled)",
    "circle": "the position on a circle (period CIRCLE_PERIOD positions, radius CIRCLE_RADIUS) in padded samples of "
              "random lengths, more positions than max_classes, so binned (twin: every sample full)",
    "interaction": "a cell effect of (a, b) not additive in them, in a plane of its own, as strong as a's effect "
                   "(twin: isotropic noise of the same total variance)",
}
"""What each departure plants (each with the constants below that set it)."""
DOCUMENT_WINDOWS = 4
DOCUMENT_NOISE_SHARE = 0.5
"""The share of each token's noise variance that its document's tokens share (a random effect per document)."""
DOCUMENT_CLUSTERING = 0.5
"""A token's class is its document's own class (drawn once per document) with this probability, else drawn anew."""
BURSTY_CLUSTERING = 0.9
ROGUE_DIMS = 2
ROGUE_SPREAD = 8.0
SINK_SHARE = 0.01
SINK_NORM = 40.0
"""A sink's added norm, times sqrt(d_model), times a uniform factor in [0.5, 1.5]: 12-35 times the other
tokens' median norm (sqrt(d_model - ROGUE_DIMS + ROGUE_DIMS * ROGUE_SPREAD^2))."""
FLOAT16_NOISE = 1e-3
FLOAT16_RADIUS = 3.0
VOCABULARY_RADIUS = 3.0
TWIN_VOCABULARY = 64
CIRCLE_PERIOD = 8
"""Positions per turn: a fast position feature, so that a range of a few positions averages points of an arc."""
CIRCLE_RADIUS = 3.0
INTERACTION_RANK = 2


@dataclass(frozen=True)
class Cell:
    """One cell of the grid: the design, the signal, the pair's truth and a's sphere ("on", "off" or
    None: effects spread evenly in their subspace, not on a sphere)."""

    d_model: int = 64
    n_classes: int = 8
    zipf: bool = False
    signal: str = "moderate"
    confounded: bool = False
    subset: bool = False
    truth: str = "oblique"
    sphere: str | None = None
    rank: int = 2
    b_classes: int = B_CLASSES
    rank_b: int = 2
    n_layers: int = 200
    n_samples: int = 256
    n_pos: int = 17
    departure: str | None = None
    twin: bool = False

    def __post_init__(self):
        if self.departure is not None and self.departure not in DEPARTURES:
            raise ValueError(f"departure {self.departure!r}: expected one of {list(DEPARTURES)} or None")
        if self.rank_b > self.b_classes - 1:
            raise ValueError(f"rank_b={self.rank_b}: b has {self.b_classes} classes, so at most {self.b_classes - 1}")

    @property
    def name(self) -> str:
        parts = [f"d{self.d_model}", f"K{self.n_classes}", "zipf" if self.zipf else "uniform", self.signal,
                 "confounded" if self.confounded else "crossed", "subset" if self.subset else "all", self.truth]
        extra = ([f"rank{self.rank}"] if self.rank != 2 else []) \
            + ([f"Kb{self.b_classes}"] if self.b_classes != B_CLASSES else []) \
            + ([f"rankb{self.rank_b}"] if self.rank_b != 2 else []) + ([f"sphere-{self.sphere}"] if self.sphere else [])
        departure = ([self.departure] if self.departure else []) + (["twin"] if self.twin else [])
        return "-".join(parts + extra + departure)

    @property
    def rank_a(self) -> int:
        return min(self.rank, self.n_classes - 1)

    @property
    def factors(self) -> list[str]:
        """The factors analysed: a (the position for the circle; read on role x with `subset`) and b."""
        if self.departure == "circle":
            return ["pos", "b"]
        return ["a[role=x]", "b"] if self.subset else ["a", "b"]

    def has(self, departure: str) -> bool:
        """Whether the cell plants `departure` itself (not its twin)."""
        return self.departure == departure and not self.twin


def twin_of(cell: Cell) -> Cell:
    """A departure's twin: the same cell without the departure (the vocabulary's twin has TWIN_VOCABULARY
    types, so that none is pooled)."""
    return replace(cell, twin=True, n_classes=TWIN_VOCABULARY if cell.departure == "vocabulary" else cell.n_classes)


@dataclass
class Planted:
    """A written cell: the store, each layer's planted smallest and largest angles and a's radius spread."""

    cell: Cell
    url: str
    angles: np.ndarray  # (layer, 2) smallest, largest
    radius_cv: float | np.ndarray  # one per cell, or per layer when cells of several stores are scored together


def class_probabilities(cell: Cell) -> np.ndarray:
    if not cell.zipf:
        return np.full(cell.n_classes, 1 / cell.n_classes)
    weights = 1 / np.arange(1, cell.n_classes + 1) ** 1.1
    return weights / weights.sum()


def _labels(cell: Cell, rng: np.random.Generator):
    n_tokens = cell.n_samples * (cell.n_pos - 1)
    a = rng.choice(cell.n_classes, size=n_tokens, p=class_probabilities(cell))
    b = rng.integers(0, cell.b_classes, n_tokens)
    if cell.confounded:
        b = np.where(rng.random(n_tokens) < 0.5, a % cell.b_classes, b)
    role_x = rng.random(n_tokens) < 0.5 if cell.subset else np.ones(n_tokens, bool)
    return a, b, role_x


def _effects(labels: np.ndarray, n_classes: int, basis: np.ndarray, singular: float, rng) -> np.ndarray:
    """Class effects (class, d) in the span of `basis` whose count-weighted centred effects have every
    singular value `singular` (their subspace has rank basis.shape[1] exactly)."""
    counts = np.bincount(labels, minlength=n_classes).astype(float)
    weights = counts / counts.sum()
    coefficients = rng.normal(size=(n_classes, basis.shape[1]))
    coefficients -= weights @ coefficients
    weighted = np.sqrt(counts)[:, None] * coefficients
    left, _, right_t = np.linalg.svd(weighted, full_matrices=False)
    coefficients = (left * singular) @ right_t / np.sqrt(np.maximum(counts, 1))[:, None]
    return coefficients @ basis.T


def _sphere_points(labels: np.ndarray, n_classes: int, basis: np.ndarray, singular: float, spread: float, rng):
    """Class points (class, d) in the plane (or line) of `basis`, at evenly spaced directions, of
    radius R (1 +- spread) alternately, R such that the weighted spread per direction is singular^2."""
    counts = np.bincount(labels, minlength=n_classes).astype(float)
    rank = basis.shape[1]
    if rank == 1:
        directions = np.where(np.arange(n_classes) % 2 == 0, 1.0, -1.0)[:, None]
    else:
        phase = 2 * np.pi * (np.arange(n_classes) / n_classes + rng.random())
        directions = np.stack([np.cos(phase), np.sin(phase)], axis=1)
    factor = 1 + spread * np.where(np.arange(n_classes) % 2 == 0, 1.0, -1.0)
    points = directions * factor[:, None]
    centred = points - (counts / counts.sum()) @ points
    scale = singular / np.sqrt(np.sum(counts[:, None] * centred**2) / rank)
    return scale * points @ basis.T, factor


def radius_spread(factor: np.ndarray, counts: np.ndarray) -> float:
    weights = counts / counts.sum()
    mean = factor @ weights
    return float(np.sqrt(((factor - mean) ** 2) @ weights) / mean)


@dataclass
class Design:
    """The labels of a cell's tokens (positions 1.. of every sample, sample-major): a's and b's classes
    (-1 where b does not apply; for the circle, a is the position), the tokens a applies to (role x),
    each token's document and whether it is a real token (else padding)."""

    a: np.ndarray
    b: np.ndarray
    role_x: np.ndarray
    documents: np.ndarray
    valid: np.ndarray


def _design(cell: Cell, rng: np.random.Generator) -> Design:
    n_tokens = cell.n_samples * (cell.n_pos - 1)
    windows = DOCUMENT_WINDOWS if cell.departure == "documents" else 1
    documents = np.repeat(np.arange(cell.n_samples) // windows, cell.n_pos - 1)
    valid = np.ones(n_tokens, bool)
    if cell.departure == "documents":
        a = clustered(class_probabilities(cell), documents, DOCUMENT_CLUSTERING, rng)
        b = clustered(np.full(cell.b_classes, 1 / cell.b_classes), documents, DOCUMENT_CLUSTERING, rng)
        return Design(a, b, valid.copy(), documents, valid)
    if cell.departure == "bursty":
        a = clustered(class_probabilities(cell), documents, BURSTY_CLUSTERING, rng)
        return Design(a, rng.integers(0, cell.b_classes, n_tokens), valid.copy(), documents, valid)
    a, b, role_x = _labels(cell, rng)
    if cell.departure == "circle":
        a = np.tile(np.arange(1, cell.n_pos), cell.n_samples)
        if not cell.twin:
            lengths = rng.integers(2, cell.n_pos + 1, cell.n_samples)  # valid positions 0 .. length - 1
            valid = (a.reshape(cell.n_samples, -1) < lengths[:, None]).ravel()
        b = np.where(valid, b, -1)
    return Design(a, b, role_x, documents, valid)


def clustered(probabilities: np.ndarray, documents: np.ndarray, clustering: float, rng) -> np.ndarray:
    """A label clustered by document: each document draws a class of its own (from `probabilities`),
    and each of its tokens takes it with probability `clustering`, else a class drawn anew."""
    own = rng.choice(len(probabilities), size=documents.max() + 1, p=probabilities)
    drawn = rng.choice(len(probabilities), size=len(documents), p=probabilities)
    return np.where(rng.random(len(documents)) < clustering, own[documents], drawn)


def design_effect(classes: np.ndarray, documents: np.ndarray, share: float = DOCUMENT_NOISE_SHARE) -> float:
    """How many times the noise variance of a class's (sqrt(count)-weighted) mean exceeds that of
    independent tokens when `share` of each token's noise is shared within its document:
    (1 - share) + share * sum_d n_cd^2 / n_c, token-weighted over the classes."""
    _, counts = np.unique(np.stack([classes, documents]), axis=1, return_counts=True)
    return (1 - share) + share * float(np.sum(counts.astype(float) ** 2) / len(classes))


def rogue_total_variance(d_model: int) -> float:
    """The rogue cell's noise variance summed over dimensions: ROGUE_DIMS at ROGUE_SPREAD^2, the others
    at 1, and the sinks' (SINK_SHARE of the tokens, along the first dimension)."""
    norm = SINK_NORM * np.sqrt(d_model)  # times U(0.5, 1.5): mean 1, mean square 13 / 12
    sinks = SINK_SHARE * norm**2 * 13 / 12 - (SINK_SHARE * norm) ** 2
    return d_model - ROGUE_DIMS + ROGUE_DIMS * ROGUE_SPREAD**2 + sinks


def _noise_unit(cell: Cell) -> float:
    """The noise's spread per dimension that the signal is set against (its twin's for the rogue cell)."""
    if cell.departure == "rogue":
        return float(np.sqrt(rogue_total_variance(cell.d_model) / cell.d_model))
    return FLOAT16_NOISE if cell.departure == "float16" else 1.0


def _noise(cell: Cell, design: Design, interaction_variance: float, rng) -> np.ndarray:
    """Each token's noise (token, d_model): independent N(0, 1) unless the cell's departure (or its
    twin, with the same total variance) says otherwise."""
    size = (len(design.a), cell.d_model)
    if cell.has("documents") or cell.has("bursty"):
        shared = rng.normal(size=(design.documents.max() + 1, cell.d_model))[design.documents]
        return np.sqrt(DOCUMENT_NOISE_SHARE) * shared + np.sqrt(1 - DOCUMENT_NOISE_SHARE) * rng.normal(size=size)
    if cell.has("rogue"):
        noise = rng.normal(size=size)
        noise[:, :ROGUE_DIMS] *= ROGUE_SPREAD
        sinks = np.flatnonzero(rng.random(size[0]) < SINK_SHARE)
        noise[sinks, 0] += SINK_NORM * np.sqrt(cell.d_model) * rng.uniform(0.5, 1.5, len(sinks))
        return noise
    variance = 1.0 + (interaction_variance / cell.d_model if cell.departure == "interaction" and cell.twin else 0.0)
    return _noise_unit(cell) * np.sqrt(variance) * rng.normal(size=size)


def _bases(cell: Cell, rng):
    """The pair's planted angles and bases (d_model, rank) of a and b: the larger rank's drawn first."""
    angles = np.array(TRUTHS[cell.truth][: min(cell.rank_a, cell.rank_b)])
    if cell.rank_a > cell.rank_b:
        basis_a, basis_b = bases_at_angles(cell.d_model, cell.rank_a, cell.rank_b, angles, rng)
    else:
        basis_b, basis_a = bases_at_angles(cell.d_model, cell.rank_b, cell.rank_a, angles, rng)
    return angles, basis_a, basis_b


def _effect_a(cell: Cell, design: Design, basis_a: np.ndarray, singular: float, rng):
    """a's class effects (class, d_model) (for the circle: per position) and its planted radius spread."""
    applied = design.a[design.role_x & design.valid]
    if cell.departure == "circle":
        phase = 2 * np.pi * (np.arange(cell.n_pos) / CIRCLE_PERIOD + rng.random())
        return CIRCLE_RADIUS * np.stack([np.cos(phase), np.sin(phase)], axis=1) @ basis_a.T, 0.0
    if cell.departure in ("vocabulary", "float16"):
        radius = VOCABULARY_RADIUS if cell.departure == "vocabulary" else FLOAT16_RADIUS
        return sphere_points(cell.n_classes, basis_a, radius, rng), 0.0
    if cell.sphere:
        effect, radius_factor = _sphere_points(applied, cell.n_classes, basis_a, singular,
                                               OFF_SPHERE_SPREAD if cell.sphere == "off" else 0.0, rng)
        return effect, radius_spread(radius_factor, np.bincount(applied, minlength=cell.n_classes).astype(float))
    return _effects(applied, cell.n_classes, basis_a, singular, rng), 0.0


def interaction(a: np.ndarray, b: np.ndarray, basis: np.ndarray, singular: float, rng) -> np.ndarray:
    """A cell effect per token (token, d_model) in the span of `basis`: random per (a, b), centred over
    a for each b and over b for each a (so that it adds nothing to either factor's effects in a crossed
    design), its sqrt(count)-weighted cells scaled to total variance rank * singular^2."""
    cells = rng.normal(size=(a.max() + 1, b.max() + 1, basis.shape[1]))
    cells = cells - cells.mean(axis=0) - cells.mean(axis=1, keepdims=True) + cells.mean(axis=(0, 1))
    per_token = cells[a, b] @ basis.T
    return per_token * singular * np.sqrt(basis.shape[1] / np.sum(per_token**2))


def plant(cell: Cell, root: Path, seed: int = 0) -> Planted:
    """Write a cell's store under `root`; returns it with its planted truth."""
    rng = np.random.default_rng(seed)
    design = _design(cell, rng)
    d = cell.d_model
    threshold_a = ((cell.n_classes - 1) * d) ** 0.25 * _noise_unit(cell)
    threshold_b = ((cell.b_classes - 1) * d) ** 0.25 * _noise_unit(cell)
    if cell.departure in ("documents", "bursty"):  # against the noise the class means carry
        threshold_a *= np.sqrt(design_effect(design.a, design.documents))
        threshold_b *= np.sqrt(design_effect(design.b, design.documents))
    strength = SIGNALS[cell.signal]
    offset = 5.0 * rng.normal(size=d)
    singular_a = strength * threshold_a
    interaction_variance = INTERACTION_RANK * singular_a**2 / len(design.a)
    layers, planted_angles, cv = [], [], 0.0
    for _ in range(cell.n_layers):
        angles, basis_a, basis_b = _bases(cell, rng)
        effect_a, cv = _effect_a(cell, design, basis_a, singular_a, rng)
        if cell.departure == "float16":
            effect_b = sphere_points(cell.b_classes, basis_b, FLOAT16_RADIUS, rng)
        else:
            effect_b = _effects(design.b[design.valid], cell.b_classes, basis_b,
                                SIGNALS["moderate" if cell.signal == "none" else cell.signal] * threshold_b, rng)
        x = effect_b[design.b] + np.where(design.role_x[:, None], effect_a[design.a], offset)
        if cell.departure == "float16":  # a residual stream's mean: values where float16's spacing is coarse
            x += offset
        if cell.has("interaction"):
            elsewhere = random_basis(d, INTERACTION_RANK, rng, exclude=np.linalg.qr(np.hstack([basis_a, basis_b]))[0])
            x += interaction(design.a, design.b, elsewhere, singular_a, rng)
        x += _noise(cell, design, interaction_variance, rng)
        x[~design.valid] = 0.0
        layer = np.zeros((cell.n_samples, cell.n_pos, d), "float32")
        layer[:, 1:] = x.reshape(cell.n_samples, cell.n_pos - 1, d)
        layer[:, 0, 0] = 30.0
        layers.append(layer)
        planted_angles.append([angles.min(), angles.max()])
    valid = np.ones((cell.n_samples, cell.n_pos), bool)
    valid[:, 1:] = design.valid.reshape(cell.n_samples, cell.n_pos - 1)
    url = write_store(root / f"{cell.name}-{seed}.zarr", {"resid_pre": np.stack(layers, axis=1)},
                      labels=_store_labels(cell, design), valid=valid, samples_per_chunk=64, with_weights=False,
                      dtype="float16" if cell.has("float16") else "float32",
                      label_dtypes={"document": "int64", "offset": "int64"})
    return Planted(cell, url, np.asarray(planted_angles), cv)


def _store_labels(cell: Cell, design: Design) -> dict[str, np.ndarray]:
    """The labels as a store holds them (sample, pos): a (as text for the vocabulary; none for the
    circle, whose factor is the position), b, the role with `subset`, and a text store's `document`
    and `offset` (chained across the windows of a document) for the document cells."""
    labels = {"b": _as_label(cell, design.b)}
    if cell.departure == "vocabulary":
        text = np.full((cell.n_samples, cell.n_pos), "", dtype=object)
        text[:, 1:] = np.char.add("t", design.a.astype(str)).reshape(cell.n_samples, cell.n_pos - 1)
        labels["a"] = text
    elif cell.departure != "circle":
        labels["a"] = _as_label(cell, np.where(design.role_x, design.a, -1))
    if cell.subset:
        roles = np.full((cell.n_samples, cell.n_pos), "start", dtype=object)
        roles[:, 1:] = np.where(design.role_x, "x", "y").reshape(cell.n_samples, cell.n_pos - 1)
        labels["role"] = roles
    if cell.departure in ("documents", "bursty"):
        windows = DOCUMENT_WINDOWS if cell.departure == "documents" else 1
        within = (np.arange(cell.n_samples) % windows)[:, None] * (cell.n_pos - 1) + np.arange(cell.n_pos - 1)
        for name, values in (("document", design.documents.reshape(cell.n_samples, -1)), ("offset", within)):
            label = np.full((cell.n_samples, cell.n_pos), label_missing_value("int64"), "int64")
            label[:, 1:] = values
            labels[name] = label
    return labels


def _as_label(cell: Cell, values: np.ndarray) -> np.ndarray:
    label = np.full((cell.n_samples, cell.n_pos), NOT_APPLICABLE, "int16")
    label[:, 1:] = np.where(values >= 0, values, NOT_APPLICABLE).reshape(cell.n_samples, cell.n_pos - 1)
    return label


def run(planted: Planted, **options):
    """The subspaces and spheres of a planted store (its cell's factors), as one analyze call."""
    tree = analyze(planted.url, analyses=["subspaces", "spheres"], **{"factors": planted.cell.factors, **options})
    return tree["subspaces"].to_dataset(), tree["spheres"].to_dataset()


def score(planted: Planted, subspaces, spheres, significance: float = 0.05) -> dict:
    """Error rates of one cell against its planted truth (shares over the store's layers). An interval's
    coverage is the share of layers with an interval (of exact ranks: `intervals_given`) whose interval holds the planted value, with the shares that miss it
    below (`_below`: the truth under the lower bound) and above; at a planted 90 (0) degrees, or a radius
    spread of 0, only the upper (lower) bound can miss, so coverage is one-sided there (nominal
    (1 + confidence) / 2)."""
    cell = planted.cell
    a, b = subspaces["factor"].values
    rank = subspaces["subspace_rank"].sel(factor=a).values
    rank_b = subspaces["subspace_rank"].sel(factor=b).values
    scores = {"layers": len(rank), "structure_fp": np.nan, "structure_fp_corrected": np.nan}
    if cell.signal == "none":
        scores["structure_fp"] = float(np.mean(subspaces["structure_p"].sel(factor=a).values <= significance))
        scores["structure_fp_corrected"] = float(np.mean(subspaces["structure_q"].sel(factor=a).values <= significance))
        scores["rank_zero"] = float(np.mean(rank == 0))
        relation = subspaces["relation"].sel(factor=a, other=b).values
        scores["claimed"] = float(np.mean(np.isin(relation, ["orthogonal", "dependent", "independent"])))
        return scores
    scores["structure_found"] = float(np.mean(subspaces["structure_p"].sel(factor=a).values <= significance))
    exact = (rank == cell.rank_a) & (rank_b == cell.rank_b)
    scores["rank_exact"] = float(np.mean(rank == cell.rank_a))
    scores["rank_exact_b"] = float(np.mean(rank_b == cell.rank_b))
    scores["rank_mean"], scores["rank_b_mean"] = float(np.mean(rank)), float(np.mean(rank_b))
    pair = subspaces.sel(factor=a, other=b)
    given = exact & np.isfinite(pair["min_angle_ci"].values).all(axis=-1)  # layers whose pair drew an interval
    scores["intervals_given"] = float(np.mean(given[exact])) if exact.any() else np.nan
    for name, column in (("min", 0), ("max", 1)):
        low, high = pair[f"{name}_angle_ci"].values.T
        truth = planted.angles[:, column]
        covered = (low - 1e-9 <= truth) & (truth <= high + 1e-9)
        scores[f"{name}_coverage"] = float(np.mean(covered[given])) if given.any() else np.nan
        scores[f"{name}_above"] = float(np.mean((truth > high + 1e-9)[given])) if given.any() else np.nan
        scores[f"{name}_below"] = float(np.mean((truth < low - 1e-9)[given])) if given.any() else np.nan
        scores[f"{name}_bias"] = float(np.mean((pair[f"{name}_angle_estimate"].values - truth)[given])) if given.any() else np.nan
        scores[f"{name}_raw_bias"] = float(np.mean((pair[f"{name}_angle"].values - truth)[exact])) if exact.any() else np.nan
    relation = pair["relation"].values
    for verdict in ("orthogonal", "dependent", "independent", "undetermined", "no structure"):
        scores[f"called_{verdict}"] = float(np.mean(relation == verdict))
    claim_p = pair["claim_p"].values
    for index, claim in enumerate(("orthogonal", "dependent", "independent")):
        scores[f"claim_{claim}_p05"] = float(np.mean(claim_p[:, index] <= significance))
    if cell.sphere:
        sphere = spheres["sphere"].sel(factor=a).values
        expected = "on sphere" if cell.sphere == "on" else "off sphere"
        scores["sphere_right"] = float(np.mean(sphere == expected))
        scores["sphere_wrong"] = float(np.mean(sphere == ("off sphere" if cell.sphere == "on" else "on sphere")))
        low, high = spheres["radius_cv_ci"].sel(factor=a).values.T
        scores["radius_cv_coverage"] = float(np.mean((low - 1e-9 <= planted.radius_cv) & (planted.radius_cv <= high + 1e-9)))
        claim_p = spheres["sphere_claim_p"].sel(factor=a).values
        scores["sphere_on_p05"], scores["sphere_off_p05"] = np.mean(claim_p <= significance, axis=0).tolist()
        scores["radius_cv_below"] = float(np.mean(planted.radius_cv < low - 1e-9))
        scores["radius_cv_above"] = float(np.mean(planted.radius_cv > high + 1e-9))
    return scores
