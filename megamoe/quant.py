"""Number formats of the FP8 x FP4 Mega MoE, and the weight layout megamoe's Triton kernels read.

Formats
-------
* **FP8 E4M3** (``torch.float8_e4m3fn``) carries activations: the layer input ``x`` and the L2 input
  (the SwiGLU output). 1 sign, 4 exponent (bias 7) and 3 mantissa bits; largest finite value 448; normals down
  to 2^-6, subnormals in steps of 2^-9. No infinities.
* **FP4 E2M1** carries weights: 1 sign, 2 exponent and 1 mantissa bit. Code ``c`` (0..7) of a nibble is the
  magnitude ``FP4_E2M1_VALUES[c]`` = 0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 of the nibble is the sign. Two nibbles
  per byte, stored as ``torch.int8``; the low nibble holds the element with the smaller index.
* **UE8M0** scale factors: an unsigned 8-bit exponent, value 2^(byte-127); it is exactly the exponent field of a
  float32 power of two. One scale covers 32 consecutive elements along K (the ``(1, 1, 32)`` recipe; the
  only granularity Mega MoE supports). Four bytes are packed little-endian into one int32: byte ``j`` of int
  ``i`` is the scale of group ``4i + j``. An ``[m, k]`` tensor thus has an int32 scale tensor ``[m, k/128]``.

A scale is the smallest power of two with ``amax / scale <= format max`` (448 for FP8, 6 for FP4), where amax
is the group's largest magnitude, floored at 1e-4 so all-zero groups get a finite scale. Dividing by a power
of two is exact, so all rounding happens in the final cast to the narrow format, and dequantisation
(``value * scale``) is exact in float32.

Layouts
-------
Quantised tensors produced here are *K-major*: element ``k`` of row ``n`` is at ``[n, k/2]`` (nibble ``k % 2``)
and its scale is byte ``(k/32) % 4`` of ``sf[n, k/128]``. :func:`transform_weights_for_mega_moe` turns the
K-major expert weights into the layout of megamoe's kernels; :func:`untransform_weights_for_mega_moe` inverts
it exactly.

(Just over 500 lines: the format's quantisers, exact dequantisers, the weight transform and its inverse, and the
Hopper scale fold belong to one number format; the SM90 FP8 format has its own module, ``megamoe.quant_fp8``.)
"""
from __future__ import annotations

import torch

FP8_E4M3_MAX = 448.0
FP4_E2M1_MAX = 6.0
FP4_E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float32)

SF_GRAN_K = 32
"""Elements along K per scale factor."""
SF_PACK = 4
"""UE8M0 scale bytes per int32."""
AMAX_FLOOR = 1e-4
"""Lower bound on a group's amax before its scale is computed (DeepGEMM's value)."""
L1_INTERLEAVE_ROWS = 8
"""Gate and up rows of the L1 weight alternate in runs of this many rows after the transform."""
FP4_REPACK_K = 64
"""K-chunk of the transformed FP4 nibble order (see :func:`transform_weights_for_mega_moe`)."""

# Midpoints between consecutive E2M1 magnitudes. A magnitude exactly on midpoint i (between codes i and i+1)
# rounds to whichever of the two codes has an even mantissa bit (code & 1 == 0): up when i is odd.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)

_FLOAT_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ----------------------------------------------------------------------------------------------------------
# UE8M0 scales
# ----------------------------------------------------------------------------------------------------------


def ceil_to_ue8m0(x: torch.Tensor) -> torch.Tensor:
    """Smallest power of two ``>= x``, computed exactly on the float32 bit pattern (no log2/pow).

    ``x``: float32 tensor of any shape, every element ``> 0`` and finite (not checked). Returns float32 of the
    same shape. Results are at least 2^-126 (the smallest normal float32, UE8M0 byte 1): subnormal inputs map
    to 2^-126. Inputs above 2^127 give ``inf``.
    """
    if x.dtype != torch.float32:
        raise TypeError(f"x: expected torch.float32, got {x.dtype}")
    bits = x.view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    exponent = exponent + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exponent << 23).view(torch.float32)


def pack_ue8m0(scales: torch.Tensor) -> torch.Tensor:
    """Pack float32 power-of-two scales ``[..., g]`` into int32 ``[..., g/4]`` of UE8M0 bytes.

    The byte of a scale is its float32 exponent field ``(bits >> 23) & 0xFF``; byte ``j`` (bits ``8j..8j+7``)
    of output int ``i`` is scale ``4i + j`` (little-endian). ``g`` must be a multiple of 4 and every scale a
    normal, finite, positive power of two (2^-126 .. 2^127), else ``ValueError``.
    """
    if scales.dtype != torch.float32:
        raise TypeError(f"scales: expected torch.float32, got {scales.dtype}")
    if scales.dim() < 1 or scales.shape[-1] % SF_PACK != 0:
        raise ValueError(f"scales: last dimension must be a multiple of {SF_PACK}, got shape {tuple(scales.shape)}")
    bits = scales.contiguous().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    is_power_of_two = ((bits & 0x807FFFFF) == 0) & (exponent > 0) & (exponent < 0xFF)
    if not bool(is_power_of_two.all()):
        raise ValueError("scales: every element must be a positive, normal, finite power of two")
    groups = exponent.to(torch.int64).unflatten(-1, (-1, SF_PACK))
    shifts = torch.arange(SF_PACK, device=scales.device, dtype=torch.int64) * 8
    packed = (groups << shifts).sum(dim=-1)  # in [0, 2^32): wrap to the signed int32 with the same bits
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)
    return packed.to(torch.int32)


