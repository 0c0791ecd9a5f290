"""The registry of analyses, the run of several over one store, and the results DataTree on disk."""
from __future__ import annotations

import json
import logging

import xarray as xr
import zarr

from orthosphere.errors import ParameterError
from orthosphere.store.location import as_location, commit_metadata, zarr_quietly
from orthosphere.store.provenance import provenance

from .accuracy import accuracy
from .attention import AttentionShare
from .errors import AnalysisError
from .inputs import open_for_analysis
from .neighbours import neighbours
from .norm_geometry import norm_geometry
from .norms import norm_spread
from .options import as_attrs
from .plan import Plan, run_plans
from .registry import Analysis
from .replay import replay
from .spheres import sphere_structure
from .subspaces import factor_subspaces

RESULTS_FORMAT = 1
ANALYSES: dict[str, Analysis] = {analysis.name: analysis for analysis in (
    accuracy, norm_spread, factor_subspaces, sphere_structure, neighbours, norm_geometry, replay)}
"""The registry, in the order the analyses run: name -> Analysis (see ``registry.py``: its
configuration, what it reads and needs, the earlier results it takes, how it starts)."""

log = logging.getLogger(__name__)


def get_analysis(name: str) -> Analysis:
    """The analysis registered as `name`."""
    if name not in ANALYSES:
        raise AnalysisError(f"unknown analysis {name!r}: expected any of {list(ANALYSES)}")
    return ANALYSES[name]


def split_options(analyses: list[Analysis], values: dict | None) -> dict[str, dict]:
    """Each analysis's options from one dict: a plain key goes to every chosen analysis that has the
    option, a key "analysis.option" to that analysis only; a key no chosen analysis takes is an error."""
    given = {analysis.name: {} for analysis in analyses}
    unknown = []
    for key, value in (values or {}).items():
        target, _, option = key.rpartition(".")
        takers = [a for a in analyses if option in a.defaults and (not target or a.name == target)]
        if not takers:
            unknown.append(key)
        for analysis in takers:
            given[analysis.name][option] = value
    if unknown:
        known = "; ".join(f"{a.name}: {', '.join(a.defaults)}" for a in analyses)
        raise AnalysisError(f"option(s) {unknown} are not options of the chosen analyses ({known})")
    return given


def run_analyses(dataset: xr.Dataset, only=None, options: dict | None = None) -> dict[str, xr.DataTree]:
    """Run the chosen analyses (all by default) on an opened store, planned together: every analysis
    whose inputs are ready adds its lazy work to one Dask computation per pass, so each chunk of the
    store is read once in a pass whatever the number of analyses that need it. Analyses that take an
    earlier one's result (spheres: the fitted subspaces) are planned once it is there, in the next
    pass; analyses without a plan (accuracy, which reads no activations) compute on their own."""
    names = list(ANALYSES) if only is None else list(only)
    if not names:
        raise AnalysisError(f"no analysis chosen: expected any of {list(ANALYSES)}")
    chosen = {name: get_analysis(name) for name in names}
    if only is None:  # the default leaves out what the store cannot feed (accuracy without pred)
        chosen = {name: analysis for name, analysis in chosen.items()
                  if all(variable in dataset.variables for variable in analysis.needs)}
    analyses = [chosen[name] for name in ANALYSES if name in chosen]
    given = split_options(analyses, options)
    configs = configure(analyses, options)
    waiting = list(analyses)
    share = AttentionShare()  # the norms read the attention each key receives from the replay's tasks

    def ready(outputs: dict) -> dict:
        """Plans of the waiting analyses whose inputs are there (analyses without a plan run now)."""
        plans = {}
        while True:
            startable = [analysis for analysis in waiting
                         if all(name in outputs or name not in chosen for name in analysis.takes)]
            if not startable:
                return plans
            for analysis in startable:
                waiting.remove(analysis)
                log.info("analysis %s of %s", analysis.name, dataset.attrs.get("url"))
                started = analysis.plan(dataset, configs[analysis.name], share, **outputs)
                if isinstance(started, Plan):
                    plans[analysis.name] = started
                else:
                    outputs[analysis.name] = started

    outputs = run_plans({}, ready)
    return {analysis.name: _tree(analysis, outputs[analysis.name], given[analysis.name], dataset)
            for analysis in analyses}


def configure(analyses: list[Analysis], options: dict | None) -> dict:
    """Each analysis's configuration of the options (one dict, as ``split_options`` reads it); a
    refused value is a ParameterError naming the option as it was given ("analysis.option" or plain)."""
    given = split_options(analyses, options)
    configs = {}
    for analysis in analyses:
        try:
            configs[analysis.name] = analysis.configure(given[analysis.name])
        except ParameterError as error:
            key = f"{analysis.name}.{error.parameter}"
            raise error.named(key if key in (options or {}) else error.parameter) from None
    return configs


def _tree(analysis: Analysis, result, options: dict, dataset: xr.Dataset) -> xr.DataTree:
    """An analysis's result as a results group, with what produced it in its attrs."""
    if not isinstance(result, (xr.Dataset, xr.DataTree)):
        result = result.to_dataset()
    tree = result if isinstance(result, xr.DataTree) else xr.DataTree(dataset=result)
    tree.attrs.update({
        "analysis": analysis.name,
        "options": as_attrs(analysis.defaults | options),
        "store": dataset.attrs.get("url"),
        "provenance": provenance(),
    })
    return tree


