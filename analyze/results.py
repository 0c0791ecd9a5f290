"""The registry of analyses, their configurations of the options given, the run of several over one
store, and the results DataTree on disk."""
from __future__ import annotations

import itertools
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
    compute on their own. The norms, norm_geometry and the replay share one ``AttentionShare``: each
    block's attention is computed once, in the replay's tasks."""
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
        "store": store_url(dataset),
        "provenance": provenance(),
    })
    return tree


def store_url(dataset: xr.Dataset) -> str | None:
    """Where the analysed store lives, as the results record it: a local path made absolute, so that
    the results name one store whatever folder they are read from; a URL as it is."""
    url = dataset.attrs.get("url")
    return as_location(url).local_path if url is not None and as_location(url).is_local else url


def results_tree(dataset: xr.Dataset, results: dict[str, xr.DataTree], command: str | None = None) -> xr.DataTree:
    """One DataTree: root attrs describe the store and this run; one child group per analysis."""
    model, task = dataset.attrs.get("model", {}), dataset.attrs.get("task", {})
    root = xr.DataTree(
        dataset=xr.Dataset(
            attrs={
                "orthosphere_results": RESULTS_FORMAT,
                "store": store_url(dataset),
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
        if not _same_store(existing.attrs.get("store"), tree.attrs.get("store")) and not overwrite:
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


def _same_store(first, second) -> bool:
    """Whether two recorded stores are one: equal, or one local path (results written before stores were
    recorded as absolute paths hold the path as given)."""
    local = [as_location(url).local_path for url in (first, second) if url is not None and as_location(url).is_local]
    return first == second or (len(local) == 2 and local[0] == local[1])


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


EVERY_CHUNK = "every_chunk_written"
"""An analysis group's attribute: each chunk of its arrays is on disk, those of fill values alone too (so a
missing one is damage; groups written before it may lack such chunks)."""


def _write_group(location, subtree: xr.DataTree) -> None:
    """One analysis's group and its sub-groups, not yet listed in the root's metadata."""
    store = location.zarr_store(read_only=False)
    for node in subtree.subtree:
        dataset = node.to_dataset(inherit=node is subtree)
        if node is subtree:
            dataset.attrs[EVERY_CHUNK] = True
        dataset.to_zarr(store, group=node.path.lstrip("/"), mode="w", consolidated=False, zarr_format=3,
                        write_empty_chunks=True)


def open_results(url, storage_options: dict | None = None) -> xr.DataTree:
    """The results tree at `url` (lazy), as written by `analyze`: the groups its root lists, never one
    that an analysis stopped while writing (zarr lists every group on disk once the root's
    consolidated metadata is empty). Refuses a store (analyze it first), anything else that is not
    results, and results whose listed groups or arrays have lost their metadata."""
    location = as_location(url, storage_options)
    if not location.is_zarr():
        raise AnalysisError(f"no results at {location.url}: analyze a store with out={location.url!r} first")
    root = _root_metadata(location)
    attributes = root.get("attributes", {})
    if "orthosphere_results" not in attributes:
        if "schema" in attributes:
            raise AnalysisError(f"{location.url} is a store, not analysis results: analyze it first "
                                f"(orthosphere analyze {location.url} --out RESULTS) and pass RESULTS")
        raise AnalysisError(f"{location.url} is not orthosphere results (its zarr.json has no 'orthosphere_results' "
                            "attribute): pass results written by `orthosphere analyze`")
    _check_metadata(location, root)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*consolidated metadata.*", category=RuntimeWarning)
        tree = xr.open_datatree(location.zarr_store(read_only=True), engine="zarr")
    listed = tree.attrs.get("analyses")
    unlisted = [name for name in tree.children if listed is not None and name not in listed]
    return tree.drop_nodes(unlisted) if unlisted else tree


def load_results(url, storage_options: dict | None = None) -> xr.DataTree:
    """The results tree at `url` read into memory (``open_results``, then every array): an array
    whose chunks do not decode is an error naming the results and the array."""
    tree = open_results(url, storage_options)
    try:
        return tree.load()
    except (OSError, AnalysisError):
        raise
    except Exception as error:  # whatever the codecs raise on bytes that are not theirs
        raise _undecodable(url, open_results(url, storage_options), error) from None


def _undecodable(url, tree: xr.DataTree, error: Exception) -> Exception:
    """The error naming the first array of `tree` that does not decode (`error` where each one does)."""
    for node in tree.subtree:
        for name, variable in node.dataset.variables.items():
            try:
                variable.load()
            except Exception as found:  # noqa: BLE001 - the codecs' own errors
                path = f"{node.path.strip('/')}/{name}".lstrip("/")
                return AnalysisError(
                    f"results {url} are damaged: array {path} does not decode ({type(found).__name__}: {found}); re-run "
                    f"`orthosphere analyze {tree.attrs.get('store') or 'STORE'} --out {url} --only {path.split('/')[0]}` "
                    "to write that analysis again")
    return error


def _chunk_keys(node: dict) -> list[str]:
    """The chunk files an array's metadata promises (regular grid, default key encoding; none for a group)."""
    if node.get("node_type") != "array" or node.get("chunk_grid", {}).get("name") != "regular" \
            or node.get("chunk_key_encoding", {}).get("name") != "default":
        return []
    separator = node["chunk_key_encoding"].get("configuration", {}).get("separator", "/")
    counts = [-(-size // chunk) for size, chunk in zip(node["shape"], node["chunk_grid"]["configuration"]["chunk_shape"])]
    return [separator.join(["c", *map(str, coords)]) for coords in itertools.product(*map(range, counts))]


def _root_metadata(location) -> dict:
    """The results' root zarr.json, read; a damaged one is an error naming it."""
    try:
        return json.loads(location.fs.cat_file(location.key("zarr.json")))
    except ValueError as error:  # not JSON, or not text
        raise AnalysisError(f"results {location.url} are damaged: their root metadata {location.key('zarr.json')} does not "
                            f"parse ({error}); re-run `orthosphere analyze STORE --out NEW_RESULTS` (what the results "
                            "hold is described only there, so they cannot be repaired in place)") from None


def _check_metadata(location, root: dict) -> None:
    """Every group and array of the listed analyses that the root's consolidated metadata describes has
    its own zarr.json on disk, and each array of a group written with EVERY_CHUNK its chunks (one listing
    of the files): a deleted group, array or chunk is an error naming it."""
    listed = root.get("attributes", {}).get("analyses")
    described = (root.get("consolidated_metadata") or {}).get("metadata", {})
    files = location.list_files()
    checked = {path: node for path, node in described.items() if listed is None or path.split("/")[0] in listed}
    whole = {path for path in checked if checked.get(path.split("/")[0], {}).get("attributes", {}).get(EVERY_CHUNK)}
    lost = [f"{path}/{key}" for path, node in checked.items()
            for key in ["zarr.json", *(_chunk_keys(node) if path in whole else [])] if f"{path}/{key}" not in files]
    if lost:
        analyses = sorted({path.split("/")[0] for path in lost})
        shown = ", ".join(lost[:5]) + (f" and {len(lost) - 5} more" if len(lost) > 5 else "")
        store = root.get("attributes", {}).get("store") or "STORE"
        raise AnalysisError(f"results {location.url} are damaged: {shown} {'is' if len(lost) == 1 else 'are'} missing; re-run "
                            f"`orthosphere analyze {store} --out {location.url} --only {','.join(analyses)}` to write "
                            f"{'that analysis' if len(analyses) == 1 else 'those analyses'} again")
