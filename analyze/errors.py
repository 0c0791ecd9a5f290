"""Errors a user can act on: each names the input, what was expected and what to do."""


class AnalysisError(ValueError):
    """An analysis that cannot run as asked: bad options, or a store that lacks what it needs."""


class NonFiniteError(AnalysisError):
    """Activations hold NaN or Inf; the message says which variable, layers and samples."""
