"""The two grouped GEMMs of the SM90 FP8 x FP8 format (DeepGEMM ``fp8_mega_moe``, recipe (128, 128, 128)).

Same pool, schedule and write-back as :mod:`megamoe.kernels.gemm` (whose helpers they reuse); what differs is the
number format (:mod:`megamoe.quant_fp8`):

* weights are FP8 e4m3 ``[El, N, K]`` (blocked by 128 x 128, ``megamoe.quant_fp8.block_weights``: each 128 x 128
  block one run of memory) with one float32 scale per 128x128 block,
  ``[El, N/128, K/128]`` (row-major); activations are FP8 with one float32 scale per row and 128 columns, MN-major in
  the pool (``sf[k/128 * SP + pool sf row]``, the same addressing as the packed UE8M0 words of the other format).
* The K loop steps 128: one K=128 FP8 dot per block, promoted in float32 with
  ``acc += dot * (sa[m] * sw[n])`` -- DeepGEMM SM90's ``final_accum += scale_a * sb * accum`` (the product of the
  two scales first, then times the block's dot), and :func:`megamoe.reference.block_scaled_matmul`.
* L1 reads interleaved weight rows (gate/up by 8, ``transform_weights_for_mega_moe_sm90``) but the *untransformed*
  scale blocks: intermediate column ``c`` uses gate scale row ``c // 128`` and up scale row ``I/128 + c // 128``.
* The L1 epilogue requantises per 128 columns with a float32 scale ``amax / 448`` (amax floored at 1e-4) and
  ``q = e4m3(act * (1 / scale))`` (:func:`megamoe.quant_fp8.per_token_cast_to_fp8_128`): ``BLOCK_N`` must be a
  multiple of 128 so a tile owns whole scale groups.

On the interpreter the float32 division and reciprocal are IEEE (numpy), so the requant is bitwise the reference's;
on a GPU Triton's ``/`` may be the approximate ``div.full.f32`` (a 1-2 ulp scale difference, inside the GPU
tolerance). The staged pipeline launches them as grids; the fused kernel (``megamoe.kernels.fused``, constexpr
``FP8W``) calls ``l1_tile_fp8`` / ``l2_tile_fp8`` from its task loop.

**Swap-AB tiles** (``l1_tile_fp8_swap`` / ``l2_tile_fp8_swap``: ``l1_tile_fp8`` / ``l2_tile_fp8`` with constexpr
``SWAP``; fused kernel constexpr ``FP8_SWAP``, chosen by ``megamoe.fused.fused_config`` for few expected tokens per
expert): 128 weight rows on the MMA's M and 16 / 32 pool tokens on its N, so a block of a few tokens does not pad
the MMA to 64 rows. Same per-block dot and promotion
(``acc += dot * (sw * sa[m])``: the same float32 scale product) and the same epilogues on the transposed
accumulator. Every product of two e4m3 values is exact in float32, so the two orientations can only differ in the
order of the float32 sums inside one 128-wide dot: on the interpreter both are one numpy float32 matmul per block
(summed in K order), and the tests find them bitwise equal to the reference.
"""
import triton
import triton.language as tl

from megamoe.kernels.formats import AMAX_FLOOR, FP8_MAX, L1_INTERLEAVE
from megamoe.kernels.gemm import for_each_pool_tile, store_combine, swiglu_weighted
from megamoe.kernels.numerics import f32_to_e4m3_bits
from megamoe.quant_fp8 import FP8_BLOCK as _FP8_BLOCK

#: Elements per scale along K, and weight rows per scale block along N.
FP8_BLOCK = tl.constexpr(_FP8_BLOCK)


