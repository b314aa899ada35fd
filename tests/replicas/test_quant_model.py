"""A model whose weights stay quantized: a GGUF file's matrices run in their own
types (`quantization: auto`), a float checkpoint's in int8/int4; each against the
dequantized float path (`none`), which is the exact oracle against transformers."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from loadtests.engine import quant_accuracy
from replicas import Engine, EngineConfig, SamplingParams
from replicas.checkpoints.presets import ensure_model_dir
from replicas.gguf.convert import ensure_gguf_dir
from replicas.models.loader import load_model
from replicas.quant.choice import resolve_quantization
from replicas.quant.linear import QuantEmbedding, QuantLinear
from replicas.quant.summary import weight_bytes
from tests.replicas.test_gguf_files import GgufWriter, Q
from tests.replicas.test_quant_gguf_blocks import raw_tensor

pytestmark = pytest.mark.timeout(300)

# One file with every layout the kernels read: q/k 4-bit (their rows permuted by
# llama.cpp), v 8-bit (so the fused q/k/v keeps two parts), K-quants in the MLP
QTYPES = {"token_embd.weight": Q.Q8_0, "output.weight": Q.Q8_0}
for _i in range(2):
    QTYPES.update({f"blk.{_i}.attn_q.weight": Q.Q4_0, f"blk.{_i}.attn_k.weight": Q.Q4_0,
                   f"blk.{_i}.attn_v.weight": Q.Q8_0, f"blk.{_i}.attn_output.weight": Q.Q5_0,
                   f"blk.{_i}.ffn_gate.weight": Q.Q4_1, f"blk.{_i}.ffn_up.weight": Q.Q5_1})


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("quant-gguf").resolve()
    writer = GgufWriter(root)
    # NOTE: K-quants from raw blocks (the gguf package does not quantize them); down
    # projections have K = 256, one super-block a row
    shape = writer.tensors()["blk.0.ffn_down.weight"].shape
    raw = {"blk.0.ffn_down.weight": (raw_tensor("Q6_K", shape), Q.Q6_K),
           "blk.1.ffn_down.weight": (raw_tensor("Q4_K", shape), Q.Q4_K)}
    path = writer.write(root / "mixed.gguf", qtypes=QTYPES, raw=raw)
    return ensure_gguf_dir(path, root / "cache")


def _logits(model_dir: str, quantization: str, ids: list[int], dtype: str = "float32"):
    resolved, _ = resolve_quantization(quantization, "cpu", model_dir)
    model = load_model(model_dir, dtype, torch.device("cpu"), 64, resolved)
    return model, quant_accuracy.window_logits(model, ids)


IDS = [int(t) for t in np.random.default_rng(0).integers(5, 8192, 40)]


def test_auto_keeps_every_gguf_matrix_in_its_own_type(gguf_dir):
    model, _ = _logits(gguf_dir, "auto", IDS[:4])
    layer = model.layers[0]
    assert isinstance(model.embed_tokens, QuantEmbedding)
    assert model.embed_tokens.weight_q.source == "Q8_0"
    assert layer.self_attn.qkv_proj.sources == ["Q4_0", "Q8_0"]  # q+k stacked, v apart
    assert layer.self_attn.o_proj.sources == ["Q5_0"]
    assert layer.mlp.gate_up_proj.sources == ["Q4_1", "Q5_1"]
    assert layer.mlp.down_proj.sources == ["Q6_K"]
    assert model.layers[1].mlp.down_proj.sources == ["Q4_K"]
    assert model.lm_head.sources == ["Q8_0"]
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())


@pytest.mark.parametrize("rows", ["kernel", "gemm"])
def test_auto_computes_what_the_dequantized_model_computes(gguf_dir, rows):
    """Through the integer kernel (decode) and the GEMM path (prefill): a wrong
    permutation, a wrong type's layout or a wrong part order moves logits by their
    own size; the kernel's activation rounding moves them by far less."""
    _, reference = _logits(gguf_dir, "none", IDS)
    model, _ = _logits(gguf_dir, "auto", IDS[:2])
    quant_accuracy.route_rows(model, rows)
    logits = quant_accuracy.window_logits(model, IDS)
    error = ((logits - reference).norm(dim=-1) / reference.norm(dim=-1)).max()
    assert error < 1e-3, error
    assert torch.equal(logits.argmax(-1), reference.argmax(-1))


def test_the_engine_serves_a_gguf_file_natively_by_default(gguf_dir):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [IDS[:5], IDS[5:30]]
    outputs = {}
    for quantization in ("auto", "none"):
        with Engine(EngineConfig(model=gguf_dir, dtype="float32", quantization=quantization)) as engine:
            assert engine.core.config.quantization == ("gguf" if quantization == "auto" else "none")
            outputs[quantization] = [o.token_ids for o in engine.generate(prompts, params)]
    assert outputs["auto"] == outputs["none"]


