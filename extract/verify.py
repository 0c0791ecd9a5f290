"""Verify a store against its model: recompute a seeded random subset of its samples from the model and
the recorded inputs, compare them with the stored values, and check the recorded hashes of the model's
weights and of the corpus (``orthosphere verify STORE [MODEL]``; ``orthosphere.verify``).

- The model must be the store's: the SHA-256 of its weights must equal the store's record (a path's
  files, or a model object's tensors as ``extract`` hashes them); another model is refused, by hash.
- The inputs: an arithmetic task is generated again from its recorded split, seed and spec, and its
  tokens, masks and labels are compared too; a corpus's samples are the tokens the store holds, and
  the corpus's files are checked against their recorded SHA-256 (and the model's tokenizer against
  the tokenizer's). A corpus no longer where it was recorded is reported missing; the samples are
  still recomputed from the stored tokens.
- Each chosen sample is recomputed in the batch the job ran it in (its shard's batches of
  ``batch_size``, the job's default unless given), so that on the same kind of machine, in the same
  dtypes, the values are bitwise those stored (``exact=True`` demands that). Otherwise each site and
  layer passes when its largest difference is within ``TOLERANCE`` of the stored dtype times the
  layer's largest magnitude (float32 results of another machine differ in their last bits).
"""
from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from orthosphere.errors import VerificationError
from orthosphere.params import NON_NEGATIVE_INTEGER, POSITIVE_INTEGER, Config, Flag, Normalised, Rule, parameter
from orthosphere.store import open_store
from orthosphere.store.location import as_location
from orthosphere.store.reader import open_group_checked

from .corpus import corpus_files
from .data import ArithmeticData, ArithmeticDataset, CorpusData, StoredTokens
from .defaults import DEFAULT_BATCH_SIZE
from .hashing import files_sha256
from .shards import ShardPlan, compute_range
from .sources import check_device, from_model, load_source
from .tasks import TaskSpec

TOLERANCE = {"float32": 1e-4, "float16": 2.0**-9, "bfloat16": 2.0**-6}
"""Largest difference a stored dtype's values may show, as a share of their layer's largest magnitude
(float16 and bfloat16: a few units of the last place, as a rounding can flip)."""
INPUT_ARRAYS = ("tokens", "valid", "target", "scored")


@dataclass(frozen=True)
class VerifyOptions(Config):
    """How ``verify`` recomputes samples; the CLI's flags and Python's keywords alike."""

    samples: int = parameter(8, POSITIVE_INTEGER, help="samples to recompute, drawn at random (seeded)")
    seed: int = parameter(0, NON_NEGATIVE_INTEGER, help="seed of the samples drawn")
    batch_size: int = parameter(DEFAULT_BATCH_SIZE, POSITIVE_INTEGER,
                                help="the extraction job's batch size (bitwise results need the same batches)")
    device: str = parameter("auto", Normalised(check_device, "auto, cpu, cuda or cuda:N"), help="where the model runs")
    exact: bool = parameter(False, Flag(), help="demand bitwise equality (a store written on this kind of machine)")
    storage_options: dict | None = parameter(None, Rule(lambda value: isinstance(value, dict), "a mapping"), None,
                                             help="fsspec options of an object-storage store")


@dataclass(frozen=True)
class Comparison:
    """One array (and layer) of the samples recomputed, against the stored values."""

    name: str
    layer: int | None
    values: int
    differing: int
    """Values beyond the tolerance (exact: values not bitwise equal)."""
    bitwise: bool
    largest: float
    """The largest difference, as a share of the layer's largest magnitude (0 where bitwise equal)."""
    tolerance: float
    worst: str = ""
    """Where the largest difference is, with the stored and the recomputed value."""

    @property
    def passed(self) -> bool:
        return self.differing == 0

    def __str__(self) -> str:
        where = self.name + ("" if self.layer is None else f" layer {self.layer}")
        if self.bitwise:
            return f"{where}: ok, bitwise equal ({self.values} values)"
        if self.passed:
            return f"{where}: ok, within {self.tolerance:.1e} (largest difference {self.largest:.1e} of the layer's scale)"
        return (f"{where}: DIFFERS: {self.differing} of {self.values} values beyond {self.tolerance:.1e} of the "
                f"layer's scale; largest {self.largest:.3g} at {self.worst}")


@dataclass(frozen=True)
class Check:
    """One recorded hash against what is there now: "ok", "differs" or "missing"."""

    name: str
    state: str
    detail: str

    def __str__(self) -> str:
        return f"{self.name}: {self.state}: {self.detail}"


