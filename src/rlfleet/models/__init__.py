"""Deterministic offline test models (random Qwen3-architecture checkpoints and LoRA
adapters for them)."""

from rlfleet.models.make import make_adapter, make_model

__all__ = ["make_adapter", "make_model"]
