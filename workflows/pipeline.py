"""Pipelines: `orthosphere run CONFIG.toml` trains, extracts, analyses and reports in one go.

A pipeline config names the models (a checkpoint to use, or a training config to train it
from), the data (task specs and sample counts), the sites, the analyses with their options,
the Dask back end and the output root. Every step skips itself when its output is already
complete, so a rerun after a crash continues where it stopped; `force` redoes every step.

Layout under the output root:
    models/NAME/                 trained checkpoints (models with `train = ...`)
    stores/NAME-DATA.zarr        one store per model and data set
    results/NAME-DATA.zarr       the analyses of that store (an xarray DataTree)
    results/NAME-DATA.zarr.request.json   the analyses and options that made them (changed: made again)
    report/                      report.html, report.md and the figures

Paths of models and training configs are relative to the pipeline config's folder; the output
root is relative to the current directory, or any fsspec URL (stores and results then live in
object storage; models and the report stay on local disk under `local_root`).
"""
from __future__ import annotations

import logging
import shutil
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from orthosphere.errors import ConfigError

if TYPE_CHECKING:
    from orthosphere.extract.data import ArithmeticData, CorpusData

from .backend import Backend, dask_client

log = logging.getLogger("orthosphere.pipeline")

TOP_LEVEL_KEYS = {"name", "root", "local_root", "backend", "models", "data", "extract", "analyze", "report"}
EXTRACT_KEYS = {"sites": "sites", "layers": "layers", "dtype": "dtype", "batch_size": "batch_size", "shards": "n_shards",
                "device": "device", "model_dtype": "model_dtype"}
"""The keys of an [extract] table, each with the ExtractJob parameter it sets."""
ANALYZE_KEYS = {"only", "options", "online", "online_samples"}
REPORT_KEYS = {"title"}


@dataclass(frozen=True)
class ModelEntry:
    name: str
    path: Path
    train: Path | None = None
    seed: int | None = None


@dataclass(frozen=True)
class DataEntry:
    name: str
    task: ArithmeticData | CorpusData
    """The task spec, parsed when the pipeline is loaded (a corpus's path made absolute)."""
    samples: int | None


@dataclass(frozen=True)
class Pipeline:
    """A parsed pipeline config."""

    name: str
    root: str
    local_root: Path
    backend: Backend
    models: tuple[ModelEntry, ...]
    data: tuple[DataEntry, ...]
    extract: dict = field(default_factory=dict)
    """ExtractJob parameters of the [extract] table, checked."""
    analyze_only: tuple[str, ...] | None = None
    analyze_options: dict = field(default_factory=dict)
    online: tuple[str, ...] = ()
    online_samples: int | None = None
    title: str = "orthosphere report"

    def store_url(self, model: ModelEntry, data: DataEntry) -> str:
        return _join(self.root, f"stores/{model.name}-{data.name}.zarr")

    def results_url(self, model: ModelEntry, data: DataEntry) -> str:
        return _join(self.root, f"results/{model.name}-{data.name}.zarr")

    @property
    def report_dir(self) -> Path:
        return self.local_root / "report"


def _join(root: str, relative: str) -> str:
    return f"{root.rstrip('/')}/{relative}"


def _analysis_options(options, only, path: Path) -> dict:
    """The [analyze.options] table in the nested form ("replay.n_draws" as {"replay": {"n_draws": ...}}),
    checked now against the chosen analyses' configurations (so that a bad value stops the pipeline
    before it extracts anything); errors name the file, table and key."""
    from orthosphere.analyze.options import nested
    from orthosphere.analyze.results import ANALYSES, configure, get_analysis
    from orthosphere.errors import AnalysisError, ParameterError

    where = f"{path} [analyze.options]"
    if not isinstance(options, dict):
        raise ConfigError(f"{where}: expected a table of options, e.g. \"replay.n_draws\" = 32")
    options = nested(options, ANALYSES.values())
    try:
        configure([get_analysis(name) for name in (only or ANALYSES)], options)
    except ParameterError as error:
        raise error.in_table(where, f'"{error.label}"' if "." in error.label else error.label) from None
    except AnalysisError as error:
        raise ConfigError(f"{where}: {error}") from None
    return options


