"""Number formats of DeepGEMM's SM90 ``fp8_mega_moe``: FP8 x FP8 with fp32 block scales, recipe (128, 128, 128).

The second format of megamoe, next to the Blackwell ``fp8_fp4_mega_moe`` format of :mod:`megamoe.quant`.

Formats
-------
* **Activations, 1 x 128** (the layer input ``x`` and the L2 input): FP8 e4m3 values with one **fp32** scale per
  token and 128 consecutive columns. ``x [m, k]`` has scales ``sf float32 [m, k/128]`` (K-major, unpacked).
* **Weights, 128 x 128**: FP8 e4m3 values with one **fp32** scale per block of 128 rows (N) x 128 columns (K).
  ``w [n, k]`` has scales ``sf float32 [n/128, k/128]``; expert weights ``[E, n, k]`` have ``[E, n/128, k/128]``.

Scale rule (DeepGEMM ``deep_gemm/utils/math.py``: ``per_token_cast_to_fp8(x, use_ue8m0=False, gran_k=128)`` and
``per_block_cast_to_fp8(x, use_ue8m0=False)``; on SM90 DeepGEMM's tests pass ``use_ue8m0=False``, UE8M0 rounding
being the SM100 recipe): per group, ``amax = max(|x|)`` floored at ``1e-4``, ``sf = amax / 448`` in float32 (*not*
rounded to a power of two), and ``q = e4m3(x * (1 / sf))`` -- the reciprocal is taken first, in float32, then
multiplied, exactly as DeepGEMM writes it, round-to-nearest-even. ``x * (1/sf)`` may exceed 448 by an ulp; the
cast rounds it back to 448 (e4m3's next value would be 480, the midpoint 464). Dequantisation is ``q * sf``; unlike
the UE8M0 format it is not exact in float32 (a 4-bit by 24-bit significand product), so
:func:`dequant_fp8_per_token_128` / :func:`dequant_fp8_block` take a ``dtype`` (float64 is exact).

L2 input: the L1 output (SwiGLU x top-k weight) is requantised with the same 1 x 128 rule (:data:`L2_ACT_SF_GRAN_K`).
Some SM90 builds use one scale per 64 columns there (so that an L1 epilogue tile of 64 columns owns its scale) and
round it up to a power of two (sgl-project/DeepGEMM's ``sm90_fp8_mega_moe.cuh``,
``sm90_fp8_mega_moe_get_e4m3_sf_and_sf_inv``); megamoe follows the issue's per-128 fp32 form, which is the
``per_token_cast_to_fp8`` rule DeepEP's dispatch also produces.

Weight transform
----------------
:func:`transform_weights_for_mega_moe_sm90` mirrors DeepGEMM's SM90 transform (``deep_gemm/mega/__init__.py``,
``transform_weights_for_mega_moe_sm90``): the L1 weight rows are interleaved gate/up by 8
(``[gate0..7, up0..7, gate8..15, ...]``, :data:`megamoe.quant.L1_INTERLEAVE_ROWS`); **the scales are not touched**.
An 8-row interleave cannot be applied to 128-row scale blocks (one scale row covers 128 gate *or* 128 up rows), so
the L1 scales stay in their natural ``[El, 2I/128, H/128]`` layout, gate blocks ``[0, I/128)`` then up blocks
``[I/128, 2I/128)``; the kernel maps a transformed row back to its original row and reads that row's block: an
interleaved tile of 128 weight rows ``[128 t, 128 t + 128)`` holds gate rows ``[64 t, 64 t + 64)`` and the same up
rows, so it reads ``sf[t // 2]`` (gate) and ``sf[I/128 + t // 2]`` (up) -- DeepGEMM's ``gate_sf_n = n_block_idx / 2``,
``up_sf_n = I/128 + n_block_idx / 2`` (``sm90_fp8_mega_moe.cuh``). L2 weights and scales are unchanged. Scales stay
row-major (K contiguous per 128-row block), as DeepGEMM's ``check_sf_layout(..., (128, 128), kFloat)``.

Then both weights' bytes are **blocked by 128 x 128** (:func:`block_weights`, megamoe's own step, not DeepGEMM's):
the tensor keeps its shape ``[El, N, K]`` but holds each expert as ``[N/128, K/128, 128, 128]`` -- weight block
``(n // 128, k // 128)`` is one run of 16 KB, row ``n % 128`` at ``128 * (n % 128)`` inside it -- so the value of
row ``n``, column ``k`` is at byte ``((n // 128) * K/128 + k // 128) * 16384 + (n % 128) * 128 + k % 128`` of its
expert (:func:`weight_offset`; the Triton tiles compute the same, the Gluon phase's TMA boxes are whole blocks).
Why: a GEMM streams a weight tile as ``[rows, 128]`` boxes, one K block at a time; row-major, such a box is 128
runs of 128 bytes ``K`` bytes apart and HBM serves it below its streaming rate; blocked, it is one run. Measured on
an H200 (``tiled`` rows of ``results/probes/fp8_ws_probe_h200.jsonl``, the same kernel reading a blocked copy,
whole ``fp8_mega_moe`` call): T = 32 810 -> 777 us, 128 832 -> 801, 512 956 -> 908; T = 2048 / 8192 (compute-bound)
unchanged within the run's spread. Read rows back with :meth:`TransformedWeightsSM90.rows`.

Because the transform only permutes bytes, transformed and untransformed weights have the same shapes and dtypes;
the result is a :class:`TransformedWeightsSM90` (tagged tuple) and the op accepts nothing else.
"""
from __future__ import annotations

