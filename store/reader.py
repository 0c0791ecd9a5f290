"""Open a store lazily as an xarray Dataset, check it against schema v1 and its chunks, describe it."""
from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING

import numpy as np
import zarr

from .bfloat16 import is_bfloat16
from .errors import DamagedStoreError, IncompleteStoreError, StorageFailureError, StoreError, StoreNotFoundError
from .integrity import GuardedStore, find_damage, guarded_group, promises
from .location import Location, as_location, group_arrays, zarr_quietly
from .lock import holder_text, live_holder
from .names import PROGRESS_GROUP
from .schema import (
    DIM_NAMES,
    PER_SAMPLE_DIMS,
    SCHEMA_VERSION,
    WEIGHT_VARIABLES,
    check_dtype,
    check_model,
    check_sites,
    dim_sizes,
    holds_pred,
    resolved_dtype,
    variables_for,
)
from .state import ABSENT, DAMAGED, FOREIGN_ZARR, REMNANT, STORE, inspect

if TYPE_CHECKING:
    import xarray

REQUIRED_ATTRS = ("schema", "model", "task", "sites", "layers", "dtype", "labels", "n_samples", "n_pos", "shards", "provenance")


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _index(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


ATTR_TYPES = {
    "model": (lambda v: isinstance(v, dict), "a dict (the model description)"),
    "task": (lambda v: isinstance(v, dict), "a dict (the task description)"),
    "sites": (lambda v: isinstance(v, list) and bool(v) and all(isinstance(x, str) for x in v), "a non-empty list of site names"),
    "layers": (lambda v: isinstance(v, list) and bool(v) and all(_index(x) for x in v), "a non-empty list of layer indices"),
    "dtype": (lambda v: isinstance(v, str), "a dtype name"),
    "labels": (lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in v.values()), "a dict of label name -> dtype"),
    "n_samples": (_count, "a positive integer"),
    "n_pos": (_count, "a positive integer"),
    "shards": (lambda v: isinstance(v, list) and bool(v) and all(isinstance(x, list) and len(x) == 2 and all(_index(i) for i in x)
                                                                 for x in v), "a non-empty list of [start, stop) sample ranges"),
    "provenance": (lambda v: isinstance(v, dict), "a dict"),
    "with_weights": (lambda v: isinstance(v, bool), "true or false"),
    "samples_per_chunk": (_count, "a positive integer"),
    "codec": (lambda v: isinstance(v, str), "a codec name"),
    "pred": (lambda v: isinstance(v, bool), "true or false"),
    "complete": (lambda v: isinstance(v, bool), "true or false"),
}
"""What each root attribute but `schema` must be (store/SCHEMA.md): a test, and the expectation in words;
those not in REQUIRED_ATTRS may be absent (stores written before they existed)."""


def root_attribute_problems(attrs: dict) -> list[str]:
    """Every root attribute that schema v1 promises and the store lacks, or holds with the wrong type or value."""
    problems = [f"root attribute {key!r} is missing" for key in REQUIRED_ATTRS if key not in attrs]
    for key, (fits, expected) in ATTR_TYPES.items():
        if key in attrs and not fits(attrs[key]):
            problems.append(f"root attribute {key!r} is {_shown(attrs[key])}, expected {expected}")
    if problems:
        return problems
    for key, check in (("sites", check_sites), ("model", check_model), ("dtype", check_dtype)):
        try:
            check(attrs[key])
        except StoreError as error:
            problems.append(f"root attribute {key!r}: {error}")
    return problems


