"""Factors: label coordinates (or the position) whose classes define subspaces of the stream.

A factor is written ``LABEL`` or ``LABEL[KEY=V1|V2,KEY2=V]``: the classes are the values of
LABEL over the analysed tokens where LABEL applies (not "" for string labels, not the label's
``not_applicable`` attribute for integer ones), restricted to the tokens whose label KEY is V1 or V2 (and so
on). ``pos`` is the position, always available. Examples: ``digit_value[role=digit]``,
``operand[role=digit|sign]``, ``pos``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import dask
import dask.array as da
import numpy as np
import xarray as xr

from .errors import AnalysisError
from .inputs import align, store_url

POSITION = "pos"
ROLE = "role"
"""The label of a token's kind (digit, sign, answer, ...): by default each kind gets its own intercept."""
NO_INTERCEPTS = "none"
MIN_GROUPS = 2
"""A class needs tokens in at least this many groups of samples to be resampled (else it is pooled)."""
TEXT_FACTORS = ("token_str", POSITION)
"""Default factors of a text store: token identity (its most frequent classes, see ``cap_classes``) and position."""
_SPEC = re.compile(r"^\s*([A-Za-z_]\w*)\s*(?:\[(.*)\])?\s*$")


@dataclass(frozen=True)
class Factor:
    """A label and the restriction of the tokens it is read on."""

    label: str
    where: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @property
    def name(self) -> str:
        if not self.where:
            return self.label
        conditions = ",".join(f"{key}={'|'.join(values)}" for key, values in self.where)
        return f"{self.label}[{conditions}]"

    @property
    def labels(self) -> tuple[str, ...]:
        """Every label the factor reads."""
        return (self.label,) + tuple(key for key, _ in self.where)

    @classmethod
    def parse(cls, spec: str) -> Factor:
        match = _SPEC.match(spec)
        if match is None:
            raise AnalysisError(
                f"factor {spec!r} is not understood: expected LABEL or LABEL[KEY=V1|V2,...], "
                "e.g. digit_value[role=digit]"
            )
        label, conditions = match.groups()
        where = []
        for condition in filter(None, (c.strip() for c in (conditions or "").split(","))):
            key, _, values = condition.partition("=")
            values = tuple(v.strip() for v in values.split("|") if v.strip())
            if not key.strip() or not values:
                raise AnalysisError(
                    f"factor {spec!r}: condition {condition!r} is not KEY=V1|V2 (e.g. role=digit)"
                )
            where.append((key.strip(), values))
        return cls(label, tuple(where))


def store_labels(dataset: xr.Dataset) -> list[str]:
    """The label coordinates of a store: non-index coords on (sample, pos)."""
    return [name for name, coord in dataset.coords.items() if coord.dims == ("sample", "pos") and name not in dataset.dims]


def default_factor_specs(dataset: xr.Dataset) -> list[str]:
    """The factors read when none are named: the task's own ``factors`` when its description names
    them; for text (a store labelled with ``token_str``) the token identity and the position
    (TEXT_FACTORS); else every label of the store, and the position."""
    task_factors = dataset.attrs.get("task", {}).get("factors")
    if task_factors:
        return list(task_factors)
    labels = store_labels(dataset)
    if "token_str" in labels:
        return list(TEXT_FACTORS)
    return labels + [POSITION]


def parse_factors(dataset: xr.Dataset, specs) -> list[Factor]:
    """The factors named by `specs` (default: see ``default_factor_specs``), checked against the store."""
    if specs is None:
        specs = default_factor_specs(dataset)
    factors = [Factor.parse(spec) for spec in specs]
    names = [factor.name for factor in factors]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise AnalysisError(f"factor(s) {repeated} given more than once: name each factor once")
    available = store_labels(dataset)
    for factor in factors:
        for label in factor.labels:
            if label != POSITION and label not in available:
                task = dataset.attrs.get("task", {})
                task_name = ", ".join(f"{k}={task[k]}" for k in ("name", "split") if k in task) or "no task description"
                raise AnalysisError(
                    f"factor {factor.name!r} needs label {label!r}, which store {store_url(dataset)} does not "
                    f"hold: its labels are {available} (and {POSITION!r}, always there). Labels are written at "
                    f"extraction by the task ({task_name}); extract with a task that labels {label!r}, "
                    "or choose factors from the labels present"
                )
        for key, values in factor.where:
            integers = key == POSITION or dataset[key].dtype.kind in "iu"
            if integers and not all(re.fullmatch(r"-?\d+", value) for value in values):
                raise AnalysisError(
                    f"factor {factor.name!r}: label {key!r} holds integers, but the condition gives {list(values)}; "
                    "give integer values"
                )
    return factors


