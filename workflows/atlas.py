"""The atlas: many checkpoints over one corpus, extracted, analysed and compared in one command.

``orthosphere atlas CONFIG.toml`` (or ``orthosphere.atlas(models, corpus, out)`` from Python) extracts
packed windows of the corpus per model (resumable, as every job), runs the analyses (norms, subspaces,
spheres, neighbours, norm_geometry, replay) and writes one comparison under the output root:

    stores/NAME.zarr, results/NAME.zarr   each model's store and results (skipped when complete)
    results/NAME.zarr.request.json        the analyses and options that made them (changed: made again)
    atlas.zarr                            one DataTree: the table at the root (dim ``model``), each
                                          model's results as the group NAME (``xr.open_datatree``)
    atlas.md, atlas.csv                   the table, one row per model (``atlas_table.py``)
    atlas.png                             the models overlaid on a relative-depth axis

A model that fails (it does not load, its corpus is too short, it has no tokenizer ...) is logged
and named in the table with its error; the others still complete. When every model fails the
command fails with their errors.

A config::

    name = "atlas"
    root = "runs/atlas"                   # relative to the current directory, as `orthosphere run`'s
    [corpus]
    task = "text:path=../data/corpus.txt,context=256"   # paths relative to the config's folder
    samples = 64
    [[models]]
    name = "smollm2"                      # default: the file or folder name without suffix
    path = "/models/SmolLM2-135M-Instruct.Q4_1.gguf"
    [[models]]
    name = "pre"
    path = "../models/pre"
    task = "arithmetic:split=test,seed=1" # a model's own data (the arithmetic family reads no text)
    samples = 256
    [extract]                             # as `orthosphere run`'s
    [analyze]                             # only = [...], and [analyze.options]
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from orthosphere.errors import ConfigError

from .analysis import analyse_and_record, analysis_request, kept_results
from .pipeline import (
    _analysis_options,
    _check_keys,
    _extract_settings,
    _table,
    _task_data,
    analysis_names,
    config_samples,
    config_text,
    read_config,
)

log = logging.getLogger("orthosphere.atlas")

TOP_LEVEL_KEYS = {"name", "root", "corpus", "models", "extract", "analyze"}
MODEL_KEYS = {"name", "path", "task", "samples"}
CORPUS_KEYS = {"task", "samples"}
DEFAULT_OPTIONS = {"replay": {"n_draws": 8, "smooth_draws": 0}}
"""The analyses' options unless the config sets them: the replay's draws kept few, as the atlas runs many models,
and its smooth summaries (total variation, output change) left out: the atlas compares collapse levels, Theorem 7's
recall and precision and the share of sparse attention, and the perturbed softmax of every instance at every level
that the summaries need was about 40 % of a language model's analyses (``replay.smooth_draws=2`` in
[analyze.options] brings them back)."""


@dataclass(frozen=True)
class AtlasModel:
    """One model of the atlas: `model` a path (a model directory, a .gguf file, an orthosphere
    checkpoint) or a model loaded in this process (with its `tokenizer` for a text corpus); `task` and
    `samples` replace the atlas's corpus for this model (the arithmetic family's own task)."""

    name: str
    model: object
    tokenizer: object = None
    task: object = None
    samples: int | None = None


@dataclass(frozen=True)
class Atlas:
    name: str
    root: Path
    models: tuple[AtlasModel, ...]
    corpus: object
    samples: int | None
    extract: dict = field(default_factory=dict)
    only: tuple[str, ...] | None = None
    options: dict = field(default_factory=dict)

    def store(self, model: AtlasModel) -> Path:
        return self.root / "stores" / f"{model.name}.zarr"

    def results(self, model: AtlasModel) -> Path:
        return self.root / "results" / f"{model.name}.zarr"


def with_defaults(options: dict, only) -> dict:
    """The options (nested) with DEFAULT_OPTIONS where they do not set them, for the chosen analyses (`only`, None: all)."""
    defaults = {name: values for name, values in DEFAULT_OPTIONS.items() if only is None or name in only}
    return options | {name: values | options.get(name, {}) for name, values in defaults.items()}


def model_name(model) -> str:
    """The default name of a model given by its path: the file or folder name without suffix."""
    if isinstance(model, (str, os.PathLike)):
        return Path(model).stem
    raise ConfigError(f"a model loaded in this session ({type(model).__name__}) needs a name: pass the models as a "
                     "dict {name: model}")


def check_names(models: list[AtlasModel], where: str = "atlas models") -> None:
    """Each name once, and usable as a folder name and as a group of atlas.zarr beside the table's variables."""
    from .atlas_table import TABLE_VARIABLES

    seen: dict[str, int] = {}
    for model in models:
        if not isinstance(model.name, str) or not model.name or "/" in model.name or model.name.startswith("."):
            raise ConfigError(f"{where}: model name {model.name!r}: expected a string without '/' that does not start with '.'")
        if model.name in ("model", *TABLE_VARIABLES):
            raise ConfigError(f"{where}: model name {model.name!r} is the name of a column of the atlas's table (atlas.zarr "
                              "holds both at its root): give the model another `name`")
        seen[model.name] = seen.get(model.name, 0) + 1
    twice = sorted(name for name, count in seen.items() if count > 1)
    if twice:
        raise ConfigError(f"{where}: two or more models are named {twice}: give each model its own `name`")


