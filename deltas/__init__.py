"""Incremental outputs: token and text deltas, their merge, detokenizing, stop strings.

Imports neither `replicas` nor `cluster`.
"""
from deltas.types import FinishReason, OutputKind, TextDelta, TokenDelta

__all__ = ["FinishReason", "OutputKind", "TextDelta", "TokenDelta"]
