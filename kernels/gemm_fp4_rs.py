"""The GEMM phase of the fused FP8 x FP4 path with the FP4 decode **in the math warps**, straight into wgmma's
register A operand (tile variant ``rs``, ``FusedConfig(kind="fp4_ws", rs_block_n=BN)``): both grouped GEMMs of
one rank in one persistent, warp-specialised Gluon launch between the front and back launches of
:func:`megamoe.kernels.fused.fused_mega_moe_kernel`, as :mod:`megamoe.kernels.gemm_fp4_ws`, for calls with few
tokens per expert.

Why: :mod:`megamoe.kernels.gemm_fp4_ws` decodes FP4 in separate warps into an e4m3 shared-memory stage the MMA
reads; at few tokens per expert the whole call is bound by that decode and streams ~1.8-1.96 TB/s of FP4 (issue #7).
``results/probes/fp4_rs_probe.py`` measured the alternative CUTLASS's mixed-input Hopper GEMMs use: swap-AB, the
**weights on the MMA's M as a register operand** (``wgmma`` "RS"), decoded by the warps that issue the MMA, the
tokens (8-32) on N from shared memory. No decoded stage, no second set of warps to hand it over; with a loader
warp, ``maxnreg`` 64 and 4 CTAs an SM the GEMM alone streamed 2.5 TB/s of FP4 (``DECODE`` 2, the byte-per-pair packing
this kernel read until session 25; 2.7-2.9 TB/s with 8 tokens; the register-order packing it reads now was
``DECODE`` 3 there, ~8 % faster at 8 tokens).

Numerics: those of ``gemm_fp4_ws`` (``megamoe.reference`` with ``numerics="hopper"``; per-tile torch twin
:mod:`megamoe.gemm_phase`): every operand an e4m3 value folded to one power of two per row over all of K, each
128-wide K block one wgmma chain into a fresh register tile added into the float32 accumulator, the weight rows'
and tokens' powers of two applied in the epilogue. The weight fold is the same table lookup (``_fold_table``,
``_decode_prmt``). The L2 A operand (tokens of the L2 pool) is folded per token relative to the largest of its I / 128
per-128 exponents, here **once per pool block**, in place in the L2 pool, by the L1 tile that completes the block
(``_l1_done``, ``_fold_block``). With ``L2_FOLDED`` off (``numerics="hopper_l2_per_block"``) nothing is folded:
``_l1_done`` sets both of its tile's bits at once, and each L2 K block's partial sums are added times the chunk's
tokens' ``2^(s_kb - 127)`` (a ``[I / 128, BN]`` float32 table built per chunk in the ``stash``, which L2 tiles do
not use otherwise, read per K block in the accumulator's column layout). Offline sm_90a (Triton 3.6): K loop 326 ->
337 SASS at chunk 64, 269 -> 272 at 8, 294 -> 304 at 32 (128-row chains; 152 B spilled outside the loops, 104 with
the fold), and one ``bar.sync`` more a K block (2 -> 3: Triton's barrier pass sees the L1 chain epilogues' stores to
the stash in the same loop nest; a table of its own would cost a ring stage at chunk 64). Not yet run on a GPU.

Tiles: the front launch's tile table (pool blocks of ``BM`` = 64 rows; entries (block, n-tile of 256 weight rows,
expert, valid rows)), L1 tiles first, taken one at a time from a counter by whichever CTA is free (a static
``pid, pid + grid, ...`` walk left ~18 % of the work on the busiest CTAs at 4 CTAs an SM: tiles of 224 stages
over 528 CTAs). A tile is up to ``ceil(valid / BN)`` token chunks of ``BN`` pool rows, each chunk four **chains** of
64 weight rows (the wgmma M of one warpgroup) over all of K, run ``PAIR`` side by side on one token stage
(``megamoe.fused.FP4_RS_PAIR``: four at BN 16 / 32, two at BN 8 / 64; four fit the register budget of 4 CTAs an
SM up to BN 16, of 2 CTAs at BN 32: ``PAIR`` [64, BN] accumulators live. GPU-tested both ways at BN 8 / 16 / 32;
measured (``megamoe.fused``): four faster at BN 16 / 32, slower at BN 8). L1: 256 weight rows =
the tile's 128 intermediate columns (gate / up interleaved by 8, so each chain's rows hold whole gate / up pairs:
SwiGLU per chain, in registers), each chain's activations (float32, times the top-k weight) stashed in shared memory
``[128, BN]``; after the fourth, the per-128 UE8M0 requant per token over the stash, the bytes and scale words into
the L2 pool, and the tile's even arrival bit ``2 nt``; the tile that sets the block's last even bit folds the
block's L2 rows and then sets all odd bits. L2: each chain's 64 hidden columns are final: bf16 into the source
ranks' combine buffers. An L2 tile's loader and math first wait for the block's full arrival mask (every L1 tile of
the block, and the fold).

Roles (``gl.warp_specialize``): the math warpgroup (the default partition, 4 warps) and a loader warp, which per (chunk,
chain pair, K block) TMA's the stage: per chain packed W ``[64, 64]`` bytes as two ``[64, 32]`` boxes (K ``[0, 64)`` and
``[64, 128)`` in the nibble order of ``transform_weights_for_mega_moe``: box ``c`` byte lane ``j`` carries K ``64c + j``
and ``64c + 32 + j``, each 4-byte word in register order) and the rows' 64 UE8M0 scale words of the K block; once for
the pair, the tokens ``[BN, 128]`` as four ``[BN, 32]`` boxes (one per K=32 MMA). The tokens are re-loaded per chain
pair (from L2: 0.5 / 1 / 2 / 4 KB a stage at BN 8 / 16 / 32 / 64, against 8 KB of weights). The weight rows' largest
exponents (the fold's reference) come from ``rmax1`` / ``rmax2`` (uint8 per weight row,
``megamoe.fused._fp4_row_maxima``: made again when the scales change).

Why two chains a stage: what a stage moves from L2 into shared memory bounds this tile. Per stage one chain's weights
are 4 KB and the chunk's tokens BN x 128 bytes, so with one chain a stage the bytes were 1.25 / 1.5 / 2x the weights'
at BN 8 / 16 / 32, and the phase's time followed them: without decode, fold and stores (the knob rows of
``results/probes/fp4_rs_knobs_h200.jsonl``: 334 / 599 us) T = 8 / 32 moved ~3.8 / ~4.2 TB/s of those bytes (1.25
x 1.02 GB / 1.5 x 1.68 GB, the weights touched with their scales: ``weight_bytes_touched`` of
``results/layer_h200.json``), and T = 128 as built (805 us, ``results/probes/rs_sweep_h200.jsonl``) moves 2 x
1.68 GB at ~4.2 TB/s. Two chains a stage make it 1.125 / 1.25 / 1.5x, four 1.06 / 1.125 / 1.25x at BN 8 / 16 / 32 (four
accumulators do not fit 104 registers at BN 32: that chunk ran 2 CTAs an SM, 232 math registers; whole call at
T = 128 667 / 668 us against 700 / 701 with two chains at 4 CTAs, session 22). Since session 23 chunk 32 moves the
same 256 weight rows a stage as two 128-row chains (``ROWS`` 128, below), each over two math warpgroups, at 2 CTAs an
SM: 16 math warps an SM instead of 8, and 649 / 658 us against the four-chain tile's 667 / 665 alternating in one
call (``rs_ctas`` rows of ``results/probes/fp8_ws_probe_h200.jsonl`` at afac6ff, same error).

Measured on an H200 (one EP8 rank of V4-Pro). Correctness: ``tests/gpu/test_fp4_rs_gpu.py`` 21 passed at 50894f9,
4122266 and (the fold once per block) 43f8755; 27 (chunk 64 added) at 8dd6787; 14 of them (every chunk on two small
cases, one EP8 rank at T = 8..512, the CUDA graph) with two chains a stage at 210c711. Session 18, one chain a stage
and the L2 A operand folded in every L2 stage (112 times per token and K block): GEMM phase 424 / 682 / 861 us at T =
8 / 32 / 128 (``results/probes/fp4_rs_profile_h200.jsonl``); timing knobs (``results/probes/fp4_rs_knobs_h200.jsonl``,
T = 8 / 32) put 63 / 62 us of the phase's 443 / 686 in that fold, ~100 / 75 in the FP4 decode, none in the
epilogues' global stores. Session 19, the fold once per pool block (``_l1_done``): 401 / 658 / 805 / 1185 us at T =
8 / 32 / 128 / 256 (chunks 8 / 16 / 32 / 32) against the decode-partition tile's 535 / 824 / 827 / 836; chunk 64 (two
CTAs an SM) 1062 / 1063 / 1621 us at T = 128 / 256 / 512 against 803 (chunk 32) / 836 / 1272 (decode-partition tile,
block 128) (``results/probes/rs_sweep_h200.jsonl``). Then two chains a stage: whole calls (``results/layer_h200.json``
at 210c711) T = 32 / 128 699 -> 633 / 852 -> 721 us (graph replays 697 -> 629 / 847 -> 718), T = 8 graph 439 -> 424
(its eager time waits on the host). The phase alone (session 20): two chains 374 / 368 us at T = 8 and 580 / 580 at
T = 32, four chains 402 / 401 and 572 / 572 (``results/probes/rs_variants_h200.jsonl``), 655 us at T = 128
(``fused_fp8_ws_profile_h200.jsonl`` at 25affd4; Nsight Compute: L2 at 84 % of its throughput,
``results/probes/ncu_h200.json``). Re-swept with them (session 23, ``rs_sweep`` rows at 1b275c4): the phase at
T = 256 / 512 (chunk 64) 784 / 1187 us against the decode-partition tile's 834 / 1268, so ``FP4_RS_MAX_EXPECTED``
is 64 (was 16).

The wide variant (128-row chains; chunk 32's default since session 23, at chunks 64 / 128 chosen only explicitly;
GPU-tested, ``-k wide`` and the candidates' ``-k rs_variant`` (then ``chunk32_variant``), 49 passed at afac6ff):
chains of
``ROWS`` = 128 weight rows (the weight boxes' rows) run by the math partition as ``num_warps`` 8 -- two warpgroups in
lock-step, each decoding and multiplying its 64 rows -- with one chain a stage (``PAIR`` 1) and the next K block's
decode issued between the current block's wgmmas and their wait, on 128-row pool blocks, one CTA an SM
(``maxnreg`` 168, math ``setmaxnreg`` 240). Meant for many tokens per expert, where the decode-partition tile is
decode-bound: per K block a warpgroup's m64n128k128 takes ~1000 cycles against ~175 issue slots of decode a thread.
Offline sm_90a: 224008 B of shared memory (5 stages), K loop 437 SASS a thread (4 QGMMA, the next block's 100 PRMT
between them and the ``WARPGROUP.DEPBAR``), no spill in it; 516 B spilled in the chain epilogues.

Offline sm_90a (Triton 3.6, two chains a stage, the host's keywords): 64 registers (setmaxnreg 104 math; loader
40 at chunk 8, 24 at 16 / 32), 54.0 / 53.4 / 46.2 KB of shared memory at chunk 8 / 16 / 32 (5 / 4 / 2 stages), K
loop 349 / 358 / 373 SASS instructions a thread a stage of two chains (one chain a stage: 195-207), no spill in it;
chunk 64: 128 registers (math 232), 108.7 KB (4 stages), no spill. Chunk 32 with four chains a stage at 2 CTAs an SM
(the default in session 22, now candidate ``c2p4``; loader 40): 128 registers, 104.1 KB (4 stages), no spill; K loop 703
SASS instructions a thread a stage of four chains (16 QGMMA, 144 PRMT; chunk 16's four chains: 670). At T = 128 that is
~2.75 instructions a weight, ~280 M warp-instructions for the ~3.3 G weights decoded: ~270 us of the SMs' issue slots at
1.98 GHz against a ~620 us phase -- by this count the tile waits (two math warps a scheduler) more than it issues (an
estimate from the SASS, not a profile). Chunk 32 on 128-row chains, two a stage, 2 CTAs an SM (the default since
session 23; loader 24): ``maxnreg`` 80, 4 stages, 110728 B, 88 B spilled outside the K loop, none in it; K loop 373
SASS a thread a stage (8 QGMMA, 72 PRMT: 128 weights a thread) with twice the math warps issuing.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from megamoe.kernels.formats import AMAX_FLOOR, FP8_MAX
from megamoe.kernels.fused import _pow2_f32
from megamoe.kernels.gemm_fp4_ws import _decode_prmt, _fold_table, _full_mask, _w_coord, _wait_mask
from megamoe.kernels.gemm_fp8_ws import (
    BK,
    _combine_rows,
    _fence_proxy_async_global,
    _round_bf16,
    _silu_mul,
    _tile,
    _to_bf16_bits,
    _to_e4m3,
)
from megamoe.kernels.numerics import ceil_ue8m0

RS_TILE = gl.constexpr(256)  #: weight rows of a tile (the L1 tile's 128 intermediate columns), in chains of ``ROWS``
#: (the weight boxes' rows: 64 = the wgmma M of one warpgroup, or 128 = two warpgroups in lock-step, ``num_warps`` 8)


@gluon.jit
def _issue_stage(w_desc, a_desc, s_desc, wp, ab, sw, bar, w_row, a_row, kb, KB, s_word, s, PAIR: gl.constexpr):
    """TMA of one stage ``s`` (completing on ``bar``, whose byte count the caller set): K block ``kb`` (of ``KB``)
    of the ``PAIR`` x 64 packed weight rows from ``w_row`` (two ``[64, 32]`` byte boxes a chain: ``wp`` slots ``2
    (PAIR s + i) + c``; the weights blocked by 256 rows x 128 K, ``gemm_fp4_ws._w_coord``), of the ``BN`` tokens from
    pool row ``a_row`` (four ``[BN, 32]`` e4m3 boxes, shared by the chains), and each chain's 64 scale words from
    flat word ``s_word + 64 i`` (``sw`` slot ``PAIR s + i``)."""
    ROWS: gl.constexpr = w_desc.block_type.shape[0]
    for i in gl.static_range(PAIR):
        for c in gl.static_range(2):
            tma.async_copy_global_to_shared(w_desc, _w_coord(w_row + ROWS * i, kb, KB, 64, 32 * c, True), bar,
                                            wp.index(2 * (PAIR * s + i) + c))
        tma.async_copy_global_to_shared(s_desc, [s_word + ROWS * i], bar, sw.index(PAIR * s + i))
    for j in gl.static_range(4):
        tma.async_copy_global_to_shared(a_desc, [a_row, kb * BK + 32 * j], bar, ab.index(4 * s + j))


@gluon.jit
def _decode_stage(wp, s, word, rm, lut, dot_a: gl.constexpr):
    """The four K=32 register operands (e4m3 ``[64, 32]`` in ``dot_a``) of ring stage ``s``: its two packed boxes
    through the fold tables of ``word`` (the rows' scale words of the K block: four UE8M0 group bytes) and ``rm``
    (the rows' largest exponents), as ``gemm_fp4_ws._decode_rows``."""
    t00, t01 = _fold_table(lut, word, rm, 0)
    t10, t11 = _fold_table(lut, word, rm, 1)
    t20, t21 = _fold_table(lut, word, rm, 2)
    t30, t31 = _fold_table(lut, word, rm, 3)
    g0, g1 = _decode_prmt(wp.index(2 * s).load(dot_a), t00, t01, t10, t11)
    g2, g3 = _decode_prmt(wp.index(2 * s + 1).load(dot_a), t20, t21, t30, t31)
    return g0, g1, g2, g3


@gluon.jit
def _k_block_chain(g0, g1, g2, g3, ab, s, like):
    """One K block's fresh wgmma chain: the four K=32 register operands ``g0..g3`` (e4m3 ``[ROWS, 32]``) times ring
    stage ``s``'s four token boxes (``ab``: ``[BN, 32]`` each, the MMA's B operand, transposed views), waited for;
    returns the float32 ``[ROWS, BN]`` partial sum (``like``: a tile of its layout, overwritten: ``use_acc=False``)."""
    return warpgroup_mma_wait(num_outstanding=0, deps=(_k_block_issue(g0, g1, g2, g3, ab, s, like), ))


@gluon.jit
def _k_block_issue(g0, g1, g2, g3, ab, s, like):
    """``_k_block_chain`` without the wait: the four wgmmas of one K block issued (asynchronous); the caller waits
    (``warpgroup_mma_wait``) before it reads the result; the operands ``g0..g3`` stay live until then."""
    dot = warpgroup_mma(g0, ab.index(4 * s).permute((1, 0)), like, use_acc=False, is_async=True)
    dot = warpgroup_mma(g1, ab.index(4 * s + 1).permute((1, 0)), dot, is_async=True)
    dot = warpgroup_mma(g2, ab.index(4 * s + 2).permute((1, 0)), dot, is_async=True)
    return warpgroup_mma(g3, ab.index(4 * s + 3).permute((1, 0)), dot, is_async=True)


@gluon.jit
def _chain_rows(tile_row, nt, q, ROWS: gl.constexpr):
    """The first weight row of chain ``q`` (of ``ROWS`` rows) of n-tile ``nt`` (``tile_row``: the expert's first
    row)."""
    return tile_row + nt * RS_TILE + q * ROWS


@gluon.jit
def _load_partition(a1_desc, a2_desc, w1_desc, w2_desc, ws1_desc, ws2_desc, wp, ab, sw, ready, empty, tile_s,
                    tile_full, tile_empty, sched, tiles, num_l1, num_tiles, l2_mask, progress, state, timeout_ns,
                    H: gl.constexpr, I: gl.constexpr, BM: gl.constexpr, STAGES: gl.constexpr, PAIR: gl.constexpr):
    """TMA producer (1 warp): takes the rank's next tile from the counter ``sched`` (``atomic_add``: tiles in table
    order, L1 first, each to the CTA that is free first), hands it to the math partition (``_post_tile``), then
    every stage of its (chunk, chain, K block)s in the math's order. An L2 tile first waits for its block's full
    arrival mask (acquire) and fences the generic-proxy L1 stores before its TMA reads; L1 tiles do not wait (the
    front launch landed the rows). The L1 tiles it waits for were all taken before it, by CTAs that are resident
    and finish them: no dead-lock."""
    BN: gl.constexpr = a1_desc.block_type.shape[0]
    ROWS: gl.constexpr = w1_desc.block_type.shape[0]
    nbytes: gl.constexpr = (PAIR * (2 * w1_desc.block_type.nbytes + ws1_desc.block_type.nbytes)
                            + 4 * a1_desc.block_type.nbytes)
    full = _full_mask(I // 128)
    TL: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    it = 0
    j = 0
    t = gl.atomic_add(sched, 1, sem="relaxed", scope="gpu")
    while t < num_tiles:
        _post_tile(tile_s, tile_full, tile_empty, j, t, TL)
        gl.atomic_add(progress, 1, sem="relaxed", scope="gpu")  # the rank's heartbeat (see gemm_fp8_ws)
        b, nt, e, valid = _tile(tiles, t)
        is_l2 = t >= num_l1
        if is_l2:
            KB = I // BK
            N = H
            _wait_mask(l2_mask + b, full, state, timeout_ns)
            _fence_proxy_async_global()  # the L1 epilogues' generic stores, then this warp's TMA reads
        else:
            KB = H // BK
            N = 2 * I
        for c in range((valid + BN - 1) // BN):
            a_row = b * BM + c * BN
            for qp in range(RS_TILE // (ROWS * PAIR)):
                w_row = _chain_rows(e * N, nt, PAIR * qp, ROWS)
                for kb in range(KB):
                    s = it % STAGES
                    mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)  # a fresh mbarrier passes phase -1
                    bar = ready.index(s)
                    mbarrier.expect(bar, nbytes)
                    s_word = (e * KB + kb) * N + w_row - e * N  # the MN-major [El][K/128][N] words
                    if is_l2:
                        _issue_stage(w2_desc, a2_desc, ws2_desc, wp, ab, sw, bar, w_row, a_row, kb, KB, s_word, s,
                                     PAIR)
                    else:
                        _issue_stage(w1_desc, a1_desc, ws1_desc, wp, ab, sw, bar, w_row, a_row, kb, KB, s_word, s,
                                     PAIR)
                    it += 1
        j += 1
        t = gl.atomic_add(sched, 1, sem="relaxed", scope="gpu")
    _post_tile(tile_s, tile_full, tile_empty, j, num_tiles, TL)  # no more: the math partition stops


@gluon.jit
def _post_tile(tile_s, tile_full, tile_empty, j, t, TL: gl.constexpr):
    """The loader hands tile ``t`` (its ``j``-th; ``num_tiles``: none left) to the math partition through slot
    ``j % 2`` of ``tile_s`` (int32 shared memory ``[2, 1]``): wait until the math read the slot's previous tile,
    store, arrive on ``tile_full``."""
    slot = j % 2
    mbarrier.wait(tile_empty.index(slot), ((j // 2) & 1) ^ 1)
    tile_s.index(slot).store(gl.full([1], t, gl.int32, TL))
    mbarrier.arrive(tile_full.index(slot), count=1)


@gluon.jit
def _take_tile(tile_s, tile_full, tile_empty, j, TL: gl.constexpr):
    """The math partition's ``j``-th tile from the loader (``_post_tile``), its slot released after the read."""
    slot = j % 2
    mbarrier.wait(tile_full.index(slot), (j // 2) & 1)
    t = gl.max(tile_s.index(slot).load(TL), axis=0)
    gl.thread_barrier()  # every warp has read the slot before it is released
    mbarrier.arrive(tile_empty.index(slot), count=1)
    return t


@gluon.jit
def _fold_block(buf, row0, valid, OFF_L2: gl.constexpr, OFF_L2_SF: gl.constexpr, I: gl.constexpr,
                SP: gl.constexpr, NW: gl.constexpr):
    """The L2 A operand of one pool block folded **once**, in place in the L2 pool: rows ``[row0, row0 + valid)``,
    every 128-column block ``kb``, ``e4m3(a * 2^(s_kb - s_max))`` through fp16 (exact for every value that survives
    into e4m3, as ``gemm_fp4_ws._fold_a_rows``), ``s_max`` the row's largest per-128 exponent (the words at
    ``L2_SF[kb SP + row]`` stay as the L1 epilogues wrote them: the L2 chains read ``s_max`` from them). ``[4 NW,
    128]`` bytes a step over the ``NW`` warps: 16 consecutive bytes a thread, one row a warp's quarter."""
    KB: gl.constexpr = I // 128
    FOLD_ROWS: gl.constexpr = 4 * NW
    FB_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [NW, 1], [1, 0])
    l2 = (buf + OFF_L2).to(gl.pointer_type(gl.uint8))
    l2_sf = (buf + OFF_L2_SF).to(gl.pointer_type(gl.int32))
    r = gl.arange(0, FOLD_ROWS, layout=gl.SliceLayout(1, FB_LAYOUT))
    col = gl.arange(0, 128, layout=gl.SliceLayout(0, FB_LAYOUT))
    for r0 in range(0, valid, FOLD_ROWS):
        ok = r0 + r < valid
        row = row0 + r0 + r
        s_mx = gl.zeros([FOLD_ROWS], gl.int32, gl.SliceLayout(1, FB_LAYOUT))
        for kb in range(KB):
            s_mx = gl.maximum(s_mx, gl.load(l2_sf + kb * SP + row, mask=ok, other=0) & 0xFF)
        for kb in range(KB):
            s_kb = gl.where(ok, gl.load(l2_sf + kb * SP + row, mask=ok, other=0) & 0xFF, s_mx)
            scale = gl.expand_dims(_pow2_f32(s_kb - s_mx).to(gl.float16), 1)
            ptr = l2 + gl.expand_dims(row.to(gl.int64) * I + kb * 128, 1) + gl.expand_dims(col, 0)
            a = gl.load(ptr, mask=gl.expand_dims(ok, 1), other=0).to(gl.float8e4nv, bitcast=True)
            gl.store(ptr, (a.to(gl.float16) * scale).to(gl.float8e4nv).to(gl.uint8, bitcast=True),
                     mask=gl.expand_dims(ok, 1))


@gluon.jit
def _l1_done(l2_mask, b, nt, valid, buf, BM: gl.constexpr, OFF_L2: gl.constexpr, OFF_L2_SF: gl.constexpr,
             I: gl.constexpr, SP: gl.constexpr, NW: gl.constexpr, L2_FOLDED: gl.constexpr = True):
    """An L1 tile's L2 pool bytes and scales are stored: ``fence.proxy.async`` (TMA reads them later), a warpgroup
    barrier, then its **even** bit ``2 nt`` OR-ed into the block's arrival mask (acquire-release). The tile that
    completes the even bits is the block's last: it folds the block's L2 rows once (``_fold_block``; the other
    tiles' stores were released by their OR and acquired by this one) and then sets every **odd** bit (release).
    An L2 tile waits for the full mask, i.e. for the fold. (Before: every L2 stage folded its own token boxes, per
    chain and per n-tile -- 112 times per token and K block; ``results/probes/fp4_rs_knobs_h200.jsonl``: 63 us of
    the phase's 443 at T = 8.) ``L2_FOLDED`` off (``"hopper_l2_per_block"``): nothing to fold, both of the tile's
    bits at once (release)."""
    full = _full_mask(I // 128)
    even = full & 0x5555555555555555
    mine = gl.to_tensor(1).to(gl.int64) << (2 * nt)
    _fence_proxy_async_global()
    gl.thread_barrier()  # every warp has stored and fenced before the one OR
    if not L2_FOLDED:
        gl.atomic_or(l2_mask + b, mine * 3, sem="release", scope="gpu")
    else:
        old = gl.atomic_or(l2_mask + b, mine, sem="acq_rel", scope="gpu")
        if ((old | mine) & even) == even:
            gl.thread_barrier()  # (the acquiring thread's view, to the whole warpgroup)
            _fold_block(buf, b * BM, valid, OFF_L2, OFF_L2_SF, I, SP, NW)
            _fence_proxy_async_global()
            gl.thread_barrier()
            gl.atomic_or(l2_mask + b, full ^ even, sem="release", scope="gpu")


@gluon.jit
def _l1_chain_epilogue(acc, stash, q: gl.constexpr, topk_w, clamp, HAS_CLAMP: gl.constexpr):
    """Chain ``q`` of an L1 tile: ``acc`` float32 ``[ROWS, BN]`` (weight rows x tokens, scaled), rows interleaved
    by 8 (``16 j + i`` gate and ``16 j + 8 + i`` up of intermediate column ``8 j + i``) -> bf16 round, clamp, SwiGLU,
    times the tokens' top-k weights (``topk_w`` float32 ``[BN]``, 0 past the chunk's real tokens) -> rows ``[ROWS / 2
    q, + ROWS / 2)`` of ``stash`` (float32 ``[128, BN]`` shared memory)."""
    ROWS: gl.constexpr = acc.shape[0]
    BN: gl.constexpr = acc.shape[1]
    g, u = gl.split(gl.permute(gl.reshape(acc, [ROWS // 16, 2, 8, BN]), (0, 2, 3, 1)))
    gate = _round_bf16(gl.reshape(g, [ROWS // 2, BN]))
    up = _round_bf16(gl.reshape(u, [ROWS // 2, BN]))
    if HAS_CLAMP:
        gate = gl.minimum(gate, clamp)
        up = gl.minimum(gl.maximum(up, -clamp), clamp)
    act = _silu_mul(gate, up)
    L: gl.constexpr = act.type.layout
    act = act * gl.expand_dims(gl.convert_layout(topk_w, gl.SliceLayout(0, L)), 0)
    stash.slice(ROWS // 2 * q, ROWS // 2).store(act)


@gluon.jit
def _l1_requant(stash, buf, a_row, nt, nv, OFF_L2: gl.constexpr, OFF_L2_SF: gl.constexpr, I: gl.constexpr,
                SP: gl.constexpr, QL: gl.constexpr):
    """The chunk's 128 intermediate columns x ``BN`` tokens (``stash``, complete) requantised per token as
    ``gemm_fp8_ws._l1_epilogue`` with ``UE8M0``: ``amax = max(|act|, 1e-4)``, scale ``2^ceil(log2(amax / 448))``,
    the bytes ``act`` times its exact inverse into L2 pool rows ``[a_row, a_row + nv)``, columns ``[128 nt, +128)``,
    the scale as a word of four equal UE8M0 bytes at ``L2_SF[nt SP + row]``. ``QL``: ``[128, BN]`` with 16 (8 at BN
    8) consecutive columns of one token a thread (one 16-byte store)."""
    BN: gl.constexpr = stash.shape[1]
    act = stash.load(QL)
    amax = gl.maximum(gl.max(gl.abs(act), axis=0), AMAX_FLOOR)
    _, sbyte = ceil_ue8m0(amax / FP8_MAX)
    inv = gl.expand_dims(((254 - sbyte) << 23).to(gl.float32, bitcast=True), 0)  # exact 1 / scale
    q = _to_e4m3(act * inv)
    col = gl.arange(0, 128, layout=gl.SliceLayout(1, QL))
    tok = gl.arange(0, BN, layout=gl.SliceLayout(0, QL))
    ok = tok < nv
    row = a_row + tok
    out = (buf + OFF_L2).to(gl.pointer_type(gl.uint8)) + gl.expand_dims(row.to(gl.int64) * I + nt * 128, 0) \
        + gl.expand_dims(col, 1)
    gl.store(out, q, mask=gl.expand_dims(ok, 0))
    gl.store((buf + OFF_L2_SF).to(gl.pointer_type(gl.int32)) + nt * SP + row, sbyte * 0x01010101, mask=ok)


@gluon.jit
def _l2_chain_epilogue(acc, buf, buffer_ptrs, me, a_row, n0, nv, OFF_META: gl.constexpr, OFF_COMBINE: gl.constexpr,
                       T: gl.constexpr, H: gl.constexpr, SL: gl.constexpr):
    """Chain of an L2 tile: ``acc`` float32 ``[ROWS, BN]`` (hidden columns ``[n0, n0 + ROWS)`` x the chunk's tokens,
    scaled) as bf16 into ``combine[slot][token]`` of each pool row's source rank (``gemm_fp8_ws._l2_epilogue``
    transposed: ``SL`` holds 8 consecutive columns of one token a thread, one 16-byte store)."""
    ROWS: gl.constexpr = acc.shape[0]
    BN: gl.constexpr = acc.shape[1]
    v = gl.convert_layout(_to_bf16_bits(acc), SL)
    r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, SL))
    tok = gl.arange(0, BN, layout=gl.SliceLayout(0, SL))
    ok = tok < nv
    dst_col = _combine_rows(buf, buffer_ptrs, me, a_row + tok, ok, n0, OFF_META, T, H)
    dst = (buf + OFF_COMBINE).to(gl.pointer_type(gl.int16)) + gl.expand_dims(dst_col, 0) + gl.expand_dims(r, 1)
    gl.store(dst, v, mask=gl.expand_dims(ok, 0))


@gluon.jit
def _chain_operand(wp, sw, slot, rm, lut, dot_a: gl.constexpr):
    """Weight slot ``slot``'s K block decoded with its scale words (``sw`` slot ``slot``) into the register A
    operand: its four K=32 pieces (``_decode_stage``)."""
    return _decode_stage(wp, slot, sw.index(slot).load(gl.SliceLayout(1, dot_a)), rm, lut, dot_a)


@gluon.jit
def _chain_step(wp, sw, ab, s, slot, rm, lut, dot_a: gl.constexpr, acc, tsk, SCALED: gl.constexpr):
    """One chain's K block of ring stage ``s``: its weight slot ``slot`` decoded into the register operand
    (``_chain_operand``), the fresh wgmma chain against the stage's tokens, waited for, added into ``acc`` (``SCALED``:
    times ``tsk``, the tokens' K-block scales ``[1, BN]``)."""
    g0, g1, g2, g3 = _chain_operand(wp, sw, slot, rm, lut, dot_a)
    if SCALED:
        return acc + _k_block_chain(g0, g1, g2, g3, ab, s, acc) * tsk
    return acc + _k_block_chain(g0, g1, g2, g3, ab, s, acc)



@gluon.jit
def _chunk_exponents(l2_sf, a_row, nv, fill: gl.constexpr, KW2_PAD: gl.constexpr, BN: gl.constexpr, I: gl.constexpr,
                     SP: gl.constexpr, KL: gl.constexpr):
    """The L2 input's per-128 UE8M0 exponents of a chunk's tokens (pool rows ``[a_row, a_row + BN)``, the first
    ``nv`` real), int32 ``[KW2_PAD, BN]`` in layout ``KL``: row ``kb`` = K block ``kb``'s; ``fill`` past the chunk's
    tokens and past ``I / 128``."""
    kw = gl.arange(0, KW2_PAD, layout=gl.SliceLayout(1, KL))
    tk = gl.arange(0, BN, layout=gl.SliceLayout(0, KL))
    words = gl.load(l2_sf + gl.expand_dims(kw, 1) * SP + a_row + gl.expand_dims(tk, 0),
                    mask=gl.expand_dims(kw < I // 128, 1) & gl.expand_dims(tk < nv, 0), other=fill)
    return words & 0xFF


@gluon.jit
def _chain_epilogue(acc, q: gl.constexpr, w_row, rmax, rows_m, ts, topk_w, is_l2, stash, clamp, buf, buffer_ptrs, me,
                    a_row, nt, nv, OFF_META: gl.constexpr, OFF_COMBINE: gl.constexpr, T: gl.constexpr,
                    H: gl.constexpr, SL: gl.constexpr, HAS_CLAMP: gl.constexpr):
    """Chain ``q`` of a chunk done (``acc`` float32 ``[ROWS, BN]``, its weight rows from ``w_row``): the powers of two
    of its weight rows (the fold reference of each row) and of the tokens (``ts``; exact: the order is free), then
    the L2 write-back or the L1 SwiGLU into the stash."""
    rs = _pow2_f32(gl.load(rmax + w_row + rows_m).to(gl.int32) - 127)
    acc = acc * gl.expand_dims(rs, 1) * gl.expand_dims(ts, 0)
    if is_l2:
        _l2_chain_epilogue(acc, buf, buffer_ptrs, me, a_row, nt * RS_TILE + q * acc.shape[0], nv, OFF_META,
                           OFF_COMBINE, T, H, SL)
    else:
        _l1_chain_epilogue(acc, stash, q, topk_w, clamp, HAS_CLAMP)


@gluon.jit
def _math_partition(buf, buffer_ptrs, me, clamp, rmax1, rmax2, lut, wp, ab, sw, stash, ready, empty, tile_s,
                    tile_full, tile_empty, tiles, num_l1, num_tiles, l2_mask, state, timeout_ns,
                    OFF_L1_SF: gl.constexpr, OFF_L1_W: gl.constexpr, OFF_L2: gl.constexpr, OFF_L2_SF: gl.constexpr,
                    OFF_META: gl.constexpr, OFF_COMBINE: gl.constexpr, T: gl.constexpr, H: gl.constexpr,
                    I: gl.constexpr, SP: gl.constexpr,
                    BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, HAS_CLAMP: gl.constexpr,
                    KW2_PAD: gl.constexpr, PAIR: gl.constexpr, ROWS: gl.constexpr, L2_FOLDED: gl.constexpr = True):
    """The math warpgroup(s) (module docstring; ``ROWS / 16`` warps: one warpgroup at ``ROWS`` 64, two in lock-step
    at 128): per stage the decode into the register A operand, four wgmmas (one fresh chain a K block), the stage
    released once they are done, the chain's partial sum added into its float32 accumulator; per chain the
    epilogue, per L1 chunk the requant, per L1 tile its arrival bits. ``PAIR`` 1 (one chain a stage) decodes the
    next K block's operand while the current block's wgmmas run. ``L2_FOLDED`` off (``"hopper_l2_per_block"``): an L2
    K block's partial sums are added times the tokens' ``2^(s_kb - 127)`` (float32 ``[I / 128, BN]`` made once per
    chunk from its tokens' words, after the tile's acquire of the arrival mask, into the L1 requant's ``stash``,
    which an L2 tile does not use otherwise; read per K block in the accumulator's column layout), and the epilogue
    has no token scale left."""
    SCALED: gl.constexpr = not L2_FOLDED
    NW: gl.constexpr = ROWS // 16
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BN, 32])
    dot_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=4)
    # the register layout of the [KW2_PAD, BN] scale words of a chunk's tokens
    KL: gl.constexpr = gl.BlockedLayout([1, 1], [32 // BN if BN < 32 else 1, BN if BN < 32 else 32], [NW, 1], [1, 0])
    if BN == 8:  # the stores' layouts: a token's consecutive columns in one thread (dim 0 fastest)
        gl.static_assert(NW == 4, "chunk 8 runs one math warpgroup")
        QL: gl.constexpr = gl.BlockedLayout([8, 1], [16, 2], [1, 4], [0, 1])
        SL: gl.constexpr = gl.BlockedLayout([4, 1], [16, 2], [1, 4], [0, 1])
    else:
        QL: gl.constexpr = gl.BlockedLayout([16, BN // (4 * NW)], [8, 4], [1, NW], [0, 1])
        SL: gl.constexpr = gl.BlockedLayout([8, BN // 16], [8, 4], [NW // 4, 4], [0, 1])
    rows_a = gl.arange(0, ROWS, layout=gl.SliceLayout(1, dot_a))
    rows_m = gl.arange(0, ROWS, layout=gl.SliceLayout(1, mma))
    tok_m = gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
    l1_sf = (buf + OFF_L1_SF).to(gl.pointer_type(gl.int32))
    l2_sf = (buf + OFF_L2_SF).to(gl.pointer_type(gl.int32))
    l1_w = (buf + OFF_L1_W).to(gl.pointer_type(gl.float32))
    # the stash as rows of BN float32 (unswizzled, row-major either way): the K blocks' token scales of an L2 chunk
    kb_scales = stash._reinterpret(gl.float32, [128, BN], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    full = _full_mask(I // 128)
    TL: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
    it = 0
    j = 0
    t = _take_tile(tile_s, tile_full, tile_empty, j, TL)
    while t < num_tiles:
        b, nt, e, valid = _tile(tiles, t)
        is_l2 = t >= num_l1
        if is_l2:
            KB = I // BK
            N = H
            rmax = rmax2
            _wait_mask(l2_mask + b, full, state, timeout_ns)  # (acquire: the L1 epilogues' scale words below)
        else:
            KB = H // BK
            N = 2 * I
            rmax = rmax1
        for c in range((valid + BN - 1) // BN):
            a_row = b * BM + c * BN
            nv = valid - c * BN  # real tokens of the chunk (the first nv of its BN; may exceed BN)
            topk_w = gl.zeros([BN], gl.float32, gl.SliceLayout(0, mma))  # (defined on both branches)
            if is_l2 and not L2_FOLDED:  # every K block's token scales into the stash (applied in the adds)
                gl.static_assert(KW2_PAD <= 128, "the K blocks' token scales fit the stash's 128 rows")
                ts = gl.full([BN], 1.0, gl.float32, gl.SliceLayout(0, mma))
                exps = _chunk_exponents(l2_sf, a_row, nv, 127, KW2_PAD, BN, I, SP, KL)
                gl.thread_barrier()  # the previous chunk's K loops have read the stash
                stash.slice(0, KW2_PAD).store(_pow2_f32(exps - 127))
                gl.thread_barrier()
            elif is_l2:  # per token the largest of its I / 128 exponents: the fold's reference, the token's scale
                smax = gl.max(_chunk_exponents(l2_sf, a_row, nv, 0, KW2_PAD, BN, I, SP, KL), axis=0)
                ts = _pow2_f32(gl.convert_layout(smax, gl.SliceLayout(0, mma)) - 127)
            else:  # the front launch's folded scale word of each pool row
                word = gl.load(l1_sf + a_row + tok_m, mask=tok_m < nv, other=127 * 0x01010101)
                ts = _pow2_f32((word & 0xFF) - 127)
                topk_w = gl.load(l1_w + a_row + tok_m, mask=tok_m < nv, other=0.0)
            gl.static_assert((PAIR == 1) | (PAIR == 2) | (PAIR == 4), "one, two or four chains a token stage")
            for qp in gl.static_range(RS_TILE // (ROWS * PAIR)):
                w_row = _chain_rows(e * N, nt, PAIR * qp, ROWS)  # the first chain's row (chain i: + ROWS i)
                rm0 = gl.load(rmax + w_row + rows_a).to(gl.int32)
                acc0 = gl.zeros([ROWS, BN], gl.float32, mma)
                tsk = gl.full([1, BN], 1.0, gl.float32, mma)  # (L1: a scale of 1)
                if PAIR == 1:  # the next K block's decode under the current block's wgmmas
                    s = it % STAGES
                    mbarrier.wait(ready.index(s), (it // STAGES) & 1)
                    g0, g1, g2, g3 = _chain_operand(wp, sw, s, rm0, lut, dot_a)
                    for kb in range(KB):
                        dot = _k_block_issue(g0, g1, g2, g3, ab, s, acc0)
                        if SCALED:  # this K block's token scales
                            if is_l2:
                                tsk = gl.expand_dims(kb_scales.index(kb).load(gl.SliceLayout(0, mma)), 0)
                        n0, n1, n2, n3 = g0, g1, g2, g3
                        if kb + 1 < KB:
                            s_n = (it + 1) % STAGES
                            mbarrier.wait(ready.index(s_n), ((it + 1) // STAGES) & 1)
                            n0, n1, n2, n3 = _chain_operand(wp, sw, s_n, rm0, lut, dot_a)
                        # (the e4m3 operands cannot be wait deps -- "Unexpected bitwidth in WGMMAWaitGroupOp: 8" --
                        # ptxas keeps a wgmma's register operands live until its wait_group)
                        part = warpgroup_mma_wait(num_outstanding=0, deps=(dot, ))
                        mbarrier.arrive(empty.index(s), count=1)
                        if SCALED:
                            acc0 = acc0 + part * tsk
                        else:
                            acc0 = acc0 + part
                        g0, g1, g2, g3 = n0, n1, n2, n3
                        it += 1
                        s = it % STAGES
                else:
                    rm1 = gl.load(rmax + w_row + ROWS + rows_a).to(gl.int32)
                    acc1 = gl.zeros([ROWS, BN], gl.float32, mma)
                    if PAIR == 4:
                        rm2 = gl.load(rmax + w_row + 2 * ROWS + rows_a).to(gl.int32)
                        rm3 = gl.load(rmax + w_row + 3 * ROWS + rows_a).to(gl.int32)
                        acc2 = gl.zeros([ROWS, BN], gl.float32, mma)
                        acc3 = gl.zeros([ROWS, BN], gl.float32, mma)
                    for kb in range(KB):
                        s = it % STAGES
                        if SCALED:  # this K block's token scales
                            if is_l2:
                                tsk = gl.expand_dims(kb_scales.index(kb).load(gl.SliceLayout(0, mma)), 0)
                        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
                        acc0 = _chain_step(wp, sw, ab, s, PAIR * s, rm0, lut, dot_a, acc0, tsk, SCALED)
                        acc1 = _chain_step(wp, sw, ab, s, PAIR * s + 1, rm1, lut, dot_a, acc1, tsk, SCALED)
                        if PAIR == 4:
                            acc2 = _chain_step(wp, sw, ab, s, PAIR * s + 2, rm2, lut, dot_a, acc2, tsk, SCALED)
                            acc3 = _chain_step(wp, sw, ab, s, PAIR * s + 3, rm3, lut, dot_a, acc3, tsk, SCALED)
                        mbarrier.arrive(empty.index(s), count=1)  # (every chain's MMAs of the stage waited for)
                        it += 1
                _chain_epilogue(acc0, PAIR * qp, w_row, rmax, rows_m, ts, topk_w, is_l2, stash, clamp, buf,
                                buffer_ptrs, me, a_row, nt, nv, OFF_META, OFF_COMBINE, T, H, SL, HAS_CLAMP)
                if PAIR >= 2:
                    _chain_epilogue(acc1, PAIR * qp + 1, w_row + ROWS, rmax, rows_m, ts, topk_w, is_l2, stash,
                                    clamp, buf, buffer_ptrs, me, a_row, nt, nv, OFF_META, OFF_COMBINE, T, H, SL,
                                    HAS_CLAMP)
                if PAIR == 4:
                    _chain_epilogue(acc2, PAIR * qp + 2, w_row + 2 * ROWS, rmax, rows_m, ts, topk_w, is_l2,
                                    stash, clamp, buf, buffer_ptrs, me, a_row, nt, nv, OFF_META, OFF_COMBINE, T, H, SL,
                                    HAS_CLAMP)
                    _chain_epilogue(acc3, PAIR * qp + 3, w_row + 3 * ROWS, rmax, rows_m, ts, topk_w, is_l2,
                                    stash, clamp, buf, buffer_ptrs, me, a_row, nt, nv, OFF_META, OFF_COMBINE, T, H, SL,
                                    HAS_CLAMP)
            if not is_l2:
                gl.thread_barrier()  # every warp's chains are in the stash
                _l1_requant(stash, buf, a_row, nt, nv, OFF_L2, OFF_L2_SF, I, SP, QL)
                gl.thread_barrier()  # read before the next chunk writes it
        if not is_l2:
            _l1_done(l2_mask, b, nt, valid, buf, BM, OFF_L2, OFF_L2_SF, I, SP, NW, L2_FOLDED)  # its bit(s); folds
        j += 1
        t = _take_tile(tile_s, tile_full, tile_empty, j, TL)


@gluon.jit
def fp4_rs_gemm_phase_kernel(a1_desc, a2_desc, w1_desc, w2_desc, ws1_desc, ws2_desc, buf, rmax1, rmax2, lut, tiles,
                             sched, buffer_ptrs, me, clamp, timeout_ns,
                             OFF_GRID: gl.constexpr, OFF_STATE: gl.constexpr, OFF_L2_MASK: gl.constexpr,
                             OFF_L1_SF: gl.constexpr, OFF_L1_W: gl.constexpr, OFF_L2: gl.constexpr,
                             OFF_L2_SF: gl.constexpr, OFF_META: gl.constexpr, OFF_COMBINE: gl.constexpr,
                             T: gl.constexpr, H: gl.constexpr, I: gl.constexpr, SP: gl.constexpr, BM: gl.constexpr,
                             HAS_CLAMP: gl.constexpr, STAGES: gl.constexpr, LOAD_REGS: gl.constexpr,
                             KW2_PAD: gl.constexpr, PAIR: gl.constexpr, PDL: gl.constexpr = False,
                             L2_FOLDED: gl.constexpr = True):
    """One rank's GEMM phase (module docstring). Descriptors: ``a1`` L1 pool ``[P, H]`` / ``a2`` L2 pool ``[P, I]``
    e4m3, box ``[BN, 32]`` (``BN`` the tokens of a chunk, 8 / 16 / 32); ``w1`` / ``w2`` the transformed packed FP4
    bytes, blocked by 256 rows x 128 K and seen as ``[rows, 64]`` (``_w_coord``), box ``[64, 32]``; ``ws1`` / ``ws2``
    the transformed MN-major scale words ``[El][K/128][N]`` as flat int32, box ``[64]``. ``rmax1`` / ``rmax2``:
    uint8 ``[El*2I]`` / ``[El*H]``, each weight row's largest UE8M0 byte; ``lut``: ``megamoe.quant.fold_lut`` (not
    read, as in ``gemm_fp4_ws``);
    ``tiles``: the front launch's tile table (pool blocks of ``BM`` rows); ``sched``: an int32 tile counter, 0 at
    the launch (the host zeroes it); ``buffer_ptrs``: every rank's buffer base. Launched with
    ``num_warps`` 4 and ``maxnreg`` 64, several CTAs an SM (``megamoe.fused.FP4_RS_CTAS_PER_SM``)."""
    if PDL:  # a programmatic dependent of the front launch (megamoe.fused.WS_PDL), as gemm_fp4_ws
        gdc_wait()
        gdc_launch_dependents()
    state = (buf + OFF_STATE).to(gl.pointer_type(gl.int32))
    l2_mask = (buf + OFF_L2_MASK).to(gl.pointer_type(gl.int64))
    progress = (buf + OFF_GRID).to(gl.pointer_type(gl.int32)) + 1  # grid-sync word 1 (megamoe.kernels.fused)
    num_l1 = gl.load(tiles)
    num_tiles = num_l1 + gl.load(tiles + 1)
    if gl.load(state + 1) != 0:  # the front launch failed (a barrier timed out): no tile
        num_tiles = 0
    BN: gl.constexpr = a1_desc.block_type.shape[0]
    gl.static_assert((BN == 8) | (BN == 16) | (BN == 32) | (BN == 64) | (BN == 128),
                     "token chunks of 8, 16, 32, 64 or 128")
    gl.static_assert(BM % BN == 0, "a pool block holds whole chunks")
    ROWS: gl.constexpr = w1_desc.block_type.shape[0]
    gl.static_assert((ROWS == 64) | (ROWS == 128), "chains of 64 (one warpgroup) or 128 weight rows (two)")
    wp = gl.allocate_shared_memory(gl.uint8, [2 * PAIR * STAGES, ROWS, 32], w1_desc.layout)
    ab = gl.allocate_shared_memory(gl.float8e4nv, [4 * STAGES, BN, 32], a1_desc.layout)
    sw = gl.allocate_shared_memory(gl.int32, [PAIR * STAGES, ROWS], ws1_desc.layout)
    stash = gl.allocate_shared_memory(gl.float32, [128, BN], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    tile_s = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    tile_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    tile_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)  # the loader's expect + the TMA bytes
        mbarrier.init(empty.index(i), count=1)  # the math warpgroup's release
    for i in gl.static_range(2):
        mbarrier.init(tile_full.index(i), count=1)  # the loader posted a tile id
        mbarrier.init(tile_empty.index(i), count=1)  # the math partition read it
    fence_async_shared()  # barrier inits visible to the async proxy before first use
    gl.warp_specialize([
        (_math_partition, (buf, buffer_ptrs, me, clamp, rmax1, rmax2, lut, wp, ab, sw, stash, ready, empty, tile_s,
                           tile_full, tile_empty, tiles, num_l1, num_tiles, l2_mask, state, timeout_ns, OFF_L1_SF,
                           OFF_L1_W, OFF_L2, OFF_L2_SF, OFF_META, OFF_COMBINE, T, H, I, SP, BM, BN, STAGES,
                           HAS_CLAMP, KW2_PAD, PAIR, ROWS, L2_FOLDED)),
        (_load_partition, (a1_desc, a2_desc, w1_desc, w2_desc, ws1_desc, ws2_desc, wp, ab, sw, ready, empty, tile_s,
                           tile_full, tile_empty, sched, tiles, num_l1, num_tiles, l2_mask, progress, state,
                           timeout_ns, H, I, BM, STAGES, PAIR)),
    ], [1], [LOAD_REGS])