def label_data(dataset: xr.Dataset, label: str, like: da.Array) -> da.Array:
    """A label (or the position) as a (sample, pos) Dask array chunked like `like` along sample."""
    if label == POSITION:
        positions = np.asarray(dataset[POSITION].values)
        return da.broadcast_to(da.from_array(positions, chunks=-1), (like.shape[0], positions.size), chunks=(like.chunks[0], -1))
    return align(dataset[label].data, like)


def missing_value(dataset: xr.Dataset, label: str):
    """A label's not-applicable value: its ``not_applicable`` attribute; None for stores written
    before labels had one (there -1 and the type's minimum both mean not applicable)."""
    if label == POSITION:
        return None
    return dataset[label].attrs.get("not_applicable")


def applies(values: np.ndarray, missing=None) -> np.ndarray:
    """Where a label has a value (not its not-applicable code `missing`; see ``missing_value``)."""
    if values.dtype.kind in "iu":
        if missing is None:
            return (values != -1) & (values != np.iinfo(values.dtype).min)
        return values != int(missing)
    return values != ""


def _matches(labels: np.ndarray, values: tuple[str, ...]) -> np.ndarray:
    """Where labels (integers or strings) equal one of the values (given as text)."""
    if labels.dtype.kind in "iu":
        return np.isin(labels, [int(value) for value in values])
    wanted = np.asarray(values, dtype=labels.dtype) if labels.dtype.kind == "T" else np.asarray(values, dtype=object)
    return np.isin(labels, wanted)


def _selected(factor: Factor, mask: np.ndarray, blocks: dict[str, np.ndarray], missing) -> np.ndarray:
    selected = mask & applies(blocks[factor.label], missing)
    for key, values in factor.where:
        selected &= _matches(blocks[key], values)
    return selected


def _selections(factors, missing, mask, blocks, strata=None) -> tuple[list[np.ndarray], np.ndarray]:
    """Where each factor is read in a block, and each token's intercept cell: its pattern (bit a set:
    factor a applies) plus, with ``strata`` (the tokens' stratum codes), the code shifted past the
    pattern bits; 0 where no factor applies."""
    selections = [_selected(factor, mask, blocks, missing_of_factor) for factor, missing_of_factor in zip(factors, missing)]
    pattern = np.zeros(mask.shape, dtype="int64")
    for number, selected in enumerate(selections):
        pattern |= selected.astype("int64") << number
    if strata is not None:
        pattern = np.where(pattern > 0, pattern + (strata.astype("int64") << len(factors)), 0)
    return selections, pattern


def _block_classes(factors, missing, n_groups, intercepts, mask, groups, names, *label_blocks):
    """One block's values, counts and groups of samples (a (value, group) presence table) per factor,
    and the (pattern, stratum value) pairs present among its tokens."""
    blocks = dict(zip(names, label_blocks))
    selections, pattern = _selections(factors, missing, mask, blocks)
    token_groups = np.asarray(groups)
    found = []
    for factor, selected in zip(factors, selections):
        values, inverse, counts = np.unique(blocks[factor.label][selected], return_inverse=True, return_counts=True)
        presence = np.zeros((len(values), n_groups), dtype=bool)
        presence[inverse.ravel(), token_groups[selected]] = True
        found.append((values, counts, presence))
    counted = pattern > 0
    stratum = blocks[intercepts][counted] if intercepts else np.zeros(int(counted.sum()), dtype="int64")
    cells = [(bits, np.unique(stratum[pattern[counted] == bits])) for bits in np.unique(pattern[counted])]
    return found, cells


