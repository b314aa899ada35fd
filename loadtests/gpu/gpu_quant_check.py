"""The quantized-weight part of the one-shot GPU check (`gpu_check --parts
quant_decode`): the linear layers of one decode step of an 8B Llama shape, in
bfloat16 against int8 and int4 weights (replicas/quant/triton_matmul.py), at
batch 1, 16 and 256, each layer's four products replayed from a CUDA graph.

One layer's weights are timed and the step's time is 32 times it (one layer of
bfloat16 weights is 436 MB, far beyond the L2 cache, so each replay reads them from
memory as the 32 distinct layers would); the lm-head is left out. With `quick`
the shapes are tiny and, without CUDA, eager on the CPU kernels: plumbing only.
"""
from __future__ import annotations

import time

import torch

# (name, in features, out features) of one layer of Llama 3.1 8B, q/k/v and gate/up fused
LAYER_8B = [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672),
            ("down", 14336, 4096)]
LAYERS_8B = 32
QUICK_LAYER = [("qkv", 128, 192), ("o", 128, 128), ("gate_up", 128, 512), ("down", 256, 128)]
BATCHES = (1, 16, 256)
SCHEMES = ("bfloat16", "int8", "int4")


def _layer(scheme: str, shapes, device: torch.device):
    from replicas.quant.float_quantize import quantize_weight
    from replicas.quant.linear import QuantLinear

    layers = []
    for _, k, n in shapes:
        weight = torch.randn(n, k) * 0.02
        if scheme == "bfloat16":
            linear = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16, device=device)
            linear.weight.data.copy_(weight)
            layers.append(linear)
        else:
            layers.append(QuantLinear([quantize_weight(weight, scheme)]).to_device(device))
    return layers


def _step_time_s(layers, shapes, batch: int, device: torch.device, dtype: torch.dtype,
                 repeats: int) -> float:
    inputs = [torch.randn(batch, k, device=device, dtype=dtype) for _, k, _ in shapes]

    def run():
        for layer, x in zip(layers, inputs):
            layer(x)

    if device.type == "cuda":
        for _ in range(2):
            run()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        graph.replay()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            graph.replay()
        torch.cuda.synchronize()
    else:
        run()
        start = time.perf_counter()
        for _ in range(repeats):
            run()
    return (time.perf_counter() - start) / repeats


def check_quant_decode(quick: bool) -> dict:
    """Per batch and scheme: the decode step's linear time (ms, 32 layers) and its
    ratio to bfloat16's."""
    from loadtests.gpu.gpu_kernel_check import require_cuda

    device = torch.device("cpu") if quick and not torch.cuda.is_available() else require_cuda()
    shapes = QUICK_LAYER if quick else LAYER_8B
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    layers = {scheme: _layer(scheme, shapes, device) for scheme in SCHEMES}
    if device.type == "cpu":  # plumbing: the CPU runs float32 activations
        layers["bfloat16"] = [layer.float() for layer in layers["bfloat16"]]
    rows = []
    for batch in BATCHES:
        times = {scheme: _step_time_s(layers[scheme], shapes, batch, device, dtype,
                                      repeats=3 if quick else 20) * LAYERS_8B * 1e3
                 for scheme in SCHEMES}
        rows.append({"batch": batch, **{f"{s}_step_ms": round(t, 3) for s, t in times.items()},
                     **{f"{s}_vs_bfloat16": round(times[s] / times["bfloat16"], 3)
                        for s in SCHEMES[1:]}})
    weight_mb = {scheme: round(sum(
        (l.weight.numel() * 2 if scheme == "bfloat16" else l.nbytes) for l in layers[scheme])
        * LAYERS_8B / 1e6) for scheme in SCHEMES}
    return {"device": str(device), "layers": LAYERS_8B, "shapes": shapes, "rows": rows,
            "weights_mb": weight_mb}
