"""The analyses' errors (defined with every other in ``orthosphere.errors``)."""
from orthosphere.errors import AnalysisError, NonFiniteError  # noqa: F401
