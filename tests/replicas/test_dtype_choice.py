"""dtype auto: on CPU bfloat16 where the CPU runs it natively and the checkpoint
carries no more (a bfloat16 checkpoint, a GGUF file of quantized matrices), else
float32 (what parity holds exact); the checkpoint's dtype on CUDA (float16 for
bfloat16 on GPUs without it)."""
import json
import logging

import pytest

from replicas.checkpoints.dtype_choice import resolve_dtype

NO_BF16 = {"avx2", "fma"}
NATIVE_BF16 = {"avx2", "avx512f", "avx512_bf16"}


def _checkpoint(tmp_path, dtype, gguf_matrix_types=None):
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": dtype} if dtype else {}))
    if gguf_matrix_types is not None:  # what replicas/gguf/convert.py writes beside it
        source = {"converter": "v2", "matrix_types": gguf_matrix_types}
        if gguf_matrix_types == "none":  # a directory of the converter before v2
            source = {"converter": "v1"}
        (tmp_path / "gguf_source.json").write_text(json.dumps(source))
    return str(tmp_path)


@pytest.mark.parametrize("ckpt,flags,expected", [
    ("bfloat16", NO_BF16, "float32"),  # emulated: several times slower
    ("bfloat16", NATIVE_BF16, "bfloat16"),
    ("float16", NATIVE_BF16, "float32"),  # bfloat16 keeps fewer bits than float16
    ("float32", NATIVE_BF16, "float32"),
    (None, NATIVE_BF16, "float32"),
])
def test_auto_on_cpu(tmp_path, ckpt, flags, expected, caplog):
    with caplog.at_level(logging.INFO, logger="stepstream"):
        dtype, why = resolve_dtype("auto", "cpu", _checkpoint(tmp_path, ckpt), flags)
    assert dtype == expected
    assert f"dtype: {expected}" in caplog.text and why in caplog.text


@pytest.mark.parametrize("matrix_types,flags,expected", [
    (["Q4_1", "Q8_0"], NATIVE_BF16, "bfloat16"),  # the trained preset's file
    (["Q4_1", "Q8_0"], NO_BF16, "float32"),
    (["BF16"], NATIVE_BF16, "bfloat16"),
    (["F16"], NATIVE_BF16, "float32"),
    (["F32", "Q4_K"], NATIVE_BF16, "float32"),  # one wide matrix: float32 for all
    ("none", NATIVE_BF16, "float32"),  # an older conversion names no types
])
def test_auto_on_cpu_for_a_gguf_conversion(tmp_path, matrix_types, flags, expected):
    # NOTE: the conversion's config.json says float32: what its safetensors hold
    dtype, why = resolve_dtype("auto", "cpu", _checkpoint(tmp_path, "float32", matrix_types),
                               flags)
    assert dtype == expected, why
    if matrix_types == ["Q4_1", "Q8_0"]:
        assert "Q4_1/Q8_0" in why


def test_auto_on_cuda_keeps_the_checkpoint_dtype(tmp_path):
    ckpt = _checkpoint(tmp_path, "bfloat16")
    assert resolve_dtype("auto", "cuda:0", ckpt, NO_BF16, cuda_bf16=True)[0] == "bfloat16"


def test_auto_on_a_gpu_without_bfloat16_runs_float16(tmp_path):
    ckpt = _checkpoint(tmp_path, "bfloat16")
    assert resolve_dtype("auto", "cuda", ckpt, NO_BF16, cuda_bf16=False)[0] == "float16"


def test_explicit_bfloat16_on_a_cpu_without_it_is_kept_with_a_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="stepstream"):
        dtype, why = resolve_dtype("bfloat16", "cpu", _checkpoint(tmp_path, "float32"), NO_BF16)
    assert dtype == "bfloat16" and "emulated" in why
    assert "several times slower than float32" in caplog.text


def test_explicit_bfloat16_on_a_cpu_with_it_is_kept_without_a_warning(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="stepstream"):
        dtype, why = resolve_dtype("bfloat16", "cpu", _checkpoint(tmp_path, "float32"), NATIVE_BF16)
    assert dtype == "bfloat16" and "native bfloat16" in why
    assert "not bit-identical" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_explicit_float16_on_a_cpu_is_kept_with_a_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="stepstream"):
        dtype, why = resolve_dtype("float16", "cpu", _checkpoint(tmp_path, "float16"),
                                   {"avx512_fp16"})
    assert dtype == "float16" and "slower than float32" in why
    assert "dtype auto would pick float32" in caplog.text


def test_the_engine_logs_and_runs_the_resolved_dtype(caplog):
    from replicas import Engine, EngineConfig
    with caplog.at_level(logging.INFO, logger="stepstream"):
        with Engine(EngineConfig(model="tiny")) as engine:
            assert engine.core.config.dtype == "float32"  # the preset checkpoint is float32
    assert "dtype: float32 (auto" in caplog.text
