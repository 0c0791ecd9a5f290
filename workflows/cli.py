"""The `orthosphere` command line: one verb per stage (info, train, extract, analyze, report, run)."""
from __future__ import annotations

import json
import logging
import sys

import click

from orthosphere.store import StoreError, format_info, info

from .backend import Backend, dask_client


class CleanErrors(click.Group):
    """Print a user's input errors as one clear line instead of a traceback."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (StoreError, ValueError, FileNotFoundError, FileExistsError) as error:
            raise click.ClickException(str(error)) from error


@click.group(cls=CleanErrors)
@click.option("--workers", type=int, default=None, help="Run Dask work on a LocalCluster of N worker processes.")
@click.option("--scheduler", default=None, metavar="ADDRESS", help="Run Dask work on an existing scheduler (tcp://HOST:PORT).")
@click.option("-v", "--verbose", is_flag=True, help="Log debugging detail.")
@click.version_option(package_name="orthosphere")
@click.pass_context
def main(ctx, workers, scheduler, verbose):
    """orthosphere: store what transformers compute in their attention layers, analyse it offline."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    ctx.obj = Backend(workers=workers, scheduler=scheduler)


@main.command("info")
@click.argument("store")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def info_command(store, as_json):
    """Describe STORE (a path or fsspec URL): model, task, sites, shapes, chunking, size, completeness."""
    summary = info(store)
    click.echo(json.dumps(summary, indent=2, default=str) if as_json else format_info(summary))


@main.command("extract")
@click.argument("model")
@click.option("--task", "task_spec", required=True, metavar="SPEC",
              help="arithmetic:split=test,seed=0[,...], or a corpus packed into windows: text:path=FILE,context=N "
                   "(also jsonl:, parquet:, hf:; max_length=N instead of context= for one padded sample a document).")
@click.option("--samples", type=int, default=None, help="Number of samples (a corpus: default all its windows or documents).")
@click.option("--out", required=True, metavar="STORE", help="The store to write: a path or fsspec URL.")
@click.option("--sites", default=None, metavar="LIST",
              help="Comma-separated sites, default all but pattern: resid_pre,resid_mid,resid_post,attn_in,q,k,v,pattern.")
@click.option("--layers", default=None, metavar="LIST", help="Layers to store, e.g. 0,2,5-7 (default: all).")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32", show_default=True,
              help="Stored activations: float16 refuses values beyond 65504; bfloat16 keeps float32's range.")
@click.option("--batch-size", type=int, default=32, show_default=True)
@click.option("--shards", type=int, default=1, show_default=True,
              help="Chunk-aligned shards: the unit of Dask tasks and of resuming.")
@click.option("--samples-per-chunk", type=int, default=None, help="Samples per chunk (default: about 4 MB chunks).")
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N.")
@click.option("--workers", type=int, default=None, help="Run the shards on a LocalCluster of N worker processes.")
@click.option("--scheduler", default=None, metavar="ADDRESS", help="Run the shards on an existing Dask scheduler.")
@click.option("--resume", is_flag=True, help="Continue an interrupted job, skipping its complete shards.")
@click.option("--overwrite", is_flag=True, help="Replace an existing store.")
@click.pass_context
def extract_command(ctx, model, task_spec, samples, out, sites, layers, dtype, batch_size, shards,
                    samples_per_chunk, device, workers, scheduler, resume, overwrite):
    """Run MODEL (a model directory or .gguf file) over a task and store its activations in STORE."""
    from orthosphere.extract.job import ExtractJob, extract, parse_layers

    backend = Backend(workers=workers or ctx.obj.workers, scheduler=scheduler or ctx.obj.scheduler)
    job = ExtractJob(
        model=model, task=task_spec, out=out, n_samples=samples,
        sites=None if sites is None else tuple(filter(None, sites.split(","))),
        layers=None if layers is None else parse_layers(layers),
        dtype=dtype, batch_size=batch_size, n_shards=shards, samples_per_chunk=samples_per_chunk,
        resume=resume, overwrite=overwrite, device=device, command=" ".join(sys.argv),
    )
    with dask_client(backend) as client:
        result = extract(job, client=client)
    click.echo(result.summary())