@dataclass(frozen=True)
class VerifyReport:
    url: str
    samples: list[int]
    checks: list[Check] = field(default_factory=list)
    comparisons: list[Comparison] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Every value within tolerance and no recorded hash that differs (a missing input is no failure)."""
        return all(c.passed for c in self.comparisons) and all(c.state != "differs" for c in self.checks)

    def failures(self) -> list[str]:
        return [str(item) for item in [*self.checks, *self.comparisons]
                if getattr(item, "state", "") == "differs" or not getattr(item, "passed", True)]

    def format(self) -> str:
        head = f"store {self.url}: {len(self.samples)} samples recomputed ({_sample_text(self.samples)})"
        verdict = "verified" if self.ok else f"NOT verified: {len(self.failures())} failure(s)"
        return "\n".join([head, *map(str, self.checks), *map(str, self.comparisons), f"store {self.url}: {verdict}"])


def verify(store, model=None, **options) -> VerifyReport:
    """Recompute a random subset of the store's samples with `model` (a path, a loaded model, or None:
    the path the store records) and compare them with the stored values; see the module docstring.
    Raises VerificationError where the model is not the store's."""
    settings = VerifyOptions.of(options, owner="verify")
    location = as_location(store, settings.storage_options)
    group = open_group_checked(location)
    attrs = dict(group.attrs)
    loaded = _load_model(attrs["model"], model, settings)
    dataset, checks = _inputs(attrs, group, loaded)
    stored = open_store(location, storage_options=settings.storage_options)
    samples = sorted(np.random.default_rng(settings.seed).choice(
        attrs["n_samples"], size=min(settings.samples, attrs["n_samples"]), replace=False).tolist())
    recomputed = _recompute(loaded, dataset, attrs, samples, settings.batch_size)
    comparisons = []
    for name, values in recomputed.items():
        if name in stored.variables:
            reference = stored[name].isel(sample=samples)
            comparisons += _compare(name, reference, values, samples, attrs, settings.exact)
    return VerifyReport(location.url, samples, checks, comparisons)


def _load_model(recorded: dict, model, settings: VerifyOptions):
    """The model, loaded as the job loaded it, checked against the store's record of its weights."""
    if model is None:
        model = recorded.get("source", "")
        if not os.path.exists(model):
            raise VerificationError(
                f"the store's model {model!r} is not there (any more): give the model the store was extracted "
                f"from (CLI: verify STORE MODEL; Python: model=...); its weights' SHA-256 is {recorded.get('weights_sha256')}")
    if isinstance(model, (str, os.PathLike)):
        dtype = recorded.get("dtype") if recorded.get("format") != "gguf" else None
        loaded = load_source(model, settings.device, dtype)
    else:
        loaded = from_model(model, device=settings.device)
    found, wanted = loaded.describe()["weights_sha256"], recorded.get("weights_sha256")
    if found != wanted:
        raise VerificationError(
            f"model {loaded.describe()['source']} is not the store's: its weights' SHA-256 is {found}, the store was "
            f"extracted from weights with SHA-256 {wanted} ({recorded.get('source')}); give that model")
    return loaded


def _inputs(attrs: dict, group, loaded):
    """The data set the samples are recomputed from, and the checks of the recorded inputs."""
    task = attrs["task"]
    if task.get("name") == "arithmetic":
        spec = TaskSpec(**{key: tuple(value) for key, value in task["spec"].items()})
        data = ArithmeticData(task["split"], task["seed"], spec)
        check = Check("task", "ok", f"arithmetic split {task['split']}, seed {task['seed']}: generated again, its "
                                    "tokens and labels compared below")
        return ArithmeticDataset(data, attrs["n_samples"]), [check]
    return StoredTokens(group), [_corpus_check(task), _tokenizer_check(task, loaded)]


def _corpus_check(task: dict) -> Check:
    path = task.get("path", "")
    data = CorpusData(task["name"], path, split=task.get("split"))
    if not os.path.exists(path):
        return Check("corpus", "missing", f"{path} is not there (any more): its SHA-256 is not checked; the samples "
                                          "are recomputed from the tokens the store holds")
    found = files_sha256(corpus_files(data))
    if found != task.get("sha256"):
        return Check("corpus", "differs", f"{path} has SHA-256 {found}, the store's corpus had {task.get('sha256')}: "
                                          "the files changed since the store was written")
    return Check("corpus", "ok", f"{path}, SHA-256 {found}")


