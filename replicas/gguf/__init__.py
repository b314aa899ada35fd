"""GGUF checkpoints (llama.cpp's single-file format) as a model source.

A GGUF file is converted once into a normal Hugging Face directory in the cache
(float32 safetensors, config.json, tokenizer.json with its chat template), which
every other part of the stack then loads as it loads any checkpoint.

NOTE: torch-free (numpy, the `gguf` package and safetensors' numpy API): the
ingress converts a file to find its tokenizer on CPU nodes without torch.
"""
from replicas.gguf.reader import GgufError, GgufFile, read_gguf

__all__ = ["GgufError", "GgufFile", "read_gguf"]
