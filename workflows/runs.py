"""The runs a report reads: each results tree as one (model, data) pair, named by its model, with
its model's variant (the seeds of one configuration share it) and readable labels."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import xarray as xr

from orthosphere.analyze.results import load_results
from orthosphere.errors import AnalysisError

SPLIT_ORDER = ("test", "interpolation", "extrapolation")
PLACEMENT_ORDER = ("pre", "qkv", "none", "post")


IDENTITY_KEYS = ("source", "weights_sha256", "format")
"""Model description keys that tell one trained model from another of the same variant."""


PLACEMENT_KEYS = ("norm_placement", "norms", "qk_norm", "v_norm", "n_parameters")
"""Model description keys that follow from the norm placement (QKV-Norm adds per-head norms and
their parameters): two configurations that differ only in these differ only in the placement."""


@dataclass
class Run:
    """One results tree: which model on which data, and its groups. ``name`` identifies the
    model (its folder's name, made unique by load_runs); runs of models that differ only in
    their weights (seeds) share a ``variant``."""

    url: str
    tree: xr.DataTree
    name: str = ""

    @property
    def model(self) -> dict:
        return self.tree.attrs.get("model", {})

    @property
    def placement(self) -> str:
        return str(self.model.get("norm_placement") or self.model.get("family") or "model")

    @property
    def split(self) -> str:
        """The data the run read: a task's split, or a corpus's task and file (text:NAME), so that two corpora differ."""
        task = self.tree.attrs.get("task", {})
        corpus = f"{task.get('name')}:{Path(str(task['path'])).stem}" if task.get("path") and not task.get("split") else None
        return str(task.get("split") or corpus or task.get("name") or "data")

    @property
    def label(self) -> str:
        return f"{self.name}/{self.split}"

    @property
    def variant(self) -> str:
        """The model's description without its identity, with the task it was made for: equal
        for the seeds of one configuration."""
        description = {key: value for key, value in self.model.items() if key not in IDENTITY_KEYS}
        return json.dumps([description, self.tree.attrs.get("task", {}).get("spec")], sort_keys=True, default=str)

    def group(self, path: str) -> xr.Dataset | None:
        try:
            return self.tree[path].to_dataset()
        except KeyError:
            return None


def _model_name(model: dict) -> str:
    source = str(model.get("source") or model.get("family") or "model")
    return source.rstrip("/").rsplit("/", 1)[-1] or source


def load_runs(urls) -> list[Run]:
    """Open results; runs of one model (same weights) share a name, two models never do. Results
    that hold no complete analysis (``analyze`` stopped before writing its first) are refused."""
    runs = []
    for url in urls:
        tree = load_results(url)
        if not tree.children:
            raise AnalysisError(f"results {url} hold no complete analysis (was `orthosphere analyze` stopped while "
                                "writing them?): run the analyses again with the same --out")
        runs.append(Run(str(url), tree))
    return name_runs(runs)


def name_runs(runs: list[Run]) -> list[Run]:
    """Name every run by its model (folder name, with a hash prefix where two models share one)
    and sort them by placement, model and split."""
    if not runs:
        raise ValueError("no results given: pass one or more results written by `orthosphere analyze`")
    identities: dict[str, set] = {}
    for run in runs:
        identities.setdefault(_model_name(run.model), set()).add(run.model.get("weights_sha256"))
    for run in runs:
        name = _model_name(run.model)
        clash = len(identities[name]) > 1
        run.name = f"{name}@{str(run.model.get('weights_sha256'))[:8]}" if clash else name
    _refuse_twins(runs)
    order = {name: i for i, name in enumerate(PLACEMENT_ORDER)}
    splits = {name: i for i, name in enumerate(SPLIT_ORDER)}
    return sorted(runs, key=lambda run: (order.get(run.placement, 99), run.placement, run.name,
                                         splits.get(run.split, 99), run.split))


def _refuse_twins(runs: list[Run]) -> None:
    """Refuse two results of one model on one data label: a report shows each model once per data."""
    seen: dict[str, Run] = {}
    for run in runs:
        other = seen.setdefault(run.label, run)
        if other is not run:
            raise AnalysisError(
                f"results {other.url} and {run.url} are both of model {run.name} on data {run.split!r}: a report shows "
                "one results of each model on each data (the figures and the headline would show only one of them); "
                "report them separately, one `orthosphere report RESULTS --out DIR` each")


def groups(runs: list[Run], path: str, variable: str) -> list[tuple[Run, xr.Dataset]]:
    """(run, group) for each model's in-distribution run whose group `path` holds `variable`."""
    found = [(run, run.group(path)) for run in in_distribution(runs)]
    return [(run, group) for run, group in found if group is not None and variable in group]


def in_distribution(runs: list[Run]) -> list[Run]:
    """One run per model: its in-distribution data where there is one, else its first."""
    chosen: dict[str, Run] = {}
    for run in runs:
        if run.name not in chosen or (run.split == "test" and chosen[run.name].split != "test"):
            chosen[run.name] = run
    return list(chosen.values())


def variants(runs: list[Run]) -> dict[str, list[Run]]:
    """variant -> its models' in-distribution runs (one per seed), in run order."""
    found: dict[str, list[Run]] = {}
    for run in in_distribution(runs):
        found.setdefault(run.variant, []).append(run)
    return found


def accuracy_table(runs: list[Run]) -> dict[str, dict[str, float]]:
    """model name -> split -> per-token answer accuracy (%)."""
    table: dict[str, dict[str, float]] = {}
    for run in runs:
        accuracy = run.group("accuracy")
        if accuracy is not None:
            table.setdefault(run.name, {})[run.split] = float(accuracy.token_accuracy) * 100
    return table


SETTINGS = {
    "mass": ("norms/resid_pre", "mass", lambda value: f"{value * 100:g} %", "the share of |x| a norm band holds (norms mass)"),
    "weighting": ("norms/resid_pre", "weighting",
                  lambda value: "attention-weighted" if value == "attention" else "unweighted (every token alike)",
                  "the norms' weighting (--uniform)"),
    "collapse_target": ("replay", "collapse_target", lambda value: f"{value * 100:g} %",
                        "the share of collapsed instances that defines the collapse level (replay collapse_target)"),
    "sparse_threshold": ("replay", "sparse_threshold", lambda value: f"{value:g}",
                         "the max attention that makes an instance sparse (replay sparse_threshold)"),
}
"""Analysis settings the report's words depend on: name -> (group, attribute, its words, what it is)."""


def setting(run: Run, name: str):
    """The value of SETTINGS[name] that the run's results record (None where they hold none)."""
    path, key = SETTINGS[name][:2]
    try:
        return run.tree[path].attrs.get(key)
    except KeyError:
        return None


def setting_words(runs: list[Run], name: str) -> str:
    """The setting in words as the runs hold it: one value, or each of theirs joined by "or" (see
    ``setting_differences``); "?" where none records it."""
    values = sorted({setting(run, name) for run in runs} - {None}, key=str)
    return " or ".join(SETTINGS[name][2](value) for value in values) or "?"


def setting_differences(runs: list[Run]) -> list[str]:
    """A sentence for each setting in which the compared (in-distribution) runs differ."""
    sentences = []
    for name, (_, _, words, what) in SETTINGS.items():
        holders: dict = {}
        for run in in_distribution(runs):
            if setting(run, name) is not None:
                holders.setdefault(setting(run, name), []).append(run.name)
        if len(holders) > 1:
            shown = "; ".join(f"{words(value)} ({', '.join(names)})" for value, names in holders.items())
            sentences.append(f"The runs compared differ in {what}: {shown}. Their figures and headline values that depend "
                             "on it are not like for like.")
    return sentences


NORM_TYPE_WORDS = {"rms": "RMSNorm", "layer": "LayerNorm"}


def model_label(model: dict) -> str:
    """The model's identity in a few words: its family (model_type) and where its norms sit, e.g.
    "qwen3: pre RMSNorm + QK-norm", "gemma2: sandwich RMSNorm", "phi: pre LayerNorm, parallel"."""
    placement = str(model.get("norm_placement") or "no norm placement")
    kind = model.get("norm_type")
    norms = " ".join([placement] + ([NORM_TYPE_WORDS.get(kind, str(kind))] if kind else []))
    if placement != "qkv":  # the arithmetic family's QKV-Norm names its q, k and v norms already
        norms += "".join(f" + {site}-norm" for site, key in (("QK", "qk_norm"), ("V", "v_norm")) if model.get(key))
    parallel = ", parallel" if model.get("parallel") else ""
    return f"{model.get('family') or 'model'}: {norms}{parallel}"


def variant_labels(runs: list[Run]) -> dict[str, str]:
    """variant -> a readable label: its model's identity (``model_label``), with its size where
    variants of one identity differ in size, and its first model's name where that still leaves
    two variants one label."""
    found = variants(runs)
    identities = {variant: model_label(members[0].model) for variant, members in found.items()}
    sizes = {variant: model_size(members[0].model) for variant, members in found.items()}
    labels = {variant: identity + f" ({sizes[variant]})"
              if len({sizes[other] for other in found if identities[other] == identity}) > 1 else identity
              for variant, identity in identities.items()}
    counts = list(labels.values())
    return {variant: label if counts.count(label) == 1 else f"{label} [{found[variant][0].name}]"
            for variant, label in labels.items()}


def training_history(run: Run) -> list[dict]:
    """The evaluation history saved with the run's model (metrics.json beside the checkpoint), when
    the model folder is readable here; else empty."""
    path = Path(str(run.model.get("source", ""))) / "metrics.json"
    try:
        return list(json.loads(path.read_text()).get("history", []))
    except (OSError, ValueError):
        return []


def model_size(model: dict) -> str:
    return f"{model.get('n_layers')} layers, d_model {model.get('d_model')}, {model.get('n_heads')} heads of {model.get('d_head')}"