def _merge_classes(per_block):
    """The blocks' findings together: per factor (values, counts, presence), the strata's values and
    the intercept cells (pattern bits + stratum code << n_factors)."""
    merged = []
    for per_factor in zip(*(found for found, _ in per_block)):
        values = np.concatenate([values for values, _, _ in per_factor])
        classes, inverse = np.unique(values, return_inverse=True)
        counts = np.bincount(inverse.ravel(), weights=np.concatenate([c for _, c, _ in per_factor]),
                             minlength=len(classes)).astype("int64")
        presence = np.zeros((len(classes), per_factor[0][2].shape[1]), dtype=bool)
        np.logical_or.at(presence, inverse.ravel(), np.concatenate([p for _, _, p in per_factor]))
        merged.append((classes, counts, presence))
    cells = [cell for _, block_cells in per_block for cell in block_cells]
    strata = np.unique(np.concatenate([values for _, values in cells])) if cells else np.zeros(0)
    shift = len(merged)
    keys = {int(bits) + (int(code) << shift) for bits, values in cells for code in np.searchsorted(strata, values)}
    return merged, strata, np.array(sorted(keys), dtype="int64")


@dataclass(frozen=True)
class FactorClasses:
    """The classes a factor is read with: the `values` kept (sorted; a token's class code indexes
    them) and, when the factor had more than ``max_classes`` classes, either one more class pooling
    the rarest ones (code len(values)) or, for the position, contiguous ranges of positions
    (``bin_ends``: the last value of each class)."""

    values: np.ndarray
    counts: np.ndarray  # tokens per class, the pooled class last
    pooled_classes: int = 0
    bin_ends: np.ndarray | None = None

    @property
    def size(self) -> int:
        return len(self.values) + (1 if self.pooled_classes else 0)

    @property
    def pooled_tokens(self) -> int:
        return int(self.counts[-1]) if self.pooled_classes else 0

    @property
    def names(self) -> list[str]:
        """The classes as text; the pooled class reads "<N other classes>", a range of positions "A-B"."""
        if self.bin_ends is not None:
            return [str(start) if start == end else f"{start}-{end}" for start, end in zip(self.values, self.bin_ends)]
        pooled = [f"<{self.pooled_classes} other classes>"] if self.pooled_classes else []
        return [str(value) for value in self.values] + pooled

    @property
    def sphere_refusal(self) -> str:
        """Why the factor's classes cannot show a sphere: "" when they can."""
        if self.bin_ends is not None and np.any(self.bin_ends > self.values):
            return ("its classes are ranges of positions (max_classes), whose means average points along a curve "
                    "and fall inside any sphere; give max_classes at least the number of positions")
        if self.size - (1 if self.pooled_classes else 0) < 3:
            return ("fewer than three classes besides the pooled one: the spread of two radii is |r1 - r2| over their "
                    "mean, whose draws do not bracket a spread near 0 (on planted binary factors on a sphere, the 90 % "
                    "intervals covered about half the time, and 'off sphere' was called)")
        return ""

    @property
    def sphere_classes(self) -> np.ndarray:
        """(size,) which classes enter the radius statistics: none when the sphere is refused
        (``sphere_refusal``), else every class but the pooled one (the mean of many classes' points
        sits near the centre, on no sphere)."""
        kept = np.full(self.size, not self.sphere_refusal)
        if self.pooled_classes:
            kept[-1] = False
        return kept

    def codes(self, values: np.ndarray) -> np.ndarray:
        """The class code of each value (one of the factor's values)."""
        if self.bin_ends is not None:
            return np.searchsorted(self.values, values, side="right") - 1
        found = np.minimum(np.searchsorted(self.values, values), len(self.values) - 1)
        return np.where(self.values[found] == values, found, len(self.values))


