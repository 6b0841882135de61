"""Decode transformed FP4 expert weights once into folded e4m3 plus one exponent per row
(``megamoe.kernels.fold_decode``; the ``"hopper"`` numerics' weight operand, ``megamoe.quant.fold_scales``).

``fold_decode(weights)`` takes one :class:`megamoe.quant.TransformedWeights` pair ``(w int8 [El, N, K/2], sf int32
[El, N, K/128] MN-major)`` and returns ``(folded float8_e4m3fn [El, N, K], row_exp int32 [El, N])``: ``folded *
2^(row_exp - 127)`` is the weight up to the fold's rounding below e4m3's normal range, bit for bit what the FP8 x
FP4 Gluon phase's decode partitions write into shared memory. Runs on the GPU (byte-permute lookups) and under the
interpreter (its twin); tested on CPU against :func:`megamoe.gemm_phase._folded_fp4_rows`.
"""
from __future__ import annotations

import torch
import triton

from megamoe.env import interpreting

#: Weight rows per program (``N`` must be a multiple: 2I and H are multiples of 128).
FOLD_DECODE_ROWS = 64
#: Warps a program and software-pipeline stages of its K loop. Measured on an H200 (``results/probes/
#: ws_variants_probe_h200.jsonl``, ``fold_decode`` rows at 741e144, both weights of one EP8 rank of V4-Pro, 4.86 GB):
#: 64 rows / 4 warps / 1 stage 1877 us (2.6 TB/s); 32 / 4 / 1 1894; 64 / 4 / 3 1982; 128 / 8 / 3 2040; 32 / 2 / 3
#: 2010; 32 / 4 / 3 2578 (all bitwise equal).
#: Two K steps an iteration or the scale words kept in registers did not help either (``fold_decode`` rows at
#: 81437de, branch fold-decode-unroll: 1853-2035 us against 1868): the pass is not bound by its dependency chain.
FOLD_DECODE_WARPS = 4
FOLD_DECODE_LOOP_STAGES = 1
#: Access-pattern variants of ``fold_decode_kernel`` (its docstring says what each changes; same bytes out). Not yet
#: measured on a GPU: the defaults are the kernel measured above. ``WIDE``: one contiguous load / store per row a K
#: step; ``STEP_K``: K values a loop iteration (128, or a multiple with ``WIDE``); ``K_SPLIT``: programs per row
#: block, each on ``K / K_SPLIT`` values; ``RMAX_CHUNK``: scale words a loop iteration of the row exponent's max (0:
#: one ``[rows, K/128]`` load); ``STREAM``: streaming cache hints on the output stores (and wide weight loads).
FOLD_DECODE_WIDE = False
FOLD_DECODE_STEP_K = 128
FOLD_DECODE_K_SPLIT = 1
FOLD_DECODE_RMAX_CHUNK = 0
FOLD_DECODE_STREAM = False


def launch_keywords(N: int, K: int, prmt_decode: bool = True) -> dict:
    """``fold_decode_kernel``'s keywords (constexprs and ``num_warps``) for weights ``[El, N, K]`` under the module's
    ``FOLD_DECODE_*`` constants (the launch's grid: ``El * N / BN * K_SPLIT`` programs); the offline compile probe
    (``results/probes/fold_decode_compile.py``) compiles exactly these. ``ValueError`` (naming ``weights``) when the
    shape does not divide into the constants' steps."""
    step, split, chunk = FOLD_DECODE_STEP_K, FOLD_DECODE_K_SPLIT, FOLD_DECODE_RMAX_CHUNK
    if N % FOLD_DECODE_ROWS or K % 128:
        raise ValueError(f"weights: N={N} must be a multiple of {FOLD_DECODE_ROWS} and K={K} of 128")
    if step % 128 or (step != 128 and not FOLD_DECODE_WIDE) or K % (step * split) or (chunk and (K // 128) % chunk):
        raise ValueError(f"weights: K={K} must be a multiple of FOLD_DECODE_STEP_K={step} x FOLD_DECODE_K_SPLIT="
                         f"{split} (STEP_K a multiple of 128, above 128 only with FOLD_DECODE_WIDE) and K/128 of "
                         f"FOLD_DECODE_RMAX_CHUNK={chunk}")
    return dict(N=N, K=K, KW_PAD=triton.next_power_of_2(K // 128), BN=FOLD_DECODE_ROWS, PRMT_DECODE=prmt_decode,
                LOOP_STAGES=FOLD_DECODE_LOOP_STAGES, WIDE=FOLD_DECODE_WIDE, STEP_K=step, K_SPLIT=split,
                RMAX_CHUNK=chunk, STREAM=FOLD_DECODE_STREAM, num_warps=FOLD_DECODE_WARPS)


def fold_decode(weights, out: torch.Tensor | None = None, row_exp: torch.Tensor | None = None):
    """Decode ``weights`` = ``(w, sf)`` (transformed, see the module docstring) into ``out`` (float8_e4m3fn ``[El, N,
    K]``) and ``row_exp`` (int32 ``[El, N]``), allocated when ``None``; returns both. Errors name the argument."""
    from megamoe.kernels.fold_decode import fold_decode_kernel

    if not isinstance(weights, (tuple, list)) or len(weights) != 2:
        raise TypeError("weights: expected a (w, sf) pair of transformed FP4 weights")
    w, sf = weights
    if w.dtype != torch.int8 or w.dim() != 3:
        raise ValueError(f"weights[0]: expected int8 [El, N, K/2], got {w.dtype} {tuple(w.shape)}")
    El, N, K = w.shape[0], w.shape[1], 2 * w.shape[2]
    kw = launch_keywords(N, K, prmt_decode=not interpreting())
    if sf.dtype != torch.int32 or tuple(sf.shape) != (El, N, K // 128) or not sf.transpose(1, 2).is_contiguous():
        raise ValueError(f"weights[1]: expected MN-major int32 [El, N, K/128] = {(El, N, K // 128)}, memory order "
                         f"[El][K/128][N] (transform_weights_for_mega_moe), got {sf.dtype} {tuple(sf.shape)} "
                         f"strides {sf.stride()}")
    if not w.is_contiguous():
        raise ValueError("weights[0]: expected a contiguous tensor")
    if out is None:
        out = torch.empty((El, N, K), dtype=torch.float8_e4m3fn, device=w.device)
    if row_exp is None:
        row_exp = torch.empty((El, N), dtype=torch.int32, device=w.device)
    if out.dtype != torch.float8_e4m3fn or tuple(out.shape) != (El, N, K) or not out.is_contiguous():
        raise ValueError(f"out: expected contiguous float8_e4m3fn {(El, N, K)}, got {out.dtype} {tuple(out.shape)}")
    if row_exp.dtype != torch.int32 or tuple(row_exp.shape) != (El, N) or not row_exp.is_contiguous():
        raise ValueError(f"row_exp: expected contiguous int32 {(El, N)}, got {row_exp.dtype} {tuple(row_exp.shape)}")
    from megamoe.fused import _fold_lut  # (the one per-device table; imported here: megamoe.fused imports this module)

    lut = _fold_lut(w.device)
    fold_decode_kernel[(El * (N // kw["BN"]) * kw["K_SPLIT"],)](w, sf, lut, out, row_exp, **kw)
    return out, row_exp

