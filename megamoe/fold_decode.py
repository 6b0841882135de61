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

#: Weight rows per program and K values per loop iteration (``FOLD_DECODE_STEP_K``: 128, or a multiple of 128 with
#: ``FOLD_DECODE_WIDE``: one contiguous load of ``STEP_K / 2`` bytes and one store of ``STEP_K`` bytes a row). Where K
#: is not a multiple of the step, ``launch_keywords`` halves the step and doubles the rows (down to 128 K), keeping a
#: program's rows x step. Measured on an H200 (``results/probes/ws_variants_probe_h200.jsonl``, ``fold_decode`` rows
#: at 251c94c, both weights of one EP8 rank of V4-Pro, 4.86 GB, all bitwise equal): 16 rows x 512 K wide **1329 us
#: (3.7 TB/s)**; 32 x 256 wide 1410; 64 x 128 wide 1757; 64 x 128 as before (32-byte pieces a row, 4 stores a step)
#: 1856; with 8 programs a row block on neighbouring K ranges 1643 (wide 1474); the row exponent's words 8 at a time
#: 1943; streaming store hints 1928 (wide 1853). Earlier (741e144, the 32-byte-piece kernel): 64 rows / 4 warps / 1
#: stage 1877 us; 32 / 4 / 1 1894; 64 / 4 / 3 1982; 128 / 8 / 3 2040; 32 / 2 / 3 2010; 32 / 4 / 3 2578; two K
#: steps an iteration or the scale words kept in registers 1853-2035 (81437de): the pass was bound by its access
#: pattern (32-byte pieces over 64 rows at a 7 KB stride), not by its dependency chain or its launch shape.
FOLD_DECODE_ROWS = 16
FOLD_DECODE_STEP_K = 512
FOLD_DECODE_WIDE = True
#: Warps a program and software-pipeline stages of its K loop (measured above).
FOLD_DECODE_WARPS = 4
FOLD_DECODE_LOOP_STAGES = 1
#: Other access-pattern knobs of ``fold_decode_kernel`` (its docstring says what each changes; same bytes out),
#: measured slower (above): ``K_SPLIT``: programs per row block, each on ``K / K_SPLIT`` values; ``RMAX_CHUNK``:
#: scale words a loop iteration of the row exponent's max (0: one ``[rows, K/128]`` load); ``STREAM``: streaming
#: cache hints on the output stores (and wide weight loads).
FOLD_DECODE_K_SPLIT = 1
FOLD_DECODE_RMAX_CHUNK = 0
FOLD_DECODE_STREAM = False


def launch_keywords(N: int, K: int, prmt_decode: bool = True) -> dict:
    """``fold_decode_kernel``'s keywords (constexprs and ``num_warps``) for weights ``[El, N, K]`` under the module's
    ``FOLD_DECODE_*`` constants (the launch's grid: ``El * N / BN * K_SPLIT`` programs), the step halved and the
    rows doubled (where N allows) while ``K`` is not a multiple of ``STEP_K x K_SPLIT`` (down to 128); the offline
    compile probe (``results/probes/fold_decode_compile.py``) compiles exactly these. ``ValueError`` (naming
    ``weights``) when the shape does not divide into the constants' steps."""
    step, rows, split, chunk = FOLD_DECODE_STEP_K, FOLD_DECODE_ROWS, FOLD_DECODE_K_SPLIT, FOLD_DECODE_RMAX_CHUNK
    while step % 256 == 0 and K % (step * split):
        step, rows = step // 2, rows * 2 if N % (2 * rows) == 0 else rows
    if N % rows or K % 128:
        raise ValueError(f"weights: N={N} must be a multiple of {rows} rows and K={K} of 128")
    if step % 128 or (step != 128 and not FOLD_DECODE_WIDE) or K % (step * split) or (chunk and (K // 128) % chunk):
        raise ValueError(f"weights: K={K} must be a multiple of FOLD_DECODE_STEP_K={step} x FOLD_DECODE_K_SPLIT="
                         f"{split} (STEP_K a multiple of 128, above 128 only with FOLD_DECODE_WIDE) and K/128 of "
                         f"FOLD_DECODE_RMAX_CHUNK={chunk}")
    return dict(N=N, K=K, KW_PAD=triton.next_power_of_2(K // 128), BN=rows, PRMT_DECODE=prmt_decode,
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



#: Rows a program of ``row_maxima`` and scale words a row a step (each lowered to a power of two dividing N, K/128).
ROW_MAXIMA_ROWS = 128
ROW_MAXIMA_CHUNK = 8


def row_maxima(sf: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Each weight row's largest UE8M0 scale byte over all K, uint8 ``[El, N]`` (into ``out`` when given), from
    transformed scales ``sf`` (int32 ``[El, N, K/128]``, memory order ``[El][K/128][N]``): the fold reference the
    register-operand FP4 tile reads (``megamoe.kernels.gemm_fp4_rs``; ``fold_decode`` writes the same values as
    int32 ``row_exp``). One Triton launch reading the scales once."""
    from megamoe.kernels.fold_decode import row_maxima_kernel

    if sf.dtype != torch.int32 or sf.dim() != 3 or not sf.transpose(1, 2).is_contiguous():
        raise ValueError(f"sf: expected MN-major int32 [El, N, K/128] (memory order [El][K/128][N]), got {sf.dtype} "
                         f"{tuple(sf.shape)} strides {sf.stride()}")
    El, N, KW = sf.shape
    chunk = min(ROW_MAXIMA_CHUNK, KW & -KW)  # (powers of two dividing KW and N)
    rows = min(ROW_MAXIMA_ROWS, N & -N)
    if out is None:
        out = torch.empty((El, N), dtype=torch.uint8, device=sf.device)
    if out.dtype != torch.uint8 or out.numel() != El * N or not out.is_contiguous():
        raise ValueError(f"out: expected contiguous uint8 with {El * N} elements, got {out.dtype} {tuple(out.shape)}")
    row_maxima_kernel[(El, N // rows)](sf, out, N, KW, rows, chunk)
    return out
