"""FP4 expert weights decoded once into folded e4m3 (``"hopper"`` numerics), for a call whose GEMMs then stream
FP8: the predecoded FP8 x FP4 path (``megamoe.fold_decode``).

Why: the FP8 x FP4 Gluon GEMM phase (``megamoe.kernels.gemm_fp4_ws``) decodes every weight stage in a few
register-starved warps *per pool block*, so at T = 8192 (eight 128-row blocks an expert) each weight is decoded
eight times, and the decode sets the phase's pace (``results/probes/ws_variants_probe_h200.jsonl``: 15720 us with
the decode, 8124 without). Decoding each weight once per call into a scratch buffer costs one elementwise pass over
the weights (read FP4 + scales, write e4m3: 1.5 bytes a value; 1329 us for one EP8 rank of V4-Pro on an H200, 3.7
TB/s, with ``WIDE`` steps of 512 K over 16 rows a program, 1856 us / 2.6 TB/s as first written: 32-byte pieces
over 64 rows; ``megamoe.fold_decode.FOLD_DECODE_ROWS``), after which the phase streams FP8 like the FP8 x FP8
format.

The values are exactly what the decode partitions write (``megamoe.kernels.fused._decode_chunk``: one table lookup
per value, ``megamoe.quant.fold_lut``): ``e4m3(m * 2^(s_g - s_row))`` with ``s_row`` the row's largest UE8M0
exponent over all K, and the same row exponent; so the GEMMs' results do not change by a bit.

Offline sm_90a compile (Triton 3.6, ptxas -v, 4 warps, 64 rows a program, PRMT lookups,
``results/probes/fold_decode_compile.py``): 55 registers at the L1 shape (N = 6144, K = 7168), 48 at L2, no spill,
1 KB shared, with the 16-byte pointer alignment the JIT specialises on for torch allocations (16-byte loads and
stores); compiled with no pointer attributes (no alignment known) it takes 142, the figure recorded earlier. Fewer
rows or a pipelined K loop (cp.async) did not run faster (the measurements at FOLD_DECODE_WARPS). The
access-pattern variants of ``fold_decode_kernel`` (one contiguous load / store per row, K split over programs,
chunked row maximum, streaming hints) write the same bytes (``tests/test_fold_decode.py``) and compile to 46-64
registers, no spill (1 KB shared; 4 KB wide); of them only ``WIDE`` (with the longer steps) ran faster on the GPU
(the measurements at ``megamoe.fold_decode.FOLD_DECODE_ROWS``): the default.
"""
import triton
import triton.language as tl

from megamoe.kernels.formats import fp4_weight_offset
from megamoe.kernels.fused import _decode_chunk, _fold_tables, _row_exponent_max
from megamoe.kernels.numerics import e2m1_lut, e2m1x2_lut_prmt, e2m1x2_nibbles


@triton.jit
def _row_exponent_max_chunked(sf_e, rows, N: tl.constexpr, KW: tl.constexpr, CHUNK: tl.constexpr):
    """``_row_exponent_max`` over all ``KW`` scale words of ``rows`` [BN], ``CHUNK`` words (``KW`` a multiple) a
    loop iteration instead of one ``[BN, KW_PAD]`` load: the same maximum, fewer live registers."""
    m = _row_exponent_max(sf_e, rows, N, CHUNK, CHUNK)
    for kb in tl.range(CHUNK, KW, CHUNK):
        m = tl.maximum(m, _row_exponent_max(sf_e + kb * N, rows, N, CHUNK, CHUNK))
    return m


@triton.jit
def _store(ptr, v, STREAM: tl.constexpr):
    """``tl.store(ptr, v)``; ``STREAM``: with the streaming cache hint ``.cs`` (written once, not read back here)."""
    if STREAM:
        tl.store(ptr, v, cache_modifier=".cs")
    else:
        tl.store(ptr, v)


