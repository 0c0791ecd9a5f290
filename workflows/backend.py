"""The Dask back end that the CLI's --workers / --scheduler options choose (a pipeline's [backend] table)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import click

from orthosphere.errors import ConfigError


@dataclass(frozen=True)
class Backend:
    """None/None: Dask's threaded scheduler in this process; workers: a LocalCluster; scheduler: a cluster's address."""

    workers: int | None = None
    scheduler: str | None = None

    def __post_init__(self):
        if self.workers is not None and self.scheduler is not None:
            raise ConfigError("give either workers=N (a LocalCluster) or scheduler=ADDRESS, not both")
        if self.workers is not None and self.workers < 1:
            raise ConfigError(f"workers={self.workers}: expected a positive number of worker processes")


@contextlib.contextmanager
def dask_client(backend: Backend):
    """A distributed Client for the chosen back end (made the default while the block runs), or None."""
    if backend.scheduler is None and backend.workers is None:
        yield None
        return
    from distributed import Client, LocalCluster

    if backend.scheduler is not None:
        try:
            client = Client(backend.scheduler, timeout="20s")
        except OSError as error:
            raise click.ClickException(
                f"cannot reach the Dask scheduler at {backend.scheduler!r}: {error}; check the address "
                "(tcp://HOST:PORT) and that the scheduler runs"
            ) from error
        with client:
            yield client
        return
    with LocalCluster(n_workers=backend.workers, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster:
        with Client(cluster) as client:
            yield client
