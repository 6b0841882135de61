"""The fused Mega MoE kernel: one persistent launch per call (Hopper fast path; also runs under the interpreter).

``G`` resident programs per rank (3-4 per SM on a GPU, ``megamoe.fused.PROGRAMS_PER_SM``; one under the
interpreter); with the ``local`` backend one launch holds every local rank's programs, program ``pid`` serving
local rank ``pid // G``. Every program walks the same phases::

    count + publish source indices  (pairs strided over the rank's programs; slot atomics, remote stores)
    grid sync -> program 0: publish counts, barrier tag 1 -> grid sync
    task loop: [pull tasks | L1 tiles | L2 tiles], handed out in increasing t by an atomic task counter
    grid sync -> program 0: barrier tag 2 -> grid sync -> combine reduce ((tokens x columns) strided) + cleanup
    grid sync -> program 0: counts cleanup, barrier tag 3

**Overlap without deadlock.** A task only waits on tasks with a smaller index: an L1 tile of pool block ``b``
spins until ``l1_arrival_count[b]`` equals the rows of ``b`` (each pull task adds the rows it landed, release);
an L2 tile spins until every bit of ``l2_arrival_mask[b]`` is set (the L1 tile that produced an N-block of
intermediate columns ORs in its bit, release). Tasks are handed out in increasing order and all programs
are resident, so the smallest unfinished task can always run: GEMMs start while the pull is still running, L2
while L1 is still running -- the seed's per-block arrival mechanism. Tasks are drawn from a per-rank atomic
counter (slot 2 of the grid-sync area), so a program that drew a cheap tile takes the next task at once.

**Two formats.** FP8 x FP4 (``fp8_fp4_mega_moe``, below) and DeepGEMM SM90's FP8 x FP8 with float32 128-block
scales (``fp8_mega_moe``, constexpr ``FP8W``): the latter runs the staged tiles of ``megamoe.kernels.gemm_fp8``
inside the same task loop (pull, arrival counts and masks, combine are format-agnostic: scale words are copied bit
for bit), or with constexpr ``FP8_SWAP`` their swap-AB variants (128 weight rows on the MMA's M, ``BM`` = 16 / 32
tokens on N; chosen for few tokens per expert by ``megamoe.fused.fused_config``).

**Two numerics** for FP8 x FP4 (constexpr ``FOLDED``). ``"exact"`` runs the staged path's GEMM tiles
(``megamoe.kernels.gemm.l1_tile`` / ``l2_tile``: FP4 decoded to FP8, one K=32 MMA per scale group, the accumulator
promoted by both per-32 scales), so the fused path computes what the staged one does. ``"hopper"`` (modelled exactly
by ``megamoe.reference`` with ``numerics="hopper"``) removes the per-32 promotion by folding the power-of-two scales
into the 8-bit operands relative to a larger block:

* L1 activations, once per row in the pull: ``x' = e4m3(x * 2^(s_g - s_max))`` with ``s_max`` the token's
  largest scale exponent; the row's pool scale words then hold ``s_max`` in all four bytes.
* weights, in the decode (FP4 -> FP8 in registers): ``w' = e4m3(e2m1 * 2^(s_g - s_row))`` with ``s_row`` the
  weight row's largest exponent over K; ``2^s_row`` is applied in the epilogue.
* L2 activations: the L1 epilogue quantises per 128 columns (one UE8M0 scale per 128, stored as four equal
  bytes); the L2 tile folds them relative to the token's largest, like the L1 input -- or, with
  ``"hopper_l2_per_block"`` (constexpr ``L2_FOLDED`` off), multiplies them as stored and adds each K block's chain
  times its tokens' ``2^(s_kb - 127)`` (DeepGEMM SM90's promotion per K block; no fold, so nothing rounds).

Each fold is exact unless a value drops below e4m3's normal range (2^-6), where it is rounded to the nearest
subnormal (RNE): an absolute error of at most 2^-10 * 2^s_max. So neither GEMM needs a scale multiply inside its K
loop: one MMA chain over K, added into an fp32 accumulator every ``PROMOTE_EVERY`` K-steps of 128 to bound the
tensor cores' limited in-MMA accumulation (~14 bits, DeepSeek-V3 report) -- which changes no rounding of the model,
only how close the GPU comes to it. Its tiles are swap-AB: 128 weight rows on the MMA's M, ``BM`` (16-32) tokens on
N, and decode FP4 and fold the weight scale in one byte-table lookup (``_decode_chunk``). Measured on an H200
(``results/layer_h200.json`` at c1f41b1) it is the faster numerics up to 128 tokens per rank (1076 against 1469 us
at T=8) and slower from 512 on (5132 against 3534 us): its L1 tile keeps gate and up accumulators plus promotion
partials, which caps BM at 32. The tile is bound by the FP4 decode's integer work: launched standalone it
streams 1.5 TB/s of FP4 where the same tile with FP8 weights streams 4.3 TB/s (``results/probes/``); inside this
kernel (4 programs an SM at 128 registers) ~1.25 TB/s. The default stays ``"exact"``.

Why one module of ~700 lines: it is one ``@triton.jit`` kernel and the device functions only it calls (phases,
waits, the swap-AB FP4 tiles, the timeline); the tiles it shares with the staged path live in ``gemm`` /
``gemm_fp8``, and splitting the rest would scatter one kernel's control flow over files.
"""
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from megamoe.kernels.formats import (
    AMAX_FLOOR,
    FOLD_LUT_MAX_SHIFT,
    FP8_MAX,
    L1_INTERLEAVE,
    SF_GRAN_K,
    TILE_GROUP_SIZES,
    TILE_HEADER,
    TILE_WORDS,
    fp4_weight_offset,
)
from megamoe.kernels.gemm import l1_tile, l2_tile, swiglu
from megamoe.kernels.gemm_fp8 import l1_tile_fp8, l1_tile_fp8_swap, l2_tile_fp8, l2_tile_fp8_swap
from megamoe.kernels.numerics import (
    bf16_bits_to_f32,
    ceil_ue8m0,
    e2m1_lut,
    e2m1x2_lut_prmt,
    e2m1x2_nibbles,
    f32_to_bf16_bits,
    f32_to_e4m3_bits,
    round_to_bf16,
)
from megamoe.kernels.pool import expert_blocks, interleaved_position, locate_block, pick, sf_row
from megamoe.kernels.symm import TAG_FUSED_INTERNAL_WAIT, _globaltimer_ns, sym_map

#: Entries of one local rank's row in the argument table (int64), see ``megamoe.fused``.
ARG_NAMES = ("buffer", "y", "w1", "w1_sf", "w2", "w2_sf", "stats", "num_tokens", "timeline", "tiles")
NUM_ARGS = tl.constexpr(len(ARG_NAMES))
#: Timeline event kinds, in the order of ``EVENT_NAMES``.
EVENT_NAMES = ("count", "barrier1", "pull", "l1", "l2", "barrier2", "combine", "barrier3")
EV_COUNT, EV_BARRIER1, EV_PULL, EV_L1, EV_L2, EV_BARRIER2, EV_COMBINE, EV_BARRIER3 = (
    tl.constexpr(i) for i in range(len(EVENT_NAMES)))
#: Failure tag recorded when an intra-rank wait (grid sync, arrival count or mask) runs out of time.
TAG_INTERNAL_WAIT = tl.constexpr(TAG_FUSED_INTERNAL_WAIT)


# ---------------------------------------------------------------------------------------------------- sync
@triton.jit
def _now(TIMED: tl.constexpr):
    """``%globaltimer`` (ns) as this thread reads it (0 when not ``TIMED``)."""
    if TIMED:
        return _globaltimer_ns()
    else:
        return tl.zeros([], tl.int64)


@triton.jit
def _failed(state):
    """The failure tag recorded in ``state[1]`` (0: none; a volatile read).

    Tried and dropped (45d059c): making this and :func:`_now` the same in every thread of the program with a
    ``tl.max`` over 1024 lanes, against warps of one program deciding a wait's timeout differently. On an H200 the
    four-local-rank skewed case then returned NaN rows and timed out in 3 runs of 3, with the static schedule too;
    without the reductions it is exact. The illegal address it was meant to cure came from the grid sync's own
    timeout racing program 0's barrier timeout (see :func:`_grid_sync`), not from warp divergence."""
    return tl.load(state + 1, volatile=True)


@triton.jit
def _grid_sync(ctr, cta, G, state, timeout_ns, TIMED: tl.constexpr):
    """All ``G`` programs of this rank meet here. Self-resetting (DeepGEMM's scheme): program 0 adds
    ``2^31 - (G - 1)``, the others 1, so bit 31 of ``ctr`` flips once all arrived and the low bits return to 0.
    Bounded on the GPU (a program that never arrives is a bug: record TAG_INTERNAL_WAIT rather than hang), but the
    clock stands still while ``ctr[3]`` is set: program 0 is in a cross-rank barrier, whose wait is bounded by the
    peers' heartbeats, not by ``timeout_ns``. Without that hold a slow but live peer failed the programs waiting
    here, and when a peer never arrived the others left this sync by their own timeout at about the moment program
    0 gave up on the barrier: some saw no failure yet, entered the task loop with incomplete receive counts and,
    with the atomic task counter, drew tasks whose rows were never published (illegal addresses on an H200)."""
    first = tl.full([], 2147483648, tl.int64) - (G - 1)
    inc = tl.where(cta == 0, first, 1).to(tl.int32)  # truncation wraps 2^31 to -2^31 for G == 1
    old = tl.atomic_add(ctr, inc, sem="acq_rel", scope="gpu")
    cur = old + inc
    t0 = _now(TIMED)
    alive = True
    while ((cur ^ old) >= 0) & (G > 1) & alive:
        cur = tl.atomic_add(ctr, 0, sem="acquire", scope="gpu")
        if TIMED:
            if tl.atomic_add(ctr + 3, 0, sem="relaxed", scope="gpu") != 0:
                t0 = _now(TIMED)
            alive = (_now(TIMED) - t0) <= timeout_ns
    if ((cur ^ old) >= 0) & (G > 1):
        tl.atomic_cas(state + 1, 0, TAG_INTERNAL_WAIT)


