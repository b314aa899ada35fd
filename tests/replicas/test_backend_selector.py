"""The attention-backend picker: torch without a GPU, clear errors for impossible asks."""
import logging

import pytest
import torch

from replicas.attention import selector
from replicas.attention.selector import select_attention_backend

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def no_triton_interpreter(monkeypatch):
    # Another test module turns the interpreter on for the whole process.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def test_auto_picks_the_cpu_kernel_for_float32_on_cpu_and_logs_why(caplog):
    from replicas.attention.native_kernels import load_paged_decode_attention
    if load_paged_decode_attention()[0] is None:
        pytest.skip(load_paged_decode_attention()[1])
    with caplog.at_level(logging.INFO, logger="stepstream"):
        backend = select_attention_backend("auto", CPU, torch.float32, 16)
    assert backend.name == "cpu"
    logged = " ".join(r.getMessage() for r in caplog.records if r.name == "stepstream")
    assert "attention backend: cpu" in logged
    assert "not flash-attn" in logged and "not triton" in logged


def test_auto_picks_cpu_for_bfloat16_and_torch_for_float16_and_logs_why(caplog):
    assert select_attention_backend("auto", CPU, torch.bfloat16, 16).name == "cpu"
    with caplog.at_level(logging.INFO, logger="stepstream"):
        backend = select_attention_backend("auto", CPU, torch.float16, 256)
    assert backend.name == "torch"
    assert type(backend).__name__ == "TorchAttentionBackend"
    logged = " ".join(r.getMessage() for r in caplog.records if r.name == "stepstream")
    assert "not cpu: it runs float32 and bfloat16 only" in logged


def test_auto_falls_back_to_torch_when_the_kernel_cannot_build(monkeypatch, caplog):
    from replicas.attention import native_kernels
    monkeypatch.setattr(native_kernels, "load_paged_decode_attention",
                        lambda kv_dtype="float32": (None, "no C compiler found"))
    with caplog.at_level(logging.INFO, logger="stepstream"):
        assert select_attention_backend("auto", CPU, torch.float32, 16).name == "torch"
    assert "no C compiler found" in " ".join(r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="no C compiler found"):
        select_attention_backend("cpu", CPU, torch.float32, 16)


def test_torch_can_be_forced():
    assert select_attention_backend("torch", "cpu", torch.float32, 16).name == "torch"


@pytest.mark.parametrize("name", ["triton", "flash-attn", "flash_attn"])
def test_gpu_backends_on_cpu_raise_a_clear_error(name):
    with pytest.raises(ValueError, match="cannot run here"):
        select_attention_backend(name, CPU, torch.bfloat16, 256)


def test_unknown_name_lists_the_choices():
    with pytest.raises(ValueError, match="choose one of"):
        select_attention_backend("xformers", CPU, torch.float32, 16)


def test_flash_attn_limits_on_cuda_are_explained(monkeypatch):
    # Pretend flash-attn imports, to reach the dtype and block-size checks without a GPU.
    monkeypatch.setattr(selector, "_import_problem", lambda module: None)
    cuda = torch.device("cuda")
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        select_attention_backend("flash-attn", cuda, torch.float32, 256)
    with pytest.raises(ValueError, match="multiple of 256"):
        select_attention_backend("flash-attn", cuda, torch.bfloat16, 16)
    assert selector.why_backend_cannot_run("flash-attn", cuda, torch.bfloat16, 512) is None


def test_auto_on_cuda_falls_back_from_flash_attn_to_triton(monkeypatch):
    monkeypatch.setattr(selector, "_import_problem",
                        lambda module: "missing" if module == "flash_attn" else None)
    built = []
    monkeypatch.setattr(selector, "_build", lambda name: built.append(name) or _Named(name))
    cuda = torch.device("cuda")
    assert select_attention_backend("auto", cuda, torch.bfloat16, 256).name == "triton"
    monkeypatch.setattr(selector, "_import_problem", lambda module: None)
    assert select_attention_backend("auto", cuda, torch.bfloat16, 256).name == "flash-attn"
    # Block 16 is too small for flash-attn's paged API: Triton serves it.
    assert select_attention_backend("auto", cuda, torch.bfloat16, 16).name == "triton"
    assert select_attention_backend("auto", cuda, torch.float32, 256).name == "triton"
    assert built == ["triton", "flash-attn", "triton", "triton"]


def test_triton_on_cpu_only_under_the_interpreter(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert selector.why_backend_cannot_run("triton", CPU, torch.float32, 16) is None
    # auto never picks the interpreter: it is for tests only.
    assert select_attention_backend("auto", CPU, torch.float32, 16).name in ("cpu", "torch")


def test_triton_needs_a_power_of_two_block_size(monkeypatch):
    monkeypatch.setattr(selector, "_import_problem", lambda module: None)
    with pytest.raises(ValueError, match="power of two"):
        select_attention_backend("triton", torch.device("cuda"), torch.bfloat16, 48)


class _Named:
    def __init__(self, name):
        self.name = name
