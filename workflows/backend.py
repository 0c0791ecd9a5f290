"""The Dask back end that the CLI's --workers / --scheduler options choose (a pipeline's [backend] table)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import click

from orthosphere.errors import ClusterError, ConfigError


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
            check_worker_code(client, backend.scheduler)
            yield client
        return
    with LocalCluster(n_workers=backend.workers, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster:
        with Client(cluster) as client:
            yield client


def check_worker_code(client, address: str, expected: str | None = None) -> None:
    """Refuse a cluster whose workers run other orthosphere code than this process (`expected`: this
    process's ``code_fingerprint``): their results would be stamped with this process's provenance.
    Workers that join later are not checked."""
    from orthosphere.store.provenance import code_fingerprint

    expected = expected or code_fingerprint()
    try:
        found = client.run(code_fingerprint)
    except Exception as error:  # a worker without orthosphere, or one that cannot read its sources
        raise ClusterError(f"the Dask workers at {address} cannot run orthosphere ({type(error).__name__}: {error}): "
                           "install the same orthosphere on them as here, then restart them") from error
    other = sorted(worker for worker, fingerprint in found.items() if fingerprint != expected)
    if other:
        shown = ", ".join(other[:3]) + (f" and {len(other) - 3} more" if len(other) > 3 else "")
        raise ClusterError(f"{len(other)} of the {len(found)} Dask workers at {address} ({shown}) run other orthosphere code "
                           f"than this process (source fingerprint {found[other[0]][:12]} there, {expected[:12]} here): "
                           "their results would carry this process's provenance; install the same orthosphere on them "
                           "(the same version and commit, no local edits), then restart them")
