"""dtype auto: float32 on CPU (what parity holds exact; explicit bfloat16 runs, said in
the log), the checkpoint's
dtype on CUDA (float16 for bfloat16 on GPUs without it)."""
import json
import logging

import pytest

from replicas.checkpoints.dtype_choice import resolve_dtype

NO_BF16 = {"avx2", "fma"}
NATIVE_BF16 = {"avx2", "avx512f", "avx512_bf16"}


def _checkpoint(tmp_path, dtype):
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": dtype} if dtype else {}))
    return str(tmp_path)


@pytest.mark.parametrize("ckpt,flags,expected", [
    ("bfloat16", NO_BF16, "float32"),
    ("bfloat16", NATIVE_BF16, "float32"),  # native bf16 still misses the float32 kernels
    ("float16", NATIVE_BF16, "float32"),  # bf16 instructions do not make fp16 native
    ("float32", NATIVE_BF16, "float32"),
    (None, NATIVE_BF16, "float32"),
])
def test_auto_on_cpu(tmp_path, ckpt, flags, expected, caplog):
    with caplog.at_level(logging.INFO, logger="stepstream"):
        dtype, why = resolve_dtype("auto", "cpu", _checkpoint(tmp_path, ckpt), flags)
    assert dtype == expected
    assert f"dtype: {expected}" in caplog.text and why in caplog.text


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


def test_explicit_bfloat16_on_a_cpu_with_it_is_kept_and_says_auto_picks_float32(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="stepstream"):
        dtype, why = resolve_dtype("bfloat16", "cpu", _checkpoint(tmp_path, "bfloat16"), NATIVE_BF16)
    assert dtype == "bfloat16" and "native bfloat16" in why
    assert "dtype auto picks float32" in caplog.text
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