import torch

from megamoe.quant import (
    AMAX_FLOOR,
    FP8_E4M3_MAX,
    L1_INTERLEAVE_ROWS,
    TaggedWeights,
    _deinterleave_gate_up,
    _interleave_gate_up,
    _swap_block_axes,
    per_expert,
)

FP8_BLOCK = 128
"""Elements per scale along K (activations and weights) and rows per weight scale along N."""
SM90_RECIPE = (FP8_BLOCK, FP8_BLOCK, FP8_BLOCK)
"""DeepGEMM's ``recipe`` argument of ``fp8_mega_moe``: (M, N, K) scale granularity; the only one supported."""
L2_ACT_SF_GRAN_K = FP8_BLOCK
"""Columns per fp32 scale of the requantised L1 output (the L2 input)."""
FORMAT = "fp8"
"""The :class:`megamoe.layout.Layout` format name of this module's tensors (the other one is ``"fp8_fp4"``)."""

_FLOAT_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

__all__ = ["FP8_BLOCK", "SM90_RECIPE", "L2_ACT_SF_GRAN_K", "FORMAT", "block_weights", "unblock_weights",
           "weight_offset", "per_token_cast_to_fp8_128",
           "per_block_cast_to_fp8", "cast_grouped_weights_to_fp8", "dequant_fp8_per_token_128", "dequant_fp8_block",
           "check_moe_weights_fp8", "TransformedWeightsSM90", "transform_weights_for_mega_moe_sm90",
           "untransform_weights_for_mega_moe_sm90", "expand_block_scales", "l1_original_rows"]


def _check_float(t, name: str, dims: tuple[int, ...], multiple_dims: tuple[int, ...]) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOAT_INPUT_DTYPES:
        raise TypeError(f"{name}: expected float32, bfloat16 or float16, got {t.dtype}")
    if t.dim() not in dims:
        raise ValueError(f"{name}: expected a {' or '.join(f'{d}-D' for d in dims)} tensor, got shape {tuple(t.shape)}")
    for d in multiple_dims:
        if t.shape[d] == 0 or t.shape[d] % FP8_BLOCK:
            raise ValueError(f"{name}: dimension {d % t.dim()} must be a positive multiple of {FP8_BLOCK}, got shape "
                             f"{tuple(t.shape)}")
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name}: contains NaN or inf")