def _tokenizer_check(task: dict, loaded) -> Check:
    tokenizer = loaded.corpus_tokenizer(task.get("tokenized", False))
    found = None if tokenizer is None else tokenizer.sha256()
    if found != task.get("tokenizer_sha256"):
        return Check("tokenizer", "differs", f"the model's tokenizer has SHA-256 {found}, the store's corpus was read "
                                             f"with one of SHA-256 {task.get('tokenizer_sha256')}")
    return Check("tokenizer", "ok", f"{task.get('tokenizer')}, SHA-256 {found}")


def _recompute(loaded, dataset, attrs: dict, samples: list[int], batch_size: int) -> dict[str, np.ndarray]:
    """Every array the job computes, for the samples, each computed in the batch the job ran it in."""
    plan = ShardPlan("", "", None, None, attrs["n_samples"], tuple(attrs["sites"]), tuple(attrs["layers"]),
                     attrs["dtype"], batch_size, "", None)
    batches = defaultdict(list)
    for sample in samples:
        start, stop = next(bounds for bounds in attrs["shards"] if bounds[0] <= sample < bounds[1])
        first = start + (sample - start) // batch_size * batch_size
        batches[(first, min(first + batch_size, stop))].append(sample)
    kept = defaultdict(list)
    sink = _Keep(batches, kept)
    for first, stop in sorted(batches):
        compute_range(loaded.adapter, dataset, plan, first, stop, sink)
    return {name: np.concatenate(parts) for name, parts in kept.items()}


class _Keep:
    """A sink for compute_range that keeps copies of the chosen samples of each batch."""

    def __init__(self, batches: dict, kept: dict):
        self.batches, self.kept = batches, kept

    def put(self, first: int, arrays: dict, release) -> None:
        stop = first + len(next(iter(arrays.values())))
        rows = [sample - first for sample in self.batches[(first, stop)]]
        for name, values in arrays.items():
            self.kept[name].append(np.array(values[rows]))
        release()


def _compare(name: str, reference, values: np.ndarray, samples: list[int], attrs: dict, exact: bool) -> list[Comparison]:
    """The comparison of one array, layer by layer where it has layers."""
    stored = reference.values
    if np.issubdtype(stored.dtype, np.floating):
        values = values.astype(stored.dtype)
    dims = reference.dims
    if "layer" not in dims:
        return [_comparison(name, None, stored, values, dims, samples, attrs["dtype"], exact)]
    axis = dims.index("layer")
    rest = dims[:axis] + dims[axis + 1:]
    return [_comparison(name, layer, np.take(stored, index, axis), np.take(values, index, axis), rest, samples,
                        attrs["dtype"], exact)
            for index, layer in enumerate(attrs["layers"])]


def _comparison(name, layer, stored, values, dims, samples, dtype, exact) -> Comparison:
    if not np.issubdtype(stored.dtype, np.floating):
        differs = stored != values
        bitwise = not differs.any()
        worst = _position(np.argmax(differs), stored, values, dims, samples) if not bitwise else ""
        return Comparison(name, layer, stored.size, int(differs.sum()), bitwise, float(not bitwise), 0.0, worst)
    bitwise = np.array_equal(stored, values, equal_nan=True)
    difference = np.abs(stored.astype(np.float64) - values.astype(np.float64))
    difference[np.isnan(stored) & np.isnan(values)] = 0.0
    scale = max(float(np.nanmax(np.abs(values), initial=0.0)), np.finfo(np.float32).tiny)
    tolerance = 0.0 if exact else TOLERANCE[dtype]
    relative = np.nan_to_num(difference / scale, nan=np.inf)
    differing = int((relative > tolerance).sum()) if not exact else int((difference != 0).sum())
    index = int(np.argmax(relative))
    worst = "" if bitwise else _position(index, stored, values, dims, samples)
    return Comparison(name, layer, stored.size, differing, bitwise, float(relative.reshape(-1)[index]), tolerance,
                      worst)


def _position(index: int, stored, values, dims, samples) -> str:
    coords = np.unravel_index(index, stored.shape)
    parts = [f"sample {samples[coords[0]]}"] + [f"{dim} {coord}" for dim, coord in zip(dims[1:], coords[1:])]
    return f"{', '.join(parts)}: stored {stored[coords]!r}, recomputed {values[coords]!r}"


def _sample_text(samples: list[int]) -> str:
    shown = ", ".join(map(str, samples[:10]))
    return f"samples {shown}{', ...' if len(samples) > 10 else ''}"