@triton.jit
def _cross_rank_barrier(signal, state, progress, hold, buffer_ptrs, me, epoch, tag, R: tl.constexpr,
                        BLOCK_R: tl.constexpr, timeout_ns, max_polls, TIMED: tl.constexpr):
    """Program 0 only: arrive with ``epoch`` at every rank (release, sys) and wait until every rank's signal here
    reached it. The wait gives up when no missing rank's progress counter moved for ``timeout_ns`` (GPU;
    ``max_polls`` polls under the interpreter) and records ``[tag, lowest missing rank]`` in ``state``.
    Skipped (returns at once) when an earlier barrier failed. ``progress``: this rank's counter (i32); ``hold``
    (i32) is set while the wait runs, so the rank's other programs waiting in the next grid sync hold their clock."""
    tl.atomic_xchg(hold, 1, sem="relaxed", scope="gpu")
    tl.atomic_add(progress, 1, sem="relaxed", scope="sys")  # arriving is progress too (peers' liveness)
    if _failed(state) == 0:
        tl.store(state, epoch)
        peers = tl.arange(0, BLOCK_R)
        valid = peers < R
        remote = sym_map(signal + me, buffer_ptrs, me, tl.where(valid, peers, me))
        tl.atomic_xchg(remote, tl.full([BLOCK_R], 0, tl.int32) + epoch, mask=valid, sem="release", scope="sys")
        seen = tl.atomic_add(signal + peers, 0, mask=valid, sem="acquire", scope="sys")
        missing = tl.sum((valid & (seen < epoch)).to(tl.int32))
        prog_ptr = sym_map(progress, buffer_ptrs, me, tl.where(valid, peers, me))
        last = tl.load(prog_ptr, mask=valid, other=0, volatile=True)
        t0 = _now(TIMED)
        polls = 0
        alive = True
        while (missing > 0) & alive:
            seen = tl.atomic_add(signal + peers, 0, mask=valid, sem="acquire", scope="sys")
            missing = tl.sum((valid & (seen < epoch)).to(tl.int32))
            cur = tl.load(prog_ptr, mask=valid, other=0, volatile=True)
            moved = tl.sum((valid & (seen < epoch) & (cur != last)).to(tl.int32)) > 0
            last = cur
            polls += 1
            if moved:
                t0 = _now(TIMED)
                polls = 0
            if TIMED:
                alive = (_now(TIMED) - t0) <= timeout_ns
            else:
                alive = polls < max_polls
        if missing > 0:
            lowest = tl.min(tl.where(valid & (seen < epoch), peers, BLOCK_R))
            tl.store(state + 2, lowest)
            tl.store(state + 1, tag)
    tl.atomic_xchg(hold, 0, sem="relaxed", scope="gpu")


@triton.jit
def _wait_at_least(ptr, target, state, timeout_ns, max_polls, TIMED: tl.constexpr):
    """Spin until ``*ptr >= target`` (acquire, gpu). A bounded wait: on expiry record TAG_INTERNAL_WAIT."""
    v = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
    if v < target:
        t0 = _now(TIMED)
        polls = 0
        alive = True
        while (v < target) & alive:
            v = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
            polls += 1
            if TIMED:
                alive = (_now(TIMED) - t0) <= timeout_ns
            else:
                alive = polls < max_polls
        if v < target:
            tl.atomic_cas(state + 1, 0, TAG_INTERNAL_WAIT)


@triton.jit
def _wait_mask_full(ptr, num_bits: tl.constexpr, state, timeout_ns, max_polls, TIMED: tl.constexpr):
    """Spin until the low ``num_bits`` bits of the int64 at ``ptr`` are all set (acquire, gpu); bounded like
    :func:`_wait_at_least`."""
    full = (tl.full([], 1, tl.int64) << num_bits) - 1
    mask = tl.atomic_or(ptr, tl.zeros([], tl.int64), sem="acquire", scope="gpu")
    if (mask & full) != full:
        t0 = _now(TIMED)
        polls = 0
        alive = True
        while ((mask & full) != full) & alive:
            mask = tl.atomic_or(ptr, tl.zeros([], tl.int64), sem="acquire", scope="gpu")
            polls += 1
            if TIMED:
                alive = (_now(TIMED) - t0) <= timeout_ns
            else:
                alive = polls < max_polls
        if (mask & full) != full:
            tl.atomic_cas(state + 1, 0, TAG_INTERNAL_WAIT)


@triton.jit
def _event(timeline, cta, n_ev, kind, t0, TIMELINE: tl.constexpr, MAX_EVENTS: tl.constexpr):
    """Append (kind, start, end) to this program's timeline row (dropped past MAX_EVENTS)."""
    if TIMELINE:
        if n_ev < MAX_EVENTS:
            p = timeline + (cta * MAX_EVENTS + n_ev) * 3
            tl.store(p, tl.zeros([], tl.int64) + kind)
            tl.store(p + 1, t0)
            tl.store(p + 2, _globaltimer_ns())
        n_ev += 1
    return n_ev