def cap_classes(values: np.ndarray, counts: np.ndarray, max_classes: int | None, ordinal: bool = False,
                presence: np.ndarray | None = None) -> FactorClasses:
    """Keep every class, or at most max_classes. A label keeps its max_classes - 1 most frequent
    classes (ties: the smaller value first) and pools the others into one class; an ordinal factor
    (the position, whose values are all about equally frequent) is cut instead into max_classes
    contiguous ranges holding about equal numbers of tokens. With ``presence`` (class x group: the
    groups of samples holding the class's tokens), a class whose tokens lie in fewer than
    MIN_GROUPS groups is pooled too (an ordinal one joins its neighbouring range): its noise could
    not be resampled (see ``design.residual_corrections``)."""
    resampled = np.ones(len(values), bool) if presence is None else presence.sum(axis=1) >= MIN_GROUPS
    if ordinal:
        return _ranges(values, counts, max_classes or len(values), presence)
    if (max_classes is None or len(values) <= max_classes) and resampled.all():
        return FactorClasses(values, counts)
    candidates = np.flatnonzero(resampled)
    order = candidates[np.lexsort((candidates, -counts[candidates]))]
    limit = len(order) if max_classes is None or len(order) < max_classes else max_classes - 1
    kept = np.sort(order[:limit])
    pooled = np.setdiff1d(np.arange(len(values)), kept)
    return FactorClasses(values[kept], np.append(counts[kept], counts[pooled].sum()), len(pooled))


def _ranges(values: np.ndarray, counts: np.ndarray, n_ranges: int, presence: np.ndarray | None) -> FactorClasses:
    """Sorted values cut into at most n_ranges contiguous, non-empty ranges of about equal total
    counts, each holding tokens of at least MIN_GROUPS groups (a range short of them joins its
    neighbour); every value its own class when that needs no cut."""
    n_ranges = min(n_ranges, len(values))
    cumulative = np.cumsum(counts)
    starts = [0]
    for k in range(1, n_ranges):
        start = int(np.searchsorted(cumulative, cumulative[-1] * k / n_ranges)) + 1
        starts.append(min(max(start, starts[-1] + 1), len(values) - (n_ranges - k)))
    starts = list(starts)
    if presence is not None:
        starts = _resampled_ranges(starts, presence)
    starts = np.asarray(starts)
    if len(starts) == len(values):
        return FactorClasses(values, counts)
    ends = np.append(starts[1:], len(values)) - 1
    return FactorClasses(values[starts], np.add.reduceat(counts, starts), 0, values[ends])


def _resampled_ranges(starts: list[int], presence: np.ndarray) -> list[int]:
    """Range starts after joining each range whose tokens lie in fewer than MIN_GROUPS groups to its
    neighbour (the previous one; the first range joins the next)."""
    while len(starts) > 1:
        groups = np.logical_or.reduceat(presence, starts, axis=0).sum(axis=1)
        short = np.flatnonzero(groups < MIN_GROUPS)
        if not short.size:
            break
        starts.pop(max(int(short[0]), 1))
    return starts


def default_intercepts(dataset: xr.Dataset) -> str | None:
    """The label whose classes get their own intercepts by default: the task's ``intercepts`` when its
    description names one, else ``role`` when the store holds it (tokens of different kinds), else none."""
    task = dataset.attrs.get("task", {})
    if "intercepts" in task:
        return task["intercepts"] or None
    return ROLE if ROLE in store_labels(dataset) else None


def parse_intercepts(dataset: xr.Dataset, spec, factors: list[Factor]) -> str | None:
    """The intercept label named by `spec`: None for the default (``default_intercepts``; none when a
    factor is that label: its classes would be the intercepts), "none" for one intercept per
    pattern, else a label of the store that no factor is read from."""
    if spec is None:
        default = default_intercepts(dataset)
        return None if any(factor.label == default for factor in factors) else default
    if spec == NO_INTERCEPTS:
        return None
    if any(factor.label == spec for factor in factors):
        raise AnalysisError(
            f"intercepts={spec!r} gives each class of label {spec!r} its own intercept, which leaves nothing of factor "
            f"{spec!r} to fit; choose other intercepts, {NO_INTERCEPTS!r}, or drop the factor"
        )
    available = store_labels(dataset)
    if spec not in available:
        raise AnalysisError(
            f"intercepts={spec!r}: store {store_url(dataset)} has no label {spec!r}; its labels are {available}. "
            f"Name the label whose classes (kinds of token) get their own intercepts, or {NO_INTERCEPTS!r}"
        )
    return spec


