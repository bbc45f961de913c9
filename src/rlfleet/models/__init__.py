"""Deterministic offline test models (random Qwen3-architecture checkpoints)."""

from rlfleet.models.make import make_model

__all__ = ["make_model"]