def _shown(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def damaged_root_error(location: Location, problems: list[str]) -> StoreError:
    """The error for a store whose root attributes depart from the schema."""
    return StoreError(
        f"{location.url}: the store's root metadata (zarr.json) is damaged: {'; '.join(problems)}; "
        "restore its zarr.json from a copy, or replace the store (rerun the job that made it with mode=\"overwrite\")"
    )


def open_group_checked(location: Location, mode: str = "r", consolidated: bool | None = None) -> zarr.Group:
    """The store's root group, after checking that it exists and is a created orthosphere store we can read.

    consolidated=False reads every array's own metadata (what validate needs); None uses the
    consolidated copy when there is one.
    """
    found = inspect(location)
    if found.kind != STORE:
        raise not_a_store_error(location, found.kind)
    try:
        with zarr_quietly():
            group = zarr.open_group(
                location.zarr_store(read_only=mode == "r"), mode=mode, zarr_format=3, use_consolidated=consolidated
            )
    except StoreError:
        raise
    except (ValueError, TypeError, FileNotFoundError) as error:
        raise StoreError(f"{location.url} is not a readable Zarr v3 group: {error}") from error
    version = group.attrs.get("schema")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise StoreError(
            f"{location.url} has schema attribute {version!r}, not a schema version (a positive integer): "
            "the store is damaged or was not written by orthosphere"
        )
    if version > SCHEMA_VERSION:
        raise StoreError(
            f"{location.url} has schema version {version!r}, newer than the {SCHEMA_VERSION} "
            "this orthosphere reads: upgrade orthosphere"
        )
    problems = root_attribute_problems(dict(group.attrs))
    if problems:
        raise damaged_root_error(location, problems)
    return group


def not_a_store_error(location: Location, kind: str) -> StoreError:
    """The error for a URL that holds no created orthosphere store (`kind`: see ``state``)."""
    if kind == ABSENT:
        return StoreNotFoundError(
            f"no store at {location.url}: the path does not exist; check it, or create a store with `orthosphere extract`"
        )
    holder = live_holder(location) if kind == REMNANT else None
    if holder is not None:
        return StoreError(f"{location.url} is a store being created now by a running writer: {holder_text(holder)}; wait for "
                          "it to finish, then read it")
    what = {
        REMNANT: "is a store whose creation or replacement was interrupted (nothing in it can be resumed): rerun the "
                 'job that makes it, with mode="resume" (or mode="overwrite")',
        DAMAGED: f"is a damaged orthosphere store: its progress record {PROGRESS_GROUP}/shard_complete is missing, so "
                 'no shard can be trusted; replace it (its job, with mode="overwrite")',
        FOREIGN_ZARR: "is a Zarr store but not an orthosphere store (no 'schema' attribute); open it with zarr or "
                      "xarray directly",
    }.get(kind, "is not a Zarr store (no zarr.json at its root): give the path of a store written by orthosphere")
    return StoreError(f"{location.url} {what}")


def read_attrs(url, storage_options: dict | None = None) -> dict:
    """The store's root attributes (model, task, sites, ...), without opening the arrays."""
    return dict(open_group_checked(as_location(url, storage_options)).attrs)


def completeness(group: zarr.Group) -> dict:
    """How many shards are complete, and whether the job finished: `complete` set, and the
    metadata consolidated in the same write."""
    done = group[f"{PROGRESS_GROUP}/shard_complete"][:]
    finished = bool(group.attrs.get("complete")) and group.metadata.consolidated_metadata is not None
    return {"complete": finished, "shards_done": int(done.sum()), "shards_total": int(done.size)}


def open_store(url, *, allow_incomplete: bool = False, storage_options: dict | None = None,
               samples_per_block: int | None = None, check_chunks: bool = True) -> xarray.Dataset:
    """The store as a lazy, Dask-backed xarray Dataset, in Dask blocks of `samples_per_block`
    samples (a multiple of the store's chunk length; default: one chunk). bfloat16 activations are
    read as float32 (exactly: every bfloat16 is a float32).

    Every chunk the store promises (every chunk of each complete shard, the weight maps, the index
    coordinates) is checked to be there and of its size first (one listing of the store;
    check_chunks=False skips it), and reads raise DamagedStoreError, naming the array and chunk,
    where a promised chunk is missing, truncated or fails its checksum. An incomplete store opened
    with allow_incomplete holds only the samples of its complete shards (attribute
    `samples_written`), and the weight maps only once they were written."""
    location = as_location(url, storage_options)
    group = open_group_checked(location)
    state = completeness(group)
    if not state["complete"] and not allow_incomplete:
        missing = state["shards_total"] - state["shards_done"]
        detail = (
            f"{missing} of {state['shards_total']} shards are missing"
            if missing
            else "every shard was written but the job did not finish"
        )
        raise IncompleteStoreError(
            f"store {location.url} is incomplete: {detail}; resume the job that wrote it "
            '(mode="resume"), or read what is there with open_store(url, allow_incomplete=True)'
        )
    promised = _promises(group)
    if check_chunks:
        damage = find_damage(group, promised, location.list_files(), decode_strings=False)
        if damage:
            raise DamagedStoreError.of(location.url, damage)
    import xarray as xr  # here, not at the top: extraction, which writes stores, need not import xarray and pandas

    chunks = {"sample": samples_per_block} if samples_per_block else {}
    guarded = GuardedStore(location.zarr_store(read_only=True), location.url, promised)
    with zarr_quietly():
        dataset = xr.open_zarr(guarded, consolidated=state["complete"] or None, zarr_format=3, chunks=chunks)
    widened = {name: variable.astype(np.float32) for name, variable in dataset.data_vars.items() if is_bfloat16(variable.dtype)}
    dataset = dataset.assign(widened)
    if not state["complete"]:
        dataset = _written_part(dataset, group)
    dataset.attrs["url"] = location.url  # where it was opened from: for messages, and readers that reopen it
    return dataset


def _written_part(dataset: xarray.Dataset, group: zarr.Group) -> xarray.Dataset:
    """An incomplete store's samples of complete shards only, and its weight maps only once written:
    what was never written would read as fill values (zeros), indistinguishable from data."""
    progress = group[PROGRESS_GROUP]
    done = progress["shard_complete"][:]
    written = [index for shard, (start, stop) in zip(done, group.attrs["shards"]) if shard for index in range(start, stop)]
    dataset = dataset.isel(sample=np.asarray(written, dtype=np.int64))
    if not bool(progress["weights_written"][0]):
        dataset = dataset.drop_vars([name for name in WEIGHT_VARIABLES if name in dataset.data_vars])
    dataset.attrs["samples_written"] = f"{len(written)} of {group.attrs['n_samples']} (the job did not finish)"
    return dataset


def _promises(group: zarr.Group) -> dict:
    progress = group[PROGRESS_GROUP]
    return promises(group, dict(group.attrs), progress["shard_complete"][:], bool(progress["weights_written"][0]))


def validate(url, storage_options: dict | None = None, full: bool = False) -> list[str]:
    """Every way the store departs from schema v1, and every chunk it promises that is missing or
    of the wrong size (with `full`: that does not decode, checksums included); empty when valid. A
    failure of the storage itself raises StorageFailureError."""
    location = as_location(url, storage_options)
    try:
        group = open_group_checked(location, consolidated=False)
    except StorageFailureError:
        raise  # the storage failed, not the store
    except StoreError as error:
        return [str(error)]
    attrs = dict(group.attrs)  # open_group_checked checked them (root_attribute_problems)
    sites, model = check_sites(attrs["sites"]), check_model(attrs["model"])
    problems = []
    sizes = dim_sizes(model, attrs["n_samples"], attrs["n_pos"], len(attrs["layers"]))
    described = consolidated_arrays(location)
    for name, var in variables_for(sites, attrs.get("with_weights", True), holds_pred(attrs)).items():
        problems += _variable_problems(group, name, var.dims, resolved_dtype(var, attrs["dtype"]), sizes, described)
    for name in attrs["labels"]:
        problems += _variable_problems(group, name, PER_SAMPLE_DIMS, None, sizes, described, kind="label coordinate")
    if problems:
        return problems
    promised = _promises(group)
    if full:
        group = guarded_group(location, promised)
    problems += [str(damage) for damage in find_damage(group, promised, location.list_files(), decode=full)]
    state = completeness(open_group_checked(location))
    if not state["complete"]:
        problems.append(f"incomplete: {state['shards_done']} of {state['shards_total']} shards complete, job not finished")
    return problems


def consolidated_arrays(location) -> dict[str, dict]:
    """The arrays the root's consolidated metadata describes, name -> metadata (none before the job finishes)."""
    root = json.loads(location.fs.cat_file(location.key("zarr.json")))
    described = (root.get("consolidated_metadata") or {}).get("metadata") or {}
    return {name: node for name, node in described.items() if node.get("node_type") == "array"}


def _variable_problems(group, name, dims, dtype, sizes, described=(), kind="variable") -> list[str]:
    array = group.get(name)
    if not isinstance(array, zarr.Array):
        if name in described:
            return [f"{kind} {name!r} is missing: its metadata ({name}/zarr.json) is gone, but the store's consolidated "
                    "metadata still describes it; resume the job that made the store (`orthosphere extract ... --resume`) "
                    "to restore it and rewrite any chunk it lost"]
        return [f"{kind} {name!r} is missing"]
    problems = []
    found_dims = tuple(array.metadata.dimension_names or ())
    if found_dims != tuple(dims):
        problems.append(f"{kind} {name!r} has dims {found_dims}, expected {tuple(dims)}")
    else:
        expected = tuple(sizes[d] for d in dims)
        if array.shape != expected:
            problems.append(f"{kind} {name!r} has shape {array.shape}, expected {expected} from the model description")
    if dtype is not None and np.dtype(array.dtype) != np.dtype(dtype):
        problems.append(f"{kind} {name!r} has dtype {array.dtype}, expected {dtype}")
    return problems


def info(url, storage_options: dict | None = None) -> dict:
    """A summary of the store: model, task, sites, shapes, dtype, chunking, size, completeness, and the
    promised chunks that one listing shows missing or of the wrong size (``damaged_chunks``)."""
    location = as_location(url, storage_options)
    group = open_group_checked(location)
    attrs = dict(group.attrs)
    arrays = {
        name: {
            "dims": list(array.metadata.dimension_names),
            "shape": list(array.shape),
            "chunks": list(array.chunks),
            "dtype": str(array.dtype),
            "chunk_mb": round(math.prod(array.chunks) * np.dtype(array.dtype).itemsize / 2**20, 3)
            if np.dtype(array.dtype).kind not in "OTU"
            else None,
        }
        for name, array in sorted(group_arrays(group))
        if name not in DIM_NAMES
    }
    files = location.list_files()  # one listing: the size, and the promised chunks it lacks
    size = sum(files.values())
    return {
        "url": location.url,
        "schema": attrs["schema"],
        "model": attrs.get("model"),
        "task": attrs.get("task"),
        "sites": attrs.get("sites"),
        "layers": attrs.get("layers"),
        "dtype": attrs.get("dtype"),
        "labels": attrs.get("labels"),
        "n_samples": attrs.get("n_samples"),
        "n_pos": attrs.get("n_pos"),
        "samples_per_chunk": attrs.get("samples_per_chunk"),
        "codec": attrs.get("codec"),
        "pred": holds_pred(attrs),
        "arrays": arrays,
        "size_bytes": size,
        **_token_bytes(group, attrs, size),
        **completeness(group),
        "damaged_chunks": [str(damage) for damage in find_damage(group, _promises(group), files, decode_strings=False)],
        "provenance": attrs.get("provenance"),
    }


def _token_bytes(group: zarr.Group, attrs: dict, size: int) -> dict:
    """Real (valid) tokens, the sites' bytes per position and the store's bytes per real token
    (its size on disk less the weight maps, which a store holds once whatever its length)."""
    valid = group["valid"]
    step = valid.chunks[0] * max(1, 2**24 // (valid.chunks[0] * valid.shape[1]))
    real = sum(int(np.count_nonzero(valid[start:start + step])) for start in range(0, valid.shape[0], step))
    positions = valid.shape[0] * valid.shape[1]
    weights = sum(math.prod(group[name].shape) * 4 for name in WEIGHT_VARIABLES if name in group)
    sites = sum(math.prod(group[site].shape[1:]) * group[site].dtype.itemsize for site in attrs.get("sites", []) if site in group)
    return {
        "real_tokens": real,
        "positions": positions,
        "weight_bytes": weights,
        "site_bytes_per_position": sites / max(1, valid.shape[1]),
        "bytes_per_real_token": (size - weights) / real if real else None,
    }


def _per_token(summary: dict) -> str:
    if summary["bytes_per_real_token"] is None:
        return "no real tokens written yet"
    per_token, sites = summary["bytes_per_real_token"], summary["site_bytes_per_position"]
    if not sites:  # no site array there (validate names what is missing)
        return f"{per_token / 1e3:,.2f} kB per real token besides the weight maps"
    return (f"{per_token / 1e3:,.2f} kB per real token besides the weight maps "
            f"({per_token / sites:.3f}x the sites' {sites / 1e3:,.2f} kB a position)")


def _shown_model(model: dict) -> dict:
    """The model description with T5's relative-bias tables summarised (they run to thousands of numbers)."""
    relative = (model.get("score") or {}).get("relative_bias")
    if relative is None:
        return model
    summary = f"<{len(relative['tables'])} table(s) of key offsets -{relative['max_offset']}..{relative['max_offset']}>"
    return {**model, "score": {**model["score"], "relative_bias": summary}}


def _pred_line(pred: bool, model: dict) -> list[str]:
    """The info line saying why a store holds no predictions (none when it holds them)."""
    if pred:
        return []
    if not model.get("lm_head", True):
        return [f"pred      none: the model ({model.get('architecture')}) has no language-model head"]
    return ["pred      none: the job left the predictions out (pred=False), so the forward pass stopped after the "
            "last stored layer"]


def format_info(summary: dict) -> str:
    """The info summary as text for a terminal."""
    model = summary["model"] or {}
    state = "complete" if summary["complete"] else "INCOMPLETE"
    damaged = summary.get("damaged_chunks") or []
    lines = [
        f"store     {summary['url']}  (schema {summary['schema']}, {state}: "
        f"{summary['shards_done']}/{summary['shards_total']} shards{', DAMAGED' if damaged else ''})",
        *([f"damage    {len(damaged)} chunk(s) missing, of the wrong size or not files, e.g. {damaged[0]}; `validate` "
           "lists them, resuming the job that wrote the store rewrites them"] if damaged else []),
        "model     " + ", ".join(f"{k}={v}" for k, v in _shown_model(model).items()),
        "task      " + ", ".join(f"{k}={v}" for k, v in (summary["task"] or {}).items()),
        f"sites     {', '.join(summary['sites'] or [])}",
        f"layers    {summary['layers']}",
        f"samples   {summary['n_samples']} x {summary['n_pos']} positions, "
        f"{summary['samples_per_chunk']} samples per chunk",
        f"dtype     {summary['dtype']} (codec {summary['codec']})",
        f"labels    {', '.join(summary['labels'] or {}) or '-'}",
        *_pred_line(summary["pred"], model),
        f"size      {summary['size_bytes'] / 2**20:.2f} MiB on disk, of which {summary['weight_bytes'] / 2**20:.2f} MiB "
        "weight maps",
        f"tokens    {summary['real_tokens']:,} real of {summary['positions']:,} positions "
        f"({100 * summary['real_tokens'] / max(1, summary['positions']):.1f} %); {_per_token(summary)}",
        "arrays:",
    ]
    for name, array in summary["arrays"].items():
        chunk = f"{array['chunk_mb']:.3f} MB/chunk" if array["chunk_mb"] is not None else "strings"
        lines.append(
            f"  {name:<11} {array['dtype']:<8} ({', '.join(array['dims'])}) = {tuple(array['shape'])}, "
            f"chunks {tuple(array['chunks'])}, {chunk}"
        )
    provenance = summary.get("provenance") or {}
    lines.append(
        f"made by   orthosphere {provenance.get('package_version')} (commit {provenance.get('git_commit')}), "
        f"torch {provenance.get('torch_version')}, {provenance.get('created')}: {provenance.get('command')}"
    )
    return "\n".join(lines)
