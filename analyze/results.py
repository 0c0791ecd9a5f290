"""The registry of analyses, their configurations of the options given, the run of several over one
store, and the results DataTree on disk."""
from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Iterable, Mapping

import xarray as xr
import zarr

from orthosphere.errors import ParameterError
from orthosphere.params import Config
from orthosphere.store.location import as_location, commit_metadata, zarr_quietly
from orthosphere.store.provenance import provenance

from .accuracy import accuracy
from .attention import AttentionShare
from .errors import AnalysisError
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


def chosen_analyses(dataset: xr.Dataset, analyses: str | Iterable[str] | None = None) -> list[Analysis]:
    """The analyses named (a list, or one string of names separated by commas), in the order they run;
    by default every one the store can feed (accuracy needs pred)."""
    names = list(ANALYSES) if analyses is None else analyses.split(",") if isinstance(analyses, str) else list(analyses)
    if not names:
        raise AnalysisError(f"no analysis chosen: expected any of {list(ANALYSES)}")
    chosen = {name: get_analysis(name) for name in names}
    if analyses is None:
        chosen = {name: analysis for name, analysis in chosen.items()
                  if all(variable in dataset.variables for variable in analysis.needs)}
    return [chosen[name] for name in ANALYSES if name in chosen]


def configure(analyses: Iterable[Analysis], options: Mapping | None = None) -> dict[str, Config]:
    """Each analysis's configuration, name -> Config, of options in the nested form: a key named after
    an analysis, with a dict, holds that analysis's own options; any other key goes to every analysis
    that takes it (an analysis's own value wins). A key none of these analyses takes is an error; a
    refused value is a ParameterError naming the option as given ("analysis.option" or plain)."""
    analyses = list(analyses)
    shared, own = {}, {}
    for key, value in (options or {}).items():
        if key in ANALYSES and isinstance(value, Mapping):
            own[key] = dict(value)
        else:
            shared[key] = value
    not_dicts = [key for key in shared if key in ANALYSES]
    if not_dicts:
        raise AnalysisError(f"{not_dicts[0]}={shared[not_dicts[0]]!r}: an analysis's own options go in a dict, e.g. "
                            f"{not_dicts[0]}={{'{next(iter(ANALYSES[not_dicts[0]].defaults), 'option')}': ...}}")
    unknown = [key for key in shared if not any(key in analysis.defaults for analysis in analyses)]
    unknown += [f"{name}.{option}" for name, given in own.items() for option in given
                if name not in {analysis.name for analysis in analyses} or option not in ANALYSES[name].defaults]
    if unknown:
        known = "; ".join(f"{a.name}: {', '.join(a.defaults)}" for a in analyses)
        raise AnalysisError(f"option(s) {unknown} are not options of the chosen analyses ({known})")
    configs = {}
    for analysis in analyses:
        given = own.get(analysis.name, {})
        try:
            configs[analysis.name] = analysis.configure(
                {key: value for key, value in shared.items() if key in analysis.defaults} | given)
        except ParameterError as error:
            raise error.named(f"{analysis.name}.{error.parameter}" if error.parameter in given else error.parameter) from None
    return configs


def run_analyses(dataset: xr.Dataset, configs: Mapping[str, Config]) -> dict[str, xr.DataTree]:
    """Run the configured analyses (name -> its Config, as ``configure`` makes them) on an opened store,
    planned together: every analysis whose inputs are ready adds its lazy work to one Dask computation
    per pass, so each chunk of the store is read once in a pass whatever the number of analyses that
    need it. Analyses that take an earlier one's result (spheres: the fitted subspaces) are planned once
    it is there, in the next pass; analyses without a plan (accuracy, which reads no activations)
    compute on their own. The norms and the replay share one ``AttentionShare``: each block's
    attention is computed once, in the replay's tasks."""
    analyses = sorted((get_analysis(name) for name in configs), key=lambda analysis: list(ANALYSES).index(analysis.name))
    waiting = list(analyses)
    share = AttentionShare()

    def ready(outputs: dict) -> dict:
        """Plans of the waiting analyses whose inputs are there (analyses without a plan run now)."""
        plans = {}
        while True:
            startable = [analysis for analysis in waiting
                         if all(name in outputs or name not in configs for name in analysis.takes)]
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
    return {analysis.name: _tree(analysis, outputs[analysis.name], configs[analysis.name], dataset)
            for analysis in analyses}


def _tree(analysis: Analysis, result, config: Config, dataset: xr.Dataset) -> xr.DataTree:
    """An analysis's result as a results group, with what produced it in its attrs."""
    if not isinstance(result, (xr.Dataset, xr.DataTree)):
        result = result.to_dataset()
    tree = result if isinstance(result, xr.DataTree) else xr.DataTree(dataset=result)
    tree.attrs.update({
        "analysis": analysis.name,
        "options": as_attrs(config.as_dict()),
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
                f"{tree.attrs.get('store')!r}: choose another path, or overwrite them (overwrite=True)"
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
    """The results tree at `url` (lazy), as written by `analyze`: the groups its root lists, never one
    that an analysis stopped while writing (zarr lists every group on disk once the root's
    consolidated metadata is empty)."""
    location = as_location(url, storage_options)
    if not location.is_zarr():
        raise AnalysisError(f"no results at {location.url}: analyze a store with out={location.url!r} first")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*consolidated metadata.*", category=RuntimeWarning)
        tree = xr.open_datatree(location.zarr_store(read_only=True), engine="zarr")
    listed = tree.attrs.get("analyses")
    unlisted = [name for name in tree.children if listed is not None and name not in listed]
    return tree.drop_nodes(unlisted) if unlisted else tree