def test_float_matrices_in_a_gguf_file_run_as_floats(tmp_path, caplog):
    writer = GgufWriter(tmp_path)
    path = writer.write(tmp_path / "half.gguf", qtypes={**QTYPES, "blk.0.ffn_down.weight": Q.F16,
                                                        "blk.1.ffn_down.weight": Q.F16})
    model_dir = ensure_gguf_dir(path, tmp_path / "cache")
    with caplog.at_level(logging.INFO, logger="stepstream"):
        model, logits = _logits(model_dir, "auto", IDS)
    assert type(model.layers[0].mlp.down_proj) is torch.nn.Linear
    assert isinstance(model.layers[0].mlp.gate_up_proj, QuantLinear)
    assert "F16" in caplog.text
    _, reference = _logits(model_dir, "none", IDS)
    torch.testing.assert_close(logits, reference, rtol=1e-3, atol=1e-3)


def test_resident_weights_are_about_the_file_s_bytes(gguf_dir):
    from replicas.gguf import read_gguf
    from replicas.quant.choice import gguf_source_file
    checkpoint = read_gguf(gguf_source_file(gguf_dir))
    file_bytes = sum(t.data.nbytes for t in checkpoint.tensors.values())
    model, _ = _logits(gguf_dir, "auto", IDS[:2])
    none_model, _ = _logits(gguf_dir, "none", IDS[:2])
    # NOTE: K-quants' scales widen to float32 (their float16 x 6-bit products are not
    # all float16s); every other type keeps the file's bytes
    assert weight_bytes(model) <= 1.25 * file_bytes
    assert weight_bytes(none_model) > 3 * weight_bytes(model)


@pytest.mark.parametrize("requested, device, gguf, expected", [
    ("auto", "cpu", True, "gguf"), ("auto", "cpu", False, "none"), ("auto", "cuda", True, "none"),
    ("none", "cpu", True, "none"), ("int8", "cpu", False, "int8"), ("int4", "cpu", True, "int4"),
])
def test_quantization_resolves_by_checkpoint_and_device(gguf_dir, requested, device, gguf, expected):
    model_dir = gguf_dir if gguf else ensure_model_dir("tiny")
    assert resolve_quantization(requested, device, model_dir)[0] == expected


def test_what_cannot_run_is_refused_with_the_reason(gguf_dir, monkeypatch):
    from replicas.quant import choice
    assert resolve_quantization("gguf", "cuda", gguf_dir)[0] == "gguf"  # asked for: the GPU kernel
    monkeypatch.setattr(choice, "_gpu_kernel_problem", lambda: "Triton is not installed")
    with pytest.raises(ValueError, match="needs the Triton kernel: Triton is not installed"):
        resolve_quantization("int4", "cuda", gguf_dir)
    with pytest.raises(ValueError, match="needs a GGUF file"):
        resolve_quantization("gguf", "cpu", ensure_model_dir("tiny"))
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="q4")


@pytest.mark.parametrize("scheme, bound", [("int8", 0.02), ("int4", 0.3)])
def test_int8_and_int4_quantize_a_float_checkpoint_at_load(scheme, bound):
    model_dir = ensure_model_dir("tiny")
    model, logits = _logits(model_dir, scheme, IDS)
    _, reference = _logits(model_dir, "none", IDS)
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(linears) > 3 * model.config.num_layers and {
        s for m in linears for s in m.sources} == {scheme}
    # NOTE: tiny's down projections read 688 values, not a multiple of 32: they stay float
    assert all(m.in_features % 32 for m in model.modules() if type(m) is torch.nn.Linear)
    if model.config.tie_word_embeddings:  # one copy serves the lookups and the lm-head
        assert model.embed_tokens.weight_q is model.lm_head.parts[0]
    error = ((logits - reference).norm(dim=-1) / reference.norm(dim=-1)).max()
    assert error < bound, error


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_tied_embedding_is_quantized_once_for_lookups_and_the_lm_head(tmp_path, scheme):
    """Qwen2-style: tied embeddings and q/k/v biases (added after the kernel)."""
    from tests.model_dirs import make_model_dir
    model_dir = make_model_dir(tmp_path, "qwen2")
    model, logits = _logits(model_dir, scheme, IDS)
    _, reference = _logits(model_dir, "none", IDS)
    assert model.config.tie_word_embeddings and model.config.attention_bias
    assert isinstance(model.embed_tokens, QuantEmbedding)
    assert model.embed_tokens.weight_q is model.lm_head.parts[0]
    assert model.layers[0].self_attn.qkv_proj.bias is not None
    assert weight_bytes(model) < weight_bytes(_logits(model_dir, "none", IDS[:2])[0]) / 2
    error = ((logits - reference).norm(dim=-1) / reference.norm(dim=-1)).max()
    assert error < (0.02 if scheme == "int8" else 0.3), error


@pytest.mark.slow
def test_the_trained_preset_keeps_its_predictions_on_the_shipped_text():
    """auto against none on the trained preset's own GGUF types, every token through
    the integer kernel as decode runs it (the text's first 512 tokens here, where the
    two agree on every token; `python -m loadtests.bench_engine --accuracy` measures
    all of it)."""
    rows = {r.mode: r for r in quant_accuracy.measure("smollm2-135m", ["none", "auto"],
                                                      max_tokens=512)}
    assert abs(rows["auto"].perplexity / rows["none"].perplexity - 1) < 0.01
    assert rows["auto"].top1_agreement >= 0.98
    assert rows["auto"].weight_bytes < rows["none"].weight_bytes / 5