def load_atlas(path, root: str | None = None) -> Atlas:
    """Parse and check an atlas config (every error names the file and key); `root` overrides its root."""
    path = Path(path)
    values = read_config(path, "atlas", "workflows/configs/atlas.toml", TOP_LEVEL_KEYS)
    here = path.resolve().parent
    corpus = _table(values, "corpus", path, CORPUS_KEYS)
    if "task" not in corpus:
        raise ConfigError(f"{path} [corpus]: needs `task`, a corpus spec such as 'text:path=corpus.txt,context=256'")
    entries = values.get("models")
    if not isinstance(entries, list) or not entries or not all(isinstance(entry, dict) for entry in entries):
        raise ConfigError(f"{path}: needs one [[models]] table per model, each with `path`")
    models = [_model_entry(number, entry, here, path) for number, entry in enumerate(entries)]
    check_names(models, str(path))
    analyze = _table(values, "analyze", path, {"only", "options"})
    only = analysis_names(analyze, path)
    options = with_defaults(_analysis_options(analyze.get("options", {}), only, path), only)
    return Atlas(
        name=config_text(values, "name", path, path.stem), root=Path(root or config_text(values, "root", path, f"runs/{path.stem}")),
        models=tuple(models), corpus=_task_data(corpus["task"], here, f"{path} [corpus]"),
        samples=config_samples(corpus.get("samples"), f"{path} [corpus] samples"),
        extract=_extract_settings(_table(values, "extract", path), path), only=None if only is None else tuple(only),
        options=options,
    )


def _model_entry(number: int, entry: dict, here: Path, path: Path) -> AtlasModel:
    where = f"{path} [[models]] #{number + 1}"
    _check_keys(entry, MODEL_KEYS, where)
    if not isinstance(entry.get("path"), str):
        raise ConfigError(f"{where}: needs `path`, a model directory or .gguf file")
    model = here / entry["path"]
    task = _task_data(entry["task"], here, where) if "task" in entry else None
    return AtlasModel(name=entry.get("name", model_name(model)), model=model, task=task,
                      samples=config_samples(entry.get("samples"), f"{where} samples"))


def run_atlas(atlas: Atlas, *, force: bool = False, client=None) -> Path:
    """Extract and analyse every model (complete steps skipped unless `force`), then write the
    comparison (see the module docstring); returns the output root. A model that fails is logged and
    named in the table; when every model fails, ConfigError names each failure."""
    from .atlas_table import write_comparison

    if atlas.root.exists() and not atlas.root.is_dir():
        raise ConfigError(f"atlas {atlas.name}: its output root {atlas.root} is a file: give a folder (the config's `root`, "
                          "or --root)")
    atlas.root.mkdir(parents=True, exist_ok=True)
    outcomes = {}
    for model in atlas.models:
        log.info("atlas %s: model %s", atlas.name, model.name)
        try:
            outcomes[model.name] = _extract_and_analyse(atlas, model, force, client)
        except Exception as error:  # noqa: BLE001 -- one model's failure, whatever it is, must not stop the others
            message = f"{type(error).__name__}: {error}"
            log.error("atlas %s: model %s failed: %s", atlas.name, model.name, message)
            outcomes[model.name] = message
    failed = {name: outcome for name, outcome in outcomes.items() if isinstance(outcome, str)}
    if len(failed) == len(outcomes):  # nothing to compare: a comparison written before stays as it was
        raise ConfigError(f"every model of atlas {atlas.name} failed: "
                         + "; ".join(f"{name}: {message}" for name, message in failed.items()))
    write_comparison(atlas, outcomes)
    return atlas.root