def _extract_settings(table: dict, path: Path) -> dict:
    """The [extract] table as ExtractJob parameters, checked now by the job's own constraints."""
    from orthosphere.errors import ParameterError
    from orthosphere.extract.job import ExtractJob

    _check_keys(table, EXTRACT_KEYS, f"{path} [extract]")
    keys = {EXTRACT_KEYS[key]: key for key in table}
    try:
        return ExtractJob.check_some({parameter: table[key] for parameter, key in keys.items()})
    except ParameterError as error:
        raise error.in_table(f"{path} [extract]", keys[error.parameter]) from None


def _check_keys(found: dict, allowed, where: str) -> None:
    unknown = sorted(set(found) - set(allowed))
    if unknown:
        raise ConfigError(f"{where}: unknown keys {unknown}; expected some of {sorted(allowed)}")


def read_config(path: Path, kind: str, example: str, keys) -> dict:
    """A `kind` config's TOML values, its top-level keys checked against `keys` (errors name the file)."""
    if not path.is_file():
        raise ConfigError(f"{kind} config {path} not found: pass the path of a TOML file such as {example}")
    try:
        values = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{kind} config {path} is not valid TOML: {error}") from None
    _check_keys(values, keys, str(path))
    return values


def load_pipeline(path, root: str | None = None) -> Pipeline:
    """Parse and check a pipeline config; `root` overrides its output root."""
    path = Path(path)
    values = read_config(path, "pipeline", "workflows/configs/quickstart.toml", TOP_LEVEL_KEYS)
    here = path.resolve().parent
    models = tuple(_model_entry(name, entry, here, path) for name, entry in _table(values, "models", path).items())
    data = tuple(_data_entry(name, entry, here, path) for name, entry in _table(values, "data", path).items())
    if not models or not data:
        raise ConfigError(f"{path}: needs at least one [models.NAME] and one [data.NAME] table")
    extract = _extract_settings(_table(values, "extract", path), path)
    analyze = _table(values, "analyze", path, ANALYZE_KEYS)
    report = _table(values, "report", path, REPORT_KEYS)
    only = analysis_names(analyze, path)
    if analyze.get("online") and only is not None and "replay" not in only:
        raise ConfigError(f"{path} [analyze]: the online check repeats the replay's noise; add \"replay\" to `only`")
    name = config_text(values, "name", path, path.stem)
    root = root or config_text(values, "root", path, f"runs/{name}")
    local_root = Path(config_text(values, "local_root", path, root if "://" not in root else f"runs/{path.stem}"))
    return Pipeline(
        name=name,
        root=root,
        local_root=local_root,
        backend=_backend(_table(values, "backend", path, {"workers", "scheduler"}), path),
        models=models,
        data=data,
        extract=extract,
        analyze_only=tuple(only) if only is not None else None,
        analyze_options=_analysis_options(analyze.get("options", {}), only, path),
        online=_online_data(analyze.get("online", []), data, path),
        online_samples=analyze.get("online_samples"),
        title=config_text(report, "title", f"{path} [report]", f"orthosphere report: {name}"),
    )


def config_text(values: dict, key: str, where, default: str) -> str:
    """The config's text value `key` (`default` when absent), refused unless a non-empty string."""
    value = values.get(key, default)
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: `{key}` = {value!r}: expected a non-empty string in quotes, e.g. {key} = {default!r}")
    return value


def config_samples(value, where: str) -> int | None:
    """A config's sample count: absent (None) or a positive integer."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ConfigError(f"{where} = {value!r}: expected a positive number of samples")
    return value


def analysis_names(analyze: dict, path: Path) -> list[str] | None:
    """The [analyze] table's `only`: None (every analysis), or a non-empty list of known analysis names."""
    from orthosphere.analyze.results import ANALYSES

    only = analyze.get("only")
    if only is None:
        return None
    where = f"{path} [analyze] only = {only!r}"
    if not isinstance(only, list) or not only or not all(isinstance(name, str) for name in only):
        raise ConfigError(f'{where}: expected a non-empty list of analysis names, e.g. ["norms"] (leave `only` out for '
                          "every analysis)")
    unknown = [name for name in only if name not in ANALYSES]
    if unknown:
        raise ConfigError(f"{where}: unknown analyses {unknown}; expected some of {sorted(ANALYSES)}")
    return only


