"""The two grouped GEMMs over the pool: FP8 activations x FP4 weights, both block-scaled per 32 along K.

L1 (``l1_swiglu_kernel``): ``l1_acts [pool rows, H]`` x ``W1[e] [2I, H]`` -> SwiGLU -> x top-k weight -> FP8 per-32
requant into ``l2_acts [pool rows, I]`` + ``l2_acts_sf``.
L2 (``l2_combine_kernel``): ``l2_acts`` x ``W2[e] [H, I]`` -> BF16 rows stored straight into the **source** rank's
``combine[slot][token]`` through ``sym_map``.

Two ways to apply the per-32 scales (constexpr ``SCALED_OPERANDS``; ``megamoe.ops.GEMM_CONFIG`` picks, from
measurements in ``results/tune_h200.json``):

* ``False`` -- FP8 operands: per scale group one K=32 FP8 dot, then ``acc += dot * sa[m] * sb[n]`` (an fp32
  "promotion" per group, DeepGEMM SM90's trick at 4x its frequency). Runs on FP8 tensor cores, whose in-MMA
  accumulation keeps ~14 bits, and every promotion waits for its MMA.
* ``True`` -- scaled operands: both scales are powers of two, so ``fp8 * sa`` and ``e2m1 * sb`` are exact in bf16;
  the operands are widened with the scales folded in and every dot chains on one accumulator (bf16 tensor cores,
  fp32 accumulate; the interpreter uses fp32 operands since its bf16 dot is broken). Products stay exact.

FP8 mode decode: ``PRMT_DECODE`` turns four FP4 values into FP8 with one PRMT byte-permute lookup (inline PTX, GPU
only; the interpreter runs the arithmetic :func:`~megamoe.kernels.numerics.e2m1_to_e4m3`), ~27% faster GEMMs on an
H200 (``results/tune_h200.json``).

Both kernels are persistent: ``tile = program_id; tile += num_programs`` over ``(pool block, N tile)`` pairs up to the
number of used pool blocks, computed on the device from ``expert_recv_count`` (no host sync, no empty programs).

The K loop steps 64 elements at a time. ``transform_weights_for_mega_moe`` packed the weights so that byte lane ``j``
of a 64-chunk carries elements ``j`` ("low") and ``j+32`` ("high"), each 4-byte word's bits in register order: a
step loads 32 bytes per weight row and decodes two 32-wide FP8 operands (``numerics.e2m1x2_nibbles`` /
``e2m1x2_to_e4m3_prmt``), each inside exactly one per-32 scale group. Each operand pair feeds one
``tl.dot`` (K=32, the FP8 MMA's native K) whose fp32 result is scaled by ``sa[m] * sb[n]`` and accumulated -- the
per-32 analogue of DeepGEMM's SM90 per-128 "promotion". FP4 is decoded to FP8 (exactly) so the dot runs at FP8
tensor-core rate; ``tl.dot_scaled`` is avoided (absent from Triton 3.6's interpreter, bf16-rate on Hopper).
"""
import triton
import triton.language as tl

from megamoe.kernels.formats import AMAX_FLOOR, FP8_MAX, L1_INTERLEAVE, SF_GRAN_K, fp4_weight_offset
from megamoe.kernels.numerics import (
    ceil_ue8m0,
    e2m1_scaled_f32,
    e2m1_to_e4m3,
    e2m1x2_nibbles,
    e2m1x2_to_e4m3_prmt,
    f32_to_bf16_bits,
    f32_to_e4m3_bits,
    round_to_bf16,
    sf_byte,
    ue8m0_to_f32,
)
from megamoe.kernels.pool import expert_blocks, locate_block
from megamoe.kernels.symm import sym_map


