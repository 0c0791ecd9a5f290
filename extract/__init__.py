"""orthosphere.extract: models -> activations (model family, tasks, capture, batch jobs).

Called as a function, ``orthosphere.extract(model, data, out, ...)`` runs an extraction and returns
the store (``orthosphere.extract.api.extract``).
"""
from orthosphere._callable import make_callable

DEFAULT_BATCH_SIZE = 64
"""Samples a forward pass runs at once, by default (the CLI, pipelines and Python alike)."""

make_callable(__name__, "orthosphere.extract.api:extract")