def _table(values: dict, name: str, path: Path, allowed: set | None = None) -> dict:
    """The config's table `name` (empty when absent), checked to be a table with allowed keys."""
    table = values.get(name, {})
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: `{name}` = {table!r}: expected a table ([{name}] or [{name}.NAME])")
    if allowed is not None:
        _check_keys(table, allowed, f"{path} [{name}]")
    return dict(table)


def _backend(values: dict, path: Path) -> Backend:
    workers, scheduler = values.get("workers") or None, values.get("scheduler")
    if workers is not None and (not isinstance(workers, int) or isinstance(workers, bool) or workers < 1):
        raise ConfigError(f"{path} [backend] workers = {workers!r}: expected a number of worker processes (0: none)")
    if scheduler is not None and not isinstance(scheduler, str):
        raise ConfigError(f"{path} [backend] scheduler = {scheduler!r}: expected an address such as \"tcp://host:8786\"")
    if workers and scheduler:
        raise ConfigError(f"{path} [backend]: give workers (a LocalCluster) or scheduler (a cluster), not both")
    return Backend(workers=workers, scheduler=scheduler)


def _online_data(names, data: tuple[DataEntry, ...], path: Path) -> tuple[str, ...]:
    """The data sets whose stores also get the online check (the replay's noise in the model)."""
    unknown = sorted(set(names) - {entry.name for entry in data})
    if unknown:
        raise ConfigError(f"{path} [analyze] online names {unknown}, which are not data sets of the pipeline "
                          f"({[entry.name for entry in data]})")
    return tuple(names)


def _model_entry(name: str, entry: dict, here: Path, path: Path) -> ModelEntry:
    if not isinstance(entry, dict):
        raise ConfigError(f"{path} [models.{name}]: expected a table with `path` or `train`")
    _check_keys(entry, {"path", "train", "seed"}, f"{path} [models.{name}]")
    if "path" not in entry and "train" not in entry:
        raise ConfigError(f"{path} [models.{name}]: give `path` (a checkpoint) or `train` (a training config)")
    if "seed" in entry and "train" not in entry:
        raise ConfigError(f"{path} [models.{name}]: `seed` replaces a training config's seed; give it with `train`")
    train = _training_config(here / entry["train"], entry.get("seed"), f"{path} [models.{name}]") if "train" in entry else None
    return ModelEntry(name=name, path=here / entry["path"] if "path" in entry else Path(), train=train,
                      seed=entry.get("seed"))


def _training_config(train: Path, seed, where: str) -> Path:
    """The model's training config, checked now with the model's seed as the train step will read it
    (so that a bad one stops the pipeline before any model trains)."""
    from .train import load_config

    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
        raise ConfigError(f"{where} seed = {seed!r}: expected a non-negative integer (it replaces the seed of the training "
                          f"config {train})")
    try:
        load_config(train, seed)
    except ConfigError as error:
        raise ConfigError(f"{where}: {error}") from None
    return train


def _data_entry(name: str, entry: dict, here: Path, path: Path) -> DataEntry:
    if not isinstance(entry, dict):
        raise ConfigError(f"{path} [data.{name}]: expected a table with `task` and `samples`")
    _check_keys(entry, {"task", "samples"}, f"{path} [data.{name}]")
    if "task" not in entry:
        raise ConfigError(f"{path} [data.{name}]: needs `task`, a task spec such as 'arithmetic:split=test,seed=1'")
    where = f"{path} [data.{name}]"
    return DataEntry(name=name, task=_task_data(entry["task"], here, where), samples=config_samples(entry.get("samples"), f"{where} samples"))


