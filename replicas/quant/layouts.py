"""Quantized weights as the kernels read them: plain data, no kernel calls.

Two layouts (csrc/quant_linear.c reads both):
- `u4`: 4-bit unsigned codes, two per byte, groups of 32 values; a group's 16
  bytes hold values 0..15 in their low nibbles and 16..31 in their high ones.
  value = scale * code + min.
- `s8`: one signed byte per value, groups of 32 or 16; value = scale * code
  (+ min, where the source has one).
Scales and mins are float16 where every one is exactly a float16 (Q4_0, Q4_1,
Q5_x and Q8_0 store them so), else float32 (K-quants multiply a float16 by a
6- or 8-bit sub-scale, which float16 cannot always hold): lossless either way.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

LAYOUTS = ("u4", "s8")
VALUES_PER_BLOCK = 32  # the activations' quantization block: every K is a multiple


@dataclass(slots=True)
class QuantizedWeight:
    layout: str  # "u4" | "s8"
    group: int  # values per scale: 32, or 16 (s8 only)
    out_features: int  # N, rows
    in_features: int  # K, values per row
    codes: torch.Tensor  # u4: uint8 (N, K/2); s8: int8 (N, K)
    scales: torch.Tensor  # float16 | float32 (N, K/group)
    mins: torch.Tensor | None  # like scales, or None (value = scale * code)
    source: str  # what the weights came from: a GGUF type ("Q4_1") or "int8"/"int4"

    def __post_init__(self) -> None:
        N, K = self.out_features, self.in_features
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if K % VALUES_PER_BLOCK or self.group not in (16, 32) or (
                self.layout == "u4" and self.group != 32):
            raise ValueError(f"{self.layout} weights need K a multiple of 32 and groups of 32"
                             f"{' or 16' if self.layout == 's8' else ''}: K={K}, group={self.group}")
        code_shape = (N, K // 2) if self.layout == "u4" else (N, K)
        code_dtype = torch.uint8 if self.layout == "u4" else torch.int8
        if tuple(self.codes.shape) != code_shape or self.codes.dtype != code_dtype:
            raise ValueError(f"{self.layout} codes must be {code_dtype} {code_shape}, got "
                             f"{self.codes.dtype} {tuple(self.codes.shape)}")
        for name, t in (("scales", self.scales), ("mins", self.mins)):
            if t is None:
                continue
            if tuple(t.shape) != (N, K // self.group) or t.dtype != self.scales.dtype or (
                    t.dtype not in (torch.float16, torch.float32)):
                raise ValueError(f"{name} must be float16 or float32 (N, K/group) = "
                                 f"{(N, K // self.group)}, got {t.dtype} {tuple(t.shape)}")

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.codes, self.scales, self.mins) if t is not None)

    @property
    def scales_half(self) -> bool:
        return self.scales.dtype == torch.float16

    def unpacked_codes(self) -> torch.Tensor:
        """(N, K) int16 codes, in value order."""
        if self.layout == "s8":
            return self.codes.to(torch.int16)
        N, K = self.out_features, self.in_features
        blocks = self.codes.view(N, K // 32, 16).to(torch.int16)
        return torch.cat((blocks & 0x0F, blocks >> 4), dim=-1).reshape(N, K)

    def dequantize(self) -> torch.Tensor:
        """(N, K) float32: scale * code, then + min, each rounded in float32 as the
        GGUF reference dequantizes them (the repacking tests compare bit for bit)."""
        N, K = self.out_features, self.in_features
        codes = self.unpacked_codes().float().view(N, K // self.group, self.group)
        values = self.scales.float().unsqueeze(-1) * codes
        if self.mins is not None:
            values = values + self.mins.float().unsqueeze(-1)
        return values.reshape(N, K)

    def to(self, device: torch.device) -> "QuantizedWeight":
        """The same weight with its tensors on `device`."""
        return QuantizedWeight(self.layout, self.group, self.out_features, self.in_features,
                               self.codes.to(device), self.scales.to(device),
                               None if self.mins is None else self.mins.to(device), self.source)

    def select_rows(self, rows: torch.Tensor | np.ndarray) -> "QuantizedWeight":
        """The weight of rows `rows` (a permutation or a subset), losslessly."""
        rows = torch.as_tensor(rows, dtype=torch.int64, device=self.codes.device)
        return QuantizedWeight(self.layout, self.group, len(rows), self.in_features,
                               self.codes[rows].contiguous(), self.scales[rows].contiguous(),
                               None if self.mins is None else self.mins[rows].contiguous(),
                               self.source)


def can_concatenate(weights: list[QuantizedWeight]) -> bool:
    """True when the weights stack into one (same layout, group, K, scale dtype, mins)."""
    first = weights[0]
    return all(w.layout == first.layout and w.group == first.group
               and w.in_features == first.in_features and w.scales.dtype == first.scales.dtype
               and (w.mins is None) == (first.mins is None) for w in weights)


def concatenate(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """Rows of every weight, in order (fused q/k/v, gate/up); can_concatenate holds."""
    first = weights[0]
    return QuantizedWeight(
        first.layout, first.group, sum(w.out_features for w in weights), first.in_features,
        torch.cat([w.codes for w in weights]), torch.cat([w.scales for w in weights]),
        None if first.mins is None else torch.cat([w.mins for w in weights]),
        "/".join(dict.fromkeys(w.source for w in weights)))


def stack_runs(weights: list[QuantizedWeight]) -> list[QuantizedWeight]:
    """Neighbours that can be stacked, stacked: q and k of one type stay one part
    beside a v of another."""
    runs: list[list[QuantizedWeight]] = []
    for weight in weights:
        if runs and can_concatenate([runs[-1][0], weight]):
            runs[-1].append(weight)
        else:
            runs.append([weight])
    return [run[0] if len(run) == 1 else concatenate(run) for run in runs]


def pack_u4(codes: np.ndarray) -> np.ndarray:
    """(N, K) codes in 0..15 -> (N, K/2) uint8 bytes of the u4 layout."""
    N, K = codes.shape
    blocks = codes.astype(np.uint8).reshape(N, K // 32, 2, 16)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(N, K // 2)


def narrowest_scales(*arrays: np.ndarray | None) -> torch.dtype:
    """float16 when every value of every array is exactly a float16, else float32."""
    for a in arrays:
        if a is None:
            continue
        with np.errstate(over="ignore"):
            if not np.array_equal(a.astype(np.float16).astype(np.float32), a):
                return torch.float32
    return torch.float16


def from_arrays(layout: str, group: int, codes: np.ndarray, scales: np.ndarray,
                mins: np.ndarray | None, source: str) -> QuantizedWeight:
    """A QuantizedWeight from (N, K) codes in value order and float32 (N, K/group)
    scales and mins; scales are stored float16 where that is lossless."""
    N, K = codes.shape
    packed = pack_u4(codes) if layout == "u4" else codes.astype(np.int8)
    dtype = narrowest_scales(scales, mins)
    np_dtype = np.float16 if dtype == torch.float16 else np.float32
    return QuantizedWeight(layout, group, N, K, torch.from_numpy(np.ascontiguousarray(packed)),
                           torch.from_numpy(np.ascontiguousarray(scales.astype(np_dtype))),
                           None if mins is None else
                           torch.from_numpy(np.ascontiguousarray(mins.astype(np_dtype))),
                           source)