def per_token_cast_to_fp8_128(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise activations to FP8 e4m3 with one fp32 scale per token and 128 columns (the SM90 1 x 128 format).

    ``x``: ``[m, k]`` float32/bfloat16/float16, ``k % 128 == 0``, finite. Returns ``(x_fp8 float8_e4m3fn [m, k],
    sf float32 [m, k/128])`` with ``sf = max(amax, 1e-4) / 448`` and ``x_fp8 = e4m3(x * (1 / sf))`` (see the module
    docstring; DeepGEMM ``per_token_cast_to_fp8(x, use_ue8m0=False, gran_k=128)``). ``m`` may be 0.
    """
    _check_float(x, "x", (2,), (1,))
    groups = x.float().unflatten(-1, (-1, FP8_BLOCK))
    sf = groups.abs().amax(dim=-1).clamp(min=AMAX_FLOOR) / FP8_E4M3_MAX
    x_fp8 = (groups * (1.0 / sf).unsqueeze(-1)).to(torch.float8_e4m3fn).flatten(-2)
    return x_fp8, sf


def _block_cast(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., n, k]`` -> (fp8 ``[..., n, k]``, fp32 ``[..., n/128, k/128]``) with one scale per 128 x 128 block."""
    *lead, n, k = w.shape
    blocks = w.float().reshape(*lead, n // FP8_BLOCK, FP8_BLOCK, k // FP8_BLOCK, FP8_BLOCK)
    sf = blocks.abs().amax(dim=(-3, -1)).clamp(min=AMAX_FLOOR) / FP8_E4M3_MAX
    inv = (1.0 / sf)[..., :, None, :, None]
    q = (blocks * inv).to(torch.float8_e4m3fn).reshape(*lead, n, k)
    return q, sf


def per_block_cast_to_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a weight matrix to FP8 e4m3 with one fp32 scale per 128 x 128 block (the SM90 weight format).

    ``w``: ``[n, k]`` float32/bfloat16/float16 with ``n``, ``k`` multiples of 128 (DeepGEMM zero-pads other sizes;
    Mega MoE's never need it), finite. Returns ``(w_fp8 float8_e4m3fn [n, k], sf float32 [n/128, k/128])``, per block
    ``sf = max(amax, 1e-4) / 448`` and ``w_fp8 = e4m3(w * (1 / sf))`` (DeepGEMM ``per_block_cast_to_fp8(w,
    use_ue8m0=False)``).
    """
    _check_float(w, "w", (2,), (0, 1))
    return _block_cast(w)


def cast_grouped_weights_to_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`per_block_cast_to_fp8` for every expert: ``w [E, n, k]`` -> (fp8 ``[E, n, k]``, fp32 ``[E, n/128,
    k/128]``), each expert (and each block) quantised independently."""
    _check_float(w, "w", (3,), (1, 2))
    return _block_cast(w)


def _check_fp8(t, name: str) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float8_e4m3fn:
        raise TypeError(f"{name}: expected a torch.float8_e4m3fn tensor, got "
                        f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")


def _check_sf(sf, name: str, expected: tuple[int, ...]) -> None:
    if not isinstance(sf, torch.Tensor) or sf.dtype != torch.float32:
        raise TypeError(f"{name}: expected a torch.float32 tensor of scales, got "
                        f"{sf.dtype if isinstance(sf, torch.Tensor) else type(sf).__name__}")
    if tuple(sf.shape) != tuple(expected):
        raise ValueError(f"{name}: expected shape {tuple(expected)}, got {tuple(sf.shape)}")


def dequant_fp8_per_token_128(x_fp8: torch.Tensor, sf: torch.Tensor, dtype: torch.dtype = torch.float32
                              ) -> torch.Tensor:
    """``x_fp8 [..., m, k]`` with ``sf float32 [..., m, k/128]`` -> ``dtype`` ``[..., m, k]`` = ``x_fp8 * sf``
    (the product rounded once to ``dtype``; exact in float64)."""
    _check_fp8(x_fp8, "x_fp8")
    if x_fp8.shape[-1] % FP8_BLOCK:
        raise ValueError(f"x_fp8: last dimension must be a multiple of {FP8_BLOCK}, got shape {tuple(x_fp8.shape)}")
    _check_sf(sf, "sf", (*x_fp8.shape[:-1], x_fp8.shape[-1] // FP8_BLOCK))
    return x_fp8.to(dtype) * sf.to(dtype).repeat_interleave(FP8_BLOCK, dim=-1)


def expand_block_scales(sf: torch.Tensor) -> torch.Tensor:
    """Block scales ``[..., n/128, k/128]`` -> one per element ``[..., n, k]`` (same dtype)."""
    return sf.repeat_interleave(FP8_BLOCK, dim=-2).repeat_interleave(FP8_BLOCK, dim=-1)


def dequant_fp8_block(w_fp8: torch.Tensor, sf: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``w_fp8 [..., n, k]`` with block scales ``sf float32 [..., n/128, k/128]`` -> ``dtype`` ``[..., n, k]``
    (rows in the *untransformed* order; exact in float64)."""
    _check_fp8(w_fp8, "w_fp8")
    if w_fp8.dim() < 2 or w_fp8.shape[-1] % FP8_BLOCK or w_fp8.shape[-2] % FP8_BLOCK:
        raise ValueError(f"w_fp8: the last two dimensions must be multiples of {FP8_BLOCK}, got shape "
                         f"{tuple(w_fp8.shape)}")
    _check_sf(sf, "sf", (*w_fp8.shape[:-2], w_fp8.shape[-2] // FP8_BLOCK, w_fp8.shape[-1] // FP8_BLOCK))
    return w_fp8.to(dtype) * expand_block_scales(sf.to(dtype))


# ----------------------------------------------------------------------------------------------------------
# Expert weights
# ----------------------------------------------------------------------------------------------------------

Fp8Weights = tuple[torch.Tensor, torch.Tensor]
"""``(w float8_e4m3fn [E, n, k], sf float32 [E, n/128, k/128])``: FP8 values and 128 x 128 block scales."""


def _check_pair(pair, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(isinstance(t, torch.Tensor) for t in pair)):
        raise TypeError(f"{name}: expected a (weights, scales) pair of tensors")
    w, sf = pair
    if w.dtype != torch.float8_e4m3fn or sf.dtype != torch.float32:
        raise TypeError(f"{name}: expected (float8_e4m3fn, float32) tensors (FP8 weights with 128x128 fp32 block "
                        f"scales), got ({w.dtype}, {sf.dtype})")
    if w.dim() != 3 or sf.dim() != 3:
        raise ValueError(f"{name}: expected 3-D tensors, got shapes {tuple(w.shape)} and {tuple(sf.shape)}")
    return w, sf


def check_moe_weights_fp8(l1_weights: Fp8Weights, l2_weights: Fp8Weights) -> tuple[int, int, int]:
    """Validate a pair of FP8 expert weights; return ``(num_experts, hidden, intermediate)``.

    ``l1_weights = (float8_e4m3fn [E, 2I, H], float32 [E, 2I/128, H/128])`` (rows ``[0, I)`` gate, ``[I, 2I)`` up, or
    the interleaved order of the transform) and ``l2_weights = (float8_e4m3fn [E, H, I], float32 [E, H/128, I/128])``;
    ``H`` and ``I`` multiples of 128, all on one device. Errors name the argument.
    """
    w1, sf1 = _check_pair(l1_weights, "l1_weights")
    w2, sf2 = _check_pair(l2_weights, "l2_weights")
    num_experts, two_i, hidden = w1.shape
    intermediate = two_i // 2
    if two_i % 2 or hidden % FP8_BLOCK or intermediate % FP8_BLOCK or hidden == 0 or intermediate == 0:
        raise ValueError(f"l1_weights: shape {tuple(w1.shape)} gives H={hidden}, 2I={two_i}; H and I must be "
                         f"positive multiples of {FP8_BLOCK}")
    if tuple(sf1.shape) != (num_experts, two_i // FP8_BLOCK, hidden // FP8_BLOCK):
        raise ValueError(f"l1_weights: scales {tuple(sf1.shape)} do not match weights {tuple(w1.shape)} (expected "
                         f"{(num_experts, two_i // FP8_BLOCK, hidden // FP8_BLOCK)}: one per 128x128 block)")
    expected = ((num_experts, hidden, intermediate),
                (num_experts, hidden // FP8_BLOCK, intermediate // FP8_BLOCK))
    if (tuple(w2.shape), tuple(sf2.shape)) != expected:
        raise ValueError(f"l2_weights: shapes {tuple(w2.shape)}, {tuple(sf2.shape)} do not match l1_weights "
                         f"(E={num_experts}, H={hidden}, I={intermediate}: expected {expected[0]}, {expected[1]})")
    if len({t.device for t in (w1, sf1, w2, sf2)}) != 1:
        raise ValueError("l2_weights: l1_weights and l2_weights must all be on one device")
    return num_experts, hidden, intermediate


class TransformedWeightsSM90(TaggedWeights):
    """One FP8 weight pair in the layout of :func:`transform_weights_for_mega_moe_sm90`: a ``(w, sf)`` tuple tagged
    with ``role`` (``"l1"``/``"l2"``) and ``format = "fp8"``, so that ``fp8_mega_moe`` rejects untransformed
    weights (which have the same shapes and dtypes: the transform only permutes bytes) and the FP4 weights of the
    other format, and the transform refuses to run twice. Build it only through the transform (or :meth:`to`).
    ``w`` is blocked by 128 x 128 (module docstring): index it through :meth:`rows`, not directly."""

    format = FORMAT

    def rows(self) -> torch.Tensor:
        """The weights in row order, ``float8_e4m3fn [El, N, K]`` (a copy): transformed row ``n`` at ``[:, n]``
        (L1 rows still interleaved gate / up by 8)."""
        return unblock_weights(self[0])


def block_weights(w: torch.Tensor) -> torch.Tensor:
    """``[El, N, K]`` row-major -> the same shape holding each expert as ``[N/128, K/128, 128, 128]`` (module
    docstring); N and K multiples of 128. A copy, contiguous."""
    return _swap_block_axes(w, FP8_BLOCK, FP8_BLOCK, blocked=False)


def unblock_weights(w: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`block_weights`: the row-major ``[El, N, K]`` (a copy)."""
    return _swap_block_axes(w, FP8_BLOCK, FP8_BLOCK, blocked=True)


def weight_offset(n, k, K: int):
    """Element offset of row ``n``, column ``k`` inside one expert's blocked weights ``[N, K]`` (ints or integer
    tensors): ``((n // 128) * K/128 + k // 128) * 128^2 + (n % 128) * 128 + k % 128``. The Triton tiles
    (``megamoe.kernels.gemm_fp8._block_step``) and the Gluon phase's box coordinates compute the same."""
    B = FP8_BLOCK
    return ((n // B) * (K // B) + k // B) * (B * B) + (n % B) * B + k % B


def _interleave_fp8(w: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    fn = _deinterleave_gate_up if inverse else _interleave_gate_up
    return fn(w.contiguous().view(torch.uint8)).contiguous().view(torch.float8_e4m3fn)


def transform_weights_for_mega_moe_sm90(
    l1_weights: Fp8Weights, l2_weights: Fp8Weights
) -> tuple[TransformedWeightsSM90, TransformedWeightsSM90]:
    """Re-lay FP8 expert weights for ``fp8_mega_moe`` (DeepGEMM ``transform_weights_for_mega_moe_sm90``).

    Inputs as from :func:`cast_grouped_weights_to_fp8` for a rank's ``El`` experts: ``l1_weights = (float8_e4m3fn
    [El, 2I, H], float32 [El, 2I/128, H/128])`` rows gate then up, ``l2_weights = (float8_e4m3fn [El, H, I], float32
    [El, H/128, I/128])``. Returns two :class:`TransformedWeightsSM90` (contiguous, same shapes): L1 weight rows
    interleaved gate/up by 8, both weights' bytes blocked by 128 x 128 (:func:`block_weights`), every scale tensor
    unchanged (see the module docstring for why the 128-row scale blocks are not interleaved and how a kernel finds a
    row's scale: :func:`l1_original_rows`). Errors name the argument, including for weights that already went
    through this transform.
    """
    for name, pair in (("l1_weights", l1_weights), ("l2_weights", l2_weights)):
        if isinstance(pair, TransformedWeightsSM90):
            raise TypeError(f"{name}: these weights are already transformed (the output of "
                            "transform_weights_for_mega_moe_sm90); transforming them again would scramble the L1 "
                            "rows. Use them directly")
    check_moe_weights_fp8(l1_weights, l2_weights)
    (w1, sf1), (w2, sf2) = l1_weights, l2_weights
    return (TransformedWeightsSM90(per_expert(lambda w: block_weights(_interleave_fp8(w)), w1), sf1.contiguous(), "l1"),
            TransformedWeightsSM90(per_expert(block_weights, w2), sf2.contiguous(), "l2"))


def untransform_weights_for_mega_moe_sm90(
    l1_weights: TransformedWeightsSM90, l2_weights: TransformedWeightsSM90
) -> tuple[Fp8Weights, Fp8Weights]:
    """Exact inverse of :func:`transform_weights_for_mega_moe_sm90` -> plain ``(w, sf)`` pairs, rows gate then up."""
    for name, pair, role in (("l1_weights", l1_weights, "l1"), ("l2_weights", l2_weights, "l2")):
        if not (isinstance(pair, TransformedWeightsSM90) and pair.role == role):
            raise TypeError(f"{name}: expected the {role} TransformedWeightsSM90 from "
                            f"transform_weights_for_mega_moe_sm90, got {type(pair).__name__}")
    check_moe_weights_fp8(l1_weights, l2_weights)
    (w1, sf1), (w2, sf2) = l1_weights, l2_weights
    return ((per_expert(lambda w: _interleave_fp8(unblock_weights(w), inverse=True), w1), sf1.clone()),
            (per_expert(unblock_weights, w2), sf2.clone()))


def l1_original_rows(two_i: int, device=None) -> torch.Tensor:
    """int64 ``[2I]``: the untransformed L1 row of each transformed (interleaved) row -- gate row ``g`` for
    ``g`` in ``[0, I)``, up row ``u`` as ``I + u``; its scale row is ``original // 128``."""
    r = torch.arange(two_i, device=device)
    pair, within = r // (2 * L1_INTERLEAVE_ROWS), r % (2 * L1_INTERLEAVE_ROWS)
    is_up = within >= L1_INTERLEAVE_ROWS
    return is_up.long() * (two_i // 2) + pair * L1_INTERLEAVE_ROWS + within % L1_INTERLEAVE_ROWS