def _task_data(spec: str, here: Path, where: str):
    """The task spec parsed (by the one parser of task specs) now, a corpus's path taken relative to
    the pipeline config's folder."""
    from orthosphere.extract.data import CorpusData, parse_task

    if not isinstance(spec, str):
        raise ConfigError(f"{where} task = {spec!r}: expected a task spec string, e.g. \"text:path=corpus.txt,context=256\" "
                          "or \"arithmetic:split=test,seed=1\"")
    try:
        data = parse_task(spec)
    except ConfigError as error:
        raise ConfigError(f"{where} task = {spec!r}: {error}") from None
    return replace(data, path=str((here / data.path).resolve())) if isinstance(data, CorpusData) else data


def run_pipeline(pipeline: Pipeline, force: bool = False, backend: Backend | None = None,
                 break_lock: bool = False) -> Path:
    """Run every step that is not complete yet (all of them with `force`); returns the report folder.
    `break_lock` breaks the locks of the stores even where their holders look alive."""
    from orthosphere.extract.job import ExtractJob

    from .report import write_report
    from .train import train

    models = [_trained(model, pipeline, force, train) for model in pipeline.models]
    results = []
    with dask_client(backend or pipeline.backend) as client:
        for model in models:
            for data in pipeline.data:
                store = pipeline.store_url(model, data)
                job = ExtractJob(
                    model=str(model.path), task=data.task, out=store, n_samples=data.samples, **pipeline.extract,
                    mode="overwrite" if force else "resume", break_lock=break_lock, command=f"orthosphere run ({pipeline.name})",
                )
                log.info(_extracted(job, client).summary())
                online = model.path if data.name in pipeline.online else None
                results.append(_analysed(store, pipeline.results_url(model, data), pipeline, force, online))
    return write_report(results, pipeline.report_dir, title=pipeline.title)


def _extracted(job, client):
    """The pipeline's extraction job run (resumed); a store made by another job (its model, data or
    samples changed in the config) gets the pipeline's advice."""
    from orthosphere.errors import JobMismatchError
    from orthosphere.extract.job import run_job

    try:
        return run_job(job, client=client, progress=False)
    except JobMismatchError as error:
        raise error.advised(f"in a pipeline: rerun with `orthosphere run --force` (force=True from Python) to redo every "
                            f"step, or delete {job.out} to make only this store again") from None


def _trained(model: ModelEntry, pipeline: Pipeline, force: bool, train) -> ModelEntry:
    """Train the model when its entry asks for it (resuming an interrupted run); else use its path."""
    if model.train is None:
        return model
    out = pipeline.local_root / "models" / model.name
    if force and out.exists():
        shutil.rmtree(out)
    log.info("training %s from %s into %s", model.name, model.train, out)
    train(model.train, out, resume=out.exists(), progress=False, seed=model.seed)
    return ModelEntry(name=model.name, path=out, train=model.train, seed=model.seed)


def _analysed(store: str, out: str, pipeline: Pipeline, force: bool, online_model: Path | None) -> str:
    """Run the analyses (and the online check with `online_model`) unless results of this store made
    with the same analyses and options are complete (the request recorded beside them, as the atlas does)."""
    from orthosphere.analyze import ANALYSES
    from orthosphere.extract.job import ExtractJob

    from .analysis import analyse_and_record, analysis_request, analyze_with_online_check, kept_results

    online = online_model is not None
    request = analysis_request(only=pipeline.analyze_only, options=pipeline.analyze_options, online=online,
                               online_samples=pipeline.online_samples if online else None)
    if not force and kept_results(out, request, pipeline.analyze_only or ANALYSES, online):
        log.info("results %s are complete, with the same analyses and options: kept (skipping the analyses)", out)
        return out
    log.info("analysing %s into %s", store, out)
    analyse_and_record(out, request, lambda: analyze_with_online_check(
        store, out, online_model=online_model, online_samples=pipeline.online_samples,
        online_device=pipeline.extract.get("device", ExtractJob.defaults()["device"]), overwrite=True,
        analyses=list(pipeline.analyze_only) if pipeline.analyze_only else None, options=pipeline.analyze_options,
        command=f"orthosphere run ({pipeline.name})"))
    return out
