"""Calibration: data sources, the block-by-block runner, per-family adapters, GPTQ/AWQ block processors."""

from .adapters import FamilyAdapter, LinearGroup, adapter_for, register_adapter, supported_model_types
from .data import CalibrationConfig, calibration_batches, load_texts, sample_token_windows
from .pipeline import make_processor, quantize_blockwise
from .runner import BlockContext, BlockProcessor, run_blockwise

__all__ = [
    "BlockContext", "BlockProcessor", "CalibrationConfig", "FamilyAdapter", "LinearGroup", "adapter_for",
    "calibration_batches", "load_texts", "make_processor", "quantize_blockwise", "register_adapter",
    "run_blockwise", "sample_token_windows", "supported_model_types",
]