def unpack_ue8m0(sf: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_ue8m0`: int32 ``[..., g/4]`` -> float32 ``[..., g]`` with value 2^(byte-127).

    Built from bits, so exact: byte 0 gives 2^-127 (a float32 subnormal) and byte 255 gives NaN (as in the OCP
    MX specification). Any stride layout of ``sf`` is accepted.
    """
    if sf.dtype != torch.int32:
        raise TypeError(f"sf: expected torch.int32, got {sf.dtype}")
    shifts = torch.arange(SF_PACK, device=sf.device, dtype=torch.int64) * 8
    exponent = ((sf.to(torch.int64).unsqueeze(-1) >> shifts) & 0xFF).flatten(-2).to(torch.int32)
    bits = exponent << 23
    bits = torch.where(exponent == 0, torch.full_like(bits, 0x00400000), bits)  # 2^-127
    bits = torch.where(exponent == 0xFF, torch.full_like(bits, 0x7FC00000), bits)  # NaN
    return bits.view(torch.float32)


# ----------------------------------------------------------------------------------------------------------
# E2M1 nibbles
# ----------------------------------------------------------------------------------------------------------


def e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """Round float32 values to E2M1 nibbles: uint8 ``sign << 3 | code``, same shape as ``v``.

    Round to nearest on the grid ``FP4_E2M1_VALUES``; a tie goes to the code with an even mantissa bit
    (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4); magnitudes above 6 saturate to 6. The sign bit
    is the float's sign bit, so negative values that round to zero give the nibble 8 (-0). ``v`` must not
    contain NaN (not checked).
    """
    magnitude = v.abs()
    code = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for i, midpoint in enumerate(_E2M1_MIDPOINTS):
        rounds_up = magnitude >= midpoint if i % 2 == 1 else magnitude > midpoint
        code += rounds_up.to(torch.uint8)
    return code | (torch.signbit(v).to(torch.uint8) << 3)


def e2m1_decode(nibbles: torch.Tensor) -> torch.Tensor:
    """E2M1 nibbles (uint8 ``sign << 3 | code``, any shape) -> float32 values of the same shape."""
    magnitude = FP4_E2M1_VALUES.to(nibbles.device)[(nibbles & 7).long()]
    return torch.where((nibbles & 8) != 0, -magnitude, magnitude)


def pack_nibbles(nibbles: torch.Tensor) -> torch.Tensor:
    """uint8 nibbles ``[..., k]`` -> int8 ``[..., k/2]``; byte ``i`` = nibble ``2i`` | nibble ``2i+1`` << 4."""
    return (nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).view(torch.int8)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: int8 ``[..., k/2]`` -> uint8 nibbles ``[..., k]``."""
    b = packed.view(torch.uint8)
    return torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)


# ----------------------------------------------------------------------------------------------------------
# Quantisation
# ----------------------------------------------------------------------------------------------------------


def _check_float_input(t: torch.Tensor, name: str, gran_k: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOAT_INPUT_DTYPES:
        raise TypeError(f"{name}: expected float32, bfloat16 or float16, got {t.dtype}")
    if gran_k != SF_GRAN_K:
        raise ValueError(f"gran_k: only {SF_GRAN_K} (the (1, 1, 32) recipe) is supported, got {gran_k}")
    if t.dim() < 1 or t.shape[-1] == 0 or t.shape[-1] % (SF_GRAN_K * SF_PACK) != 0:
        raise ValueError(
            f"{name}: last dimension must be a positive multiple of {SF_GRAN_K * SF_PACK}, got shape {tuple(t.shape)}"
        )
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name}: contains NaN or inf")


def _group_scales(t: torch.Tensor, format_max: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Split ``t [..., k]`` into float32 groups ``[..., k/32, 32]`` and their power-of-two scales ``[..., k/32]``."""
    groups = t.float().unflatten(-1, (-1, SF_GRAN_K))
    amax = groups.abs().amax(dim=-1).clamp(min=AMAX_FLOOR)
    return groups, ceil_to_ue8m0(amax / format_max)


def per_token_cast_to_fp8(x: torch.Tensor, gran_k: int = SF_GRAN_K) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise activations per 32 elements to FP8 E4M3 with UE8M0 scales.

    ``x``: ``[m, k]`` float32/bfloat16/float16, ``k % 128 == 0``, finite. Returns ``(x_fp8, sf)``:
    ``x_fp8`` ``[m, k]`` ``torch.float8_e4m3fn`` and ``sf`` int32 ``[m, k/128]`` (packed UE8M0, K-major).
    Per group: ``scale = ceil_to_ue8m0(max(amax, 1e-4) / 448)`` and ``x_fp8 = fp8(x / scale)`` with
    round-to-nearest-even (the division is exact, and ``|x / scale| <= 448`` so nothing saturates).
    """
    _check_float_input(x, "x", gran_k)
    if x.dim() != 2:
        raise ValueError(f"x: expected a 2-D [m, k] tensor, got shape {tuple(x.shape)}")
    groups, scales = _group_scales(x, FP8_E4M3_MAX)
    x_fp8 = (groups / scales.unsqueeze(-1)).to(torch.float8_e4m3fn).flatten(-2)
    return x_fp8, pack_ue8m0(scales)


def _cast_to_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    groups, scales = _group_scales(w, FP4_E2M1_MAX)
    nibbles = e2m1_encode(groups / scales.unsqueeze(-1)).flatten(-2)
    return pack_nibbles(nibbles), pack_ue8m0(scales)


def per_token_cast_to_fp4(w: torch.Tensor, gran_k: int = SF_GRAN_K) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a weight matrix per 32 elements along K to FP4 E2M1 with UE8M0 scales.

    ``w``: ``[n, k]`` float32/bfloat16/float16, ``k % 128 == 0``, finite. Returns ``(w_packed, sf)``:
    ``w_packed`` int8 ``[n, k/2]`` (low nibble = even element, see :func:`pack_nibbles`) and ``sf`` int32
    ``[n, k/128]`` (packed UE8M0, K-major). Per group: ``scale = ceil_to_ue8m0(max(amax, 1e-4) / 6)`` and each
    element is :func:`e2m1_encode` of ``w / scale``.
    """
    _check_float_input(w, "w", gran_k)
    if w.dim() != 2:
        raise ValueError(f"w: expected a 2-D [n, k] tensor, got shape {tuple(w.shape)}")
    return _cast_to_fp4(w)


def cast_grouped_weights_to_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`per_token_cast_to_fp4` for every expert.

    ``w [E, n, k]`` -> (int8 ``[E, n, k/2]``, int32 ``[E, n, k/128]``), each expert quantised independently.
    """
    _check_float_input(w, "w", SF_GRAN_K)
    if w.dim() != 3:
        raise ValueError(f"w: expected a 3-D [E, n, k] tensor, got shape {tuple(w.shape)}")
    return _cast_to_fp4(w)


def _expand_scales(sf: torch.Tensor, k: int, name: str) -> torch.Tensor:
    """Unpacked scales broadcastable over ``[..., k]``, after checking ``sf`` is ``[..., k/128]``."""
    if sf.dtype != torch.int32:
        raise TypeError(f"sf: expected torch.int32, got {sf.dtype}")
    if sf.shape[-1] * SF_GRAN_K * SF_PACK != k:
        raise ValueError(f"sf: last dimension {sf.shape[-1]} does not match {name} (k = {k}, expected k/128)")
    return unpack_ue8m0(sf).repeat_interleave(SF_GRAN_K, dim=-1)


def dequant_fp8(x_fp8: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    """``x_fp8 [..., m, k]`` float8_e4m3fn with ``sf`` int32 ``[..., m, k/128]`` -> float32 ``[..., m, k]`` (exact)."""
    if x_fp8.dtype != torch.float8_e4m3fn:
        raise TypeError(f"x_fp8: expected torch.float8_e4m3fn, got {x_fp8.dtype}")
    if sf.shape[:-1] != x_fp8.shape[:-1]:
        raise ValueError(f"sf: shape {tuple(sf.shape)} does not match x_fp8 {tuple(x_fp8.shape)}")
    return x_fp8.float() * _expand_scales(sf, x_fp8.shape[-1], "x_fp8")


def dequant_fp4(w_packed: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    """``w_packed`` int8 ``[..., n, k/2]`` (K-major nibbles) with ``sf`` int32 ``[..., n, k/128]`` -> float32
    ``[..., n, k]`` (exact)."""
    if w_packed.dtype != torch.int8:
        raise TypeError(f"w_packed: expected torch.int8, got {w_packed.dtype}")
    if sf.shape[:-1] != w_packed.shape[:-1]:
        raise ValueError(f"sf: shape {tuple(sf.shape)} does not match w_packed {tuple(w_packed.shape)}")
    values = e2m1_decode(unpack_nibbles(w_packed))
    return values * _expand_scales(sf, values.shape[-1], "w_packed")


# ----------------------------------------------------------------------------------------------------------
# Hopper numerics: per-32 scales folded into the 8-bit operands (the fused kernel's model)
# ----------------------------------------------------------------------------------------------------------


def ue8m0_bytes(sf: torch.Tensor) -> torch.Tensor:
    """Packed UE8M0 int32 ``[..., g/4]`` -> the exponent bytes as int32 ``[..., g]`` (group order)."""
    if sf.dtype != torch.int32:
        raise TypeError(f"sf: expected torch.int32, got {sf.dtype}")
    shifts = torch.arange(SF_PACK, device=sf.device, dtype=torch.int64) * 8
    return ((sf.to(torch.int64).unsqueeze(-1) >> shifts) & 0xFF).flatten(-2).to(torch.int32)


def fold_scales(values: torch.Tensor, sf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold per-32 power-of-two scales into 8-bit values relative to each row's largest scale.

    ``values``: float32 ``[..., n, k]``, each exactly an FP8 e4m3 or FP4 e2m1 value (before scaling); ``sf``: the
    packed UE8M0 scales ``[..., n, k/128]`` of ``values``. Returns ``(folded, row_byte)``: ``folded``
    float8_e4m3fn ``[..., n, k]`` = ``e4m3(values * 2^(s_g - s_row))`` (round-to-nearest-even) and ``row_byte``
    int32 ``[..., n]`` = ``s_row``, the row's largest scale byte, so that ``folded * 2^(s_row - 127)``
    approximates ``values * scales``. Exact except where a product falls below e4m3's normal range 2^-6, where it
    rounds to the nearest subnormal (absolute error <= 2^-10 * 2^(s_row - 127)). This is the operand form of
    the fused Hopper kernel (``megamoe.kernels.fused``): one scale per row instead of a promotion per 32.
    """
    bytes_ = ue8m0_bytes(sf)
    row = bytes_.amax(dim=-1)
    shift = (bytes_ - row.unsqueeze(-1)).clamp(min=-126).repeat_interleave(SF_GRAN_K, dim=-1)
    folded = (values * torch.pow(2.0, shift.float())).to(torch.float8_e4m3fn)
    return folded, row


#: Fold shifts the weight decode table holds; e2m1 magnitudes (<= 6) times 2^-13 or less all round to 0 in e4m3,
#: so every larger shift reads the last entry.
FOLD_LUT_MAX_SHIFT = 15
#: The e2m1 magnitudes by 3-bit code.
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


#: Weight rows of one block of the transformed FP4 weights (:func:`block_fp4_weights`; the Gluon decode-partition
#: tile's 256 weight rows), and packed bytes of one block row (128 K values: one TMA box row, one K block).
FP4_BLOCK_ROWS = 256
FP4_BLOCK_BYTES = 64


def fp4_weight_offset(n, b, N: int, KH: int):
    """Byte offset of packed byte ``b`` (``< KH = K/2``) of row ``n`` (``< N``) inside one expert's transformed FP4
    weights ``[N, KH]`` (ints or broadcastable integer tensors), blocked by :func:`block_fp4_weights`: the rows in
    blocks of ``FP4_BLOCK_ROWS`` (the last ``N % 256`` rows one shorter block), each block as ``KH / 64`` runs of
    ``rows x 64`` bytes, one per 128-wide K block, row-major inside a run::

        n0 * KH + (b // 64) * rows * 64 + (n - n0) * 64 + b % 64,   n0 = n // 256 * 256,   rows = min(256, N - n0)

    The Triton kernels' ``megamoe.kernels.formats.fp4_weight_offset`` computes the same; the Gluon tiles' TMA
    coordinates (``megamoe.kernels.gemm_fp4_ws._w_coord``) the same for ``N`` a multiple of 256."""
    R, B = FP4_BLOCK_ROWS, FP4_BLOCK_BYTES
    n0 = n // R * R
    rows = (N - n0).clamp(max=R) if isinstance(n0, torch.Tensor) else min(R, N - n0)
    return n0 * KH + (b // B) * rows * B + (n - n0) * B + b % B


def _swap_block_axes(w: torch.Tensor, rows: int, width: int, blocked: bool) -> torch.Tensor:
    """``w [El, N, X]`` (one-byte elements) laid out row-major (``blocked`` False) or blocked by ``rows`` rows x
    ``width`` columns (True: each block contiguous, blocks of a row block in column order; the last ``N % rows`` rows
    one shorter block), as the other layout: a contiguous copy of the same shape and dtype. Each row block of ``R``
    rows is viewed ``[R, X / width, width]`` or ``[X / width, R, width]`` and its first two axes swapped. The FP4
    weights' blocking (:func:`block_fp4_weights`) and the FP8 format's (``megamoe.quant_fp8.block_weights``)."""
    El, N, X = w.shape
    u = w.contiguous().view(torch.uint8)
    out = torch.empty_like(u)
    full = N // rows * rows
    for lo, hi, R in ((0, full, rows), (full, N, N - full)):
        if hi > lo:
            shape = (El, (hi - lo) // R) + ((X // width, R) if blocked else (R, X // width))
            out[:, lo:hi] = u[:, lo:hi].reshape(*shape, width).transpose(2, 3).reshape(El, hi - lo, X)
    return out.view(w.dtype)


def block_fp4_weights(w: torch.Tensor) -> torch.Tensor:
    """Row-major FP4 weight bytes ``w`` (int8 / uint8 ``[El, N, K/2]``, ``N`` a multiple of 128, ``K`` of 128) ->
    the same shape and dtype holding each expert blocked by ``FP4_BLOCK_ROWS`` rows x 128 K
    (:func:`fp4_weight_offset`): every 256 rows' K block is one contiguous 16 KB run, what one ring stage of the FP8 x
    FP4 Gluon tiles reads with one TMA box (instead of 256 pieces of 64 bytes, 3.5 or 1.5 KB apart). The last
    step of :func:`transform_weights_for_mega_moe`. A contiguous copy."""
    El, N, KH = w.shape
    if N % 128 or KH % FP4_BLOCK_BYTES:
        raise ValueError(f"w: rows ({N}) must be a multiple of 128 and packed K ({KH}) of {FP4_BLOCK_BYTES}")
    return _swap_block_axes(w, FP4_BLOCK_ROWS, FP4_BLOCK_BYTES, blocked=False)


def unblock_fp4_weights(w: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`block_fp4_weights`: the row-major ``[El, N, K/2]`` bytes, same dtype (a copy)."""
    return _swap_block_axes(w, FP4_BLOCK_ROWS, FP4_BLOCK_BYTES, blocked=True)


def fp4_weight_rows(w: torch.Tensor, e: int, rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` (int64 ``[n]``) of expert ``e`` of blocked FP4 weights ``w`` ``[El, N, K/2]``, row-major
    ``[n, K/2]`` (a gather by :func:`fp4_weight_offset`)."""
    _, N, KH = w.shape
    b = torch.arange(KH, device=w.device)
    return w[e].reshape(-1)[fp4_weight_offset(rows.to(w.device).long()[:, None], b[None, :], N, KH)]


def fold_lut(device=None) -> torch.Tensor:
    """The fused Hopper kernel's weight-decode table: int32 ``[2 * (FOLD_LUT_MAX_SHIFT + 1)]``.

    Entry pair ``(2d, 2d+1)`` holds, byte ``j`` of the pair's eight bytes (little-endian), the e4m3 bits of
    ``E2M1_MAGNITUDES[j] * 2^-d`` (RNE, as :func:`fold_scales`): FP4 decode and scale fold in one byte lookup
    (``prmt`` on the GPU, four values per instruction), with ``d = s_row - s_g`` per weight row and 32-group.
    Built from torch's own e4m3 cast, so the table is the model and ``tests/test_fused.py`` checks it against
    :func:`fold_scales` for every shift and code."""
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32)
    words = []
    for d in range(FOLD_LUT_MAX_SHIFT + 1):
        b = (mags * 2.0 ** -d).to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int64)
        for half in (b[:4], b[4:]):
            w = int(half[0] | half[1] << 8 | half[2] << 16 | half[3] << 24)
            words.append(w - (1 << 32) if w >= 1 << 31 else w)
    return torch.tensor(words, dtype=torch.int32, device=device)


def fold_to_row_scale_dequant(values: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    """``fold_scales`` then dequantised: float32 ``[..., n, k]`` = ``folded * 2^(s_row - 127)`` (exact)."""
    folded, row = fold_scales(values, sf)
    return folded.float() * torch.pow(2.0, (row - 127).float()).unsqueeze(-1)


def per_128_cast_to_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x`` float32 ``[m, k]`` to FP8 e4m3 with one UE8M0 scale per 128 elements (amax floored at 1e-4,
    ``scale = ceil_to_ue8m0(amax / 448)``, RNE). Scales are returned in the per-32 packed form with all four bytes
    of a word equal, so :func:`dequant_fp8` reads them unchanged: ``(x_fp8 [m, k], sf int32 [m, k/128])``."""
    groups = x.float().unflatten(-1, (-1, SF_GRAN_K * SF_PACK))
    scales = ceil_to_ue8m0(groups.abs().amax(dim=-1).clamp(min=AMAX_FLOOR) / FP8_E4M3_MAX)
    x_fp8 = (groups / scales.unsqueeze(-1)).to(torch.float8_e4m3fn).flatten(-2)
    return x_fp8, pack_ue8m0(scales.repeat_interleave(SF_PACK, dim=-1))


# ----------------------------------------------------------------------------------------------------------
# Expert weights: validation and the kernel layout
# ----------------------------------------------------------------------------------------------------------

QuantWeights = tuple[torch.Tensor, torch.Tensor]
"""``(w int8 [E, n, k/2], sf int32 [E, n, k/128])``: FP4 nibbles and packed UE8M0 scales of E experts."""


def _check_pair(pair: object, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(isinstance(t, torch.Tensor) for t in pair)):
        raise TypeError(f"{name}: expected a (weights, scales) pair of tensors")
    w, sf = pair
    if w.dtype != torch.int8 or sf.dtype != torch.int32:
        raise TypeError(f"{name}: expected (int8, int32) tensors, got ({w.dtype}, {sf.dtype})")
    if w.dim() != 3 or sf.dim() != 3:
        raise ValueError(f"{name}: expected 3-D tensors, got shapes {tuple(w.shape)} and {tuple(sf.shape)}")
    return w, sf


def check_moe_weights(l1_weights: QuantWeights, l2_weights: QuantWeights) -> tuple[int, int, int]:
    """Validate a pair of FP4 expert weights and return ``(num_experts, hidden, intermediate)``.

    ``l1_weights = (int8 [E, 2I, H/2], int32 [E, 2I, H/128])`` (rows ``[0, I)`` gate, ``[I, 2I)`` up) and
    ``l2_weights = (int8 [E, H, I/2], int32 [E, H, I/128])``, with ``H`` and ``I`` multiples of 128 and all
    four tensors on one device. Only shapes, dtypes and devices are checked, so the transformed layout of
    :func:`transform_weights_for_mega_moe` passes as well. Errors name the offending argument.
    """
    w1, sf1 = _check_pair(l1_weights, "l1_weights")
    w2, sf2 = _check_pair(l2_weights, "l2_weights")
    num_experts, two_i, half_h = w1.shape
    hidden, intermediate = 2 * half_h, two_i // 2
    if two_i % 2 != 0 or hidden % 128 != 0 or intermediate % 128 != 0:
        raise ValueError(
            f"l1_weights: shape {tuple(w1.shape)} gives H={hidden}, 2I={two_i}; H and I must be multiples of 128"
        )
    if tuple(sf1.shape) != (num_experts, two_i, hidden // 128):
        raise ValueError(f"l1_weights: scales {tuple(sf1.shape)} do not match weights {tuple(w1.shape)}")
    expected = ((num_experts, hidden, intermediate // 2), (num_experts, hidden, intermediate // 128))
    if (tuple(w2.shape), tuple(sf2.shape)) != expected:
        raise ValueError(
            f"l2_weights: shapes {tuple(w2.shape)}, {tuple(sf2.shape)} do not match l1_weights "
            f"(E={num_experts}, H={hidden}, I={intermediate}: expected {expected[0]}, {expected[1]})"
        )
    if len({t.device for t in (w1, sf1, w2, sf2)}) != 1:
        raise ValueError("l2_weights: l1_weights and l2_weights must all be on one device")
    return num_experts, hidden, intermediate


def _interleave_gate_up(t: torch.Tensor) -> torch.Tensor:
    """``[E, 2I, c]`` with rows gate | up -> rows ``[gate0..7, up0..7, gate8..15, up8..15, ...]``."""
    e, two_i, c = t.shape
    gate, up = t.view(e, 2, two_i // (2 * L1_INTERLEAVE_ROWS), L1_INTERLEAVE_ROWS, c).unbind(1)
    return torch.stack((gate, up), dim=2).reshape(e, two_i, c)


def _deinterleave_gate_up(t: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_interleave_gate_up`."""
    e, two_i, c = t.shape
    pairs = t.reshape(e, two_i // (2 * L1_INTERLEAVE_ROWS), 2, L1_INTERLEAVE_ROWS, c)
    return pairs.transpose(1, 2).reshape(e, two_i, c)


#: Packed bytes a piece of :func:`_repack_nibbles` / :func:`_unrepack_nibbles` works on at once: their int64
#: intermediates take ~40x the piece, so one V4-Pro weight tensor (8.5 GB) is done in pieces, not whole.
_REPACK_PIECE_BYTES = 1 << 24


def _by_pieces(fn, w: torch.Tensor) -> torch.Tensor:
    """``fn`` (int8 ``[rows, k/2]`` -> int8, same shape) over ``w`` ``[..., k/2]``, a bounded number of rows at a
    time (:data:`_REPACK_PIECE_BYTES`)."""
    flat = w.reshape(-1, w.shape[-1])
    out = torch.empty_like(flat)
    rows = max(1, _REPACK_PIECE_BYTES // max(1, flat.shape[-1]))
    for r in range(0, flat.shape[0], rows):
        out[r: r + rows] = fn(flat[r: r + rows])
    return out.view(w.shape)


def per_expert(fn, w: torch.Tensor) -> torch.Tensor:
    """``fn`` (one expert's weights ``[1, N, X]`` -> a new tensor of that shape and dtype) over every expert of ``w``
    ``[El, N, X]``, into one contiguous output of ``w``'s shape and dtype. The weight (un)transforms of both formats
    run their steps through it, so their temporaries are one expert's: whole-tensor steps held ~3 extra copies of
    the tensor at their peak (one EP8 rank's V4-Pro L1 FP8 weights are 15.75 GiB), and the real-size FP8 GPU tests
    ran out of an 80 GB H100's memory in ``transform_weights_for_mega_moe_sm90`` (session 39)."""
    out = torch.empty(w.shape, dtype=w.dtype, device=w.device)
    for e in range(w.shape[0]):
        out[e] = fn(w[e: e + 1])[0]
    return out


def _repack_rows(w: torch.Tensor) -> torch.Tensor:
    chunks = unpack_nibbles(w).long().unflatten(-1, (-1, 2, FP4_REPACK_K // 2 // 4, 4))  # [..., c, lo/hi, q, i]
    lo, hi = chunks[..., 0, :, :], chunks[..., 1, :, :]
    i = torch.arange(4, device=w.device)
    word = (((lo & 7) << (4 * i)) | ((lo >> 3) << (8 * i + 7)) | ((hi & 7) << (16 + 4 * i))
            | ((hi >> 3) << (8 * i + 3))).sum(dim=-1)  # disjoint bits: the sum is the OR
    lanes = (word.unsqueeze(-1) >> (8 * i)) & 0xFF  # the word's little-endian bytes
    return lanes.to(torch.uint8).flatten(-3).view(torch.int8)


def _unrepack_rows(w: torch.Tensor) -> torch.Tensor:
    lanes = w.view(torch.uint8).long().unflatten(-1, (-1, FP4_REPACK_K // 2 // 4, 4))  # [..., c, q, i]
    i = torch.arange(4, device=w.device)
    word = (lanes << (8 * i)).sum(dim=-1, keepdim=True)
    lo = ((word >> (4 * i)) & 7) | (((word >> (8 * i + 7)) & 1) << 3)
    hi = ((word >> (16 + 4 * i)) & 7) | (((word >> (8 * i + 3)) & 1) << 3)
    nibbles = torch.stack((lo, hi), dim=-3).flatten(-4).to(torch.uint8)  # [..., c, lo/hi, q, i] -> K order
    return pack_nibbles(nibbles)


def _repack_nibbles(w: torch.Tensor) -> torch.Tensor:
    """K-major nibbles ``[..., k/2]`` -> the kernel order of :func:`transform_weights_for_mega_moe` (b): per
    64-element chunk ``c``, byte lane ``j`` (0..31) carries element ``64c + j`` ("low") and ``64c + 32 + j``
    ("high"), and each little-endian 32-bit word of lanes ``4q .. 4q + 3`` holds their bits in register order:
    lane ``i``'s low magnitude (3 bits) at bit ``4i``, its sign at bit ``8i + 7``; its high magnitude at bit
    ``16 + 4i``, its sign at bit ``8i + 3``."""
    return _by_pieces(_repack_rows, w)


def _unrepack_nibbles(w: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_repack_nibbles`."""
    return _by_pieces(_unrepack_rows, w)


def _to_mn_major(sf: torch.Tensor) -> torch.Tensor:
    """``[E, N, K/128]`` with strides ``(N*K/128, 1, N)``: the N index is contiguous."""
    return sf.transpose(1, 2).contiguous().transpose(1, 2)


class TaggedWeights(tuple):
    """A ``(w, sf)`` weight pair tagged with its ``role`` (``"l1"`` or ``"l2"``): the common base of each format's
    transformed weights (:class:`TransformedWeights`, ``megamoe.quant_fp8.TransformedWeightsSM90``). It unpacks,
    indexes and iterates like the plain pair; the ops accept only their own format's subclass, and the transforms
    refuse to run twice. Build one only through its transform (or :meth:`to`)."""

    ROLES = ("l1", "l2")

    def __new__(cls, w: torch.Tensor, sf: torch.Tensor, role: str):
        if role not in cls.ROLES:
            raise ValueError(f"role={role!r} must be one of {cls.ROLES}")
        obj = super().__new__(cls, (w, sf))
        obj.role = role
        return obj

    def __reduce__(self):
        return type(self), (self[0], self[1], self.role)

    @property
    def w(self) -> torch.Tensor:
        return self[0]

    @property
    def sf(self) -> torch.Tensor:
        return self[1]

    def to(self, device) -> "TaggedWeights":
        """The same pair on ``device`` (layout and strides kept)."""
        return type(self)(self[0].to(device), self[1].to(device), self.role)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(role={self.role!r}, w={tuple(self[0].shape)} {self[0].dtype}, "
                f"sf={tuple(self[1].shape)} {self[1].dtype}, device={self[0].device})")


class TransformedWeights(TaggedWeights):
    """One weight pair in the kernel layout, as returned by :func:`transform_weights_for_mega_moe`.

    A ``(w, sf)`` tuple -- it unpacks, indexes and iterates like the plain pair (``w`` int8 ``[El, N, K/2]``,
    ``sf`` int32 ``[El, N, K/128]`` MN-major) -- tagged with ``role`` (``"l1"`` or ``"l2"``), so that the op can
    tell transformed weights from untransformed ones (which it rejects instead of computing garbage), and the
    transform can refuse to run twice. Build it only through the transform (or :meth:`to`). ``w`` is blocked by
    256 rows x 128 K (:func:`block_fp4_weights`): index it through :meth:`rows`, not directly.
    """

    def rows(self) -> torch.Tensor:
        """The weight bytes in row order, int8 ``[El, N, K/2]`` (a copy): transformed row ``n`` at ``[:, n]`` (L1
        rows interleaved gate / up by 8, nibbles in the transform's order)."""
        return unblock_fp4_weights(self[0])


def _check_untransformed(pair, name: str) -> None:
    """Reject weights that already are in the kernel layout (they would be permuted a second time)."""
    if isinstance(pair, TransformedWeights):
        raise TypeError(f"{name}: these weights are already transformed (the output of "
                        "transform_weights_for_mega_moe); transforming them again would scramble them. Pass the "
                        "untransformed FP4 weights (e.g. from cast_grouped_weights_to_fp4), or use the transformed "
                        "ones directly")
    sf = pair[1]
    if sf.shape[2] > 1 and sf.shape[1] > 1 and not sf.is_contiguous() and sf.transpose(1, 2).is_contiguous():
        raise ValueError(f"{name}: the scales are MN-major, as transform_weights_for_mega_moe leaves them; "
                         "untransformed weights have K-major (contiguous) scales. Were these weights transformed "
                         "already?")


def transform_weights_for_mega_moe(
    l1_weights: QuantWeights, l2_weights: QuantWeights, activation: str = "swiglu"
) -> tuple[TransformedWeights, TransformedWeights]:
    """Re-lay K-major FP4 expert weights into the layout megamoe's Triton kernels read.

    Inputs (as from :func:`cast_grouped_weights_to_fp4`, for the ``El`` experts a rank owns):
    ``l1_weights = (int8 [El, 2I, H/2], int32 [El, 2I, H/128])`` with rows ``[0, I)`` gate and ``[I, 2I)`` up,
    and ``l2_weights = (int8 [El, H, I/2], int32 [El, H, I/128])``; ``H``, ``I`` multiples of 128.

    Returns ``((l1_w, l1_sf), (l2_w, l2_sf))`` as two :class:`TransformedWeights` (tuples tagged ``"l1"`` /
    ``"l2"``; ``fp8_fp4_mega_moe`` accepts nothing else), same shapes and dtypes, with four changes:

    a. **L1 gate/up interleave** (L1 weights and scales): rows become
       ``[gate0..7, up0..7, gate8..15, up8..15, ...]``, as DeepGEMM's ``_interleave_weights(gran=8)``. Every
       16-row period holds matching gate and up rows, so an L1 output tile of ``2*BN`` weight rows contains
       ``BN`` complete gate/up pairs and the SwiGLU epilogue needs no exchange across tiles.
    b. **Nibble order** (L1 and L2 weights): along K, in chunks of 64 elements, byte lane ``j`` (0..31) of
       chunk ``c`` carries element ``64c + j`` ("low") and element ``64c + 32 + j`` ("high"). The low values of
       lanes ``4q .. 4q + 3`` are one 4-byte register of a 32-wide FP8 dot operand, their high values one of the
       next operand, each in exactly one per-32 scale group. Within each little-endian 32-bit word of lanes
       ``4q .. 4q + 3`` the bits are in **register order**: lane ``i``'s low magnitude (e2m1's 3 bits) at bit
       ``4i``, its sign at bit ``8i + 7``, its high magnitude at bit ``16 + 4i``, its sign at bit ``8i + 3``. So a
       byte-permute lookup (``prmt``, whose selector is a word's low 16 bits) takes the masked word itself as the
       selector of the four low values and the word shifted by 16 as that of the four high ones, and each half's
       signs are one mask (of the word, or the word shifted by 4) away from bit 7 of their bytes: 7 instructions
       per 8 values (``megamoe.kernels.numerics``) where a byte per (low, high) pair took ~12.
    c. **MN-major scales** (L1 and L2): shape stays ``[El, N, K/128]`` but strides become
       ``(N*K/128, 1, N)``, like DeepGEMM's MN-major SF, so a kernel reads one int32 per ``(k/128, n)`` with
       ``n`` contiguous. (DeepGEMM's further UTCCP row permutation is an SM100 tensor-memory detail and is
       not applied.)
    d. **Blocked weight bytes** (L1 and L2 weights, megamoe's own step, not DeepGEMM's; after a. and b.): each
       expert's rows in blocks of 256, each block's 128-wide K block one contiguous run of 256 x 64 bytes
       (:func:`block_fp4_weights`, addresses by :func:`fp4_weight_offset`; read rows through
       :meth:`TransformedWeights.rows`), so that a ring stage of the Gluon tiles reads one 16 KB run. Measured on
       H100s (``results/probes/blocked_runs/``, session 37): against a row-major read in one run, 2.4 / 2.1 / 1.4 %
       less time a call at T = 32 / 128 / 512, even at 2048, the same bits; this layout on a second machine kept
       the T = 32 / 128 times (661 / 691 us) but not T = 512's (1051-1060 against 1039). The FP8 format blocks
       its weights alike (``megamoe.quant_fp8.block_weights``).

    Errors name ``l1_weights``/``l2_weights`` for bad dtypes or shapes, and for weights already transformed (a
    :class:`TransformedWeights`, or MN-major scales); ``activation`` must be ``"swiglu"``.
    """
    if activation != "swiglu":
        raise ValueError(f"activation: only 'swiglu' is supported, got {activation!r}")
    check_moe_weights(l1_weights, l2_weights)
    _check_untransformed(l1_weights, "l1_weights")
    _check_untransformed(l2_weights, "l2_weights")
    (w1, sf1), (w2, sf2) = l1_weights, l2_weights
    l1 = TransformedWeights(per_expert(lambda w: block_fp4_weights(_repack_nibbles(_interleave_gate_up(w))), w1),
                            _to_mn_major(_interleave_gate_up(sf1.contiguous())), "l1")
    l2 = TransformedWeights(per_expert(lambda w: block_fp4_weights(_repack_nibbles(w)), w2), _to_mn_major(sf2), "l2")
    return l1, l2


def untransform_weights_for_mega_moe(
    l1_weights: QuantWeights, l2_weights: QuantWeights
) -> tuple[QuantWeights, QuantWeights]:
    """Exact inverse of :func:`transform_weights_for_mega_moe`: its two :class:`TransformedWeights` -> plain
    contiguous K-major ``(w, sf)`` pairs."""
    check_moe_weights(l1_weights, l2_weights)
    for name, pair, role in (("l1_weights", l1_weights, "l1"), ("l2_weights", l2_weights, "l2")):
        if not (isinstance(pair, TransformedWeights) and pair.role == role):
            raise TypeError(f"{name}: expected the {role} TransformedWeights from transform_weights_for_mega_moe, "
                            f"got {type(pair).__name__}" + (f" of role {pair.role!r}"
                                                            if isinstance(pair, TransformedWeights) else ""))
    (w1, sf1), (w2, sf2) = l1_weights, l2_weights
    l1 = (per_expert(lambda w: _deinterleave_gate_up(_unrepack_nibbles(unblock_fp4_weights(w))), w1),
          _deinterleave_gate_up(sf1.contiguous()))
    l2 = (per_expert(lambda w: _unrepack_nibbles(unblock_fp4_weights(w)), w2), sf2.contiguous())
    return l1, l2
