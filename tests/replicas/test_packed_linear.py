"""oneDNN-packed linear layers: same outputs as nn.Linear, and a clean fallback."""
import logging

import pytest
import torch
from torch import nn

from replicas.models import packed_linear
from replicas.models.packed_linear import PackedLinear, pack_linears

needs_packing = pytest.mark.skipif(packed_linear.packing_available() is not None,
                                   reason="no oneDNN packed linear in this torch build")
BFLOAT16_REFUSED = (packed_linear.packing_available()
                    or packed_linear.packing_refused(torch.bfloat16))
needs_bfloat16_packing = pytest.mark.skipif(BFLOAT16_REFUSED is not None,
                                            reason=str(BFLOAT16_REFUSED))


@needs_packing
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 200])
def test_matches_nn_linear(bias, rows):
    torch.manual_seed(0)
    linear = nn.Linear(96, 320, bias=bias)
    x = torch.randn(rows, 96)
    torch.testing.assert_close(PackedLinear(linear, 64)(x), linear(x), atol=1e-4, rtol=1e-5)


@needs_bfloat16_packing
@pytest.mark.parametrize("rows", [1, 64, 256])
def test_bfloat16_packed_outputs_are_nn_linear_s(rows):
    torch.manual_seed(rows)
    linear = nn.Linear(576, 960, bias=False).to(torch.bfloat16)
    x = torch.randn(rows, 576).to(torch.bfloat16)
    got = PackedLinear(linear, 256)(x)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, linear(x))  # the same kernels: only the reordering moved


@needs_packing
def test_packs_every_float32_and_bfloat16_linear_and_keeps_a_tied_weight_for_the_embedding():
    model = nn.Module()
    model.embed = nn.Embedding(50, 16)
    model.proj = nn.Linear(16, 16)
    model.head = nn.Linear(16, 50, bias=False)
    model.head.weight = model.embed.weight
    model.low = nn.Linear(16, 16).to(torch.bfloat16)
    model.half_layer = nn.Linear(16, 16).to(torch.float16)
    # NOTE: bfloat16 packs only on CPUs with AVX-512 or AVX-NE-CONVERT: elsewhere it
    # stays a plain layer (the next tests)
    assert pack_linears(model, 8) == (3 if BFLOAT16_REFUSED is None else 2)
    assert isinstance(model.proj, PackedLinear) and isinstance(model.head, PackedLinear)
    assert isinstance(model.low, PackedLinear if BFLOAT16_REFUSED is None else nn.Linear)
    assert type(model.half_layer) is nn.Linear  # float32 and bfloat16 only
    assert model.embed.weight.shape == (50, 16)
    ids = torch.tensor([3, 7])
    torch.testing.assert_close(model.head(model.embed(ids)), model.embed(ids) @ model.embed.weight.T,
                               atol=1e-4, rtol=1e-5)


@needs_packing
def test_a_layer_onednn_refuses_stays_plain_and_the_rest_are_packed(monkeypatch, caplog):
    def refusing_bfloat16(linear, hint):
        if linear.weight.dtype == torch.bfloat16:
            raise RuntimeError("no bfloat16 reorder here")
        return PackedLinear(linear, hint)

    monkeypatch.setattr(packed_linear, "PackedLinear", refusing_bfloat16)
    # NOTE: the dtype itself passes, so that the refusal comes from the layer
    monkeypatch.setattr(packed_linear, "packing_refused", lambda dtype: None)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8).to(torch.bfloat16))
    with caplog.at_level(logging.INFO, logger="stepstream"):
        assert pack_linears(model, 4) == 1
    assert isinstance(model[0], PackedLinear) and type(model[1]) is nn.Linear
    assert "stays unpacked: no bfloat16 reorder here" in caplog.text


@needs_packing
def test_a_dtype_this_cpu_cannot_pack_stays_plain_with_one_log_line(monkeypatch, caplog):
    monkeypatch.setattr(packed_linear, "packing_refused",
                        lambda dtype: "needs avx512" if dtype == torch.bfloat16 else None)
    model = nn.Sequential(nn.Linear(8, 8), *(nn.Linear(8, 8).to(torch.bfloat16) for _ in range(5)))
    with caplog.at_level(logging.INFO, logger="stepstream"):
        assert pack_linears(model, 4) == 1
    assert isinstance(model[0], PackedLinear)
    assert all(type(layer) is nn.Linear for layer in model[1:])
    assert caplog.text.count("needs avx512") == 1
    assert "bfloat16 linear layers stay unpacked on this CPU: needs avx512" in caplog.text


def test_packing_refused_answers_for_float32_and_names_a_reason_or_none():
    if packed_linear.packing_available() is not None:
        pytest.skip("no oneDNN packed linear in this torch build")
    assert packed_linear.packing_refused(torch.float32) is None
    why = packed_linear.packing_refused(torch.bfloat16)
    assert why is None or "bf16" in why or "avx" in why.lower()


def test_without_onednn_the_model_stays_as_it_is(monkeypatch, caplog):
    monkeypatch.setattr(packed_linear, "packing_available", lambda: "this torch build has no oneDNN")
    model = nn.Sequential(nn.Linear(4, 4))
    with caplog.at_level(logging.INFO, logger="stepstream"):
        assert pack_linears(model, 8) == 0
    assert type(model[0]) is nn.Linear
    assert "stay unpacked: this torch build has no oneDNN" in caplog.text