@triton.jit
def _load_a_step(acts, acts_sf, rows, sf_rows, mask_m, k0, K: tl.constexpr, SP: tl.constexpr):
    """Activation operands of one 64-wide K step: two fp8 [BM, 32] tiles and their fp32 scales [BM]."""
    kk = tl.arange(0, 32)
    base = acts + rows[:, None].to(tl.int64) * K + k0 + kk[None, :]
    a0 = tl.load(base, mask=mask_m[:, None], other=0.0)
    a1 = tl.load(base + 32, mask=mask_m[:, None], other=0.0)
    word = tl.load(acts_sf + (k0 // 128) * SP + sf_rows, mask=mask_m, other=0)
    g = k0 // SF_GRAN_K
    return a0, a1, ue8m0_to_f32(sf_byte(word, g)), ue8m0_to_f32(sf_byte(word, g + 1))


@triton.jit
def _load_w(w, w_sf, n_rows, k0, K: tl.constexpr, N: tl.constexpr):
    """Weights of one 64-wide K step: packed FP4 bytes uint8 [BN, 32] (64-chunk nibble packing) and the int32 scale
    word [BN] holding their two groups. ``w``: uint8 [N, K/2] (blocked, ``fp4_weight_offset``); ``w_sf``: int32
    MN-major [K/128][N]."""
    packed = tl.load(w + fp4_weight_offset(n_rows[:, None], k0 // 2, tl.arange(0, 32)[None, :], N, K // 2))
    return packed, tl.load(w_sf + (k0 // 128) * N + n_rows)


@triton.jit
def _weight_step(acc, a0, a1, sa0, sa1, packed, word, k0, PRMT_DECODE: tl.constexpr):
    """acc [BM, BN] += (a0 . W[n, k0:k0+32]) * sa0 sb0 + (a1 . W[n, k0+32:k0+64]) * sa1 sb1 from :func:`_load_w`'s
    ``packed``/``word``. ``PRMT_DECODE``: decode 4 bytes per instruction sequence with a byte-permute table (GPU)."""
    if PRMT_DECODE:
        b0, b1 = e2m1x2_to_e4m3_prmt(packed)
    else:
        n0, n1 = e2m1x2_nibbles(packed)
        b0 = e2m1_to_e4m3(n0)
        b1 = e2m1_to_e4m3(n1)
    g = k0 // SF_GRAN_K
    sb0 = ue8m0_to_f32(sf_byte(word, g))
    sb1 = ue8m0_to_f32(sf_byte(word, g + 1))
    acc += tl.dot(a0, tl.trans(b0)) * (sa0[:, None] * sb0[None, :])
    acc += tl.dot(a1, tl.trans(b1)) * (sa1[:, None] * sb1[None, :])
    return acc


@triton.jit
def _widen_a(a0, a1, sa0, sa1, DOT_DTYPE: tl.constexpr):
    """Scaled-operand mode: fold the per-32 activation scales into the operands, exactly (fp8 * 2^k fits bf16)."""
    return (a0.to(tl.float32) * sa0[:, None]).to(DOT_DTYPE), (a1.to(tl.float32) * sa1[:, None]).to(DOT_DTYPE)


@triton.jit
def _weight_step_scaled(acc, a0w, a1w, w, w_sf, n_rows, k0, K: tl.constexpr, N: tl.constexpr,
                        DOT_DTYPE: tl.constexpr):
    """acc += a0w . (W[n, k0:k0+32] * sb0) + a1w . (W[n, k0+32:k0+64] * sb1), scales folded into the decoded weights
    (exact: e2m1 * 2^k has 2 significant bits). No per-group promotion: both dots chain on one accumulator."""
    packed = tl.load(w + fp4_weight_offset(n_rows[:, None], k0 // 2, tl.arange(0, 32)[None, :], N, K // 2))
    word = tl.load(w_sf + (k0 // 128) * N + n_rows)
    g = k0 // SF_GRAN_K
    n0, n1 = e2m1x2_nibbles(packed)
    b0 = e2m1_scaled_f32(n0, sf_byte(word, g)[:, None]).to(DOT_DTYPE)
    b1 = e2m1_scaled_f32(n1, sf_byte(word, g + 1)[:, None]).to(DOT_DTYPE)
    acc = tl.dot(a0w, tl.trans(b0), acc)
    acc = tl.dot(a1w, tl.trans(b1), acc)
    return acc


@triton.jit
def _pool_tile(tile, recv, N_TILES: tl.constexpr, R: tl.constexpr, El: tl.constexpr, BLOCK_M: tl.constexpr,
               SF_BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr):
    """tile -> (expert, pool rows [BM], sf rows [BM], row mask [BM], n tile)."""
    n, blocks, cum = expert_blocks(recv, R, El, BLOCK_M, BLOCK_R, BLOCK_E)
    block = tile // N_TILES
    expert, row0, valid = locate_block(block, n, blocks, cum, BLOCK_M, BLOCK_E)
    m = tl.arange(0, BLOCK_M)
    return expert, row0 + m, block * SF_BLOCK_M + m, m < valid, tile % N_TILES


@triton.jit
def _num_tiles(recv, N_TILES: tl.constexpr, R: tl.constexpr, El: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr):
    n, blocks, cum = expert_blocks(recv, R, El, BLOCK_M, BLOCK_R, BLOCK_E)
    return tl.max(cum, axis=0) * N_TILES


@triton.jit
def swiglu(gate, up, F64_EXP: tl.constexpr):
    """``gate / (1 + exp(-gate)) * up`` in float32; ``F64_EXP``: the exp in float64 rounded once to float32, the
    reference's ``exp_f32`` (bit-exact whatever the libm; the interpreter), else the fast float32 exp (GPU)."""
    if F64_EXP:
        return gate / (1.0 + tl.exp((-gate).to(tl.float64)).to(tl.float32)) * up
    else:
        return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def swiglu_weighted(acc_g, acc_u, clamp, topk_w, rows, mask_m, HAS_CLAMP: tl.constexpr, F64_EXP: tl.constexpr):
    """The L1 epilogue's activation, both formats: the float32 gate / up accumulators ``[BM, BN]`` (pool ``rows``
    int32 ``[BM]`` x intermediate columns) rounded to bf16 (as DeepGEMM and the reference's L1 output), clamped
    (``HAS_CLAMP``: ``gate <= clamp``, ``-clamp <= up <= clamp``), :func:`swiglu`, times each row's top-k weight
    (``topk_w``: float32 per pool row; 0 on padding rows, ``mask_m`` False) -> float32 ``[BM, BN]``."""
    gate = round_to_bf16(acc_g)
    up = round_to_bf16(acc_u)
    if HAS_CLAMP:
        gate = tl.minimum(gate, clamp)
        up = tl.minimum(tl.maximum(up, -clamp), clamp)
    act = swiglu(gate, up, F64_EXP)
    return act * tl.load(topk_w + rows, mask=mask_m, other=0.0)[:, None]


@triton.jit
def l1_tile(buf, w1, w1_sf, clamp, expert, rows, sf_rows, mask_m, nt,
            OFF_L1: tl.constexpr, OFF_L1_SF: tl.constexpr, OFF_L1_W: tl.constexpr, OFF_L2: tl.constexpr,
            OFF_L2_SF: tl.constexpr, H: tl.constexpr, I: tl.constexpr, SP: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, HAS_CLAMP: tl.constexpr, SCALED_OPERANDS: tl.constexpr, DOT_DTYPE: tl.constexpr,
            PRMT_DECODE: tl.constexpr, F64_EXP: tl.constexpr):
    """One L1 tile: pool ``rows`` [BM] (``mask_m`` valid, scale rows ``sf_rows``) of local ``expert`` x intermediate
    columns ``[nt*BLOCK_N, (nt+1)*BLOCK_N)`` (2*BLOCK_N interleaved gate/up weight rows); SwiGLU, top-k weight and
    the per-32 FP8 requant into the L2 pool. Shared by the staged kernel below and the fused kernel.
    ``F64_EXP``: SwiGLU's exp in float64 rounded to float32, as ``megamoe.reference.exp_f32`` (the interpreter);
    else the fast float32 exp (GPU)."""
    acts = (buf + OFF_L1).to(tl.pointer_type(tl.float8e4nv))
    acts_sf = (buf + OFF_L1_SF).to(tl.pointer_type(tl.int32))
    topk_w = (buf + OFF_L1_W).to(tl.pointer_type(tl.float32))
    out = (buf + OFF_L2).to(tl.pointer_type(tl.uint8))
    out_sf = (buf + OFF_L2_SF).to(tl.pointer_type(tl.uint8))
    w1 = w1.to(tl.pointer_type(tl.uint8))
    G: tl.constexpr = BLOCK_N // SF_GRAN_K
    c = nt * BLOCK_N + tl.arange(0, BLOCK_N)
    gate_rows = (c // L1_INTERLEAVE) * (2 * L1_INTERLEAVE) + c % L1_INTERLEAVE  # gate/up interleaved
    w = w1 + expert.to(tl.int64) * (2 * I) * (H // 2)
    w_sf = w1_sf + expert.to(tl.int64) * (H // 128) * (2 * I)
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, 64):
        a0, a1, sa0, sa1 = _load_a_step(acts, acts_sf, rows, sf_rows, mask_m, k0, H, SP)
        if SCALED_OPERANDS:
            a0w, a1w = _widen_a(a0, a1, sa0, sa1, DOT_DTYPE)
            acc_g = _weight_step_scaled(acc_g, a0w, a1w, w, w_sf, gate_rows, k0, H, 2 * I, DOT_DTYPE)
            acc_u = _weight_step_scaled(acc_u, a0w, a1w, w, w_sf, gate_rows + L1_INTERLEAVE, k0, H, 2 * I, DOT_DTYPE)
        else:
            pg, sg = _load_w(w, w_sf, gate_rows, k0, H, 2 * I)
            pu, su = _load_w(w, w_sf, gate_rows + L1_INTERLEAVE, k0, H, 2 * I)
            acc_g = _weight_step(acc_g, a0, a1, sa0, sa1, pg, sg, k0, PRMT_DECODE)
            acc_u = _weight_step(acc_u, a0, a1, sa0, sa1, pu, su, k0, PRMT_DECODE)
    # epilogue: bf16 round (as DeepGEMM), clamp, SwiGLU, top-k weight
    act = swiglu_weighted(acc_g, acc_u, clamp, topk_w, rows, mask_m, HAS_CLAMP, F64_EXP)
    # FP8 requant per 32 columns: scale = 2^ceil(log2(amax / 448)), amax >= 1e-4
    act3 = tl.reshape(act, [BLOCK_M, G, SF_GRAN_K])
    amax = tl.maximum(tl.max(tl.abs(act3), axis=2), AMAX_FLOOR)
    _, sbyte = ceil_ue8m0(amax / FP8_MAX)
    inv = ((254 - sbyte) << 23).to(tl.float32, bitcast=True)  # exact 1/scale
    q = tl.reshape(f32_to_e4m3_bits(act3 * inv[:, :, None]), [BLOCK_M, BLOCK_N])
    tl.store(out + rows[:, None].to(tl.int64) * I + c[None, :], q.to(tl.uint8), mask=mask_m[:, None])
    grp = nt * G + tl.arange(0, G)
    sf_addr = ((grp[None, :] // 4) * SP + sf_rows[:, None]) * 4 + grp[None, :] % 4
    tl.store(out_sf + sf_addr, sbyte.to(tl.uint8), mask=mask_m[:, None])


@triton.jit
def for_each_pool_tile(tile_fn: tl.constexpr, lead, trail, buf, OFF_RECV: tl.constexpr, N_TILES: tl.constexpr,
                       R: tl.constexpr, El: tl.constexpr, BLOCK_M: tl.constexpr, SF_BLOCK_M: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr):
    """The persistent schedule of the staged GEMM kernels (both layers, both formats: :mod:`megamoe.kernels.gemm`
    and :mod:`megamoe.kernels.gemm_fp8`). Tiles are ``(pool block, N tile)`` pairs, ``tile = block * N_TILES + nt``,
    up to the number of used pool blocks times ``N_TILES``, computed on the device from ``expert_recv_count``
    (int64 ``[R, El]`` at byte offset ``OFF_RECV`` of ``buf``); program ``p`` runs tiles ``p, p + num_programs, ...``
    as ``tile_fn(*lead, expert, rows, sf_rows, mask_m, nt, *trail)``: ``expert`` the local expert (int32 scalar),
    ``rows`` its pool rows int32 ``[BLOCK_M]``, ``sf_rows`` their rows in the MN-major scale segments (block *
    ``SF_BLOCK_M`` + m), ``mask_m`` bool ``[BLOCK_M]`` (rows holding a token; padding rows past the expert's count
    are False), ``nt`` the N tile. ``lead`` / ``trail``: tuples of ``tile_fn``'s other arguments, before / after those
    five (constexprs included)."""
    recv = (buf + OFF_RECV).to(tl.pointer_type(tl.int64))
    num_tiles = _num_tiles(recv, N_TILES, R, El, BLOCK_M, BLOCK_R, BLOCK_E)
    tile = tl.program_id(0)
    while tile < num_tiles:
        expert, rows, sf_rows, mask_m, nt = _pool_tile(tile, recv, N_TILES, R, El, BLOCK_M, SF_BLOCK_M,
                                                       BLOCK_R, BLOCK_E)
        tile_fn(*lead, expert, rows, sf_rows, mask_m, nt, *trail)
        tile += tl.num_programs(0)


@triton.jit
def l1_swiglu_kernel(buf, w1, w1_sf, clamp,
                     OFF_RECV: tl.constexpr, OFF_L1: tl.constexpr, OFF_L1_SF: tl.constexpr, OFF_L1_W: tl.constexpr,
                     OFF_L2: tl.constexpr, OFF_L2_SF: tl.constexpr,
                     R: tl.constexpr, El: tl.constexpr, H: tl.constexpr, I: tl.constexpr, SP: tl.constexpr,
                     BLOCK_M: tl.constexpr, SF_BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr, HAS_CLAMP: tl.constexpr,
                     SCALED_OPERANDS: tl.constexpr, DOT_DTYPE: tl.constexpr, PRMT_DECODE: tl.constexpr,
                     F64_EXP: tl.constexpr = False):
    """Persistent over tiles = BLOCK_M pool rows x BLOCK_N intermediate columns (:func:`l1_tile` on each, scheduled
    by :func:`for_each_pool_tile`)."""
    for_each_pool_tile(l1_tile, (buf, w1, w1_sf, clamp),
                       (OFF_L1, OFF_L1_SF, OFF_L1_W, OFF_L2, OFF_L2_SF, H, I, SP, BLOCK_M, BLOCK_N, HAS_CLAMP,
                        SCALED_OPERANDS, DOT_DTYPE, PRMT_DECODE, F64_EXP),
                       buf, OFF_RECV, I // BLOCK_N, R, El, BLOCK_M, SF_BLOCK_M, BLOCK_R, BLOCK_E)


@triton.jit
def store_combine(out, meta, combine, buffer_ptrs, me, rows, mask_m, n_rows, T: tl.constexpr, H: tl.constexpr):
    """The L2 write-back of both formats' tiles: ``out`` float32 ``[BM, BN]`` (pool ``rows`` int32 ``[BM]`` x hidden
    columns ``n_rows`` int32 ``[BN]``) rounded to bf16 into ``combine[slot][token]`` (``combine``: int16 pointer to
    this rank's ``[K, T, H]`` bf16 bits) of each row's source rank, read from ``meta`` (int32 pointer to
    ``token_src_metadata`` ``[pool rows, 3]``: source rank, token, slot) and reached through
    :func:`~megamoe.kernels.symm.sym_map`; padding rows (``mask_m`` False) skipped."""
    src_rank = tl.load(meta + rows * 3, mask=mask_m, other=0)
    token = tl.load(meta + rows * 3 + 1, mask=mask_m, other=0)
    slot = tl.load(meta + rows * 3 + 2, mask=mask_m, other=0)
    dst = combine + ((slot * T + token).to(tl.int64) * H)[:, None] + n_rows[None, :]
    dst = sym_map(dst, buffer_ptrs, me, src_rank[:, None])
    tl.store(dst, f32_to_bf16_bits(out).to(tl.int16), mask=mask_m[:, None])


@triton.jit
def l2_tile(buf, buffer_ptrs, me, w2, w2_sf, expert, rows, sf_rows, mask_m, nt,
            OFF_L2: tl.constexpr, OFF_L2_SF: tl.constexpr, OFF_META: tl.constexpr, OFF_COMBINE: tl.constexpr,
            T: tl.constexpr, H: tl.constexpr, I: tl.constexpr, SP: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, SCALED_OPERANDS: tl.constexpr, DOT_DTYPE: tl.constexpr, PRMT_DECODE: tl.constexpr):
    """One L2 tile: pool ``rows`` x hidden columns ``[nt*BLOCK_N, (nt+1)*BLOCK_N)``, written as bf16 into
    ``combine[slot][token]`` of each row's source rank (padding rows skipped, :func:`store_combine`). Shared with
    the fused kernel."""
    acts = (buf + OFF_L2).to(tl.pointer_type(tl.float8e4nv))
    acts_sf = (buf + OFF_L2_SF).to(tl.pointer_type(tl.int32))
    meta = (buf + OFF_META).to(tl.pointer_type(tl.int32))
    combine = (buf + OFF_COMBINE).to(tl.pointer_type(tl.int16))
    w2 = w2.to(tl.pointer_type(tl.uint8))
    n_rows = nt * BLOCK_N + tl.arange(0, BLOCK_N)
    w = w2 + expert.to(tl.int64) * H * (I // 2)
    w_sf = w2_sf + expert.to(tl.int64) * (I // 128) * H
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, I, 64):
        a0, a1, sa0, sa1 = _load_a_step(acts, acts_sf, rows, sf_rows, mask_m, k0, I, SP)
        if SCALED_OPERANDS:
            a0w, a1w = _widen_a(a0, a1, sa0, sa1, DOT_DTYPE)
            acc = _weight_step_scaled(acc, a0w, a1w, w, w_sf, n_rows, k0, I, H, DOT_DTYPE)
        else:
            pw, sw = _load_w(w, w_sf, n_rows, k0, I, H)
            acc = _weight_step(acc, a0, a1, sa0, sa1, pw, sw, k0, PRMT_DECODE)
    store_combine(acc, meta, combine, buffer_ptrs, me, rows, mask_m, n_rows, T, H)


@triton.jit
def l2_combine_kernel(buf, buffer_ptrs, me, w2, w2_sf,
                      OFF_RECV: tl.constexpr, OFF_L2: tl.constexpr, OFF_L2_SF: tl.constexpr, OFF_META: tl.constexpr,
                      OFF_COMBINE: tl.constexpr,
                      R: tl.constexpr, El: tl.constexpr, T: tl.constexpr, H: tl.constexpr, I: tl.constexpr,
                      SP: tl.constexpr, BLOCK_M: tl.constexpr, SF_BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr, SCALED_OPERANDS: tl.constexpr,
                      DOT_DTYPE: tl.constexpr, PRMT_DECODE: tl.constexpr):
    """Persistent over tiles = BLOCK_M pool rows x BLOCK_N hidden columns (:func:`l2_tile` on each, scheduled by
    :func:`for_each_pool_tile`)."""
    for_each_pool_tile(l2_tile, (buf, buffer_ptrs, me, w2, w2_sf),
                       (OFF_L2, OFF_L2_SF, OFF_META, OFF_COMBINE, T, H, I, SP, BLOCK_M, BLOCK_N, SCALED_OPERANDS,
                        DOT_DTYPE, PRMT_DECODE),
                       buf, OFF_RECV, H // BLOCK_N, R, El, BLOCK_M, SF_BLOCK_M, BLOCK_R, BLOCK_E)