@main.command("analyze")
@click.argument("store")
@click.option("--out", required=True, metavar="RESULTS", help="Where to write the results tree: a path or fsspec URL.")
@click.option("--only", default=None, metavar="LIST",
              help="Comma-separated analyses, default all: accuracy,norms,subspaces,spheres,neighbours,replay.")
@click.option("--layers", default=None, metavar="LIST", help="Layers to analyse, e.g. 0,2,5-7 (default: all stored).")
@click.option("--sites", default=None, metavar="LIST", help="norms: sites, e.g. resid_pre,k (default: every vector site).")
@click.option("--site", default=None, help="subspaces, spheres, neighbours: the residual site (default resid_pre).")
@click.option("--factor", "factors", multiple=True, metavar="SPEC",
              help="A factor, LABEL or LABEL[KEY=V1|V2] (repeat; default: the task's factors, else every label and pos).")
@click.option("--rank", type=int, default=None, help="Fixed rank of every factor subspace.")
@click.option("--rank-threshold", type=float, default=None, help="Share of between-class variance the rank holds (0.95).")
@click.option("--bootstrap", "n_bootstrap", type=int, default=None, help="Bootstrap replicates.")
@click.option("--seed", type=int, default=None, help="Seed of the bootstrap (and of the replay's noise).")
@click.option("--uniform", is_flag=True, help="norms: weight tokens uniformly, not by the attention they receive.")
@click.option("--include-start", is_flag=True, help="Keep each sequence's start token.")
@click.option("--option", "extra", multiple=True, metavar="KEY=VALUE",
              help="Any other option, e.g. mass=0.8 or replay.levels=[0.01,0.1] (repeat).")
@click.option("--overwrite", is_flag=True, help="Replace results of another store at RESULTS.")
@click.option("--online", "online_model", default=None, metavar="MODEL",
              help="replay: inject the same noise into MODEL (the store's model) too: accuracy and collapses "
                   "under noise, one layer at a time and in all layers, in /replay/online.")
@click.option("--online-samples", type=int, default=None, help="Samples the online check runs (default: all).")
@click.pass_context
def analyze_command(ctx, store, out, only, layers, sites, site, factors, rank, rank_threshold, n_bootstrap, seed,
                    uniform, include_start, extra, overwrite, online_model, online_samples):
    """Analyse STORE (accuracy, norm spread, factor subspaces, spheres, neighbours, replay) into the DataTree RESULTS."""
    from orthosphere.analyze.options import parse_assignment
    from orthosphere.extract.job import parse_layers

    from .online_check import analyze_with_online_check

    options = {
        "layers": None if layers is None else list(parse_layers(layers)),
        "sites": None if sites is None else sites.split(","),
        "site": site, "factors": list(factors) or None, "rank": rank, "rank_threshold": rank_threshold,
        "n_bootstrap": n_bootstrap, "seed": seed,
        "weight_by_attention": False if uniform else None, "exclude_start": False if include_start else None,
    }
    options = {key: value for key, value in options.items() if value is not None}
    options.update(parse_assignment(text) for text in extra)
    with dask_client(ctx.obj):
        tree = analyze_with_online_check(store, out, online_model=online_model, online_samples=online_samples,
                                         overwrite=overwrite, only=None if only is None else only.split(","),
                                         options=options, command=" ".join(sys.argv))
    click.echo(f"wrote {', '.join('/' + name for name in tree.children)} to {out}")


@main.command("train")
@click.argument("config", type=click.Path(dir_okay=False))
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Folder for the checkpoint, metrics and training state.")
@click.option("--resume", is_flag=True, help="Continue an interrupted run from its checkpoint in --out.")
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N.")
@click.option("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice).")
def train_command(config, out, resume, device, threads):
    """Train an arithmetic transformer from CONFIG (TOML) into --out."""
    from .train import train

    metrics = train(config, out, resume=resume, device=device, threads=threads)
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
@click.pass_context
def run_command(ctx, config, force, root):
    """Run the pipeline in CONFIG (TOML): train, extract, analyse, report; complete steps are skipped."""
    from .pipeline import load_pipeline, run_pipeline

    pipeline = load_pipeline(config, root=root)
    backend = ctx.obj if (ctx.obj.workers or ctx.obj.scheduler) else None
    folder = run_pipeline(pipeline, force=force, backend=backend)
    click.echo(f"report: {folder / 'report.html'}")