@dataclass(frozen=True)
class Discovery:
    """What the label pass found: each factor's classes, the intercept label and its values among
    the analysed tokens (the strata), and the intercept cells present (pattern bits + the stratum's
    code << n_factors; sorted)."""

    classes: dict[str, FactorClasses]
    intercepts: str | None
    strata: np.ndarray
    cells: np.ndarray

    def stratum_codes(self, blocks: dict[str, np.ndarray]) -> np.ndarray | None:
        """Each token's stratum code (None without an intercept label)."""
        if self.intercepts is None:
            return None
        found = np.minimum(np.searchsorted(self.strata, blocks[self.intercepts]), max(len(self.strata) - 1, 0))
        return found


def discover_classes(dataset: xr.Dataset, factors: list[Factor], mask: da.Array, max_classes: int | None = None,
                     groups: da.Array | None = None, n_groups: int = 1, intercepts: str | None = None) -> Discovery:
    """Each factor's classes over the analysed tokens (see ``cap_classes``; with ``groups``, the
    (sample, pos) group of each token, classes held by fewer than MIN_GROUPS groups are pooled), and
    the intercept cells present: a cheap pass over the labels only. A factor with no tokens, a
    single class, or fewer than two classes that its groups can resample is an error."""
    names = sorted({label for factor in factors for label in factor.labels} | ({intercepts} if intercepts else set()))
    arrays = [label_data(dataset, name, mask) for name in names]
    if groups is None:
        groups = da.zeros(mask.shape, dtype="int64", chunks=mask.chunks)
    missing = [missing_value(dataset, factor.label) for factor in factors]
    per_block = [
        dask.delayed(_block_classes)(factors, missing, n_groups, intercepts, mask_block, group_block, names, *blocks)
        for mask_block, group_block, *blocks in zip(*(array.to_delayed().ravel() for array in [mask, groups, *arrays]))
    ]
    (merged, strata, cells), = dask.compute(dask.delayed(_merge_classes)(per_block))
    classes = {}
    for factor, (values, counts, presence) in zip(factors, merged):
        if len(values) < 2:
            found = f"a single class ({str(values[0])!r}, {counts[0]} tokens)" if len(values) else "no tokens"
            raise AnalysisError(
                f"factor {factor.name!r} has {found} among the analysed tokens of store {store_url(dataset)}: "
                "a factor subspace needs at least two classes; choose another factor or widen its restriction"
            )
        found = cap_classes(values, counts, max_classes, ordinal=factor.label == POSITION,
                            presence=presence if n_groups > 1 else None)
        if found.size < 2:
            raise AnalysisError(
                f"factor {factor.name!r}: its classes are too rare to test in store {store_url(dataset)}: "
                f"{int((presence.sum(axis=1) < MIN_GROUPS).sum())} of its {len(values)} classes have all their tokens in "
                f"one of the {n_groups} groups of samples (bootstrap_groups) that the null and the intervals resample, "
                "and pooling them leaves a single class; analyse more samples, lower bootstrap_groups, or choose "
                "a factor with more frequent classes"
            )
        classes[factor.name] = found
    return Discovery(classes, intercepts, strata, cells)


def _codes(classes: FactorClasses, selected: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """(sample, pos) int32 class code of each selected token (see ``FactorClasses.codes``), else -1."""
    codes = np.full(selected.shape, -1, dtype="int32")
    codes[selected] = classes.codes(labels[selected])
    return codes


def design_columns(dataset: xr.Dataset, factors: list[Factor], discovery: Discovery, layout, mask: da.Array) -> da.Array:
    """Lazy (sample, pos, 1 + factors) int32 design columns of each token (see ``Layout.token_columns``)."""
    intercepts = {discovery.intercepts} if discovery.intercepts else set()
    names = sorted({label for factor in factors for label in factor.labels} | intercepts)
    arrays = [label_data(dataset, name, mask) for name in names]
    missing = [missing_value(dataset, factor.label) for factor in factors]
    classes = discovery.classes

    def block(mask_block, *label_blocks):
        blocks = dict(zip(names, label_blocks))
        selections, pattern = _selections(factors, missing, mask_block, blocks, discovery.stratum_codes(blocks))
        codes = [_codes(classes[factor.name], selected, blocks[factor.label]) for factor, selected in zip(factors, selections)]
        return layout.token_columns(pattern, codes)

    return da.map_blocks(block, mask, *arrays, dtype="int32", new_axis=2, chunks=mask.chunks + ((1 + len(factors),),),
                         meta=np.empty((0, 0, 0), dtype="int32"))