def _extract_and_analyse(atlas: Atlas, model: AtlasModel, force: bool, client) -> dict:
    """The model's store and results (each made unless complete, or with `force`), and the seconds each took
    (NaN for a step skipped)."""
    from orthosphere.analyze import ANALYSES, analyze
    from orthosphere.errors import JobMismatchError
    from orthosphere.extract.job import ExtractJob, run_job

    store, results = atlas.store(model), atlas.results(model)
    samples = model.samples if model.samples is not None or model.task is not None else atlas.samples
    job = ExtractJob(model=str(model.model) if isinstance(model.model, os.PathLike) else model.model,
                     task=model.task or atlas.corpus, out=str(store), n_samples=samples, **atlas.extract,
                     tokenizer=model.tokenizer, mode="overwrite" if force else "resume", command=f"orthosphere atlas ({atlas.name})")
    try:
        extracted = run_job(job, client=client, progress=False)
    except JobMismatchError as error:
        raise error.advised("in the atlas: rerun with --force (force=True from Python) to redo every model with this "
                            "config, or give another root") from None
    log.info("%s", extracted.summary())
    extract_seconds = float("nan") if extracted.already_complete else extracted.seconds
    analyse_seconds = float("nan")
    request = _request(atlas)
    if force or not kept_results(results, request, atlas.only or set(ANALYSES) - {"accuracy"}):
        started = time.perf_counter()
        analyse_and_record(results, request, lambda: analyze(str(store), str(results), analyses=list(atlas.only) if atlas.only else None,
                                                             overwrite=True, command=f"orthosphere atlas ({atlas.name})", **atlas.options))
        analyse_seconds = time.perf_counter() - started
    else:
        log.info("atlas %s: model %s: the results at %s are complete, with the same analyses and options: kept",
                 atlas.name, model.name, results)
    return {"store": store, "results": results, "extract_seconds": extract_seconds, "analyse_seconds": analyse_seconds}


def _request(atlas: Atlas) -> str:
    """The analyses and options asked for, as the text recorded beside each model's results."""
    return analysis_request(only=atlas.only, options=atlas.options)


def atlas(models, corpus, out, *, samples: int | None = None, analyses=None, options: dict | None = None,
          force: bool = False, client=None, **extract_options) -> Path:
    """The atlas from Python: `models` a path, a list of paths, or a dict name -> path, loaded model, or
    (model, tokenizer); `corpus` a task spec or data object (``orthosphere.corpus.text(...)``);
    `out` the output root; `samples` windows per model; `analyses`, `options` the analyses and their
    options (as ``orthosphere.analyze`` takes them: an analysis's own in a dict under its name); other
    keywords are the extraction's (``sites``, ``dtype``, ``batch_size`` ...).
    Returns the output root (open ``atlas.zarr`` there with ``xr.open_datatree``)."""
    from orthosphere.extract.data import parse_task
    from orthosphere.extract.job import ExtractJob

    if isinstance(models, (str, os.PathLike)) or not isinstance(models, (dict, list, tuple)):
        models = [models]  # one model
    if isinstance(analyses, str):
        analyses = [analyses]
    samples = config_samples(samples, "atlas samples")
    entries = []
    for name, given in (models.items() if isinstance(models, dict) else ((model_name(m), m) for m in models)):
        model, tokenizer = given if isinstance(given, tuple) else (given, None)
        entries.append(AtlasModel(name=name, model=os.fspath(model) if isinstance(model, os.PathLike) else model,
                                  tokenizer=tokenizer))
    if not entries:
        raise ConfigError("atlas models: expected at least one model (a path, or name -> model)")
    if analyses is not None and not analyses:
        raise ConfigError("atlas analyses=[]: expected some analysis names, or None for every analysis")
    check_names(entries)
    from orthosphere.analyze.options import nested
    from orthosphere.analyze.results import ANALYSES, configure, get_analysis

    options = nested(dict(options or {}), ANALYSES.values())
    configure([get_analysis(name) for name in (analyses or ANALYSES)], options)
    spec = Atlas(name=Path(out).name, root=Path(out), models=tuple(entries),
                 corpus=parse_task(corpus) if isinstance(corpus, str) else corpus, samples=samples,
                 extract=ExtractJob.check_some(extract_options), only=None if analyses is None else tuple(analyses),
                 options=with_defaults(options, analyses))
    return run_atlas(spec, force=force, client=client)