def results_tree(dataset: xr.Dataset, results: dict[str, xr.DataTree], command: str | None = None) -> xr.DataTree:
    """One DataTree: root attrs describe the store and this run; one child group per analysis."""
    model, task = dataset.attrs.get("model", {}), dataset.attrs.get("task", {})
    root = xr.DataTree(
        dataset=xr.Dataset(
            attrs={
                "orthosphere_results": RESULTS_FORMAT,
                "store": dataset.attrs.get("url"),
                "model": model,
                "task": task,
                "store_provenance": dataset.attrs.get("provenance", {}),
                "provenance": provenance(command),
            }
        )
    )
    for name, tree in results.items():
        root[name] = tree
    root.attrs["analyses"] = [name for name in ANALYSES if name in root.children]
    return root


def analyze(store, out=None, *, only=None, options: dict | None = None, storage_options: dict | None = None,
            out_storage_options: dict | None = None, overwrite: bool = False, command: str | None = None) -> xr.DataTree:
    """Run analyses on the complete store at `store` and return their results as one DataTree;
    with `out`, also write it there (a path or fsspec URL), replacing the groups of these analyses
    in results already there for the same store."""
    dataset = open_for_analysis(store, storage_options)
    tree = results_tree(dataset, run_analyses(dataset, only, options), command)
    if out is not None:
        tree = write_results(tree, out, storage_options=out_storage_options, overwrite=overwrite)
    return tree


def _is_results(location) -> bool:
    try:
        return location.is_zarr() and "orthosphere_results" in open_results(location.url, location.storage_options).attrs
    except (OSError, ValueError, KeyError):
        return False


def write_results(tree: xr.DataTree, out, *, storage_options: dict | None = None, overwrite: bool = False) -> xr.DataTree:
    """Write results to `out`; groups already there from other analyses of the same store are kept.
    Refuses to write over anything that is not orthosphere results, or results of another store
    unless `overwrite` (which replaces them all). Returns the tree as written, kept groups included.

    Readers see the groups listed in the root's consolidated metadata. A group to replace is first
    dropped from that list (one write of the root), then rewritten; new groups are written beside
    the listed ones, then listed in one more write of the root. A crash loses at most the analyses
    being written, never the others."""
    location = as_location(out, storage_options)
    keep: list[str] = []
    if location.exists() and not location.is_empty_dir():
        if not _is_results(location):
            raise AnalysisError(
                f"{location.url} exists and is not an orthosphere results tree: refusing to write over it; "
                "choose a new path for the results"
            )
        existing = open_results(location.url, storage_options)
        if existing.attrs.get("store") != tree.attrs.get("store") and not overwrite:
            raise AnalysisError(
                f"{location.url} holds results of store {existing.attrs.get('store')!r}, not of "
                f"{tree.attrs.get('store')!r}: choose another path, or overwrite them (CLI: --overwrite)"
            )
        if not overwrite:
            keep = [name for name in existing.children if name not in tree.children]
            for name in keep:
                tree[name] = existing[name].load().copy()
    tree.attrs["analyses"] = [name for name in ANALYSES if name in tree.children]
    attributes = as_attrs(dict(tree.attrs))
    with zarr_quietly():
        _keep_only(location, keep, attributes)
        for name in tree.children:
            if name not in keep:
                _write_group(location, tree[name])
        commit_metadata(location, attributes)
    return tree


def _keep_only(location, keep: list[str], attributes: dict) -> None:
    """Drop every group but `keep` from the root's consolidated metadata (one write), then from
    the disk; a new results tree gets its root."""
    if not location.is_zarr():
        zarr.create_group(location.zarr_store(read_only=False), zarr_format=3,
                          attributes={**attributes, "analyses": []})
        return
    root = json.loads(location.fs.cat_file(location.key("zarr.json")))
    listed = (root.get("consolidated_metadata") or {}).get("metadata", {})
    root.setdefault("consolidated_metadata", {"kind": "inline", "must_understand": False})["metadata"] = {
        path: node for path, node in listed.items() if path.split("/")[0] in keep}
    root.setdefault("attributes", {})["analyses"] = [name for name in root["attributes"].get("analyses", []) if name in keep]
    location.write_atomic("zarr.json", json.dumps(root).encode())
    for name in location.entries():
        if name != "zarr.json" and name not in keep:
            location.remove_entry(name)


def _write_group(location, subtree: xr.DataTree) -> None:
    """One analysis's group and its sub-groups, not yet listed in the root's metadata."""
    store = location.zarr_store(read_only=False)
    for node in subtree.subtree:
        node.to_dataset(inherit=node is subtree).to_zarr(store, group=node.path.lstrip("/"), mode="w",
                                                         consolidated=False, zarr_format=3)


def open_results(url, storage_options: dict | None = None) -> xr.DataTree:
    """The results tree at `url` (lazy), as written by `analyze`."""
    location = as_location(url, storage_options)
    if not location.is_zarr():
        raise AnalysisError(f"no results at {location.url}: run `orthosphere analyze STORE --out {location.url}` first")
    return xr.open_datatree(location.zarr_store(read_only=True), engine="zarr")
