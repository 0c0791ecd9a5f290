"""Every error orthosphere raises for input a user can act on, in one hierarchy: each message
names the input (the parameter, with its CLI flag or TOML key where the caller used one), what
was expected and what to do.

    OrthosphereError (a ValueError)
    ├── ConfigError: a configuration, a file or an argument
    │   ├── ParameterError: a parameter of a typed configuration (``orthosphere.params``)
    │   │   └── AnalysisParameterError (also an AnalysisError): an analysis's option
    │   ├── UnsupportedModelError: an architecture or configuration extraction cannot make exact
    │   ├── CorpusError: a corpus that cannot be read as asked
    │   ├── Float16OverflowError: activations beyond float16's range
    │   └── ClusterError: a Dask cluster that cannot run a job's tasks (no workers, workers killed)
    ├── StoreError: a store that cannot be created, written or read as asked
    │   ├── StoreNotFoundError, StoreExistsError, IncompleteStoreError, StoreLockedError,
    │   │   DamagedStoreError
    │   ├── StorageFailureError (also an OSError): the storage under a store failed
    │   ├── VerificationError: a store that cannot be verified against the model given
    │   └── JobMismatchError: a store made by another job than the one resuming it
    └── AnalysisError: an analysis that cannot run as asked
        ├── NonFiniteError: NaN or Inf in the activations read
        └── ReplayError: bad input to the replay
            └── ModelMismatchError: the online check's model is not the store's

The subpackages re-export the errors of their stage (``orthosphere.store.StoreError``, ...).
"""
from __future__ import annotations


class OrthosphereError(ValueError):
    """Input orthosphere cannot use as given; the message says which input and what to do."""


class ConfigError(OrthosphereError):
    """Bad input from a user: a config, a file or an argument."""


class ParameterError(ConfigError):
    """A parameter's value its declared constraints refuse (or a parameter that is not declared):
    the message names it as the caller did (``named``: a CLI flag, a TOML file, table and key)."""

    def __init__(self, parameter: str, value, expected: str, *, unknown: bool = False, label: str | None = None):
        self.parameter, self.value, self.expected, self.unknown = parameter, value, expected, unknown
        self.label = label or parameter
        if unknown:
            message = f"{self.label}: not known: expected {expected}"
        else:
            message = f"{self.label}={value!r}: expected {expected}"
        super().__init__(message)

    def named(self, label: str) -> ParameterError:
        """The same error with the parameter named `label` (as the caller wrote it)."""
        return type(self)(self.parameter, self.value, self.expected, unknown=self.unknown, label=label)

    def in_table(self, where: str, key: str) -> ConfigError:
        """The error as a TOML file's: `where` names the file and table, `key` the parameter there."""
        if self.unknown:
            return ConfigError(f"{where} {key}: not known: expected {self.expected}")
        return ConfigError(f"{where} {key} = {self.value!r}: expected {self.expected}")

    def __reduce__(self):
        return _parameter_error, (type(self), self.parameter, self.value, self.expected, self.unknown, self.label)


def _parameter_error(kind, parameter, value, expected, unknown, label):
    return kind(parameter, value, expected, unknown=unknown, label=label)


class UnsupportedModelError(ConfigError):
    """A model of an architecture, or a configuration of one, that extraction cannot make exact."""


class CorpusError(ConfigError):
    """A corpus that cannot be read as asked: a missing file or column, bad bytes or values."""


class Float16OverflowError(ConfigError):
    """Activations beyond float16's range: stored as float16 they would be inf."""


class ClusterError(ConfigError):
    """A Dask cluster that cannot run a job's tasks: it has no workers, or a task kills the workers
    that run it."""


class StoreError(OrthosphereError):
    """A store that cannot be created, written or read as asked."""


class StoreNotFoundError(StoreError, FileNotFoundError):
    """The URL holds no store."""


class StoreExistsError(StoreError, FileExistsError):
    """A store already exists where a new one was to be created."""


class IncompleteStoreError(StoreError):
    """Some shards of the store were never finished."""


class StoreLockedError(StoreError):
    """Another writer holds the store's lock."""


class DamagedStoreError(StoreError):
    """Chunks the store promises are missing or damaged."""

    def __init__(self, message: str, damage: list | None = None):
        super().__init__(message)
        self.damage = list(damage or [])

    def __reduce__(self):
        return type(self), (str(self), self.damage)

    @classmethod
    def of(cls, url: str, damage) -> DamagedStoreError:
        """The error for damaged chunks of the store at `url` (one Damage or a list), with what to do."""
        damage = damage if isinstance(damage, list) else [damage]
        shown = "; ".join(str(item) for item in damage[:3]) + ("; ..." if len(damage) > 3 else "")
        count = f"{len(damage)} chunk{'s' if len(damage) != 1 else ''}"
        if all(item.listed for item in damage):
            advice = (f"resume the job that wrote it (mode=\"resume\") to rewrite them; "
                      f"`orthosphere validate {url}` lists every damaged chunk")
        else:
            advice = (f"`orthosphere validate {url} --full --reopen` lists every damaged chunk and reopens their "
                      "shards; then resume the job that wrote the store (mode=\"resume\") to rewrite them")
        return cls(f"store {url} is damaged ({count}): {shown}. To repair it, {advice}", damage)


class StorageFailureError(StoreError, OSError):
    """The storage under a store failed (a local I/O error, a full disk, an object store's outage):
    the message names the store, the array and chunk (or the metadata, lock or flag file), the
    cause and what to do."""


class VerificationError(StoreError):
    """A store that cannot be verified as asked: a model that is not the store's, bad options."""


class JobMismatchError(StoreError):
    """A store made by a different job than the one asked to resume it: `difference` says what differs,
    `advice` what to do (a workflow that makes its stores itself gives its own with ``advised``)."""

    ADVICE = 'resume with the original model, task, sites, layers, dtype, pred and n_samples, or pass mode="overwrite" to replace the store'

    def __init__(self, difference: str, advice: str = ADVICE):
        self.difference, self.advice = difference, advice
        super().__init__(f"{difference}; {advice}")

    def advised(self, advice: str) -> JobMismatchError:
        """The same difference with another `advice`."""
        return type(self)(self.difference, advice)

    def __reduce__(self):
        return type(self), (self.difference, self.advice)


class AnalysisError(OrthosphereError):
    """An analysis that cannot run as asked: bad options, or a store that lacks what it needs."""


class AnalysisParameterError(ParameterError, AnalysisError):
    """An analysis option its declared constraints refuse."""


class NonFiniteError(AnalysisError):
    """Activations hold NaN or Inf; the message says which variable, layers and samples."""


class ReplayError(AnalysisError):
    """Bad input to the replay: the message names the input, what was expected and what to do."""


class ModelMismatchError(ReplayError):
    """The model given to the online check is not the one the store was extracted from."""
