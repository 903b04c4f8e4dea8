"""Exceptions with messages that name the problem and the fix."""

from .config_utils import ConfigError


class CheckpointError(ValueError):
    """A model or checkpoint folder is missing, incomplete, corrupt or of an unsupported kind."""


class QuantizationError(ValueError):
    """The model or data cannot be quantized as asked (NaN weights, bad shapes, unsupported model)."""


class EvaluationError(ValueError):
    """An evaluation cannot run as asked (window longer than the model's context, too little text)."""


__all__ = ["CheckpointError", "ConfigError", "EvaluationError", "QuantizationError"]