@triton.jit
def _decode_wide(w_e, sf_e, rmax, rows, k0, N: tl.constexpr, K: tl.constexpr, lut, PRMT_DECODE: tl.constexpr,
                 STEP_K: tl.constexpr, STREAM: tl.constexpr):
    """Folded e4m3 ``[BN, STEP_K]`` of K values ``k0 .. k0 + STEP_K - 1`` of ``rows`` [BN], in K order (``STEP_K`` a
    multiple of 128): each row's ``STEP_K / 2`` packed bytes are one load (``S`` pieces of 64 bytes in the blocked
    layout, ``fp4_weight_offset``; the ``BN`` rows' pieces of one K block adjacent), viewed ``[BN, S, 2, 32]`` (128-
    wide step ``s``, 64-chunk ``c``, byte lane ``j``: low value K ``128s + 64c + j``, high value ``+32``,
    ``transform_weights_for_mega_moe``), decoded through the tables of ``_fold_tables`` (low values: group ``2c``
    of step ``s``'s scale word, high: ``2c + 1``) and interleaved back into K order ``128s + 64c + 32h + j``."""
    S: tl.constexpr = STEP_K // 128
    BN: tl.constexpr = rows.shape[0]
    src = w_e + fp4_weight_offset(rows[:, None], k0 // 2, tl.arange(0, STEP_K // 2)[None, :], N, K // 2)
    if STREAM:
        packed = tl.load(src, eviction_policy="evict_first")
    else:
        packed = tl.load(src)
    packed = tl.reshape(packed, [BN, S, 2, 32])     # (a [BN, S, 2, 32] pointer tile would load 32 bytes a row a warp)
    words = tl.load(sf_e + (k0 // 128 + tl.arange(0, S))[None, :] * N + rows[:, None])      # [BN, S]
    r = rmax[:, None]
    ta0, ta1 = _fold_tables(lut, words, r, 0)                                                # [BN, 1, S] each
    tc0, tc1 = _fold_tables(lut, words, r, 2)
    tb0, tb1 = _fold_tables(lut, words, r, 1)
    td0, td1 = _fold_tables(lut, words, r, 3)
    la0 = tl.reshape(tl.join(ta0, tc0), [BN, S, 2, 1])      # low values: group 2c of step s
    la1 = tl.reshape(tl.join(ta1, tc1), [BN, S, 2, 1])
    lb0 = tl.reshape(tl.join(tb0, td0), [BN, S, 2, 1])      # high values: group 2c + 1
    lb1 = tl.reshape(tl.join(tb1, td1), [BN, S, 2, 1])
    if PRMT_DECODE:
        z = tl.zeros(packed.shape, tl.int32)
        lo, hi = e2m1x2_lut_prmt(packed, la0 + z, la1 + z, lb0 + z, lb1 + z)
    else:
        n0, n1 = e2m1x2_nibbles(packed)
        lo, hi = e2m1_lut(n0, la0, la1), e2m1_lut(n1, lb0, lb1)
    v = tl.permute(tl.join(lo, hi), (0, 1, 2, 4, 3))                                         # [BN, S, 2, 2, 32]
    return tl.reshape(v, [BN, STEP_K])


@triton.jit
def fold_decode_kernel(w, w_sf, lut, out, row_exp, N: tl.constexpr, K: tl.constexpr, KW_PAD: tl.constexpr,
                       BN: tl.constexpr, PRMT_DECODE: tl.constexpr,
                       LOOP_STAGES: tl.constexpr = 1, WIDE: tl.constexpr = False, STEP_K: tl.constexpr = 128,
                       K_SPLIT: tl.constexpr = 1, RMAX_CHUNK: tl.constexpr = 0, STREAM: tl.constexpr = False):
    """One program: ``BN`` rows of one local expert (``K_SPLIT`` > 1: ``K / K_SPLIT`` of their K values). ``w`` int8
    ``[El, N, K/2]`` transformed FP4 (register-order nibbles, ``transform_weights_for_mega_moe``), ``w_sf`` int32
    MN-major ``[El][K/128][N]`` UE8M0 words, ``lut`` ``fold_lut``; writes ``out`` e4m3 ``[El, N, K]`` in K order and
    ``row_exp`` int32 ``[El, N]``. ``PRMT_DECODE``: the GPU's byte-permute lookup (the interpreter runs its twin,
    ``e2m1_lut``). ``LOOP_STAGES``: software-pipeline stages of the K loop (its loads in flight ahead of the decode).

    The access-pattern variants (all write the same bytes; defaults = the kernel measured at 1877 us):

    * ``WIDE``: each K step of ``STEP_K`` values (a multiple of 128) is one contiguous ``STEP_K / 2``-byte load and
      one contiguous ``STEP_K``-byte store per row (``_decode_wide``: the nibble halves interleaved back into K order
      in registers, the compiler's layout conversion through shared memory), instead of two 32-byte loads and four
      32-byte stores per row 64 / 32 values apart. A warp's store then covers 4 rows x 128 bytes (16 x 512: 1 row x
      512) rather than 16 rows x 32, its load 8 rows x 64 bytes (2 x 256) rather than 16 x 32 (sm_90a TTGIR).
      ``STEP_K`` > 128 (wide only): fewer rows a program at the same bytes an iteration, longer runs per row.
    * ``K_SPLIT``: ``K_SPLIT`` programs per row block, neighbouring program ids on neighbouring K ranges of the
      same rows (the rows' output written by programs running side by side; every program reads the rows' scale
      words for the row exponent, the first writes ``row_exp``). ``(K / STEP_K)`` must be a multiple.
    * ``RMAX_CHUNK`` > 0: the row exponent's scale words read ``RMAX_CHUNK`` a loop iteration
      (``_row_exponent_max_chunked``) instead of one ``[BN, KW_PAD]`` tile, the kernel's register peak (the
      prologue, not the K loop: 55 -> 46 registers at L1, 8 chunks), so more programs fit an SM.
    * ``STREAM``: output stores with the streaming cache hint (``.cs``: written once, not read back by this
      kernel) and, with ``WIDE``, weight loads ``evict_first``."""
    pid = tl.program_id(0)
    split = pid % K_SPLIT
    blk = pid // K_SPLIT
    e = (blk // (N // BN)).to(tl.int64)
    rows = (blk % (N // BN)) * BN + tl.arange(0, BN)
    w_e = w + e * N * (K // 2)
    sf_e = w_sf + e * (K // 128) * N
    if RMAX_CHUNK > 0:
        rmax = _row_exponent_max_chunked(sf_e, rows, N, K // 128, RMAX_CHUNK)
    else:
        rmax = _row_exponent_max(sf_e, rows, N, K // 128, KW_PAD)
    KC: tl.constexpr = K // K_SPLIT
    k_lo = split * KC
    if WIDE:
        o = out + (e * N + rows[:, None]) * K + tl.arange(0, STEP_K)[None, :]
        for kk in tl.range(0, KC, STEP_K, num_stages=LOOP_STAGES):
            k0 = k_lo + kk
            _store(o + k0, _decode_wide(w_e, sf_e, rmax, rows, k0, N, K, lut, PRMT_DECODE, STEP_K, STREAM), STREAM)
    else:
        tl.static_assert(STEP_K == 128, "STEP_K > 128 needs WIDE")
        o = out + (e * N + rows[:, None]) * K + tl.arange(0, 32)[None, :]
        for kk in tl.range(0, KC, 128, num_stages=LOOP_STAGES):
            k0 = k_lo + kk
            word = tl.load(sf_e + (k0 // 128) * N + rows)
            b0, b1 = _decode_chunk(w_e, word, rmax, rows, k0, 0, K, lut, PRMT_DECODE, N)
            _store(o + k0, b0, STREAM)
            _store(o + k0 + 32, b1, STREAM)
            b2, b3 = _decode_chunk(w_e, word, rmax, rows, k0, 1, K, lut, PRMT_DECODE, N)
            _store(o + k0 + 64, b2, STREAM)
            _store(o + k0 + 96, b3, STREAM)
    if K_SPLIT == 1:
        tl.store(row_exp + e * N + rows, rmax)
    else:
        tl.store(row_exp + e * N + rows, rmax, mask=(split + 0 * rows) == 0)


@triton.jit
def row_maxima_kernel(sf, out, N: tl.constexpr, KW: tl.constexpr, BN: tl.constexpr, CHUNK: tl.constexpr):
    """Each weight row's largest UE8M0 byte over all K (the fold's reference, ``s_row``), uint8 ``out`` ``[El, N]``,
    from the transformed int32 scales ``sf`` (MN-major ``[El][KW][N]``, four group bytes a word): one program per
    (expert, ``BN`` rows), ``CHUNK`` words a row a step (``_row_exponent_max_chunked``; the loads coalesced along N).
    Without the weights themselves: one read of the scales (1/16 of the FP4 bytes)."""
    e = tl.program_id(0)
    rows = tl.program_id(1) * BN + tl.arange(0, BN)
    m = _row_exponent_max_chunked(sf + e.to(tl.int64) * KW * N, rows, N, KW, CHUNK)
    tl.store(out + e.to(tl.int64) * N + rows, m.to(tl.uint8))