@triton.jit
def _load_a_block(acts, acts_sf, rows, sf_rows, mask_m, k0, K: tl.constexpr, SP: tl.constexpr):
    """Activations of one 128-wide K block: fp8 [BM, 128] and their float32 scales [BM] (0 on padding rows)."""
    kk = tl.arange(0, FP8_BLOCK)
    a = tl.load(acts + rows[:, None].to(tl.int64) * K + k0 + kk[None, :], mask=mask_m[:, None], other=0.0)
    sa = tl.load(acts_sf + (k0 // FP8_BLOCK) * SP + sf_rows, mask=mask_m, other=0.0)
    return a, sa


@triton.jit
def _block_step(acc, a, sa, w, w_sf, n_rows, sf_n, k0, K: tl.constexpr, SWAP: tl.constexpr):
    """One promoted 128-wide K block against ``BN`` weight rows ``n_rows`` int32 ``[BN]`` of ``w`` (fp8 ``[N, K]``
    blocked by 128 x 128, ``megamoe.quant_fp8.weight_offset``: the block's 128 values of a row are contiguous):
    ``b = W[n_rows, k0:k0+128]`` and ``sw = w_sf[sf_n, k0/128]`` (``w_sf`` float32 ``[N/128, K/128]``
    row-major; ``sf_n`` the rows' scale block rows, int32 ``[BN]``, or one scalar when all ``BN`` rows lie in one
    block), with ``a`` fp8 ``[BM, 128]`` and ``sa`` float32 ``[BM]`` from :func:`_load_a_block`.

    * ``SWAP`` False: ``acc [BM, BN] += (a . b^T) * (sa[m] * sw[n])``.
    * ``SWAP`` True (swap-AB: weight rows on the MMA's M, tokens on its N): ``acc [BN, BM] += (b . a^T) * (sw *
      sa[m])``, the transpose. The scale product is the same float32 product (multiplication commutes), so the
      promotion is bitwise the other orientation's."""
    kk = tl.arange(0, FP8_BLOCK)
    blk = ((n_rows // FP8_BLOCK) * (K // FP8_BLOCK) + k0 // FP8_BLOCK).to(tl.int64) * (FP8_BLOCK * FP8_BLOCK)
    b = tl.load(w + (blk + (n_rows % FP8_BLOCK) * FP8_BLOCK)[:, None] + kk[None, :])
    sw = tl.load(w_sf + sf_n * (K // FP8_BLOCK) + k0 // FP8_BLOCK)
    if SWAP:
        acc = acc + tl.dot(b, tl.trans(a)) * (sw * sa[None, :])
    else:
        acc = acc + tl.dot(a, tl.trans(b)) * (sa[:, None] * sw[None, :])
    return acc


@triton.jit
def _zeros_acc(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP: tl.constexpr):
    """A float32 accumulator of ``BLOCK_M`` pool rows x ``BLOCK_N`` weight rows: ``[BLOCK_M, BLOCK_N]``, or its
    transpose ``[BLOCK_N, BLOCK_M]`` for the swap-AB tiles (``SWAP``)."""
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    return acc


@triton.jit
def _l1_epilogue_fp8(acc_g, acc_u, buf, clamp, rows, sf_rows, mask_m, nt, OFF_L1_W: tl.constexpr,
                     OFF_L2: tl.constexpr, OFF_L2_SF: tl.constexpr, I: tl.constexpr, SP: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_CLAMP: tl.constexpr, F64_EXP: tl.constexpr):
    """The L1 epilogue of a tile of pool ``rows`` [BLOCK_M] x intermediate columns ``[nt*BLOCK_N, (nt+1)*BLOCK_N)``
    (``BLOCK_N % 128 == 0``): ``acc_g`` / ``acc_u`` float32 ``[BLOCK_M, BLOCK_N]`` (tokens x columns) rounded to
    bf16 (as the reference's L1 output), clamp, SwiGLU, top-k weight, then the FP8 requant per 128 columns of each
    token into the L2 pool: e4m3 bytes ``[P, I]`` row-major and float32 scales MN-major ``[I/128][SP]``."""
    topk_w = (buf + OFF_L1_W).to(tl.pointer_type(tl.float32))
    out = (buf + OFF_L2).to(tl.pointer_type(tl.uint8))
    out_sf = (buf + OFF_L2_SF).to(tl.pointer_type(tl.float32))
    G: tl.constexpr = BLOCK_N // FP8_BLOCK
    c = nt * BLOCK_N + tl.arange(0, BLOCK_N)
    act = swiglu_weighted(acc_g, acc_u, clamp, topk_w, rows, mask_m, HAS_CLAMP, F64_EXP)
    # FP8 requant per 128 columns: scale = max(amax, 1e-4) / 448 (float32), q = e4m3(act * (1 / scale))
    act3 = tl.reshape(act, [BLOCK_M, G, FP8_BLOCK])
    scale = tl.maximum(tl.max(tl.abs(act3), axis=2), AMAX_FLOOR) / FP8_MAX
    inv = 1.0 / scale
    q = tl.reshape(f32_to_e4m3_bits(act3 * inv[:, :, None]), [BLOCK_M, BLOCK_N])
    tl.store(out + rows[:, None].to(tl.int64) * I + c[None, :], q.to(tl.uint8), mask=mask_m[:, None])
    grp = nt * G + tl.arange(0, G)
    tl.store(out_sf + grp[None, :] * SP + sf_rows[:, None], scale, mask=mask_m[:, None])


@triton.jit
def l1_tile_fp8(buf, w1, w1_sf, clamp, expert, rows, sf_rows, mask_m, nt,
                OFF_L1: tl.constexpr, OFF_L1_SF: tl.constexpr, OFF_L1_W: tl.constexpr, OFF_L2: tl.constexpr,
                OFF_L2_SF: tl.constexpr, H: tl.constexpr, I: tl.constexpr, SP: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, HAS_CLAMP: tl.constexpr, F64_EXP: tl.constexpr, SWAP: tl.constexpr = False):
    """One L1 tile: pool ``rows`` of local ``expert`` x intermediate columns ``[nt*BLOCK_N, (nt+1)*BLOCK_N)``
    (``BLOCK_N % 128 == 0``); SwiGLU, top-k weight and the per-128 float32-scaled FP8 requant into the L2 pool.
    ``SWAP`` (``BLOCK_N == 128``): the swap-AB orientation (:func:`l1_tile_fp8_swap`)."""
    acts = (buf + OFF_L1).to(tl.pointer_type(tl.float8e4nv))
    acts_sf = (buf + OFF_L1_SF).to(tl.pointer_type(tl.float32))
    c = nt * BLOCK_N + tl.arange(0, BLOCK_N)
    gate_rows = (c // L1_INTERLEAVE) * (2 * L1_INTERLEAVE) + c % L1_INTERLEAVE  # gate/up interleaved by 8
    if SWAP:
        gate_sf_n = nt  # the tile's 128 columns are one scale block row
    else:
        gate_sf_n = c // FP8_BLOCK  # scale blocks are not interleaved: gate blocks, then up blocks
    w = w1.to(tl.pointer_type(tl.float8e4nv)) + expert.to(tl.int64) * (2 * I) * H
    w_sf = w1_sf + expert.to(tl.int64) * ((2 * I) // FP8_BLOCK) * (H // FP8_BLOCK)
    acc_g = _zeros_acc(BLOCK_M, BLOCK_N, SWAP)
    acc_u = _zeros_acc(BLOCK_M, BLOCK_N, SWAP)
    for k0 in range(0, H, FP8_BLOCK):
        a, sa = _load_a_block(acts, acts_sf, rows, sf_rows, mask_m, k0, H, SP)
        acc_g = _block_step(acc_g, a, sa, w, w_sf, gate_rows, gate_sf_n, k0, H, SWAP)
        acc_u = _block_step(acc_u, a, sa, w, w_sf, gate_rows + L1_INTERLEAVE, gate_sf_n + I // FP8_BLOCK, k0, H,
                            SWAP)
    if SWAP:
        acc_g = tl.trans(acc_g)
        acc_u = tl.trans(acc_u)
    _l1_epilogue_fp8(acc_g, acc_u, buf, clamp, rows, sf_rows, mask_m, nt, OFF_L1_W, OFF_L2, OFF_L2_SF, I, SP,
                     BLOCK_M, BLOCK_N, HAS_CLAMP, F64_EXP)


@triton.jit
def l1_swiglu_fp8_kernel(buf, w1, w1_sf, clamp,
                         OFF_RECV: tl.constexpr, OFF_L1: tl.constexpr, OFF_L1_SF: tl.constexpr,
                         OFF_L1_W: tl.constexpr, OFF_L2: tl.constexpr, OFF_L2_SF: tl.constexpr,
                         R: tl.constexpr, El: tl.constexpr, H: tl.constexpr, I: tl.constexpr, SP: tl.constexpr,
                         BLOCK_M: tl.constexpr, SF_BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr, HAS_CLAMP: tl.constexpr,
                         F64_EXP: tl.constexpr = False):
    """Persistent over tiles = BLOCK_M pool rows x BLOCK_N intermediate columns (:func:`l1_tile_fp8` on each,
    scheduled by :func:`megamoe.kernels.gemm.for_each_pool_tile`)."""
    for_each_pool_tile(l1_tile_fp8, (buf, w1, w1_sf, clamp),
                       (OFF_L1, OFF_L1_SF, OFF_L1_W, OFF_L2, OFF_L2_SF, H, I, SP, BLOCK_M, BLOCK_N, HAS_CLAMP, F64_EXP),
                       buf, OFF_RECV, I // BLOCK_N, R, El, BLOCK_M, SF_BLOCK_M, BLOCK_R, BLOCK_E)


@triton.jit
def l2_tile_fp8(buf, buffer_ptrs, me, w2, w2_sf, expert, rows, sf_rows, mask_m, nt,
                OFF_L2: tl.constexpr, OFF_L2_SF: tl.constexpr, OFF_META: tl.constexpr, OFF_COMBINE: tl.constexpr,
                T: tl.constexpr, H: tl.constexpr, I: tl.constexpr, SP: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, SWAP: tl.constexpr = False):
    """One L2 tile: pool ``rows`` x hidden columns ``[nt*BLOCK_N, (nt+1)*BLOCK_N)``, written as bf16 into
    ``combine[slot][token]`` of each row's source rank (padding rows skipped). ``SWAP`` (``BLOCK_N == 128``): the
    swap-AB orientation (:func:`l2_tile_fp8_swap`)."""
    acts = (buf + OFF_L2).to(tl.pointer_type(tl.float8e4nv))
    acts_sf = (buf + OFF_L2_SF).to(tl.pointer_type(tl.float32))
    n_rows = nt * BLOCK_N + tl.arange(0, BLOCK_N)
    w = w2.to(tl.pointer_type(tl.float8e4nv)) + expert.to(tl.int64) * H * I
    w_sf = w2_sf + expert.to(tl.int64) * (H // FP8_BLOCK) * (I // FP8_BLOCK)
    acc = _zeros_acc(BLOCK_M, BLOCK_N, SWAP)
    for k0 in range(0, I, FP8_BLOCK):
        a, sa = _load_a_block(acts, acts_sf, rows, sf_rows, mask_m, k0, I, SP)
        if SWAP:
            acc = _block_step(acc, a, sa, w, w_sf, n_rows, nt, k0, I, SWAP)  # the 128 rows: one scale block row
        else:
            acc = _block_step(acc, a, sa, w, w_sf, n_rows, n_rows // FP8_BLOCK, k0, I, SWAP)
    if SWAP:
        acc = tl.trans(acc)
    meta = (buf + OFF_META).to(tl.pointer_type(tl.int32))
    combine = (buf + OFF_COMBINE).to(tl.pointer_type(tl.int16))
    store_combine(acc, meta, combine, buffer_ptrs, me, rows, mask_m, n_rows, T, H)


@triton.jit
def l2_combine_fp8_kernel(buf, buffer_ptrs, me, w2, w2_sf,
                          OFF_RECV: tl.constexpr, OFF_L2: tl.constexpr, OFF_L2_SF: tl.constexpr,
                          OFF_META: tl.constexpr, OFF_COMBINE: tl.constexpr,
                          R: tl.constexpr, El: tl.constexpr, T: tl.constexpr, H: tl.constexpr, I: tl.constexpr,
                          SP: tl.constexpr, BLOCK_M: tl.constexpr, SF_BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr):
    """Persistent over tiles = BLOCK_M pool rows x BLOCK_N hidden columns (:func:`l2_tile_fp8` on each, scheduled
    by :func:`megamoe.kernels.gemm.for_each_pool_tile`)."""
    for_each_pool_tile(l2_tile_fp8, (buf, buffer_ptrs, me, w2, w2_sf),
                       (OFF_L2, OFF_L2_SF, OFF_META, OFF_COMBINE, T, H, I, SP, BLOCK_M, BLOCK_N),
                       buf, OFF_RECV, H // BLOCK_N, R, El, BLOCK_M, SF_BLOCK_M, BLOCK_R, BLOCK_E)


# ------------------------------------------------------------------ swap-AB tiles (the fused kernel, few tokens)
@triton.jit
def l1_tile_fp8_swap(buf, w1, w1_sf, clamp, expert, rows, sf_rows, mask_m, nt,
                     OFF_L1: tl.constexpr, OFF_L1_SF: tl.constexpr, OFF_L1_W: tl.constexpr, OFF_L2: tl.constexpr,
                     OFF_L2_SF: tl.constexpr, H: tl.constexpr, I: tl.constexpr, SP: tl.constexpr,
                     BLOCK_M: tl.constexpr, HAS_CLAMP: tl.constexpr, F64_EXP: tl.constexpr):
    """:func:`l1_tile_fp8` swap-AB, for few tokens per expert: 128 intermediate columns ``[nt*128, (nt+1)*128)``
    -- 128 gate and 128 up weight rows (interleaved by 8 in ``w1``), each on the MMA's M -- times ``BLOCK_M``
    (16 / 32) pool ``rows`` on its N. Accumulators ``[128, BLOCK_M]`` float32; the epilogue (bf16 round, SwiGLU,
    top-k weight, per-128 requant) runs on their transposes and is :func:`l1_tile_fp8`'s (``BLOCK_N = 128``)."""
    l1_tile_fp8(buf, w1, w1_sf, clamp, expert, rows, sf_rows, mask_m, nt, OFF_L1, OFF_L1_SF, OFF_L1_W, OFF_L2,
                OFF_L2_SF, H, I, SP, BLOCK_M, FP8_BLOCK, HAS_CLAMP, F64_EXP, True)


@triton.jit
def l2_tile_fp8_swap(buf, buffer_ptrs, me, w2, w2_sf, expert, rows, sf_rows, mask_m, nt,
                     OFF_L2: tl.constexpr, OFF_L2_SF: tl.constexpr, OFF_META: tl.constexpr,
                     OFF_COMBINE: tl.constexpr, T: tl.constexpr, H: tl.constexpr, I: tl.constexpr,
                     SP: tl.constexpr, BLOCK_M: tl.constexpr):
    """:func:`l2_tile_fp8` swap-AB: 128 hidden columns ``[nt*128, (nt+1)*128)`` (weight rows, the MMA's M) x
    ``BLOCK_M`` pool ``rows`` (its N); the transposed accumulator is written as bf16 rows into the source rank's
    ``combine[slot][token]``, as :func:`l2_tile_fp8`."""
    l2_tile_fp8(buf, buffer_ptrs, me, w2, w2_sf, expert, rows, sf_rows, mask_m, nt, OFF_L2, OFF_L2_SF, OFF_META,
                OFF_COMBINE, T, H, I, SP, BLOCK_M, FP8_BLOCK, True)