# ---------------------------------------------------------------------------------------------------- numerics
@triton.jit
def _pow2_f32(e):
    """2^e as float32 for int32 ``e`` <= 127 (exact; exponents below -126 give 2^-126, whose products with
    FP8/FP4 values all round to 0 in e4m3)."""
    return ((tl.maximum(e, -126) + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _fold_e4m3(v, scale, HW_CVT: tl.constexpr):
    """``e4m3(v * scale)`` with round-to-nearest-even: ``v`` FP8 e4m3 tile, ``scale`` a power of two <= 1
    broadcastable to it (float32). GPU: through fp16 (exact for every value that can survive into e4m3) and the
    hardware's ``cvt.rn.satfinite``; interpreter: float32 and the integer rounding of ``f32_to_e4m3_bits``."""
    if HW_CVT:
        return (v.to(tl.float16) * scale.to(tl.float16)).to(tl.float8e4nv)
    else:
        return f32_to_e4m3_bits(v.to(tl.float32) * scale).to(tl.uint8).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _row_exponent_max(w_sf, rows, N: tl.constexpr, KW: tl.constexpr, BLOCK_KW: tl.constexpr):
    """Largest UE8M0 byte of each weight row over all K: ``w_sf`` int32 MN-major ``[KW][N]``, ``rows`` [BN]."""
    kw = tl.arange(0, BLOCK_KW)
    words = tl.load(w_sf + kw[None, :] * N + rows[:, None], mask=kw[None, :] < KW, other=0)
    m = tl.maximum(tl.maximum(words & 0xFF, (words >> 8) & 0xFF),
                   tl.maximum((words >> 16) & 0xFF, (words >> 24) & 0xFF))
    return tl.max(m, axis=1)


@triton.jit
def _fold_tables(lut, w_sf_word, rmax, g: tl.constexpr):
    """The decode table words ``(lut0, lut1)`` ``[BN, 1]`` of per-32 group ``g`` (0..3) of a 128-wide K step:
    ``lut`` = ``megamoe.quant.fold_lut`` indexed by the fold shift ``s_row - s_g`` (clamped to the table)."""
    d = tl.minimum(rmax - ((w_sf_word >> (8 * g)) & 0xFF), FOLD_LUT_MAX_SHIFT)
    return tl.load(lut + 2 * d)[:, None], tl.load(lut + 2 * d + 1)[:, None]


@triton.jit
def _decode_chunk(w, w_sf_word, rmax, rows, k0, c: tl.constexpr, K: tl.constexpr, lut, PRMT_DECODE: tl.constexpr,
                  N: tl.constexpr):
    """Folded FP8 weights of 64-chunk ``c`` (0/1) of the 128-wide K step at ``k0``: two ``[BN, 32]`` tiles
    (elements ``k0+64c .. +31`` and ``k0+64c+32 .. +63``, see ``transform_weights_for_mega_moe``).

    Decode and fold are one byte lookup per value: the per-(row, group) table of ``_fold_tables`` maps the e2m1
    magnitude straight to ``e4m3(m * 2^(s_g - s_row))``. On the GPU one ``prmt`` serves four values (the table is
    two registers per row and group), measured 4.3x faster than decoding then folding through fp16 conversions on
    an H200 (same bits; L1 shape, 48 experts, 1-256 tokens per expert)."""
    packed = tl.load(w + fp4_weight_offset(rows[:, None], (k0 + 64 * c) // 2, tl.arange(0, 32)[None, :], N,
                                                K // 2))
    la0, la1 = _fold_tables(lut, w_sf_word, rmax, 2 * c)
    lb0, lb1 = _fold_tables(lut, w_sf_word, rmax, 2 * c + 1)
    if PRMT_DECODE:
        z = tl.zeros(packed.shape, tl.int32)
        return e2m1x2_lut_prmt(packed, la0 + z, la1 + z, lb0 + z, lb1 + z)
    else:
        n0, n1 = e2m1x2_nibbles(packed)
        return e2m1_lut(n0, la0, la1), e2m1_lut(n1, lb0, lb1)


@triton.jit
def _load_a4(acts, rows, mask_m, k0, K: tl.constexpr):
    """Four FP8 activation tiles ``[BM, 32]`` of the K step at ``k0`` (groups 0..3)."""
    base = acts + rows[:, None].to(tl.int64) * K + k0 + tl.arange(0, 32)[None, :]
    a0 = tl.load(base, mask=mask_m[:, None], other=0.0)
    a1 = tl.load(base + 32, mask=mask_m[:, None], other=0.0)
    a2 = tl.load(base + 64, mask=mask_m[:, None], other=0.0)
    a3 = tl.load(base + 96, mask=mask_m[:, None], other=0.0)
    return a0, a1, a2, a3


@triton.jit
def _mma_step(acc, w, w_sf, rmax, rows, a0, a1, a2, a3, k0, K: tl.constexpr, N: tl.constexpr, lut,
              PRMT_DECODE: tl.constexpr):
    """acc [BN, BM] += W'[rows, k0:k0+128] . A[:, k0:k0+128]^T as four chained K=32 FP8 MMAs (no promotion)."""
    word = tl.load(w_sf + (k0 // 128) * N + rows)
    b0, b1 = _decode_chunk(w, word, rmax, rows, k0, 0, K, lut, PRMT_DECODE, N)
    acc = tl.dot(b0, tl.trans(a0), acc)
    acc = tl.dot(b1, tl.trans(a1), acc)
    b2, b3 = _decode_chunk(w, word, rmax, rows, k0, 1, K, lut, PRMT_DECODE, N)
    acc = tl.dot(b2, tl.trans(a2), acc)
    acc = tl.dot(b3, tl.trans(a3), acc)
    return acc


# ---------------------------------------------------------------------------------------------------- tasks
@triton.jit
def _pull_task(t, buf, buffer_ptrs, me, recv, chunks_flat, cum_flat, blocks, cum, arrival,
               OFF_SRC_IDX: tl.constexpr, OFF_X: tl.constexpr, OFF_X_SF: tl.constexpr, OFF_TOPK_W: tl.constexpr,
               OFF_L1: tl.constexpr, OFF_L1_SF: tl.constexpr, OFF_L1_W: tl.constexpr, OFF_META: tl.constexpr,
               R: tl.constexpr, El: tl.constexpr, T: tl.constexpr, K: tl.constexpr, H: tl.constexpr,
               SP: tl.constexpr, LAYOUT_BM: tl.constexpr, LAYOUT_SF_BM: tl.constexpr, BM: tl.constexpr,
               BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_H: tl.constexpr,
               BLOCK_W: tl.constexpr, HW_CVT: tl.constexpr, FOLDED: tl.constexpr, COPY_ROWS: tl.constexpr = True):
    """Pull task ``t``: up to BLOCK_J pairs of one (local expert, source rank) -- task order is expert-major, then
    source, then chunk of BLOCK_J pairs -- from the source's input buffer into the local L1 pool at the
    interleaved, expert-major rows of ``megamoe.kernels.pool``, folding each row's per-32 scales into its largest
    (module docstring); then adds the landed rows to ``arrival`` (int32 per pool block of BM rows, release)."""
    BRE: tl.constexpr = BLOCK_E * BLOCK_R
    f = tl.sum((cum_flat <= t).to(tl.int32), axis=0)          # flat (expert, source) index of task t
    chunk = t - (pick(cum_flat, f, BRE) - pick(chunks_flat, f, BRE))
    local_e = f // BLOCK_R
    source = f % BLOCK_R
    r = tl.arange(0, BLOCK_R)
    counts = tl.load(recv + r * El + local_e, mask=r < R, other=0).to(tl.int32)
    count = pick(counts, source, BLOCK_R)
    first_row = pick(cum - blocks, local_e, BLOCK_E) * BM

    j = chunk * BLOCK_J + tl.arange(0, BLOCK_J)
    mj = j < count
    row = first_row + interleaved_position(counts, source, j, BLOCK_R)
    pair = tl.load((buf + OFF_SRC_IDX).to(tl.pointer_type(tl.int32)) + (local_e * R + source) * T + j, mask=mj,
                   other=0)
    token = pair // K
    slot = pair % K
    x = sym_map(buf + OFF_X, buffer_ptrs, me, source).to(tl.pointer_type(tl.float8e4nv))
    x_sf = sym_map(buf + OFF_X_SF, buffer_ptrs, me, source)  # bytes: UE8M0 of group g of a token at g
    topk_w = sym_map((buf + OFF_TOPK_W).to(tl.pointer_type(tl.float32)), buffer_ptrs, me, source)
    if COPY_ROWS:  # (False: the Gluon GEMM phase copies the rows; this task places them: metadata + weights)
        _copy_rows(buf, x, x_sf, token, row, mj, OFF_L1, OFF_L1_SF, H, SP, LAYOUT_BM, LAYOUT_SF_BM, BLOCK_J, BLOCK_H,
                   BLOCK_W, HW_CVT, FOLDED)
    tl.store((buf + OFF_L1_W).to(tl.pointer_type(tl.float32)) + row, tl.load(topk_w + pair, mask=mj), mask=mj)
    meta = (buf + OFF_META).to(tl.pointer_type(tl.int32))
    tl.store(meta + row * 3, tl.full([BLOCK_J], 0, tl.int32) + source, mask=mj)
    tl.store(meta + row * 3 + 1, token, mask=mj)
    tl.store(meta + row * 3 + 2, slot, mask=mj)
    if COPY_ROWS:
        tl.debug_barrier()
        tl.atomic_add(arrival + row // BM, tl.full([BLOCK_J], 1, tl.int32), mask=mj, sem="release", scope="gpu")


@triton.jit
def _copy_rows(buf, x, x_sf, token, row, mj, OFF_L1: tl.constexpr, OFF_L1_SF: tl.constexpr, H: tl.constexpr,
               SP: tl.constexpr, LAYOUT_BM: tl.constexpr, LAYOUT_SF_BM: tl.constexpr, BLOCK_J: tl.constexpr,
               BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr, HW_CVT: tl.constexpr, FOLDED: tl.constexpr):
    """The bytes and scale words of ``token`` [BLOCK_J] of the source's ``x`` / ``x_sf`` into pool ``row``."""
    # s_max: the token's largest scale exponent
    g = tl.arange(0, BLOCK_W)
    sfb = tl.load(x_sf + token[:, None] * (H // SF_GRAN_K) + g[None, :],
                  mask=mj[:, None] & (g[None, :] < H // SF_GRAN_K), other=0)
    smax = tl.max(sfb.to(tl.int32), axis=1)
    l1 = (buf + OFF_L1).to(tl.pointer_type(tl.float8e4nv))
    G_H: tl.constexpr = BLOCK_H // SF_GRAN_K
    for h0 in tl.static_range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        v = tl.load(x + token[:, None].to(tl.int64) * H + h[None, :], mask=mj[:, None], other=0.0)
        gb = tl.load(x_sf + token[:, None] * (H // SF_GRAN_K) + h0 // SF_GRAN_K + tl.arange(0, G_H)[None, :],
                     mask=mj[:, None], other=0).to(tl.int32)
        if FOLDED:
            scale = _pow2_f32(gb - smax[:, None])                               # [BLOCK_J, BLOCK_H / 32]
            v = tl.reshape(_fold_e4m3(tl.reshape(v, [BLOCK_J, G_H, SF_GRAN_K]), scale[:, :, None], HW_CVT),
                           [BLOCK_J, BLOCK_H])
        tl.store(l1 + row[:, None].to(tl.int64) * H + h[None, :], v, mask=mj[:, None])
    w = tl.arange(0, BLOCK_W)
    mw = mj[:, None] & (w[None, :] < H // 128)
    sf_r = sf_row(row, LAYOUT_BM, LAYOUT_SF_BM)
    if FOLDED:
        sf_words = (smax * 0x01010101)[:, None] + tl.zeros([BLOCK_J, BLOCK_W], tl.int32)
    else:
        sf_words = tl.load(x_sf.to(tl.pointer_type(tl.int32)) + token[:, None] * (H // 128) + w[None, :], mask=mw)
    tl.store((buf + OFF_L1_SF).to(tl.pointer_type(tl.int32)) + w[None, :].to(tl.int64) * SP + sf_r[:, None],
             sf_words, mask=mw)


@triton.jit
def _l1_tile_hopper(buf, w1, w1_sf, lut, clamp, expert, rows, sf_rows, mask_m, nt,
                    OFF_L1: tl.constexpr, OFF_L1_SF: tl.constexpr, OFF_L1_W: tl.constexpr, OFF_L2: tl.constexpr,
                    OFF_L2_SF: tl.constexpr, H: tl.constexpr, I: tl.constexpr, SP: tl.constexpr, BM: tl.constexpr,
                    HAS_CLAMP: tl.constexpr, PROMOTE_EVERY: tl.constexpr, PRMT_DECODE: tl.constexpr,
                    HW_CVT: tl.constexpr, KW1_PAD: tl.constexpr, F64_EXP: tl.constexpr):
    """Hopper-numerics L1 tile (swap-AB): pool ``rows`` of ``expert`` x 128 intermediate columns (256 interleaved
    gate/up weight rows); SwiGLU, top-k weight, per-128 FP8 requant into the L2 pool."""
    acts = (buf + OFF_L1).to(tl.pointer_type(tl.float8e4nv))
    c = nt * 128 + tl.arange(0, 128)
    gate_rows = (c // L1_INTERLEAVE) * (2 * L1_INTERLEAVE) + c % L1_INTERLEAVE
    up_rows = gate_rows + L1_INTERLEAVE
    w = w1 + expert.to(tl.int64) * (2 * I) * (H // 2)
    w_sf = w1_sf + expert.to(tl.int64) * (H // 128) * (2 * I)
    rmax_g = _row_exponent_max(w_sf, gate_rows, 2 * I, H // 128, KW1_PAD)
    rmax_u = _row_exponent_max(w_sf, up_rows, 2 * I, H // 128, KW1_PAD)
    acc_g = tl.zeros([128, BM], dtype=tl.float32)
    acc_u = tl.zeros([128, BM], dtype=tl.float32)
    part_g = tl.zeros([128, BM], dtype=tl.float32)
    part_u = tl.zeros([128, BM], dtype=tl.float32)
    for k0 in range(0, H, 128):
        a0, a1, a2, a3 = _load_a4(acts, rows, mask_m, k0, H)
        part_g = _mma_step(part_g, w, w_sf, rmax_g, gate_rows, a0, a1, a2, a3, k0, H, 2 * I, lut, PRMT_DECODE)
        part_u = _mma_step(part_u, w, w_sf, rmax_u, up_rows, a0, a1, a2, a3, k0, H, 2 * I, lut, PRMT_DECODE)
        if (k0 // 128) % PROMOTE_EVERY == PROMOTE_EVERY - 1:  # bound the in-MMA accumulation chain
            acc_g += part_g
            acc_u += part_u
            part_g = tl.zeros([128, BM], dtype=tl.float32)
            part_u = tl.zeros([128, BM], dtype=tl.float32)
    acc_g += part_g
    acc_u += part_u
    # epilogue: weight-row and token scales, bf16 round (as the reference), clamp, SwiGLU, top-k weight
    sa_words = tl.load((buf + OFF_L1_SF).to(tl.pointer_type(tl.int32)) + sf_rows, mask=mask_m, other=127 * 0x01010101)
    sa = _pow2_f32((sa_words & 0xFF) - 127)
    gate = round_to_bf16(tl.trans(acc_g * _pow2_f32(rmax_g - 127)[:, None]) * sa[:, None])
    up = round_to_bf16(tl.trans(acc_u * _pow2_f32(rmax_u - 127)[:, None]) * sa[:, None])
    if HAS_CLAMP:
        gate = tl.minimum(gate, clamp)
        up = tl.minimum(tl.maximum(up, -clamp), clamp)
    act = swiglu(gate, up, F64_EXP)
    act = act * tl.load((buf + OFF_L1_W).to(tl.pointer_type(tl.float32)) + rows, mask=mask_m, other=0.0)[:, None]
    # FP8 requant per 128 columns: scale = 2^ceil(log2(amax / 448)), amax >= 1e-4
    amax = tl.maximum(tl.max(tl.abs(act), axis=1), AMAX_FLOOR)
    _, sbyte = ceil_ue8m0(amax / FP8_MAX)
    inv = ((254 - sbyte) << 23).to(tl.float32, bitcast=True)  # exact 1/scale
    q = f32_to_e4m3_bits(act * inv[:, None])
    out = (buf + OFF_L2).to(tl.pointer_type(tl.uint8))
    tl.store(out + rows[:, None].to(tl.int64) * I + c[None, :], q.to(tl.uint8), mask=mask_m[:, None])
    tl.store((buf + OFF_L2_SF).to(tl.pointer_type(tl.int32)) + nt * SP + sf_rows, sbyte * 0x01010101, mask=mask_m)


@triton.jit
def _l2_tile_hopper(buf, buffer_ptrs, me, w2, w2_sf, lut, expert, rows, sf_rows, mask_m, nt,
                    OFF_L2: tl.constexpr, OFF_L2_SF: tl.constexpr, OFF_META: tl.constexpr, OFF_COMBINE: tl.constexpr,
                    T: tl.constexpr, H: tl.constexpr, I: tl.constexpr, SP: tl.constexpr, BM: tl.constexpr,
                    PROMOTE_EVERY: tl.constexpr, PRMT_DECODE: tl.constexpr, HW_CVT: tl.constexpr,
                    KW2_PAD: tl.constexpr, L2_FOLDED: tl.constexpr = True):
    """Hopper-numerics L2 tile (swap-AB): pool ``rows`` x 128 hidden columns; bf16 rows into the source rank's
    ``combine[slot][token]``. ``L2_FOLDED`` (``"hopper"``): the per-128 activation scales folded per token like the
    L1 input, one MMA chain of ``PROMOTE_EVERY`` K blocks between adds; else (``"hopper_l2_per_block"``) the
    activations as stored and each K block's chain added times its tokens' ``2^(s_kb - 127)`` (exact)."""
    acts = (buf + OFF_L2).to(tl.pointer_type(tl.float8e4nv))
    acts_sf = (buf + OFF_L2_SF).to(tl.pointer_type(tl.int32))
    n_rows = nt * 128 + tl.arange(0, 128)
    w = w2 + expert.to(tl.int64) * H * (I // 2)
    w_sf = w2_sf + expert.to(tl.int64) * (I // 128) * H
    rmax = _row_exponent_max(w_sf, n_rows, H, I // 128, KW2_PAD)
    acc = tl.zeros([128, BM], dtype=tl.float32)
    if L2_FOLDED:
        # the token's largest per-128 exponent over I: fold each K-block's activations relative to it (module
        # docstring)
        part = tl.zeros([128, BM], dtype=tl.float32)
        kb = tl.arange(0, KW2_PAD)
        sf_all = tl.load(acts_sf + kb[None, :] * SP + sf_rows[:, None],
                         mask=mask_m[:, None] & (kb[None, :] < I // 128), other=0) & 0xFF
        smax = tl.max(sf_all, axis=1)
        for k0 in range(0, I, 128):
            a0, a1, a2, a3 = _load_a4(acts, rows, mask_m, k0, I)
            sa = _pow2_f32((tl.load(acts_sf + (k0 // 128) * SP + sf_rows, mask=mask_m, other=0) & 0xFF)
                           - smax)[:, None]
            a0 = _fold_e4m3(a0, sa, HW_CVT)
            a1 = _fold_e4m3(a1, sa, HW_CVT)
            a2 = _fold_e4m3(a2, sa, HW_CVT)
            a3 = _fold_e4m3(a3, sa, HW_CVT)
            part = _mma_step(part, w, w_sf, rmax, n_rows, a0, a1, a2, a3, k0, I, H, lut, PRMT_DECODE)
            if (k0 // 128) % PROMOTE_EVERY == PROMOTE_EVERY - 1:
                acc += part
                part = tl.zeros([128, BM], dtype=tl.float32)
        acc += part
        acc = acc * _pow2_f32(smax - 127)[None, :]
    else:
        for k0 in range(0, I, 128):
            a0, a1, a2, a3 = _load_a4(acts, rows, mask_m, k0, I)
            sa = _pow2_f32((tl.load(acts_sf + (k0 // 128) * SP + sf_rows, mask=mask_m, other=127) & 0xFF) - 127)
            part = _mma_step(tl.zeros([128, BM], dtype=tl.float32), w, w_sf, rmax, n_rows, a0, a1, a2, a3, k0, I,
                             H, lut, PRMT_DECODE)
            acc += part * sa[None, :]
    out = tl.trans(acc * _pow2_f32(rmax - 127)[:, None])
    meta = (buf + OFF_META).to(tl.pointer_type(tl.int32))
    src_rank = tl.load(meta + rows * 3, mask=mask_m, other=0)
    token = tl.load(meta + rows * 3 + 1, mask=mask_m, other=0)
    slot = tl.load(meta + rows * 3 + 2, mask=mask_m, other=0)
    combine = (buf + OFF_COMBINE).to(tl.pointer_type(tl.int16))
    dst = combine + ((slot * T + token).to(tl.int64) * H)[:, None] + n_rows[None, :]
    dst = sym_map(dst, buffer_ptrs, me, src_rank[:, None])
    tl.store(dst, f32_to_bf16_bits(out).to(tl.int16), mask=mask_m[:, None])


# ---------------------------------------------------------------------------------------------------- kernel
@triton.jit
def _tile_rows(tile, N_TILES: tl.constexpr, n, blocks, cum, BM: tl.constexpr, BLOCK_E: tl.constexpr,
               LAYOUT_BM: tl.constexpr, LAYOUT_SF_BM: tl.constexpr):
    """GEMM tile -> (pool block, N tile, local expert, pool rows [BM], scale rows [BM], row mask [BM], valid rows)
    for tiles numbered block-major (all N tiles of a pool block of BM rows are consecutive)."""
    b = tile // N_TILES
    expert, row0, valid = locate_block(b, n, blocks, cum, BM, BLOCK_E)
    rows = row0 + tl.arange(0, BM)
    sf_rows = sf_row(rows, LAYOUT_BM, LAYOUT_SF_BM)
    return b, tile % N_TILES, expert, rows, sf_rows, tl.arange(0, BM) < valid, valid


@triton.jit
def _tile_entries(tiles, first, cta, G, n, blocks, cum, groups, num_tiles, N_T: tl.constexpr, BM: tl.constexpr,
                  BLOCK_E: tl.constexpr):
    """Entries ``first ..`` of the tile table for one GEMM of ``N_T`` n-tiles per pool block, ordered expert, n-tile,
    then pool block of the expert (consecutive tiles share a weight tile, which the L2 cache then serves):
    ``(pool block, n-tile, local expert, valid rows)`` int32 each; at ``groups + first + t`` each entry's group word
    (``TILE_GROUP_SIZES * (first entry of its weight tile) + entries of the weight tile``, the size capped) and at
    ``groups + num_tiles + first + t`` its group counter, zeroed. Strided over the rank's programs; returns the
    number of tiles."""
    CHUNK: tl.constexpr = 128
    count = blocks * N_T  # tiles per expert [BLOCK_E]
    cum_t = tl.cumsum(count, axis=0)
    total = tl.max(cum_t, axis=0)
    ev = tl.arange(0, BLOCK_E)
    t0 = cta * CHUNK
    while t0 < total:
        t = t0 + tl.arange(0, CHUNK)
        e = tl.sum((cum_t[None, :] <= t[:, None]).to(tl.int32), axis=1)
        sel = ev[None, :] == e[:, None]
        start = tl.sum(tl.where(sel, (cum_t - count)[None, :], 0), axis=1)
        nb = tl.maximum(tl.sum(tl.where(sel, blocks[None, :], 0), axis=1), 1)
        first_block = tl.sum(tl.where(sel, (cum - blocks)[None, :], 0), axis=1)
        n_e = tl.sum(tl.where(sel, n[None, :], 0), axis=1)
        r = t - start
        m = r % nb
        p = tiles + TILE_HEADER + (first + t) * TILE_WORDS
        ok = t < total
        tl.store(p, first_block + m, mask=ok)
        tl.store(p + 1, r // nb, mask=ok)
        tl.store(p + 2, e, mask=ok)
        tl.store(p + 3, tl.minimum(n_e - m * BM, BM), mask=ok)
        group = (first + t - m) * TILE_GROUP_SIZES + tl.minimum(nb, TILE_GROUP_SIZES - 1)
        tl.store(groups + first + t, group, mask=ok)
        tl.store(groups + num_tiles + first + t, tl.zeros([CHUNK], tl.int32), mask=ok)
        t0 += G * CHUNK
    return total


@triton.jit
def _tile_pairs(pairs, cap, first_tile, first_pair, cta, G, blocks, N_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """The pairs of one GEMM (``TILE_PAIR_WORDS``) for its tiles from ``first_tile`` (ordered expert, n-tile, pool
    block, :func:`_tile_entries`), per expert: for each n-tile its pool blocks two by two (**weight pairs**: blocks
    ``2j``, ``2j + 1``, one weight tile), then, where the expert's block count is odd, its last block's tiles two
    n-tiles at a time (**token pairs**: n-tiles ``2q``, ``2q + 1``, one pool block), a last one alone (a **single**)
    where the n-tiles are odd. At ``pairs + 2 + 2 (first_pair + p)`` the pair's words ``(4 t0 + kind, t1)`` (kind 0
    single, 1 weight pair, 2 token pair; ``t1`` the second entry, ``t0`` for a single); ``2 cap`` words further its
    group word (a weight pair: the pairs of its weight tile; else itself alone), ``3 cap`` further its group counter,
    zeroed. Strided over the rank's programs; returns the number of pairs."""
    CHUNK: tl.constexpr = 128
    wp = blocks // 2  # weight pairs per n-tile [BLOCK_E]
    tp = (blocks % 2) * ((N_T + 1) // 2)  # token pairs (and a single) of the last block
    count = wp * N_T + tp
    cum_p = tl.cumsum(count, axis=0)
    cum_t = tl.cumsum(blocks * N_T, axis=0)
    total = tl.max(cum_p, axis=0)
    ev = tl.arange(0, BLOCK_E)
    p0 = cta * CHUNK
    while p0 < total:
        p = p0 + tl.arange(0, CHUNK)
        e = tl.sum((cum_p[None, :] <= p[:, None]).to(tl.int32), axis=1)
        sel = ev[None, :] == e[:, None]
        start = tl.sum(tl.where(sel, (cum_p - count)[None, :], 0), axis=1)
        t_start = first_tile + tl.sum(tl.where(sel, (cum_t - blocks * N_T)[None, :], 0), axis=1)
        nb = tl.sum(tl.where(sel, blocks[None, :], 0), axis=1)
        w = tl.maximum(nb // 2, 1)
        r = p - start
        weight = r < (nb // 2) * N_T
        j = r % w
        q = r - (nb // 2) * N_T  # token pairs: n-tiles 2q, 2q + 1 of the last block
        has2 = 2 * q + 1 < N_T
        t0 = tl.where(weight, t_start + (r // w) * nb + 2 * j, t_start + 2 * q * nb + nb - 1)
        t1 = tl.where(weight, t0 + 1, tl.where(has2, t0 + nb, t0))
        kind = tl.where(weight, 1, tl.where(has2, 2, 0))
        group = tl.where(weight, (first_pair + p - j) * TILE_GROUP_SIZES + tl.minimum(nb // 2, TILE_GROUP_SIZES - 1),
                         (first_pair + p) * TILE_GROUP_SIZES + 1)
        ok = p < total
        words = pairs + 2 + 2 * (first_pair + p)
        tl.store(words, 4 * t0 + kind, mask=ok)
        tl.store(words + 1, t1, mask=ok)
        tl.store(pairs + 2 + 2 * cap + first_pair + p, group, mask=ok)
        tl.store(pairs + 2 + 3 * cap + first_pair + p, tl.zeros([CHUNK], tl.int32), mask=ok)
        p0 += G * CHUNK
    return total


@triton.jit
def _write_tile_table(tiles, cta, G, n, blocks, cum, N1: tl.constexpr, N2: tl.constexpr, BM: tl.constexpr,
                      BLOCK_E: tl.constexpr, PAIRS: tl.constexpr = False):
    """The GEMM phase's tile table (:mod:`megamoe.kernels.gemm_fp8_ws`): header ``(L1 tiles, L2 tiles, pool blocks,
    word offset of the block table)``, the L1 tiles (``N1`` per pool block) and the L2 tiles (``N2``), see
    :func:`_tile_entries`; then the block table: the valid rows of each pool block (what the GEMM phase's pull
    copies and the L1 tiles of the block wait for); then the group words and counters (``TILE_GROUP_SIZES``);
    with ``PAIRS`` then the pair table (``TILE_PAIR_WORDS``: L1 pairs, all pairs, then :func:`_tile_pairs`' pairs of
    L1 and of L2)."""
    num_blocks = tl.max(cum, axis=0)
    blk = TILE_HEADER + num_blocks * (N1 + N2) * TILE_WORDS
    groups = tiles + blk + num_blocks
    num_l1 = _tile_entries(tiles, 0, cta, G, n, blocks, cum, groups, num_blocks * (N1 + N2), N1, BM, BLOCK_E)
    num_l2 = _tile_entries(tiles, num_l1, cta, G, n, blocks, cum, groups, num_blocks * (N1 + N2), N2, BM, BLOCK_E)
    if PAIRS:
        cap = num_blocks * (N1 + N2)
        pairs = groups + 2 * cap
        p1 = _tile_pairs(pairs, cap, 0, 0, cta, G, blocks, N1, BLOCK_E)
        p2 = _tile_pairs(pairs, cap, num_l1, p1, cta, G, blocks, N2, BLOCK_E)
        if cta == 0:
            tl.store(pairs, p1)
            tl.store(pairs + 1, p1 + p2)
    ev = tl.arange(0, BLOCK_E)
    b0 = cta * 128
    while b0 < num_blocks:
        b = b0 + tl.arange(0, 128)
        e = tl.sum((cum[None, :] <= b[:, None]).to(tl.int32), axis=1)
        sel = ev[None, :] == e[:, None]
        first_block = tl.sum(tl.where(sel, (cum - blocks)[None, :], 0), axis=1)
        n_e = tl.sum(tl.where(sel, n[None, :], 0), axis=1)
        tl.store(tiles + blk + b, tl.minimum(n_e - (b - first_block) * BM, BM), mask=b < num_blocks)
        b0 += G * 128
    if cta == 0:
        tl.store(tiles, num_l1)
        tl.store(tiles + 1, num_l2)
        tl.store(tiles + 2, num_blocks)
        tl.store(tiles + 3, blk)


@triton.jit
def _rank_ptr(base, tab, i: tl.constexpr, dtype: tl.constexpr):
    """Local rank's pointer = rank 0's tensor argument ``base`` + the byte delta in column ``i`` of its table row.
    Deltas are multiples of 16 (checked on the host): with the hint, Triton keeps 16-byte vector accesses, which a
    pointer loaded from memory would lose (its alignment unknown, every access would go byte by byte)."""
    delta = tl.load(tab + i) // 16 * 16  # exact (a multiple of 16); tells Triton so
    return (base.to(tl.pointer_type(tl.uint8)) + delta).to(tl.pointer_type(dtype))


@triton.jit
def fused_mega_moe_kernel(
        buf0, y0, w1_0, w1_sf0, w2_0, w2_sf0, stats0, timeline0, tiles0, args, buffer_ptrs, fold_lut, rank0, G, clamp,
        timeout_ns,
        max_polls,
        OFF_GRID: tl.constexpr, OFF_SIGNAL: tl.constexpr, OFF_STATE: tl.constexpr, OFF_SEND: tl.constexpr,
        OFF_RECV: tl.constexpr, OFF_RECV_SUM: tl.constexpr, OFF_ARRIVAL: tl.constexpr, OFF_L2_MASK: tl.constexpr,
        OFF_SRC_IDX: tl.constexpr, OFF_META: tl.constexpr, OFF_X: tl.constexpr, OFF_X_SF: tl.constexpr,
        OFF_TOPK_IDX: tl.constexpr, OFF_TOPK_W: tl.constexpr, OFF_L1: tl.constexpr, OFF_L1_SF: tl.constexpr,
        OFF_L1_W: tl.constexpr, OFF_L2: tl.constexpr, OFF_L2_SF: tl.constexpr, OFF_COMBINE: tl.constexpr,
        OFF_CALL: tl.constexpr,
        R: tl.constexpr, E: tl.constexpr, El: tl.constexpr, T: tl.constexpr, K: tl.constexpr, H: tl.constexpr,
        I: tl.constexpr, SP: tl.constexpr, LAYOUT_BM: tl.constexpr, LAYOUT_SF_BM: tl.constexpr,
        BM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_J: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr, COUNT_BLOCK: tl.constexpr, COMBINE_T: tl.constexpr,
        COMBINE_H: tl.constexpr, HAS_CLAMP: tl.constexpr, HAS_STATS: tl.constexpr, PROMOTE_EVERY: tl.constexpr,
        PRMT_DECODE: tl.constexpr, HW_CVT: tl.constexpr, TIMED: tl.constexpr, TIMELINE: tl.constexpr,
        MAX_EVENTS: tl.constexpr, KW1_PAD: tl.constexpr, KW2_PAD: tl.constexpr, FOLDED: tl.constexpr,
        BN1: tl.constexpr, BN2: tl.constexpr, F64_EXP: tl.constexpr, FP8W: tl.constexpr = False,
        FP8_SWAP: tl.constexpr = False, PHASE: tl.constexpr = 0, PDL: tl.constexpr = False,
        L2_FOLDED: tl.constexpr = True, PAIRS: tl.constexpr = False):
    """One call of the layer for every local rank; see the module docstring. ``buf0 .. timeline0``: local rank 0's
    tensors; ``args``: int64 ``[local ranks, NUM_ARGS]``, per local rank the byte deltas of its tensors from rank
    0's (``ARG_NAMES`` order; the token count in its column); ``G`` programs per local rank.

    ``PHASE``: 0 = the whole call (the one persistent launch). With the GEMM phase in a separate Gluon launch
    (:mod:`megamoe.kernels.gemm_fp8_ws`, :mod:`megamoe.kernels.gemm_fp4_ws`): 1 = the front (count, publish,
    barrier 1, pull tasks only -- placing the rows for the FP8 phase's own pull, copying and folding them with
    ``FOLDED`` -- and the tile table of the GEMM phase at ``tiles``), 2 = the back (barrier 2, combine, cleanup,
    barrier 3).

    The kernel marks the call in each local rank's ``call_state`` (``OFF_CALL``: [calls begun, calls completed]; the
    host's ``megamoe.ops.guarded_call`` does it for the staged pipeline): program 0 of the rank adds 1 to the first
    word when the call starts (PHASE 0 / 1) and to the second after barrier 3 (PHASE 0 / 2), so a call whose launches
    did not all run leaves them unequal. Two torch launches fewer a call than marking from the host.

    ``PAIRS`` (PHASE 1, ``megamoe.fused.FP8_WS_MULTICAST``): the tile table also gets the pair table of the GEMM
    phase's 2-CTA clusters (``megamoe.kernels.formats.TILE_PAIR_WORDS``).

    ``PDL`` (GPU only; ``megamoe.fused.WS_PDL``): the front lets the GEMM phase's grid launch early and the back,
    launched as a programmatic dependent, waits at its first instruction for the GEMM phase to complete."""
    if PDL:  # a Gluon kind's launches chained by programmatic dependent launch (megamoe.fused.WS_PDL)
        if PHASE == 1:  # the front: the GEMM phase's grid may be scheduled as this one's programs exit
            gdc_launch_dependents()
        if PHASE == 2:  # the back, launched as a dependent of the GEMM phase: nothing is read before it finished
            gdc_wait()
    pid = tl.program_id(0)
    lr = pid // G
    cta = pid % G
    me = rank0 + lr
    tab = args + lr * NUM_ARGS
    buf = _rank_ptr(buf0, tab, 0, tl.uint8)
    y = _rank_ptr(y0, tab, 1, tl.int16)
    w1 = _rank_ptr(w1_0, tab, 2, tl.uint8)
    w1_sf = _rank_ptr(w1_sf0, tab, 3, tl.int32)
    w2 = _rank_ptr(w2_0, tab, 4, tl.uint8)
    w2_sf = _rank_ptr(w2_sf0, tab, 5, tl.int32)
    stats = _rank_ptr(stats0, tab, 6, tl.int32)
    num_tokens = tl.load(tab + 7).to(tl.int32)
    timeline = _rank_ptr(timeline0, tab, 8, tl.int64)
    tiles = _rank_ptr(tiles0, tab, 9, tl.int32)
    grid_ctr = (buf + OFF_GRID).to(tl.pointer_type(tl.int32))
    progress = grid_ctr + 1
    task_ctr = grid_ctr + 2  # the next task index to hand out (dynamic schedule); zero between calls
    barrier_hold = grid_ctr + 3  # set while program 0 waits in a cross-rank barrier (see _grid_sync)
    signal = (buf + OFF_SIGNAL).to(tl.pointer_type(tl.int32))
    state = (buf + OFF_STATE).to(tl.pointer_type(tl.int32))
    send = (buf + OFF_SEND).to(tl.pointer_type(tl.int64))
    recv = (buf + OFF_RECV).to(tl.pointer_type(tl.int64))
    recv_sum = (buf + OFF_RECV_SUM).to(tl.pointer_type(tl.int64))
    arrival = (buf + OFF_ARRIVAL).to(tl.pointer_type(tl.int32))
    l2_mask = (buf + OFF_L2_MASK).to(tl.pointer_type(tl.int64))
    call_state = (buf + OFF_CALL).to(tl.pointer_type(tl.int32))
    if PHASE != 2:
        if cta == 0:
            tl.atomic_add(call_state, 1, sem="relaxed", scope="gpu")  # calls begun
    epoch0 = tl.load(state, volatile=True)
    if PHASE == 2:  # the front launch's barrier 1 stored epoch0 + 1
        epoch0 -= 1
    n_ev = 0
    if PHASE != 2:
        n_ev = _front(buf, buffer_ptrs, me, cta, G, num_tokens, timeline, tiles, grid_ctr, progress, task_ctr,
                      barrier_hold, signal, state, send, recv, recv_sum, arrival, l2_mask, epoch0, n_ev, w1, w1_sf,
                      w2, w2_sf, fold_lut, clamp, timeout_ns, max_polls, OFF_SRC_IDX, OFF_META, OFF_X, OFF_X_SF,
                      OFF_TOPK_IDX, OFF_TOPK_W, OFF_L1, OFF_L1_SF, OFF_L1_W, OFF_L2, OFF_L2_SF, OFF_COMBINE, R, E, El,
                      T, K, H, I, SP, LAYOUT_BM, LAYOUT_SF_BM, BM, BLOCK_R, BLOCK_E, BLOCK_J, BLOCK_H, BLOCK_W,
                      COUNT_BLOCK, HAS_CLAMP, PROMOTE_EVERY, PRMT_DECODE, HW_CVT, TIMED, TIMELINE, MAX_EVENTS,
                      KW1_PAD, KW2_PAD, FOLDED, BN1, BN2, F64_EXP, FP8W, FP8_SWAP, PHASE, L2_FOLDED, PAIRS)
    # task_ctr back to 0 for the next call once every program has drawn its last task (past the end): after a grid
    # sync in the one launch; the back launch's program 0 at once (the front's programs have all exited); not in
    # the front (a grid sync fewer in each of the two launches around the Gluon phase: nothing else needs one here)
    if PHASE == 0:
        _grid_sync(grid_ctr, cta, G, state, timeout_ns, TIMED)
    if PHASE != 1:
        if cta == 0:
            tl.store(task_ctr, 0)
        _back(buf, buffer_ptrs, me, cta, G, num_tokens, y, stats, timeline, grid_ctr, progress, barrier_hold, signal,
              state, send, recv, recv_sum, arrival, l2_mask, epoch0, n_ev, timeout_ns, max_polls, OFF_TOPK_IDX,
              OFF_COMBINE, R, E, El, T, K, H, BM, BLOCK_R, BLOCK_E, COMBINE_T, COMBINE_H, HAS_STATS, TIMED, TIMELINE,
              MAX_EVENTS)
        if cta == 0:  # after barrier 3 (program 0's last step)
            tl.atomic_add(call_state + 1, 1, sem="relaxed", scope="gpu")  # calls completed


@triton.jit
def _front(buf, buffer_ptrs, me, cta, G, num_tokens, timeline, tiles, grid_ctr, progress, task_ctr, barrier_hold,
           signal, state, send, recv, recv_sum, arrival, l2_mask, epoch0, n_ev, w1, w1_sf, w2, w2_sf, fold_lut, clamp,
           timeout_ns, max_polls, OFF_SRC_IDX: tl.constexpr, OFF_META: tl.constexpr, OFF_X: tl.constexpr,
           OFF_X_SF: tl.constexpr, OFF_TOPK_IDX: tl.constexpr, OFF_TOPK_W: tl.constexpr, OFF_L1: tl.constexpr,
           OFF_L1_SF: tl.constexpr, OFF_L1_W: tl.constexpr, OFF_L2: tl.constexpr, OFF_L2_SF: tl.constexpr,
           OFF_COMBINE: tl.constexpr, R: tl.constexpr, E: tl.constexpr, El: tl.constexpr, T: tl.constexpr,
           K: tl.constexpr, H: tl.constexpr, I: tl.constexpr, SP: tl.constexpr, LAYOUT_BM: tl.constexpr,
           LAYOUT_SF_BM: tl.constexpr, BM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr,
           BLOCK_J: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr, COUNT_BLOCK: tl.constexpr,
           HAS_CLAMP: tl.constexpr, PROMOTE_EVERY: tl.constexpr, PRMT_DECODE: tl.constexpr, HW_CVT: tl.constexpr,
           TIMED: tl.constexpr, TIMELINE: tl.constexpr, MAX_EVENTS: tl.constexpr, KW1_PAD: tl.constexpr,
           KW2_PAD: tl.constexpr, FOLDED: tl.constexpr, BN1: tl.constexpr, BN2: tl.constexpr, F64_EXP: tl.constexpr,
           FP8W: tl.constexpr, FP8_SWAP: tl.constexpr, PHASE: tl.constexpr, L2_FOLDED: tl.constexpr,
           PAIRS: tl.constexpr):
    """The call up to the end of the task loop (count, publish, barrier 1, tasks); returns the timeline count."""
    N1: tl.constexpr = I // BN1  # L1 N-blocks per pool block (= bits of its L2 arrival mask)
    N2: tl.constexpr = H // BN2

    # ---- count + publish source indices (as kernels/dispatch.py, strided over this rank's programs)
    t0 = _now(TIMED)
    topk_idx = (buf + OFF_TOPK_IDX).to(tl.pointer_type(tl.int64))
    src_idx = (buf + OFF_SRC_IDX).to(tl.pointer_type(tl.int32))
    p0 = cta * COUNT_BLOCK
    while p0 < num_tokens * K:  # (while, not range: the interpreter's range needs Python ints)
        offs = p0 + tl.arange(0, COUNT_BLOCK)
        inb = offs < num_tokens * K
        expert = tl.load(topk_idx + offs, mask=inb, other=-1)
        ok = inb & (expert >= 0)
        expert = tl.where(ok, expert, 0)
        slot = tl.atomic_add(send + expert, tl.full([COUNT_BLOCK], 1, tl.int64), mask=ok, sem="relaxed")
        owner = tl.where(ok, expert // El, me).to(tl.int32)
        dst = src_idx + ((expert % El) * R + me) * T + tl.where(ok, slot, 0)
        tl.store(sym_map(dst, buffer_ptrs, me, owner), offs.to(tl.int32), mask=ok)
        p0 += G * COUNT_BLOCK
    _grid_sync(grid_ctr, cta, G, state, timeout_ns, TIMED)
    # ---- publish counts: send_count[e] -> owner's recv_count[me][e % El] and recv_count_sum[e % El]. Program 0
    # alone, just before its barrier 1 (a grid sync fewer than with the experts strided over the programs: the
    # counts are only read after barrier 1; its release orders them, after a barrier of the program's threads)
    if cta == 0:
        for e0 in tl.static_range(0, E, 128):
            e = e0 + tl.arange(0, 128)
            inb = e < E
            cnt = tl.load(send + e, mask=inb, other=0, volatile=True)
            owner = tl.where(inb, e // El, me)
            le = tl.where(inb, e % El, 0)
            tl.store(sym_map(recv + me * El + le, buffer_ptrs, me, owner), cnt, mask=inb)
            tl.atomic_add(sym_map(recv_sum + le, buffer_ptrs, me, owner), cnt, mask=inb, sem="relaxed", scope="sys")
        tl.debug_barrier()
    n_ev = _event(timeline, cta, n_ev, EV_COUNT, t0, TIMELINE, MAX_EVENTS)
    t0 = _now(TIMED)
    if cta == 0:
        _cross_rank_barrier(signal, state, progress, barrier_hold, buffer_ptrs, me, epoch0 + 1, 1, R, BLOCK_R,
                            timeout_ns, max_polls, TIMED)
    _grid_sync(grid_ctr, cta, G, state, timeout_ns, TIMED)
    n_ev = _event(timeline, cta, n_ev, EV_BARRIER1, t0, TIMELINE, MAX_EVENTS)

    # ---- the task loop
    if _failed(state) == 0:
        n, blocks, cum = expert_blocks(recv, R, El, BM, BLOCK_R, BLOCK_E)
        BRE: tl.constexpr = BLOCK_E * BLOCK_R
        f = tl.arange(0, BRE)  # flat (expert, source) index: expert-major
        fe = f // BLOCK_R
        fr = f % BLOCK_R
        counts_flat = tl.load(recv + fr * El + fe, mask=(fe < El) & (fr < R), other=0).to(tl.int32)
        chunks_flat = (counts_flat + BLOCK_J - 1) // BLOCK_J
        cum_flat = tl.cumsum(chunks_flat, axis=0)
        num_pull = tl.max(cum_flat, axis=0)
        num_blocks = tl.max(cum, axis=0)
        num_l1 = num_blocks * N1
        num_l2 = num_blocks * N2
        # PHASE 1: the GEMM tiles run in a Gluon launch: write its tile table, hand out pull tasks only. They copy
        # the rows only for the FP8 x FP4 phase with folded rows (megamoe.kernels.gemm_fp4_ws, no pull of its own);
        # the FP8 phase's pull partition copies raw rows itself, so for it they place rows (metadata, weights).
        if PHASE == 1:
            _write_tile_table(tiles, cta, G, n, blocks, cum, I // 128, H // 256, BM, BLOCK_E, PAIRS)
            num_l1 = 0
            num_l2 = 0
        # Tasks are handed out in index order by an atomic counter (a work queue), not statically as cta, cta + G,
        # ...: L1 and L2 tiles differ in cost (K = H vs I) and a static round-robin left the programs that drew an
        # extra L1 tile finishing last. Every task's prerequisites (pull chunks of its block, the block's L1 tiles)
        # have smaller indices, so they were handed to resident programs before it: no wait can dead-lock.
        t = tl.atomic_add(task_ctr, 1, sem="relaxed", scope="gpu")
        while t < num_pull + num_l1 + num_l2:
            t0 = _now(TIMED)
            if t < num_pull:
                _pull_task(t, buf, buffer_ptrs, me, recv, chunks_flat, cum_flat, blocks, cum, arrival,
                           OFF_SRC_IDX, OFF_X, OFF_X_SF, OFF_TOPK_W, OFF_L1, OFF_L1_SF, OFF_L1_W, OFF_META,
                           R, El, T, K, H, SP, LAYOUT_BM, LAYOUT_SF_BM, BM, BLOCK_R, BLOCK_E, BLOCK_J, BLOCK_H,
                           BLOCK_W, HW_CVT, FOLDED, (PHASE != 1) | (FOLDED & (not FP8W)))
                n_ev = _event(timeline, cta, n_ev, EV_PULL, t0, TIMELINE, MAX_EVENTS)
            elif PHASE == 1:
                pass
            elif t < num_pull + num_l1:
                b, nt, expert, rows, sf_rows, mask_m, valid = _tile_rows(t - num_pull, N1, n, blocks, cum, BM,
                                                                         BLOCK_E, LAYOUT_BM, LAYOUT_SF_BM)
                _wait_at_least(arrival + b, valid, state, timeout_ns, max_polls, TIMED)
                if FP8W & FP8_SWAP:  # SM90 FP8 x FP8, swap-AB (few tokens per expert; BN1 == 128)
                    l1_tile_fp8_swap(buf, w1, w1_sf.to(tl.pointer_type(tl.float32)), clamp, expert, rows, sf_rows,
                                     mask_m, nt, OFF_L1, OFF_L1_SF, OFF_L1_W, OFF_L2, OFF_L2_SF, H, I, SP, BM,
                                     HAS_CLAMP, F64_EXP)
                elif FP8W:  # the SM90 FP8 x FP8 format: the staged tile of megamoe.kernels.gemm_fp8
                    l1_tile_fp8(buf, w1, w1_sf.to(tl.pointer_type(tl.float32)), clamp, expert, rows, sf_rows, mask_m,
                                nt, OFF_L1, OFF_L1_SF, OFF_L1_W, OFF_L2, OFF_L2_SF, H, I, SP, BM, BN1, HAS_CLAMP,
                                F64_EXP)
                elif FOLDED:
                    _l1_tile_hopper(buf, w1, w1_sf, fold_lut, clamp, expert, rows, sf_rows, mask_m, nt, OFF_L1,
                                    OFF_L1_SF, OFF_L1_W, OFF_L2, OFF_L2_SF, H, I, SP, BM, HAS_CLAMP, PROMOTE_EVERY,
                                    PRMT_DECODE, HW_CVT, KW1_PAD, F64_EXP)
                else:
                    l1_tile(buf, w1, w1_sf, clamp, expert, rows, sf_rows, mask_m, nt, OFF_L1, OFF_L1_SF, OFF_L1_W,
                            OFF_L2, OFF_L2_SF, H, I, SP, BM, BN1, HAS_CLAMP, False, tl.float32, PRMT_DECODE, F64_EXP)
                tl.debug_barrier()
                tl.atomic_or(l2_mask + b, tl.full([], 1, tl.int64) << nt, sem="release", scope="gpu")
                n_ev = _event(timeline, cta, n_ev, EV_L1, t0, TIMELINE, MAX_EVENTS)
            else:
                b, nt, expert, rows, sf_rows, mask_m, valid = _tile_rows(t - num_pull - num_l1, N2, n, blocks, cum, BM,
                                                                         BLOCK_E, LAYOUT_BM, LAYOUT_SF_BM)
                # Every L1 N-block of the pool block first. The mask would allow waiting per K-block, but
                # Triton's software pipeliner issues the loads of K-block kb+1 before iteration kb's body runs,
                # i.e. before a per-K-block wait could order them (wrong results on an H200 with I/128 > 1).
                _wait_mask_full(l2_mask + b, N1, state, timeout_ns, max_polls, TIMED)
                if FP8W & FP8_SWAP:  # BN2 == 128
                    l2_tile_fp8_swap(buf, buffer_ptrs, me, w2, w2_sf.to(tl.pointer_type(tl.float32)), expert, rows,
                                     sf_rows, mask_m, nt, OFF_L2, OFF_L2_SF, OFF_META, OFF_COMBINE, T, H, I, SP, BM)
                elif FP8W:
                    l2_tile_fp8(buf, buffer_ptrs, me, w2, w2_sf.to(tl.pointer_type(tl.float32)), expert, rows, sf_rows,
                                mask_m, nt, OFF_L2, OFF_L2_SF, OFF_META, OFF_COMBINE, T, H, I, SP, BM, BN2)
                elif FOLDED:
                    _l2_tile_hopper(buf, buffer_ptrs, me, w2, w2_sf, fold_lut, expert, rows, sf_rows, mask_m, nt,
                                    OFF_L2, OFF_L2_SF, OFF_META, OFF_COMBINE, T, H, I, SP, BM, PROMOTE_EVERY,
                                    PRMT_DECODE, HW_CVT, KW2_PAD, L2_FOLDED)
                else:
                    l2_tile(buf, buffer_ptrs, me, w2, w2_sf, expert, rows, sf_rows, mask_m, nt, OFF_L2, OFF_L2_SF,
                            OFF_META, OFF_COMBINE, T, H, I, SP, BM, BN2, False, tl.float32, PRMT_DECODE)
                n_ev = _event(timeline, cta, n_ev, EV_L2, t0, TIMELINE, MAX_EVENTS)
            tl.atomic_add(progress, 1, sem="relaxed", scope="gpu")  # liveness for the peers' barrier waits
            t = tl.atomic_add(task_ctr, 1, sem="relaxed", scope="gpu")
    return n_ev


@triton.jit
def _back(buf, buffer_ptrs, me, cta, G, num_tokens, y, stats, timeline, grid_ctr, progress, barrier_hold, signal,
          state, send, recv, recv_sum, arrival, l2_mask, epoch0, n_ev, timeout_ns, max_polls,
          OFF_TOPK_IDX: tl.constexpr, OFF_COMBINE: tl.constexpr, R: tl.constexpr, E: tl.constexpr,
          El: tl.constexpr, T: tl.constexpr, K: tl.constexpr, H: tl.constexpr, BM: tl.constexpr,
          BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr, COMBINE_T: tl.constexpr, COMBINE_H: tl.constexpr,
          HAS_STATS: tl.constexpr, TIMED: tl.constexpr, TIMELINE: tl.constexpr, MAX_EVENTS: tl.constexpr):
    """The call from barrier 2 on: barrier 2, combine reduce into ``y``, workspace cleanup, barrier 3."""
    topk_idx = (buf + OFF_TOPK_IDX).to(tl.pointer_type(tl.int64))
    t0 = _now(TIMED)
    if cta == 0:
        _cross_rank_barrier(signal, state, progress, barrier_hold, buffer_ptrs, me, epoch0 + 2, 2, R, BLOCK_R,
                            timeout_ns, max_polls, TIMED)
    _grid_sync(grid_ctr, cta, G, state, timeout_ns, TIMED)
    n_ev = _event(timeline, cta, n_ev, EV_BARRIER2, t0, TIMELINE, MAX_EVENTS)

    # ---- combine reduce into y, then clean the workspace (+ recv stats)
    t0 = _now(TIMED)
    ok_all = _failed(state) == 0
    if ok_all:
        combine = (buf + OFF_COMBINE).to(tl.pointer_type(tl.int16))
        # Work items are (COMBINE_T tokens x COMBINE_H columns) strided over the programs: with few tokens a
        # token-only split left one program summing all H columns alone (T = 8, FP8 format: 75 us of a 536 us
        # call on an H200, ``results/probes/fused_fp8_sched_probe_h200.jsonl``); now every program takes a slice.
        NH: tl.constexpr = H // COMBINE_H
        w = cta
        while w < ((num_tokens + COMBINE_T - 1) // COMBINE_T) * NH:
            tok = (w // NH) * COMBINE_T + tl.arange(0, COMBINE_T)
            h = (w % NH) * COMBINE_H + tl.arange(0, COMBINE_H)
            mt = tok < num_tokens
            acc = tl.zeros([COMBINE_T, COMBINE_H], dtype=tl.float32)
            for j in tl.static_range(K):
                v = tl.load(topk_idx + tok * K + j, mask=mt, other=-1) >= 0
                src = combine + ((j * T + tok).to(tl.int64) * H)[:, None] + h[None, :]
                acc += bf16_bits_to_f32(tl.load(src, mask=v[:, None], other=0))
            tl.store(y + (tok.to(tl.int64) * H)[:, None] + h[None, :], f32_to_bf16_bits(acc).to(tl.int16),
                     mask=mt[:, None])
            w += G
        n, blocks, cum = expert_blocks(recv, R, El, BM, BLOCK_R, BLOCK_E)
        num_blocks = tl.max(cum, axis=0)
        i0 = cta * 128
        while i0 < num_blocks:
            i = i0 + tl.arange(0, 128)
            tl.store(arrival + i, tl.zeros([128], tl.int32), mask=i < num_blocks)
            tl.store(l2_mask + i, tl.zeros([128], tl.int64), mask=i < num_blocks)
            i0 += G * 128
        if cta == 0:
            for i0 in range(0, El, 128):
                i = i0 + tl.arange(0, 128)
                mi = i < El
                if HAS_STATS:
                    s = tl.load(stats + i, mask=mi, other=0)
                    tl.store(stats + i, s + tl.load(recv_sum + i, mask=mi, other=0).to(tl.int32), mask=mi)
                tl.store(recv_sum + i, tl.zeros([128], tl.int64), mask=mi)
    n_ev = _event(timeline, cta, n_ev, EV_COMBINE, t0, TIMELINE, MAX_EVENTS)
    _grid_sync(grid_ctr, cta, G, state, timeout_ns, TIMED)
    t0 = _now(TIMED)
    if cta == 0:
        # the send and receive counts back to 0: program 0 alone, once every program has read ``recv`` above (a grid
        # sync fewer than with the zeroing strided over the programs between two syncs); barrier 3's release
        # orders these stores before any peer's next call publishes into this rank's counts
        if ok_all:
            for i0 in tl.static_range(0, E, 128):
                i = i0 + tl.arange(0, 128)
                tl.store(send + i, tl.zeros([128], tl.int64), mask=i < E)
            for i0 in tl.static_range(0, R * El, 128):
                i = i0 + tl.arange(0, 128)
                tl.store(recv + i, tl.zeros([128], tl.int64), mask=i < R * El)
            tl.debug_barrier()
        _cross_rank_barrier(signal, state, progress, barrier_hold, buffer_ptrs, me, epoch0 + 3, 3, R, BLOCK_R,
                            timeout_ns, max_polls, TIMED)
    n_ev = _event(timeline, cta, n_ev, EV_BARRIER3, t0, TIMELINE, MAX_EVENTS)
