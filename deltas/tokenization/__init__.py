"""Text <-> token ids for the ingress and the offline engine: the tokenizer
(`tokenizers`, no transformers), chat templates rendered as transformers does,
and the per-token byte table the incremental detokenizer reads.
"""
from deltas.tokenization.tokenizer import Tokenizer

__all__ = ["Tokenizer"]
