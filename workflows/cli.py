"""The `orthosphere` command line: one verb per stage (info, validate, verify, train, extract, analyze, report, run,
atlas).

The options of extract, analyze and train are generated from their configurations' parameters
(``cli_options``): SPELLINGS says where a flag differs from its parameter, NOT_EXPOSED which
parameters have none. Every error is one line that names its input, parameters by the verb's flags
(the traceback only with -v). The verbs that need PyTorch (extract, verify, train, run, analyze
--online) import it when they run or show their options, so that the others work with the base
installation (`pip install orthosphere`, without the `extract` extra)."""
from __future__ import annotations

import json
import logging
import sys

import click

from orthosphere.errors import ConfigError
from orthosphere.extract import DEFAULT_BATCH_SIZE
from orthosphere.store import format_info, info, open_writer, validate
from orthosphere.store.failures import is_storage_failure

from .backend import Backend, dask_client
from .cli_options import ConfigCommand, ConfigOptions, Spelled, Spelling

EXTRA_MODULES = ("torch", "transformers", "safetensors", "gguf", "accelerate", "tqdm", "pyarrow")
"""What the `extract` extra installs."""


class CleanErrors(click.Group):
    """Every error as one line that names its input (parameters by the verb's flags), instead of a
    traceback (kept for -v)."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except Exception as error:
            if ctx.params.get("verbose"):
                raise
            spelled = Spelled(self.commands.get(ctx.invoked_subcommand or ""))
            raise click.ClickException(one_line(spelled.error(error), spelled)) from error


def one_line(error: Exception, spelled=str) -> str:
    """The error's message on one line, `spelled` (the Python names of parameters as a command
    spells them). Bad input (ValueError and its kin: every orthosphere error) and file or storage
    errors (OSError) name their input; anything else is unexpected."""
    text = spelled(" ".join(str(error).split()))
    if isinstance(error, ModuleNotFoundError) and error.name and error.name.split(".")[0] in EXTRA_MODULES:
        return (f"this needs {error.name.split('.')[0]}, which is not installed: install the extract extra "
                "(pip install 'orthosphere[extract]')")
    if is_storage_failure(error) and not isinstance(error, OSError):
        return (f"the storage failed ({type(error).__name__}: {text or 'no detail given'}): check the endpoint, the "
                "network and the credentials, then run the command again (a job: with --resume)")
    if isinstance(error, (ValueError, OSError)) and text:
        return text
    if isinstance(error, MemoryError):
        return f"out of memory ({text or 'MemoryError'}): ask for less (fewer samples, a smaller batch or fewer layers)"
    return f"unexpected {type(error).__name__}: {text} (run with -v for the traceback; please report it)"


def quiet_unretrieved_failures(record: logging.LogRecord) -> bool:
    """Drop asyncio's tracebacks of the sibling requests of a failed one (an object store's outage
    fails many at once; the first failure is the error reported). Kept with -v."""
    return "exception was never retrieved" not in record.getMessage()


def layer_list(ctx, param, text):
    """A --layers value, "0,2,5-7", as layer indices (None when not given)."""
    if text is None:
        return None
    layers = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        first, dash, last = item.partition("-")
        try:
            span = range(int(first), int(last) + 1) if dash else [int(first)]
        except ValueError:
            raise click.BadParameter(f"{text!r}: {item!r} is not a layer index or range; expected e.g. 0,2,5-7") from None
        if not span:
            raise click.BadParameter(f"{text!r}: the range {item!r} runs backwards; write it low-high, e.g. 5-7")
        layers.extend(span)
    if not layers:
        raise click.BadParameter(f"{text!r}: no layers given; expected e.g. 0,2,5-7")
    return tuple(layers)


SPELLINGS = {
    "model": Spelling(argument=True, metavar="MODEL"),
    "task": Spelling(metavar="SPEC", help=(
        "arithmetic:split=test,seed=0[,...], or a corpus packed into windows: text:path=FILE,context=N (also jsonl:, "
        "parquet:, hf:; max_length=N instead of context= for one padded sample a document).")),
    "extract.out": Spelling(metavar="STORE"),
    "extract.mode": Spelling(values={"resume": "--resume", "overwrite": "--overwrite"}, help={
        "resume": "Continue an interrupted job, skipping its complete shards.",
        "overwrite": "Replace an existing store."}),
    "n_samples": Spelling("--samples"),
    "n_shards": Spelling("--shards"),
    "layers": Spelling(metavar="LIST", parse=layer_list),
    "pred": Spelling(values={False: "--no-pred"}, help="Store no predictions: the forward pass then stops after the last of --layers."),
    "n_bootstrap": Spelling("--bootstrap"),
    "factors": Spelling("--factor", multiple=True, metavar="SPEC"),
    "weight_by_attention": Spelling(values={False: "--uniform"}, help="norms: weight tokens uniformly, not by the attention they receive."),
    "exclude_start": Spelling(values={False: "--include-start"}, help="Keep each sequence's start token."),
    "analyze.device": Spelling(default="auto", help=(
        "Where the attention kernels of norms and replay run, and the online check's model: auto (cuda where torch sees "
        "a GPU, else cpu), cpu (numpy), cpu-torch (the torch kernels on the CPU), cuda or cuda:N.")),
    "train.config": Spelling(argument=True, metavar="CONFIG", type=click.Path(dir_okay=False)),
    "train.out": Spelling(type=click.Path(file_okay=False)),
}
"""How the command line spells the parameters of the configurations whose options it generates
(ExtractJob, the analyses' configurations, TrainJob), where it differs from `--name` with dashes
("verb.name": on that verb only). Error messages name a parameter by the same spelling."""

NOT_EXPOSED = {
    "storage_options": "fsspec options of an object store: a mapping, from Python or a pipeline",
    "command": "the CLI records its own command line",
    "tokenizer": "goes with a model loaded in the same Python process",
    "progress": "the CLI always shows its progress",
}
"""The configurations' parameters that have no option, and why."""


def extract_options() -> ConfigOptions:
    from orthosphere.extract.job import ExtractJob

    return ConfigOptions(ExtractJob, SPELLINGS, NOT_EXPOSED, "extract")


def analyze_options() -> ConfigOptions:
    from orthosphere.analyze import ANALYSES

    return ConfigOptions({name: analysis.config for name, analysis in ANALYSES.items()}, SPELLINGS, NOT_EXPOSED, "analyze")


def train_options() -> ConfigOptions:
    from .train import TrainJob

    return ConfigOptions(TrainJob, SPELLINGS, NOT_EXPOSED, "train")


def backend(ctx: click.Context, workers: int | None, scheduler: str | None) -> Backend:
    """The Dask back end of these options (a contradiction is a usage error)."""
    try:
        return Backend(workers=workers, scheduler=scheduler)
    except ConfigError as error:
        raise click.UsageError(Spelled(ctx.command)(str(error))) from None


@click.group(cls=CleanErrors)
@click.option("--workers", type=int, default=None, help="Run Dask work on a LocalCluster of N worker processes.")
@click.option("--scheduler", default=None, metavar="ADDRESS", help="Run Dask work on an existing scheduler (tcp://HOST:PORT).")
@click.option("-v", "--verbose", is_flag=True, help="Log debugging detail.")
@click.version_option(package_name="orthosphere")
@click.pass_context
def main(ctx, workers, scheduler, verbose):
    """orthosphere: store what transformers compute in their attention layers, analyse it offline."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if not verbose:
        logging.getLogger("asyncio").addFilter(quiet_unretrieved_failures)
    ctx.obj = backend(ctx, workers, scheduler)


@main.command("info")
@click.argument("store")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def info_command(store, as_json):
    """Describe STORE (a path or fsspec URL): model, task, sites, shapes, chunking, size, completeness."""
    summary = info(store)
    click.echo(json.dumps(summary, indent=2, default=str) if as_json else format_info(summary))


@main.command("validate")
@click.argument("store")
@click.option("--full", is_flag=True, help="Also decode every chunk, checksums included (reads the whole store).")
@click.option("--reopen", is_flag=True,
              help="Mark the shards that hold damaged chunks unfinished, so that resuming the job rewrites them.")
@click.option("--break-lock", is_flag=True, help="With --reopen: break the store's lock even if its holder looks alive.")
def validate_command(store, full, reopen, break_lock):
    """Check STORE against the schema, and that every chunk it promises is there and of its size (--full: decodes)."""
    problems = validate(store, full=full)
    for problem in problems:
        click.echo(problem)
    if reopen and problems:
        with open_writer(store, break_lock=break_lock) as writer:
            damage = writer.find_damage(decode=full)
            if damage:
                shards = writer.reopen(damage)
                click.echo(f"reopened shard(s) {shards}: resume the job that wrote {store} (its command, with "
                           "--resume) to rewrite them")
                return
    if problems:
        raise click.ClickException(f"store {store} has {len(problems)} problem(s), listed above")
    click.echo(f"store {store} is valid" + (": every chunk decodes" if full else ": every chunk is there"))


@main.command("verify")
@click.argument("store")
@click.argument("model", required=False)
@click.option("--samples", type=int, default=8, show_default=True, help="Samples to recompute, drawn at random.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the samples drawn.")
@click.option("--batch-size", type=int, default=DEFAULT_BATCH_SIZE, show_default=True,
              help="The extraction's batch size: each sample is recomputed in the batch the job ran it in.")
@click.option("--exact", is_flag=True, help="Demand bitwise equality (a store written on this kind of machine).")
@click.option("--device", default="auto", show_default=True, help="Where the model runs: auto, cpu, cuda or cuda:N.")
def verify_command(store, model, samples, seed, batch_size, exact, device):
    """Recompute random samples of STORE with MODEL (default: the path the store records) and compare them with the
    stored values, per site and layer; check the recorded SHA-256 of the model's weights and the corpus."""
    from orthosphere.extract.verify import verify

    report = verify(store, model, samples=samples, seed=seed, batch_size=batch_size, exact=exact, device=device)
    click.echo(report.format())
    if not report.ok:
        raise click.ClickException(f"store {store} is not verified: {'; '.join(report.failures()[:3])}")


@main.command("extract", cls=ConfigCommand, options=extract_options)
@click.option("--workers", type=int, default=None, help="Run the shards on a LocalCluster of N worker processes.")
@click.option("--scheduler", default=None, metavar="ADDRESS", help="Run the shards on an existing Dask scheduler.")
@click.pass_context
def extract_command(ctx, workers, scheduler, **given):
    """Run MODEL (a model directory or .gguf file) over a task and store its activations in STORE."""
    from orthosphere.extract.job import ExtractJob, run_job

    parameters = ctx.command.options.values(given)
    job = ExtractJob(**parameters, command=" ".join(sys.argv))
    with dask_client(backend(ctx, workers or ctx.obj.workers, scheduler or ctx.obj.scheduler)) as client:
        result = run_job(job, client=client)
    click.echo(result.summary())


@main.command("analyze", cls=ConfigCommand, options=analyze_options)
@click.argument("store")
@click.option("--out", required=True, metavar="RESULTS", help="Where to write the results tree: a path or fsspec URL.")
@click.option("--only", default=None, metavar="LIST",
              help="Comma-separated analyses, default all: accuracy,norms,subspaces,spheres,neighbours,norm_geometry,replay.")
@click.option("--option", "extra", multiple=True, metavar="KEY=VALUE",
              help="Any option as KEY=VALUE, e.g. mass=0.8, or one analysis's, e.g. replay.levels=[0.01,0.1] (repeat).")
@click.option("--overwrite", is_flag=True, help="Replace results of another store at RESULTS.")
@click.option("--online", "online_model", default=None, metavar="MODEL",
              help="replay: inject the same noise into MODEL (the store's model) too: accuracy and collapses "
                   "under noise, one layer at a time and in all layers, in /replay/online.")
@click.option("--online-samples", type=int, default=None, help="Samples the online check runs (default: all).")
@click.pass_context
def analyze_command(ctx, store, out, only, extra, overwrite, online_model, online_samples, **given):
    """Analyse STORE (accuracy, norm spread, factor subspaces, spheres, neighbours, norm geometry, replay) into the
    DataTree RESULTS. An option several analyses take goes to each of them (default: each its own)."""
    from orthosphere.analyze import ANALYSES
    from orthosphere.analyze.options import parse_assignment, parse_options
    from orthosphere.analyze.results import get_analysis

    from .analysis import analyze_with_online_check

    options = ctx.command.options.values(given)
    device = options.pop("device")
    options.update(parse_options(extra, ANALYSES.values()))
    chosen = ANALYSES if only is None else only.split(",")
    if "device" not in options and any("device" in get_analysis(name).defaults for name in chosen):
        options["device"] = parse_assignment(f"device={device}", ANALYSES.values())[1]
    with dask_client(ctx.obj):
        tree = analyze_with_online_check(store, out, online_model=online_model, online_samples=online_samples,
                                         online_device="cpu" if device == "cpu-torch" else device,
                                         overwrite=overwrite, analyses=None if only is None else only.split(","),
                                         options=options, command=" ".join(sys.argv))
    click.echo(f"wrote {', '.join('/' + name for name in tree.children)} to {out}")


@main.command("train", cls=ConfigCommand, options=train_options)
@click.pass_context
def train_command(ctx, **given):
    """Train an arithmetic transformer from CONFIG (TOML) into --out."""
    from .train import train

    metrics = train(**ctx.command.options.values(given))
    click.echo(json.dumps(metrics.get("final", metrics), indent=2, default=str))


@main.command("report")
@click.argument("results", nargs=-1, required=True)
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Folder for report.html, report.md and figures/.")
@click.option("--title", default="orthosphere report", show_default=True)
def report_command(results, out, title):
    """Write an HTML and Markdown report with figures from one or more RESULTS of `orthosphere analyze`."""
    from .report import write_report

    folder = write_report(results, out, title=title)
    click.echo(f"report written to {folder / 'report.html'} and {folder / 'report.md'}")


@main.command("run")
@click.argument("config", type=click.Path(dir_okay=False))
@click.option("--force", is_flag=True, help="Redo every step, even those already complete.")
@click.option("--root", default=None, help="Override the config's output root (a path or fsspec URL).")
@click.option("--break-lock", is_flag=True,
              help="Break the locks of the pipeline's stores even if their holders look alive (a stale lock is broken anyway).")
@click.pass_context
def run_command(ctx, config, force, root, break_lock):
    """Run the pipeline in CONFIG (TOML): train, extract, analyse, report; complete steps are skipped."""
    from .pipeline import load_pipeline, run_pipeline

    pipeline = load_pipeline(config, root=root)
    backend = ctx.obj if (ctx.obj.workers or ctx.obj.scheduler) else None
    folder = run_pipeline(pipeline, force=force, backend=backend, break_lock=break_lock)
    click.echo(f"report: {folder / 'report.html'}")


@main.command("atlas")
@click.argument("config", type=click.Path(dir_okay=False))
@click.option("--force", is_flag=True, help="Redo every model's extraction and analyses, even those already complete.")
@click.option("--root", default=None, help="Override the config's output root (a local folder).")
@click.pass_context
def atlas_command(ctx, config, force, root):
    """Extract, analyse and compare the models of CONFIG (TOML) over one corpus: atlas.zarr, atlas.md, atlas.png."""
    from .atlas import load_atlas, run_atlas

    atlas = load_atlas(config, root=root)
    with dask_client(ctx.obj) as client:
        folder = run_atlas(atlas, force=force, client=client)
    click.echo(f"atlas: {folder / 'atlas.md'}, {folder / 'atlas.zarr'}, {folder / 'atlas.png'}")
