"""Hugging Face Clover checkpoint -> GGUF converter."""

from __future__ import annotations

from typing import Any

__all__ = ["convert", "plan_conversion", "ConversionPlan", "ConversionError"]


def __getattr__(name: str) -> Any:
    # lazy, so that `import clover_convert.safetensors_io` does not pull in gguf
    if name in ("convert", "plan_conversion", "ConversionPlan", "TensorPlan"):
        from . import converter

        return getattr(converter, name)
    if name == "ConversionError":
        from .config import ConversionError

        return ConversionError
    raise AttributeError(f"module 'clover_convert' has no attribute {name!r}")
