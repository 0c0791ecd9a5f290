"""Defaults shared by the extraction's doors (the Python API, the job, verification and the CLI), kept free of
heavy imports so that the CLI can show them without loading PyTorch."""

DEFAULT_BATCH_SIZE = 64
"""Samples a forward pass runs at once, by default (the CLI, pipelines and Python alike)."""
