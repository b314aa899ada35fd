"""A GGUF file -> a Hugging Face directory in the model cache, converted once.

The directory is named by the file's content hash, so a changed file is converted
anew and an unchanged one, wherever it lies, is found again.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import time
from pathlib import Path

from replicas.checkpoints.cache_dirs import models_dir, write_once
from replicas.gguf.llama_layout import check_tensors, hf_config, hf_tensors
from replicas.gguf.reader import GgufError, read_gguf
from replicas.gguf.tokenizer_files import write_tokenizer_files

logger = logging.getLogger("stepstream")
# NOTE: bump when the conversion's output changes, so that directories written by
# an older converter are never mistaken for the new one's.
CONVERTER_VERSION = "v2"  # v2: gguf_source.json names the matrices' types
SOURCE_FILE = "gguf_source.json"


def is_gguf_path(name_or_path: str) -> bool:
    return name_or_path.lower().endswith(".gguf")


def ensure_gguf_dir(path: str | os.PathLike, cache_dir: str | os.PathLike | None = None,
                    tokenizer_only: bool = False) -> str:
    """The converted directory of the GGUF file at `path` (converted on first use).

    tokenizer_only: a directory with the tokenizer files alone (what an ingress
    needs), unless the whole conversion is there already."""
    path = os.path.realpath(os.path.expanduser(str(path)))
    if not os.path.isfile(path):
        raise GgufError(f"{path}: no such file")
    digest = _content_hash(path, os.path.getsize(path), os.stat(path).st_mtime_ns)
    stem = Path(path).name[: -len(".gguf")]
    final_dir = models_dir(cache_dir) / f"gguf-{stem}-{digest[:16]}-{CONVERTER_VERSION}"
    if tokenizer_only and not final_dir.is_dir():
        tokenizer_dir = final_dir.with_name(final_dir.name + "-tokenizer")
        if not tokenizer_dir.is_dir():
            write_once(tokenizer_dir, lambda out_dir: convert_gguf(path, out_dir, digest,
                                                                   with_weights=False))
        return str(tokenizer_dir)
    if not final_dir.is_dir():
        started = time.monotonic()
        write_once(final_dir, lambda out_dir: convert_gguf(path, out_dir, digest))
        logger.info("converted %s into %s in %.1f s", path, final_dir, time.monotonic() - started)
    return str(final_dir)


def convert_gguf(path: str, out_dir: Path, digest: str, with_weights: bool = True) -> None:
    """Write config.json, model.safetensors (float32; unless not with_weights), the
    tokenizer files and gguf_source.json for the GGUF file at `path` into out_dir."""
    from safetensors.numpy import save_file

    checkpoint = read_gguf(path)
    config = hf_config(checkpoint)
    check_tensors(checkpoint, config)  # NOTE: for a tokenizer-only dir too: one verdict per file
    # NOTE: the tokenizer first: a vocabulary we cannot read fails before the
    # seconds of dequantization
    write_tokenizer_files(checkpoint, config, out_dir)
    if with_weights:
        tensors = dict(hf_tensors(checkpoint, config))
        save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out_dir / "config.json", config)
    # NOTE: the matrices' types say what precision the weights carry (dtype auto)
    matrix_types = sorted({t.type_name for t in checkpoint.tensors.values() if len(t.shape) >= 2})
    _write_json(out_dir / SOURCE_FILE, {"file": path, "sha256": digest,
                                        "converter": CONVERTER_VERSION,
                                        "name": checkpoint.metadata.get("general.name"),
                                        "license": checkpoint.metadata.get("general.license"),
                                        "matrix_types": matrix_types})


def matrix_types(model_dir: str | os.PathLike) -> list[str] | None:
    """The GGUF types of the matrices a converted directory came from, or None: not a
    conversion, or one written before the converter recorded them (v1)."""
    try:
        with open(os.path.join(model_dir, SOURCE_FILE)) as f:
            return json.load(f).get("matrix_types")
    except (OSError, ValueError):
        return None


@functools.lru_cache(maxsize=8)
def _content_hash(path: str, size: int, mtime_ns: int) -> str:
    """sha256 of the file; size and mtime key the cache, so an edited file is hashed anew."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
