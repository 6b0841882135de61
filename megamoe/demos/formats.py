"""The number formats of Mega MoE, as tables and numbers: FP8 e4m3, FP4 e2m1, UE8M0 scales, per-32 quantisation.

:func:`megamoe.figures.quantization_figure` draws :func:`quantization_errors`.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from megamoe.quant import (
    dequant_fp4,
    dequant_fp8,
    e2m1_decode,
    per_token_cast_to_fp4,
    per_token_cast_to_fp8,
    unpack_nibbles,
    unpack_ue8m0,
)


def fp8_e4m3_codes() -> list[dict]:
    """Characteristic FP8 e4m3 codes: the value each decodes to (torch's ``float8_e4m3fn``)."""
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    named = [(0x01, "smallest subnormal (2^-9)"), (0x07, "largest subnormal"), (0x08, "smallest normal (2^-6)"),
             (0x38, "one"), (0x39, "next after one (1 + 2^-3)"), (0x7E, "largest finite"), (0x7F, "NaN"),
             (0xB8, "minus one"), (0xFE, "most negative")]
    return [{"code": f"0x{c:02x}", "bits s.eeee.mmm": f"{c >> 7}.{(c >> 3) & 15:04b}.{c & 7:03b}",
             "value": float(values[c]), "meaning": m} for c, m in named]


def fp8_positive_values() -> torch.Tensor:
    """All positive finite FP8 e4m3 values (float32, ascending)."""
    v = torch.arange(1, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return v


def e2m1_codes() -> list[dict]:
    """The 16 FP4 e2m1 nibbles and their values."""
    nib = torch.arange(16, dtype=torch.uint8)
    vals = e2m1_decode(nib)
    return [{"nibble": f"0b{n:04b}", "sign": n >> 3, "code": n & 7, "value": float(v)} for n, v in
            zip(nib.tolist(), vals.tolist())]


def ue8m0_codes(codes: Sequence[int] = (0, 1, 117, 126, 127, 128, 135, 254, 255)) -> list[dict]:
    """UE8M0 scale bytes and the power of two each means (decoded by ``megamoe.quant.unpack_ue8m0``)."""
    out = []
    for c in codes:
        word = torch.tensor([c | (127 << 8) | (127 << 16) | (127 << 24)], dtype=torch.int64)
        word = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)
        v = float(unpack_ue8m0(word)[0])
        out.append({"byte": c, "value": v, "as 2^(byte-127)": f"2^{c - 127}" if c < 255 else "NaN"})
    return out


def quantization_errors(rows: int = 512, cols: int = 1024, seed: int = 0) -> dict:
    """Quantise Gaussian data per 32 to FP8 (activations) and FP4 (weights); return the data, the dequantised values,
    the per-group amax and the relative-error statistics."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    x8 = dequant_fp8(*per_token_cast_to_fp8(x))
    x4 = dequant_fp4(*per_token_cast_to_fp4(x))
    amax = x.unflatten(-1, (-1, 32)).abs().amax(-1).repeat_interleave(32, -1)
    stats = {}
    for name, q in (("FP8 e4m3", x8), ("FP4 e2m1", x4)):
        err = (q - x)
        stats[name] = {"format": name, "rel. RMS error": float(err.norm() / x.norm()),
                       "max |err| / group amax": float((err.abs() / amax).max()),
                       "exact zeros kept": bool(torch.equal(q[x == 0], x[x == 0]))}
    return {"x": x, "fp8": x8, "fp4": x4, "amax": amax, "stats": list(stats.values())}



def block_scaled_dot_demo(k: int = 256, seed: int = 0) -> list[dict]:
    """Why the kernels issue one ``tl.dot`` per 32-wide K group: a row of FP8 activations times a row of FP4 weights,
    both with a scale per 32. Per-group dots scaled by ``sa*sb`` and summed in float32 equal the exact (float64)
    dot of the dequantised rows up to float32 summation order; one dot over a wider K with a single pair of scales
    (what an MMA over K=64/128 would do without per-32 "promotion") is wrong."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(1, k, generator=g) * torch.logspace(-2, 2, k // 32).repeat_interleave(32)
    b = torch.randn(1, k, generator=g)
    a8, asf = per_token_cast_to_fp8(a)
    b4, bsf = per_token_cast_to_fp4(b)
    exact = float((dequant_fp8(a8, asf).double() * dequant_fp4(b4, bsf).double()).sum())
    sa, sb = unpack_ue8m0(asf)[0], unpack_ue8m0(bsf)[0]
    av = a8.float()[0]
    bv = e2m1_decode(unpack_nibbles(b4))[0]
    rows = []
    for width in (32, 64, 128):
        acc = torch.zeros((), dtype=torch.float32)
        for g0 in range(0, k, width):
            dot = (av[g0:g0 + width] * bv[g0:g0 + width]).sum()  # an MMA over `width` K elements, unscaled
            acc += dot * sa[g0 // 32] * sb[g0 // 32]  # one scale pair per dot: the first group's
        rows.append({"K per dot": width, "scale pairs used": k // width, "result": float(acc), "exact": exact,
                     "relative error": abs(float(acc) - exact) / abs(exact)})
    return rows

