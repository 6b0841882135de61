"""FP4 expert weights decoded once into folded e4m3 (``"hopper"`` numerics), for a call whose GEMMs then stream
FP8: the predecoded FP8 x FP4 path (``megamoe.fold_decode``).

Why: the FP8 x FP4 Gluon GEMM phase (``megamoe.kernels.gemm_fp4_ws``) decodes every weight stage in a few
register-starved warps *per pool block*, so at T = 8192 (eight 128-row blocks an expert) each weight is decoded
eight times, and the decode sets the phase's pace (``results/probes/ws_variants_probe_h200.jsonl``: 15720 us with
the decode, 8124 without). Decoding each weight once per call into a scratch buffer costs one elementwise pass over
the weights (read FP4 + scales, write e4m3: 1.5 bytes a value; 1877 us for one EP8 rank of V4-Pro on an H200, 2.6
TB/s, ``megamoe.fold_decode.FOLD_DECODE_WARPS``), after which the phase streams FP8 like the FP8 x FP8 format.

The values are exactly what the decode partitions write (``megamoe.kernels.fused._decode_chunk``: one table lookup
per value, ``megamoe.quant.fold_lut``): ``e4m3(m * 2^(s_g - s_row))`` with ``s_row`` the row's largest UE8M0
exponent over all K, and the same row exponent; so the GEMMs' results do not change by a bit.

Offline sm_90a compile (Triton 3.6, ptxas -v, 4 warps, 64 rows a program, PRMT lookups): 142 registers at the L1
shape (N = 6144, K = 7168), no spill: three programs an SM. Fewer rows (72 registers at 32) or a pipelined K loop
(cp.async) did not run faster (the measurements at FOLD_DECODE_WARPS).
"""
import triton
import triton.language as tl

from megamoe.kernels.fused import _decode_chunk, _row_exponent_max


@triton.jit
def fold_decode_kernel(w, w_sf, lut, out, row_exp, N: tl.constexpr, K: tl.constexpr, KW_PAD: tl.constexpr,
                       BN: tl.constexpr, PRMT_DECODE: tl.constexpr,
                       LOOP_STAGES: tl.constexpr = 1):
    """One program: ``BN`` rows of one local expert. ``w`` int8 ``[El, N, K/2]`` transformed FP4 (split nibble
    order, ``transform_weights_for_mega_moe``), ``w_sf`` int32 MN-major ``[El][K/128][N]`` UE8M0 words, ``lut``
    ``fold_lut``; writes ``out`` e4m3 ``[El, N, K]`` in K order and ``row_exp`` int32 ``[El, N]``. ``PRMT_DECODE``:
    the GPU's byte-permute lookup (the interpreter runs its twin, ``e2m1_lut``). ``LOOP_STAGES``: software-pipeline
    stages of the K loop (its loads in flight ahead of the decode)."""
    pid = tl.program_id(0)
    e = (pid // (N // BN)).to(tl.int64)
    rows = (pid % (N // BN)) * BN + tl.arange(0, BN)
    w_e = w + e * N * (K // 2)
    sf_e = w_sf + e * (K // 128) * N
    rmax = _row_exponent_max(sf_e, rows, N, K // 128, KW_PAD)
    o = out + (e * N + rows[:, None]) * K + tl.arange(0, 32)[None, :]
    for k0 in tl.range(0, K, 128, num_stages=LOOP_STAGES):
        word = tl.load(sf_e + (k0 // 128) * N + rows)
        b0, b1 = _decode_chunk(w_e, word, rmax, rows, k0, 0, K, lut, PRMT_DECODE)
        tl.store(o + k0, b0)
        tl.store(o + k0 + 32, b1)
        b2, b3 = _decode_chunk(w_e, word, rmax, rows, k0, 1, K, lut, PRMT_DECODE)
        tl.store(o + k0 + 64, b2)
        tl.store(o + k0 + 96, b3)
    tl.store(row_exp + e * N + rows, rmax)
