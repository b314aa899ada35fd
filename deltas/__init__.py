"""Incremental outputs: token and text deltas, their merge, detokenizing, stop strings.

Imports neither `replicas` nor `cluster`, nor torch: the Ray ingress loads it.
"""
from deltas.collector import DeltaCollector
from deltas.detokenizer import IncrementalDetokenizer
from deltas.sink import DeltaSink
from deltas.stop_strings import StopStringMatcher
from deltas.text_stream import TextStream
from deltas.tokenization.tokenizer import Tokenizer
from deltas.types import FinishReason, OutputKind, TextDelta, TokenDelta

__all__ = [
    "DeltaCollector", "DeltaSink", "FinishReason", "IncrementalDetokenizer", "OutputKind",
    "StopStringMatcher", "TextDelta", "TextStream", "TokenDelta", "Tokenizer",
]
