"""The `orthosphere` command line: one verb per stage (info, train, extract, analyze, report, run)."""
from __future__ import annotations

import json
import logging

import click

from orthosphere.store import StoreError, format_info, info

from .backend import Backend


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
