"""orthosphere: store what trained transformers compute inside their attention layers, and analyse it offline.

The stages are the subpackages ``orthosphere.extract``, ``orthosphere.store``,
``orthosphere.analyze`` and ``orthosphere.workflows``, each in its own folder of the repository;
this module only holds what belongs to the whole package: its version and ``python -m orthosphere``.
"""
from importlib.metadata import version

__version__ = version("orthosphere")
