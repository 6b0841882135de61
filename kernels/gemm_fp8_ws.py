"""The GEMM phase of the fused SM90 FP8 x FP8 path, warp-specialised in Gluon: the pull of the tokens into the L1
pool, both grouped GEMMs (L1 + SwiGLU + top-k weight + FP8 requant, then L2 + write-back into the source ranks'
combine buffers) in one persistent launch, the GEMMs starting while the pull is still running.

Why Gluon: the plain Triton tiles of :mod:`megamoe.kernels.gemm_fp8` reach ~525 TFLOP/s on the L1 shape of V4-Pro
on an H200, this structure ~1040-1100 (``results/probes/gluon_fp8_gemm_probe_h200.jsonl``: the same tile as a
plain grouped GEMM). What plain ``tl`` cannot say and this kernel does (DeepGEMM SM90's structure):

* **warp roles** (``gl.warp_specialize``): one TMA loader warp (``LOAD_REGS`` registers), two math warpgroups
  (``MATH_REGS``) and ``PULL_WARPS`` pull warps (``PULL_REGS``), which ``setmaxnreg`` rebalances -- DeepGEMM's
  dispatch / TMA / math roles;
* **the pull overlapping L1** (:func:`_pull_partition`): the CTAs copy the pool's rows in order, interleaved (the
  rows the front launch placed, from the source ranks' inputs), each landed row adding 1 to its block's
  ``l1_arrival_count``; the loader of an L1 tile waits for its block's count to reach the block's valid rows
  (acquire) -- the seed's per-block arrival counter;
* a **STAGES-deep shared-memory ring** filled by TMA (A ``[128, 128]``, W ``[256, 128]``, the 128 A scales of one K
  block) with ``ready`` / ``empty`` mbarriers, so the loader runs ahead of the math for as long as the ring allows;
* **the promotion order**: each warpgroup issues the wgmma of one 128-wide K block into a fresh register tile, waits
  for it and adds it into its float32 accumulator times ``sa * sw`` (the per-block promotion of
  :func:`megamoe.reference.block_scaled_matmul`) while the other warpgroup's wgmma runs; BLOCK_N = 256 is done
  "in halves" (two ``[64, 128]`` dot tiles one after the other, so 64 + 64 accumulator + 64 dot registers fit 232), with
  :func:`_pin` keeping LLVM from sinking the left half's promotion below the right half's wgmma (660 B of spill
  without it, offline sm_90a compile).

Tiles (one CTA per SM, static stride ``t = pid, pid + G, ...`` over the tile table the front launch wrote, see
:func:`megamoe.kernels.fused.fused_mega_moe_kernel` with ``PHASE=1``): L1 tiles, then L2 tiles. A tile is one pool block
of ``BM`` rows x 256 weight rows. ``BM`` = 128: each math warpgroup takes 64 of the rows and all 256 weight rows;
a warpgroup whose 64 rows are all padding (the last block of an expert often has fewer than 64) issues no MMA and
passes the ring's stages through. ``BM`` = 64 (:func:`_math_partition_m64`, up to
``megamoe.fused.FP8_WS_BLOCK64_MAX_EXPECTED`` expected tokens per expert; by default never since session 11's
faster epilogues): both take the same 64 rows, each its 128 of the weight rows, and exchange the L1 requant's row
maxima through shared memory. The pool is sized for blocks of 128 (``block_m`` 128), DeepGEMM's rule of sizing
for the largest block a call may pick:

* L1: W1 rows ``[nt*256, nt*256+256)`` of the expert = intermediate columns ``[nt*128, nt*128+128)``, gate and up
  interleaved by 8 (``transform_weights_for_mega_moe_sm90``). In the wgmma accumulator layout columns ``j`` and
  ``j + 8`` sit in the same thread, so splitting gate from up is a free register reshape (no shared memory). The
  weight scales are per 128x128 block of the *untransformed* rows: gate block row ``nt``, up block row
  ``I/128 + nt``, chosen per column by a select in the promotion.
  Epilogue: bf16 round, clamp, SwiGLU, top-k weight, the per-128 requant (``scale = max(amax, 1e-4) / 448``) into the
  L2 pool (the hardware's conversions, :func:`_to_e4m3` / :func:`_round_bf16`, and 16-byte stores after a layout
  change, :data:`STORE_E4M3`); then ``fence.proxy.async`` (generic-proxy stores that TMA will read) and the
  warpgroup's bit ``2*nt + wg`` OR-ed into ``l2_arrival_mask[b]`` (release).
* L2: W2 rows ``[nt*256, nt*256+256)`` = hidden columns, weight scale rows ``2nt`` / ``2nt+1`` (one per half). The
  loader waits **per K block** ``kb`` for the two bits of L1 tile ``kb`` of the block (acquire, then
  ``fence.proxy.async``): an L2 tile starts while later L1 tiles of its block are still running -- the seed's
  arrival-mask mechanism at the finest grain. Epilogue: bf16 rows into ``combine[slot][token]`` of each row's source
  rank (``sym_map`` arithmetic, rows past the block's valid count skipped); with ``BULK`` (``megamoe.fused.
  FP8_WS_BULK``, the default at block 128) staged in shared memory and written by one ``cp.async.bulk`` a (row,
  half) while the warpgroup goes back to its MMAs (:func:`_l2_epilogue_bulk`; the staging buffer's address comes
  from :mod:`megamoe.shared_address`), else stored from registers after a layout change (:func:`_l2_epilogue`).
  With ``COPIER`` too (``megamoe.fused.FP8_WS_COPIER``, the default since session 50) the pull warps, once their
  pull is done, compute the rows' destinations and issue those copies (:func:`_copy_rows`): a math warpgroup only
  converts and stages its rows (:func:`_l2_epilogue_staged`; mbarriers ``staged`` / ``freed`` hand the staging rows
  back and forth).

**2-CTA clusters** (``MC``, pool block 128, ``megamoe.fused.FP8_WS_MULTICAST``): the grid runs as clusters of two
CTAs (:mod:`megamoe.multicast`) over the front launch's pair table instead of the tile stride: each cluster takes
pairs ``c, c + G/2, ...``, its two CTAs one tile of the pair each (:func:`_slot`). A weight pair (two pool blocks on
one weight tile) streams each weight stage once for both, each CTA loading one half multicast to both; a token
pair (one pool block, two n-tiles) does so with the pool rows (:func:`_load_stage`). A stage is released in both
CTAs (``empty`` counts four arrives: the count-2 arrive the PTX pass splits), so the pair moves in step; the
math is each tile's own, so the bits are those of the single-CTA schedule.

Waits are bounded (``timeout_ns`` on ``%globaltimer``): on expiry the loader records ``TAG_GEMM_PHASE_WAIT`` in
``barrier_state[1]`` and carries on (the output is then garbage and the call raises), so nothing hangs. A launch
that finds the state already failed by the front launch (a barrier or grid sync timed out) does no tile.

Numerics: the model is the FP8 reference (:func:`megamoe.reference.reference_fp8_mega_moe`): per K block the
float32 promotion ``acc += dot * (sa * sw)``; only the order of the float32 sums inside one 128-wide dot (the
tensor cores') differs, which the GPU tests bound with the tolerance of the other FP8 tiles. What each tile reads
and writes, in pure torch: :mod:`megamoe.gemm_phase` (CPU ranks run the three-launch call with it, bit-exact).

Measured on an H200 (``results/probes/fused_fp8_ws_profile_1add9b3_h200.jsonl``, the pull included): 987 (64-row
tiles; 1012 with 128) / 2193 / 7308 us at T = 512 / 2048 / 8192 tokens of one EP8 rank of V4-Pro, ~890 TFLOP/s at
T = 8192 (without the pull, ``fused_fp8_ws_profile_h200.jsonl``: 1029 / 2227 / 7502).

Where the time went (``results/probes/fp8_ws_probe_h200.jsonl``, whole call, text-patched copies of this kernel,
session 11): without the epilogues' stores the call took 20-24 % less at T = 512 / 2048 / 8192 (2674 -> 2036 us at
T = 2048), as much as without any MMA (2083) or without the weight loads (2075): the two math warpgroups run
their epilogues at the same time, so the tensor cores idle for the whole epilogue. Its integer rounding (~25
operations a value into e4m3, ``numerics.f32_to_e4m3_bits``) was most of it: with the hardware's conversions and
16-byte stores the call took 2231 us against 2522 for the old epilogue in the same run (conversions alone 2272,
stores alone 2481), 7229 against 7858 at T = 8192, 924 against 1021 at T = 512 with 128-row tiles.
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

from megamoe.kernels.formats import AMAX_FLOOR, FP8_MAX, TILE_GROUP_SIZES, TILE_HEADER, TILE_WORDS, WS_TILE_M, WS_TILE_N
from megamoe.kernels.numerics import BF16X2_ROUND_ASM, ceil_ue8m0
from megamoe.kernels.symm import TAG_GEMM_PHASE_WAIT, _globaltimer_ns
from megamoe.multicast import CLUSTER_READY_ASM, Spec, register
from megamoe.shared_address import PASS_VERSION as SHARED_ADDRESS_VERSION
from megamoe.shared_address import offset_token

BK = gl.constexpr(128)  #: K block = scale block along K
WM = gl.constexpr(64)  #: rows per math warpgroup (the wgmma M)
TILE_M = WS_TILE_M  #: pool rows per tile: two math warpgroups
TILE_N = WS_TILE_N  #: weight rows per tile (two halves of 128)
HN = gl.constexpr(128)  #: weight rows per half
TAG_INTERNAL_WAIT = gl.constexpr(TAG_GEMM_PHASE_WAIT)
#: The PTX pass of ``MC`` (:mod:`megamoe.multicast`): the loads through ``w1_desc`` / ``w2_desc`` (the third and
#: fourth TMA descriptor parameters) and ``a1m_desc`` / ``a2m_desc`` (seventh and eighth) are multicast; the default
#: partition is math warpgroup 0 (``num_warps`` 4).
register("fp8_gemm_phase_kernel", Spec(multicast_descs=(2, 3, 6, 7), default_threads=128))
CLUSTER_READY = gl.constexpr(CLUSTER_READY_ASM)


@gluon.jit
def _fence_proxy_async_global():
    """``fence.proxy.async.global``: order this thread's generic-proxy global accesses with async-proxy (TMA) ones."""
    gl.inline_asm_elementwise("fence.proxy.async.global; mov.b32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False,
                              pack=1)


@gluon.jit
def _pin(x):
    """Identity through a side-effecting no-op (``mov.b32``, coalesced away by ptxas): LLVM may not move what
    computes ``x`` below a later wgmma (module docstring, "halves")."""
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=False, pack=1)


@gluon.jit
def _to_e4m3(x):
    """float32 -> e4m3 bytes (uint8), round-to-nearest-even saturating to +-448: the hardware's
    ``cvt.rn.satfinite.e4m3x2.f32``, two values an instruction. The same bits as
    :func:`megamoe.kernels.numerics.f32_to_e4m3_bits` (the integer rounding the interpreter-run kernels need, ~25
    integer operations a value); this module runs on GPUs only."""
    return x.to(gl.float8e4nv).to(gl.uint8, bitcast=True)


@gluon.jit
def _to_bf16_bits(x):
    """float32 -> bf16 bit pattern (int16), round-to-nearest-even: ``cvt.rn.bf16x2.f32`` (the bits of
    :func:`megamoe.kernels.numerics.f32_to_bf16_bits`)."""
    return x.to(gl.bfloat16).to(gl.int16, bitcast=True)


@gluon.jit
def _round_bf16(x):
    """float32 -> nearest bf16 value as float32 (:func:`megamoe.kernels.numerics.round_to_bf16`'s bits), two values
    an instruction (``megamoe.kernels.numerics.BF16X2_ROUND_ASM``: 3 instructions per 2 values, where
    ``x.to(bfloat16).to(float32)`` compiles to one ``F2F.BF16.F32`` and a shift per value)."""
    return gl.inline_asm_elementwise(BF16X2_ROUND_ASM, "=r,=r,r,r", [x], dtype=gl.float32, is_pure=True, pack=2)


#: -log2(e) in float32: Triton's ``exp(x)`` is ``ex2(x * log2(e))``, so ``exp(-gate)``'s operand is ``gate`` times this.
NEG_LOG2E = gl.constexpr(-1.4426950408889634)


@gluon.jit
def _silu_mul(gate, up):
    """SwiGLU ``gate / (1 + exp(-gate)) * up`` in float32, bit for bit what :func:`megamoe.kernels.gemm.swiglu`
    (``F64_EXP`` off) compiles to on sm_90 -- ``ex2.approx`` of ``-gate * log2(e)`` and ``div.full`` (the numerator
    times ``rcp.approx`` of the denominator) -- without the guards ptxas puts around both for subnormal operands
    (an ``FSETP`` and two predicated ``FMUL`` each, 384 of the L1 epilogue's instructions a thread a tile at block
    128): here ``ex2.approx.ftz`` and ``rcp.approx.ftz``. Where the guards do not act (a denominator up to 2^126)
    both compute the same instructions on the same values. Where they would: ``exp(-gate)`` below 2^-126 (gate >
    87.3) adds nothing to 1 in float32 either way; a denominator above 2^126 (-88.7 < gate < -87.3; below, both give
    0) gives a quotient of magnitude below 2^-119 with the guard and a signed zero here, so ``act`` differs only by
    that quotient times ``up``, which the requant to e4m3 (its scale at least ``AMAX_FLOOR`` / 448) rounds to the
    same signed zero unless ``|up|`` exceeds ~2^87 -- the same L2 input bytes for any layer whose L1 outputs are
    not near float32's range."""
    # (gate * -log2(e) is (-gate) * log2(e) bit for bit, one FMUL with no FADD for the negation)
    e = gl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [gate * NEG_LOG2E], dtype=gl.float32,
                                  is_pure=True, pack=1)
    r = gl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [1.0 + e], dtype=gl.float32, is_pure=True,
                                  pack=1)
    return gate * r * up


#: Epilogue store layouts: 16 contiguous bytes a thread (one ``st.global.v4``), a warp's row covering whole 32-byte
#: sectors -- e4m3 ``[64, 64]`` (4 threads a row) and bf16 ``[64, 128]`` (16 threads a row). The wgmma layout holds
#: 2 adjacent values a thread, so stored from it each instruction writes 2 or 4 bytes a thread and half of each
#: sector; ``gl.convert_layout`` moves the tile through shared memory first (``COALESCED``).
STORE_E4M3: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
STORE_BF16: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])

#: ``BULK`` (:func:`_l2_epilogue_bulk`): the math warpgroups' L2 staging rows, int16 (bf16 bits), ``[128, 256]`` with
#: 8 elements of padding after every 256: a 528-byte pitch (``STAGE_PITCH`` elements) puts the 8 rows that a warp's
#: lanes hold in one store of the wgmma layout 16 bytes apart (no bank conflict) and keeps every row 16-byte aligned
#: for ``cp.async.bulk``. Rows ``[64 wg, 64 wg + 64)`` are warpgroup ``wg``'s; 67.5 KB in all, what a 3-stage ring
#: leaves (``megamoe.fused.FP8_WS_BULK``).
STAGE_PITCH: gl.constexpr = gl.constexpr(2 * HN.value + 8)
STAGE_LAYOUT: gl.constexpr = gl.PaddedSharedLayout.with_identity_for([[2 * HN.value, 8]], [2 * WM.value, 2 * HN.value],
                                                                      [1, 0])
#: ``BULK``: one (pool row, 128-column half) of a warpgroup's 64 x 256 a thread -- each thread issues one copy.
#: ``cp.async.bulk`` takes uniform registers, so ptxas issues a warp's copies one lane at a time (``R2UR`` of the
#: lane's operands, ``UBLKCP``, ``BRA.U.ANY`` back; lanes predicated off skip that loop): session 48's profile had
#: ~2700 cycles a tile issuing a warpgroup's 128 copies, hence ``COPIER`` (the pull warps issue them). One 512-byte copy
#: a row from 16 rows a warp, half the loop (``fp8_ws_probe.py``'s ``rowcopies`` / ``copier_rowcopies``), was no
#: faster under ``COPIER`` in session 50 (``results/probes/copier_runs/``).
BULK_ROWS: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [2, 2], [0, 1])
#: ``BULK``: copy ``BULK_BYTES`` from the staging buffer (``$2``: byte offset in it) to global ``$1`` when ``$3`` is
#: nonzero, as one bulk-async group of this thread (an empty group when zero). The staging buffer's offset from
#: ``global_smem`` is resolved when the kernel compiles (:mod:`megamoe.shared_address`).
BULK_BYTES = 2 * HN.value  #: one (row, half): 128 bf16
BULK_STORE_ASM: gl.constexpr = gl.constexpr(
    f"// megamoe.shared_address {SHARED_ADDRESS_VERSION}\n\t"
    "{ .reg .b32 %bks; .reg .pred %bkp; setp.ne.b32 %bkp, $3, 0; mov.u32 %bks, global_smem; "
    f"add.u32 %bks, %bks, {offset_token('l2_stage')}; add.u32 %bks, %bks, $2; "
    f"@%bkp cp.async.bulk.global.shared::cta.bulk_group [$1], [%bks], {BULK_BYTES}; cp.async.bulk.commit_group; "
    "mov.u32 $0, 0; }")


@gluon.jit
def _tile(tiles, t):
    """Entry ``t`` of the tile table: (pool block, n-tile, local expert, valid rows)."""
    p = tiles + TILE_HEADER + t * TILE_WORDS
    return gl.load(p), gl.load(p + 1), gl.load(p + 2), gl.load(p + 3)


@gluon.jit
def _group_sync(tiles, t, num_tiles, state, timeout_ns):
    """Start tile ``t`` together with the other programs of its wave (tiles ``[G w, G w + G)`` of a grid of ``G``
    programs, each taking ``t``, ``t + G``, ...) whose tiles share its weight tile (its group, from the front
    launch's group word ``TILE_GROUP_SIZES``): each adds one to the group's counter (the first group tile of the
    wave) and waits until all have, so their TMA loads of the same weight boxes meet in the L2 cache. Without it
    they drift apart, and each streams the weights from DRAM: Nsight Compute had the FP8 phase at T = 2048 reading
    ~2.3x the weights' bytes at 75 % of DRAM's throughput with a 33 % L2 hit rate
    (``results/probes/ncu_h200/fp8_2048_193bd42.txt``); with it 46 % of DRAM and a 61 % hit rate, the phase 12 %
    shorter (``fp8_2048_3df89c0.txt``; whole-call rows in ``megamoe.fused.WS_GROUP_SYNC``'s comment). Bounded: on
    expiry ``TAG_INTERNAL_WAIT``."""
    num_blocks = gl.load(tiles + 2)
    _sync_group(tiles + gl.load(tiles + 3) + num_blocks, num_tiles, t, gl.num_programs(0), 1, state, timeout_ns)


@gluon.jit
def _sync_group(groups, cap, i, step, per: gl.constexpr, state, timeout_ns):
    """:func:`_group_sync` over any schedule: slot ``i`` of a schedule that hands slots ``i, i + step, ...`` to each
    of ``step`` schedule places (programs, or clusters of ``per`` programs that all take the slot); the slots' group
    words at ``groups``, their counters ``cap`` words further. Each program adds one; the group's slots of the wave
    start once all ``per`` x their count have."""
    word = gl.load(groups + i)
    first = word // TILE_GROUP_SIZES
    wave = i - i % step
    lo = gl.maximum(first, wave)
    size = gl.minimum(first + word % TILE_GROUP_SIZES, wave + step) - lo
    if size > 1:
        ctr = groups + cap + lo
        seen = gl.atomic_add(ctr, 1, sem="relaxed", scope="gpu") + 1
        if seen < size * per:
            t0 = _globaltimer_ns()
            alive = True
            while (seen < size * per) & alive:
                seen = gl.atomic_add(ctr, 0, sem="relaxed", scope="gpu")
                alive = (_globaltimer_ns() - t0) <= timeout_ns
            if seen < size * per:
                gl.atomic_cas(state + 1, 0, TAG_INTERNAL_WAIT)


@gluon.jit
def _pairs(tiles, num_tiles):
    """The pair table after the group counters (``TILE_PAIR_WORDS``, written by the front launch with ``PAIRS``): its
    first word holds the L1 pairs, the second all pairs, then two words a pair."""
    return tiles + gl.load(tiles + 3) + gl.load(tiles + 2) + 2 * num_tiles


@gluon.jit
def _schedule(tiles, num_tiles, MC: gl.constexpr):
    """This program's slots as ``range(first, stop, step)``: tiles ``pid, pid + G, ...`` of ``G`` programs; with
    ``MC`` the pairs ``c, c + G/2, ...`` of cluster ``c = pid // 2`` (both programs of a cluster take every pair)."""
    if MC:
        return gl.program_id(0) // 2, gl.load(_pairs(tiles, num_tiles) + 1), gl.num_programs(0) // 2
    else:
        return gl.program_id(0), num_tiles, gl.num_programs(0)


@gluon.jit
def _slot(tiles, num_tiles, i, MC: gl.constexpr):
    """Slot ``i`` of the schedule -> ``(tile index, pool block, n-tile, local expert, valid rows, pair kind)``. With
    ``MC`` pair ``i``'s words ``(4 t0 + kind, t1)``: cluster rank 0 takes tile ``t0``, rank 1 ``t1``; kind 1 a weight
    pair (two pool blocks on one weight tile), 2 a token pair (one pool block, two n-tiles), 0 a single, where rank
    1 takes a **padding** slot: tile ``t0``'s entry with valid rows -1 (the math passes its stages through, nothing
    is stored or published). Without ``MC`` kind 0."""
    if MC:
        words = _pairs(tiles, num_tiles) + 2 + 2 * i
        word = gl.load(words)
        rank = gl.program_id(0) % 2
        t = gl.where(rank == 1, gl.load(words + 1), word // 4)
        kind = word % 4
        b, nt, e, valid = _tile(tiles, t)
        valid = gl.where((rank == 1) & (kind == 0), -1, valid)
    else:
        t = i
        kind = 0
        b, nt, e, valid = _tile(tiles, t)
    return t, b, nt, e, valid, kind


@gluon.jit
def _load_stage(a_desc, am_desc, w_desc, wu_desc, sa_desc, a_row, kb, w_lo, w_hi, sa_at, bar, a_s, w_s, sa_s, half,
                kind, MC: gl.constexpr):
    """One ring stage's boxes: A ``[BM, 128]`` (pool rows ``a_row``.., K block ``kb``), W's two halves of 128 rows
    (box rows ``w_lo`` / ``w_hi``) into ``w_s`` [256, 128], the ``BM`` A scales at ``sa_at``. With ``MC`` (the PTX
    pass multicasts the loads through ``am_desc`` and ``w_desc`` to both CTAs, all others stay in this CTA): a
    weight pair (``kind`` 1) loads only W's half ``half`` (this CTA's cluster rank) through ``w_desc``, a token pair
    (2) only A's half of ``BM / 2`` rows through ``am_desc``, the rest through ``a_desc`` / ``wu_desc``."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    if MC:
        if kind == 2:
            if half == 0:
                tma.async_copy_global_to_shared(am_desc, [a_row, kb * BK], bar, a_s.slice(0, BM // 2))
            else:
                tma.async_copy_global_to_shared(am_desc, [a_row + BM // 2, kb * BK], bar, a_s.slice(BM // 2, BM // 2))
        else:
            tma.async_copy_global_to_shared(a_desc, [a_row, kb * BK], bar, a_s)
        if kind == 1:
            if half == 0:
                tma.async_copy_global_to_shared(w_desc, [w_lo, 0], bar, w_s.slice(0, HN))
            else:
                tma.async_copy_global_to_shared(w_desc, [w_hi, 0], bar, w_s.slice(HN, HN))
        else:
            tma.async_copy_global_to_shared(wu_desc, [w_lo, 0], bar, w_s.slice(0, HN))
            tma.async_copy_global_to_shared(wu_desc, [w_hi, 0], bar, w_s.slice(HN, HN))
    else:
        tma.async_copy_global_to_shared(a_desc, [a_row, kb * BK], bar, a_s)
        tma.async_copy_global_to_shared(w_desc, [w_lo, 0], bar, w_s.slice(0, HN))
        tma.async_copy_global_to_shared(w_desc, [w_hi, 0], bar, w_s.slice(HN, HN))
    tma.async_copy_global_to_shared(sa_desc, [sa_at], bar, sa_s)


@gluon.jit
def _load_partition(a1_desc, a2_desc, w1_desc, w2_desc, sa1_desc, sa2_desc, a1m_desc, a2m_desc, w1u_desc, w2u_desc,
                    a_bufs, w_bufs, sa_bufs, ready, empty, tiles, num_l1, num_tiles, l2_mask, arrival, progress,
                    state, timeout_ns, N1: gl.constexpr, H: gl.constexpr, I: gl.constexpr, SP: gl.constexpr,
                    STAGES: gl.constexpr, GROUP_SYNC: gl.constexpr = False, MC: gl.constexpr = False):
    """TMA producer (1 warp): per K block of each tile, A [128, 128] + W [256, 128] + sa [128] into the next ring
    stage (``ready[s]`` completes on the bytes); before an L2 tile's K block ``kb``, the wait for L1 tile ``kb``'s
    two bits of the block's arrival mask.

    The weights are blocked by 128 x 128 (``megamoe.quant_fp8.block_weights``): the descriptors see them as
    ``[El * N * K/128, 128]``, and W's two halves of 128 rows are two boxes of one 128 x 128 block each -- 16 KB in
    one run of memory, at box row ``(g * KB + kb) * 128`` for row block ``g`` (row-major, a [256, 128] box was 256
    runs of 128 bytes ``K`` bytes apart; measured in ``megamoe.quant_fp8``'s docstring).

    ``MC`` (the 2-CTA multicast, :mod:`megamoe.multicast`): of a weight pair this CTA loads only W's half of its
    cluster rank, of a token pair only A's half, multicast into the same stage of both CTAs (the PTX pass), and
    still expects the whole stage's bytes (the peer's half lands here too, :func:`_load_stage`); ``empty[s]``
    counts both CTAs' releases, so a stage is refilled only when both are done with it. A padding slot (valid rows
    -1) waits for nothing. After the last stage the loader waits until both CTAs released every stage: the peer's
    arrives on this CTA's barriers are then all done, and this CTA may exit."""
    nbytes: gl.constexpr = (a1_desc.block_type.nbytes + 2 * w1_desc.block_type.nbytes + sa1_desc.block_type.nbytes)
    BM: gl.constexpr = a1_desc.block_type.shape[0]
    half = gl.program_id(0) % 2
    it = 0
    first, stop, step = _schedule(tiles, num_tiles, MC)
    for i in range(first, stop, step):
        # the rank's heartbeat: a peer waiting in barrier 2 for this rank sees it move (it names only ranks whose
        # counter stood still for barrier_timeout_s), as the one-launch kernel's task loop does per task
        gl.atomic_add(progress, 1, sem="relaxed", scope="gpu")
        if GROUP_SYNC:
            if MC:
                _sync_group(_pairs(tiles, num_tiles) + 2 + 2 * num_tiles, num_tiles, i, step, 2, state, timeout_ns)
            else:
                _group_sync(tiles, i, num_tiles, state, timeout_ns)
        t, b, nt, e, valid, kind = _slot(tiles, num_tiles, i, MC)
        is_l2 = t >= num_l1
        if is_l2:
            KB = I // BK
            w_row = (e * H + nt * TILE_N)
            if valid < 0:  # a padding slot reads nothing of the block's L1 output: no wait
                mask_seen = gl.to_tensor(-1).to(gl.int64)
            else:
                mask_seen = gl.atomic_or(l2_mask + b, 0, sem="acquire", scope="gpu")
        else:
            KB = H // BK
            w_row = (e * 2 * I + nt * TILE_N)
            mask_seen = gl.to_tensor(0).to(gl.int64)
            # the block's rows have landed in the L1 pool (every CTA's pull partition, :func:`_pull_partition`)
            landed = gl.atomic_add(arrival + b, 0, sem="acquire", scope="gpu")
            if landed < valid:
                t0 = _globaltimer_ns()
                alive = True
                while (landed < valid) & alive:
                    landed = gl.atomic_add(arrival + b, 0, sem="acquire", scope="gpu")
                    alive = (_globaltimer_ns() - t0) <= timeout_ns
                if landed < valid:
                    gl.atomic_cas(state + 1, 0, TAG_INTERNAL_WAIT)
            _fence_proxy_async_global()
        for kb in range(KB):
            if is_l2:  # the L1 tile kb of this block (both warpgroups) has landed its 128 columns in the L2 pool
                need = gl.to_tensor(3).to(gl.int64) << (2 * kb)
                if (mask_seen & need) != need:
                    t0 = _globaltimer_ns()
                    alive = True
                    while ((mask_seen & need) != need) & alive:
                        mask_seen = gl.atomic_or(l2_mask + b, 0, sem="acquire", scope="gpu")
                        alive = (_globaltimer_ns() - t0) <= timeout_ns
                    if (mask_seen & need) != need:
                        gl.atomic_cas(state + 1, 0, TAG_INTERNAL_WAIT)
                        mask_seen = mask_seen | need  # carry on: the call is failed, nothing may hang
                _fence_proxy_async_global()
            s = it % STAGES
            ph = (it // STAGES) & 1
            # a fresh mbarrier counts as having completed the phase before phase 0: the first STAGES waits pass
            mbarrier.wait(empty.index(s), ph ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, nbytes)
            w_lo = ((w_row // HN) * KB + kb) * HN  # box row of the left half's 128 x 128 block; the right half's
            w_hi = w_lo + KB * HN                 # is the next row block's
            if is_l2:
                _load_stage(a2_desc, a2m_desc, w2_desc, w2u_desc, sa2_desc, b * BM, kb, w_lo, w_hi, kb * SP + b * BM,
                            bar, a_bufs.index(s), w_bufs.index(s), sa_bufs.index(s), half, kind, MC)
            else:
                _load_stage(a1_desc, a1m_desc, w1_desc, w1u_desc, sa1_desc, b * BM, kb, w_lo, w_hi, kb * SP + b * BM,
                            bar, a_bufs.index(s), w_bufs.index(s), sa_bufs.index(s), half, kind, MC)
            it += 1
    if MC:  # drain: both CTAs released every stage (module docstring of megamoe.multicast: nothing remote after exit)
        for j in range(it, it + STAGES):
            mbarrier.wait(empty.index(j % STAGES), ((j // STAGES) & 1) ^ 1)


@gluon.jit
def _pull_partition(buf, buffer_ptrs, me, tiles, arrival, num_blocks, OFF_META: gl.constexpr, OFF_X: gl.constexpr,
                    OFF_X_SF: gl.constexpr, OFF_L1: gl.constexpr, OFF_L1_SF: gl.constexpr, H: gl.constexpr,
                    SP: gl.constexpr, PULL_WARPS: gl.constexpr, BM: gl.constexpr, PULL_CHUNK: gl.constexpr):
    """The pull (``PULL_WARPS`` warps, one pool row per warp and step). Pool rows in order, **interleaved over the
    CTAs**: at step ``s`` CTA ``i`` takes rows ``[(i + s G) ROWS, + ROWS)``, so all G CTAs land the first blocks
    (which the first L1 tiles read) together: a block of 128 rows is in after about one step. (The first version
    had CTA ``i`` copy whole blocks ``i, i + G, ...`` with one 16-byte load in flight a thread: by estimate ~450 us
    before a block of 128 rows was in, and the call measured 26 / 11 / 3 % slower than with the pull in the front
    launch at T = 512 / 2048 / 8192.) Each row: its H bytes from the source rank's ``x`` (``sym_map`` of
    ``token_src_metadata``, written by the front launch) in chunks of ``PULL_CHUNK`` bytes a warp
    (``PULL_CHUNK / 512`` 16-byte loads in flight per thread), and its H/128 float32 scale words (K-major in
    ``x_sf``) into the pool's MN-major scales, bit for bit. Then ``fence.proxy.async`` (the L1 loader reads the rows
    by TMA), a partition barrier, and +1 per landed row on its block's ``l1_arrival_count`` (release); the L1 loader
    waits for the count to reach the block's valid rows. Padding rows (past a block's valid count) are skipped."""
    ROWS: gl.constexpr = PULL_WARPS  # one row per warp and step
    CH: gl.constexpr = PULL_CHUNK
    # 16 bytes a thread, a warp's 32 threads on 512 contiguous bytes, the layout repeated CH / 512 times: each load
    # or store instruction covers whole 32-byte sectors. (With CH / 32 contiguous bytes a thread, each 16-byte
    # instruction of a warp touched 32 sectors half each: Nsight Compute counted ~450 excess sectors a pulled row,
    # 26 % of the phase's global sectors at T = 8192, ``results/probes/ncu_h200/fp8_8192_3df89c0.txt``.)
    L: gl.constexpr = gl.BlockedLayout([1, 16], [1, 32], [PULL_WARPS, 1], [1, 0])
    KW: gl.constexpr = H // 128
    KW_PAD: gl.constexpr = 64 if KW <= 64 else 128
    LS: gl.constexpr = gl.BlockedLayout([1, KW_PAD // 32], [1, 32], [PULL_WARPS, 1], [1, 0])
    blk = gl.load(tiles + 3)
    base_me = gl.load(buffer_ptrs + me)
    meta = (buf + OFF_META).to(gl.pointer_type(gl.int32))
    l1 = buf + OFF_L1
    l1_sf = (buf + OFF_L1_SF).to(gl.pointer_type(gl.int32))
    x_sf = (buf + OFF_X_SF).to(gl.pointer_type(gl.int32))
    c = gl.arange(0, CH, layout=gl.SliceLayout(0, L))
    kw = gl.arange(0, KW_PAD, layout=gl.SliceLayout(0, LS))
    num_rows = num_blocks * BM
    for g in range(gl.program_id(0), gl.cdiv(num_rows, ROWS), gl.num_programs(0)):
        row = g * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, L))
        b = row // BM
        ok = (row < num_rows) & (row % BM < gl.load(tiles + blk + b, mask=row < num_rows, other=0))
        if gl.sum(ok.to(gl.int32), axis=0) > 0:
            src = gl.load(meta + row * 3, mask=ok, other=0)
            token = gl.load(meta + row * 3 + 1, mask=ok, other=0)
            # sym_map: the same offset in the source's buffer (bases 16-byte aligned, so the delta is too)
            delta = (gl.load(buffer_ptrs + src, mask=ok, other=0) - base_me) // 16 * 16
            x_row = gl.expand_dims(delta + OFF_X + token.to(gl.int64) * H, 1)
            dst_row = gl.expand_dims(row.to(gl.int64) * H, 1)
            ok2 = gl.expand_dims(ok, 1)
            for h0 in range(0, H, CH):  # not unrolled: one chunk (PULL_CHUNK / 512 loads a thread) in flight
                m = ok2 & gl.expand_dims(h0 + c < H, 0)
                v = gl.load(buf + x_row + h0 + gl.expand_dims(c, 0), mask=m)
                gl.store(l1 + dst_row + h0 + gl.expand_dims(c, 0), v, mask=m)
            rows_s = g * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, LS))
            ok_s = gl.convert_layout(ok, gl.SliceLayout(1, LS))
            oks = gl.expand_dims(ok_s, 1) & gl.expand_dims(kw < KW, 0)
            src_s = gl.load(meta + rows_s * 3, mask=ok_s, other=0)
            tok_s = gl.load(meta + rows_s * 3 + 1, mask=ok_s, other=0)
            delta_s = (gl.load(buffer_ptrs + src_s, mask=ok_s, other=0) - base_me) // 4
            w = gl.load(x_sf + gl.expand_dims(delta_s + tok_s.to(gl.int64) * KW, 1) + gl.expand_dims(kw, 0), mask=oks)
            gl.store(l1_sf + gl.expand_dims(kw.to(gl.int64), 0) * SP + gl.expand_dims(rows_s, 1), w, mask=oks)
            _fence_proxy_async_global()  # the L1 loader reads these rows and scales by TMA
            gl.thread_barrier()  # every warp of the partition has stored (and fenced) before the counts move
            gl.atomic_add(arrival + b, ok.to(gl.int32), mask=ok, sem="release", scope="gpu")


@gluon.jit
def _pull_copy_partition(buf, buffer_ptrs, me, tiles, arrival, num_blocks, num_l1, num_tiles, staged, freed,
                         OFF_META: gl.constexpr, OFF_X: gl.constexpr, OFF_X_SF: gl.constexpr, OFF_L1: gl.constexpr,
                         OFF_L1_SF: gl.constexpr, OFF_COMBINE: gl.constexpr, T: gl.constexpr, H: gl.constexpr,
                         SP: gl.constexpr, PULL_WARPS: gl.constexpr, BM: gl.constexpr, PULL_CHUNK: gl.constexpr,
                         MC: gl.constexpr, COPY: gl.constexpr):
    """The pull warps (pool block 128): the pull (:func:`_pull_partition`), then with ``COPY`` (``COPIER``) the L2
    copies of both math warpgroups (:func:`_copy_rows`; one (row, half) of a warpgroup's 64 x 256 a thread: 4
    warps)."""
    _pull_partition(buf, buffer_ptrs, me, tiles, arrival, num_blocks, OFF_META, OFF_X, OFF_X_SF, OFF_L1, OFF_L1_SF,
                    H, SP, PULL_WARPS, BM, PULL_CHUNK)
    if COPY:
        gl.static_assert(PULL_WARPS == 4, "COPIER: BULK_ROWS spans 4 warps")
        _copy_rows(buf, buffer_ptrs, me, tiles, num_l1, num_tiles, staged, freed, OFF_META, OFF_COMBINE, T, H, MC)


@gluon.jit
def _promote(acc, dot, sa, s_gate, s_up, gate_col):
    """acc [64, 128] += dot * (sa[m] * sw[n]), the scale product first; sw is ``s_gate`` on the columns where
    ``gate_col`` (``[1, 128]``) is true, ``s_up`` elsewhere (L2: both the same)."""
    pg = gl.expand_dims(sa * s_gate, 1)
    pu = gl.expand_dims(sa * s_up, 1)
    return acc + dot * gl.where(gate_col, pg, pu)


@gluon.jit
def _retire(dot, empty, s, acc, sa, s_gate, s_up, gate_col, ARRIVE: gl.constexpr = 1):
    """The end of a K block's last wgmma ``dot`` (async, ``[64, 128]`` float32 in the wgmma layout): wait for it,
    release ring stage ``s`` (an arrive of ``ARRIVE`` on ``empty[s]``: 2 is the multicast's marker, one arrive here
    and one on the peer CTA's barrier, :mod:`megamoe.multicast`), promote it into ``acc`` (:func:`_promote`).
    Returns the new ``acc`` and the dot's register tile (the next block's ``use_acc=False`` target)."""
    d = warpgroup_mma_wait(num_outstanding=0, deps=(dot, ))
    mbarrier.arrive(empty.index(s), count=ARRIVE)
    return _promote(acc, d, sa, s_gate, s_up, gate_col), d


@gluon.jit
def _split_gate_up(acc):
    """[64, 128] columns interleaved by 8 (gate 0..7, up 8..15, ...) -> gate, up [64, 64] (a register reshape)."""
    g, u = gl.split(gl.permute(gl.reshape(acc, [WM, 8, 2, 8]), (0, 1, 3, 2)))
    return gl.reshape(g, [WM, 64]), gl.reshape(u, [WM, 64])


@gluon.jit
def _l1_half(acc, clamp, HAS_CLAMP: gl.constexpr):
    """SwiGLU of one half (64 intermediate columns): float32 ``[64, 64]``."""
    g, u = _split_gate_up(acc)
    gate = _round_bf16(g)
    up = _round_bf16(u)
    if HAS_CLAMP:
        gate = gl.minimum(gate, clamp)
        up = gl.minimum(gl.maximum(up, -clamp), clamp)
    return _silu_mul(gate, up)


@gluon.jit
def _l1_rows(L: gl.constexpr, buf, b, valid, wg: gl.constexpr, BM: gl.constexpr, OFF_L1_W: gl.constexpr):
    """Warpgroup ``wg``'s 64 rows of the L1 tile of pool block ``b`` (``BM`` rows a block): the pool rows
    ``[b BM + 64 wg, +64)`` as int32, the mask of the real ones (the first ``valid`` of the block) and their float32
    top-k weights (``buf[OFF_L1_W:]`` per pool row, 0 on padding rows), each ``[64]`` in ``SliceLayout(1, L)``,
    ``L`` the layout of the epilogue's ``[64, 64]`` activations."""
    r = gl.arange(0, WM, layout=gl.SliceLayout(1, L))
    row_ok = r < valid - wg * WM
    row = b * BM + wg * WM + r
    topk_w = gl.load((buf + OFF_L1_W).to(gl.pointer_type(gl.float32)) + row, mask=row_ok, other=0.0)
    return row, row_ok, topk_w


@gluon.jit
def _l1_publish(l2_mask, b, nt, wg: gl.constexpr, BITS: gl.constexpr, ACQ: gl.constexpr = False):
    """After a warpgroup's L1 epilogue stored its L2 pool bytes and scales: ``fence.proxy.async`` (the L2 tiles read
    them by TMA), a warpgroup barrier (every thread has stored and fenced), then ``BITS << (2 nt + wg)`` OR-ed into
    the block's int64 arrival mask ``l2_mask[b]`` (release, gpu): ``BITS`` 1 sets the warpgroup's bit, 3 both bits
    of L1 tile ``nt`` (``wg`` 0). Returns the mask before the OR; ``ACQ``: acquire-release, so that the warpgroup
    that completes a set of bits also sees the stores the other bits released (``gemm_fp4_ws``'s fold once)."""
    _fence_proxy_async_global()
    gl.thread_barrier()
    sem: gl.constexpr = "acq_rel" if ACQ else "release"
    return gl.atomic_or(l2_mask + b, gl.to_tensor(BITS).to(gl.int64) << (2 * nt + wg), sem=sem, scope="gpu")


@gluon.jit
def _l1_epilogue(acc_lo, acc_hi, buf, clamp, b, nt, valid, l2_mask, wg: gl.constexpr, OFF_L1_W: gl.constexpr,
                 OFF_L2: gl.constexpr, OFF_L2_SF: gl.constexpr, I: gl.constexpr, SP: gl.constexpr,
                 HAS_CLAMP: gl.constexpr, BM: gl.constexpr, NWG: gl.constexpr, UE8M0: gl.constexpr,
                 COALESCED: gl.constexpr = True, ACQ: gl.constexpr = False):
    """Warpgroup ``wg``'s 64 rows of an L1 tile, both halves: ``acc_lo`` / ``acc_hi`` float32 ``[64, 128]`` in the
    wgmma layout (gate / up interleaved by 8; for ``gemm_fp4_ws`` already scaled by the weight rows' and tokens'
    powers of two). bf16 round, clamp (``HAS_CLAMP``), SwiGLU (:func:`_l1_half`), top-k weight (:func:`_l1_rows`),
    then the requant of the tile's 128 intermediate columns per row (``amax = max(|act|, 1e-4)``) into the L2 pool
    ``[P, I]`` e4m3: the bytes at pool row ``b BM + 64 wg + r``, columns ``[128 nt, +128)``, and one scale per row
    at ``L2_SF[nt * SP + row]`` (MN-major ``[I/128][SP]``):

    * ``UE8M0`` False (this module's FP8 format): float32 ``amax / 448``, the bytes ``act / scale``;
    * ``UE8M0`` True (``gemm_fp4_ws``, ``_l1_tile_hopper``'s): ``2^ceil(log2(amax / 448))``, the bytes ``act`` times
      its exact inverse, stored as an int32 word of four equal UE8M0 bytes.

    ``COALESCED``: the bytes stored from :data:`STORE_E4M3` (16 a thread) instead of the wgmma layout.

    Then the arrival bits (:func:`_l1_publish`): the warpgroup's, or with ``NWG`` = 1 (``gemm_fp4_ws`` at BM 64: the
    one warpgroup holds the tile's rows) both bits of the tile, so the mask and its waits are those of BM 128.
    Returns the mask before this warpgroup's bits (acquire-release with ``ACQ``)."""
    act_lo = _l1_half(acc_lo, clamp, HAS_CLAMP)
    act_hi = _l1_half(acc_hi, clamp, HAS_CLAMP)
    L: gl.constexpr = act_lo.type.layout
    row, row_ok, topk_w = _l1_rows(L, buf, b, valid, wg, BM, OFF_L1_W)
    topk_w = gl.expand_dims(topk_w, 1)
    act_lo = act_lo * topk_w
    act_hi = act_hi * topk_w
    amax = gl.maximum(gl.maximum(gl.max(gl.abs(act_lo), axis=1), gl.max(gl.abs(act_hi), axis=1)), AMAX_FLOOR)
    if UE8M0:
        _, sbyte = ceil_ue8m0(amax / FP8_MAX)
        inv = gl.expand_dims(((254 - sbyte) << 23).to(gl.float32, bitcast=True), 1)  # exact 1 / scale
    else:
        scale = amax / FP8_MAX
        inv = gl.expand_dims(1.0 / scale, 1)
    q_lo = _to_e4m3(act_lo * inv)
    q_hi = _to_e4m3(act_hi * inv)
    if COALESCED:
        q_lo = gl.convert_layout(q_lo, STORE_E4M3)
        q_hi = gl.convert_layout(q_hi, STORE_E4M3)
        r = gl.arange(0, WM, layout=gl.SliceLayout(1, STORE_E4M3))
        c = gl.arange(0, 64, layout=gl.SliceLayout(0, STORE_E4M3))
        ok = gl.expand_dims(r < valid - wg * WM, 1)
        row_s = b * BM + wg * WM + r
    else:
        c = gl.arange(0, 64, layout=gl.SliceLayout(0, L))
        ok = gl.expand_dims(row_ok, 1)
        row_s = row
    out = (buf + OFF_L2).to(gl.pointer_type(gl.uint8)) + gl.expand_dims(row_s.to(gl.int64) * I + nt * 128, 1) \
        + gl.expand_dims(c, 0)
    gl.store(out, q_lo, mask=ok)
    gl.store(out + 64, q_hi, mask=ok)
    if UE8M0:
        gl.store((buf + OFF_L2_SF).to(gl.pointer_type(gl.int32)) + nt * SP + row, sbyte * 0x01010101, mask=row_ok)
    else:
        gl.store((buf + OFF_L2_SF).to(gl.pointer_type(gl.float32)) + nt * SP + row, scale, mask=row_ok)
    if NWG == 1:
        old = _l1_publish(l2_mask, b, nt, wg, 3, ACQ)
    else:
        old = _l1_publish(l2_mask, b, nt, wg, 1, ACQ)
    return old


@gluon.jit
def _l2_rows(buf, buffer_ptrs, me, row0, n0, valid, OFF_META: gl.constexpr, T: gl.constexpr, H: gl.constexpr,
             mma: gl.constexpr, COALESCED: gl.constexpr = True):
    """Where a warpgroup's 64 pool rows ``[row0, row0 + 64)`` of an L2 tile go (the first ``valid`` real): per row
    the int16 offset of hidden column ``n0`` of its ``combine[slot][token]`` (:func:`_combine_rows`) and whether it
    is real, both in the row slice of the store layout (:data:`STORE_BF16` where ``COALESCED``, else the wgmma
    layout ``mma``). Made once a tile and used by each of its 128-column halves (:func:`_l2_store`): one round of
    metadata loads, not two."""
    if COALESCED:
        S: gl.constexpr = STORE_BF16
    else:
        S: gl.constexpr = mma
    r = gl.arange(0, WM, layout=gl.SliceLayout(1, S))
    ok = r < valid
    return _combine_rows(buf, buffer_ptrs, me, row0 + r, ok, n0, OFF_META, T, H), ok


@gluon.jit
def _l2_values(acc, COALESCED: gl.constexpr = True):
    """A warpgroup's 64 rows x 128 hidden columns of an L2 tile (``acc`` float32 in the wgmma layout) as bf16 bits
    (int16), in :data:`STORE_BF16` where ``COALESCED`` (16 bytes a thread), else in the wgmma layout."""
    v = _to_bf16_bits(acc)
    if COALESCED:
        v = gl.convert_layout(v, STORE_BF16)
    return v


@gluon.jit
def _l2_store(v, buf, dst_row, ok, OFF_COMBINE: gl.constexpr):
    """Store ``v`` (:func:`_l2_values`: 64 rows x 128 columns of bf16 bits) into the source ranks' ``combine`` rows
    at ``dst_row`` (:func:`_l2_rows`, plus the half's column offset), the real rows ``ok``."""
    c = gl.arange(0, HN, layout=gl.SliceLayout(0, v.type.layout))
    dst = (buf + OFF_COMBINE).to(gl.pointer_type(gl.int16)) + gl.expand_dims(dst_row, 1) + gl.expand_dims(c, 0)
    gl.store(dst, v, mask=gl.expand_dims(ok, 1))


@gluon.jit
def _l2_epilogue(acc_lo, acc_hi, buf, buffer_ptrs, me, row0, n0, valid, OFF_META: gl.constexpr,
                 OFF_COMBINE: gl.constexpr, T: gl.constexpr, H: gl.constexpr, mma: gl.constexpr,
                 COALESCED: gl.constexpr = True):
    """A warpgroup's 64 pool rows ``[row0, row0 + 64)`` (the first ``valid`` real) x 256 hidden columns ``[n0, n0 +
    256)`` of an L2 tile (``acc_lo`` / ``acc_hi``: the two 128-column halves, float32 in the wgmma layout ``mma``)
    as bf16 into ``combine[slot][token]`` of each row's source rank: both halves converted first (their float32
    registers free), then the rows' destinations made once (:func:`_l2_rows`) and both stored (:func:`_l2_store`)."""
    v_lo = _l2_values(acc_lo, COALESCED)
    v_hi = _l2_values(acc_hi, COALESCED)
    dst_row, ok = _l2_rows(buf, buffer_ptrs, me, row0, n0, valid, OFF_META, T, H, mma, COALESCED)
    _l2_store(v_lo, buf, dst_row, ok, OFF_COMBINE)
    _l2_store(v_hi, buf, dst_row + HN, ok, OFF_COMBINE)


@gluon.jit
def _bulk_wait(READ: gl.constexpr = True, PENDING: gl.constexpr = 0):
    """Wait until all but this thread's ``PENDING`` (0 or 1; 0 only without ``READ``) most recent bulk-async groups
    have read their shared source (``READ``), or all have completed."""
    gl.static_assert((PENDING == 0) | (PENDING == 1), "PENDING: 0 or 1")
    if READ:
        if PENDING == 1:
            gl.inline_asm_elementwise("cp.async.bulk.wait_group.read 1; mov.u32 $0, 0;", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)
        else:
            gl.inline_asm_elementwise("cp.async.bulk.wait_group.read 0; mov.u32 $0, 0;", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)
    else:
        gl.inline_asm_elementwise("cp.async.bulk.wait_group 0; mov.u32 $0, 0;", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)


@gluon.jit
def _bulk_rows(buf, buffer_ptrs, me, row0, n0, valid, wg: gl.constexpr, OFF_META: gl.constexpr,
               OFF_COMBINE: gl.constexpr, T: gl.constexpr, H: gl.constexpr):
    """The copies of warpgroup ``wg``'s staged L2 rows (pool rows ``row0 + [0, 64)``, hidden columns ``n0 +
    [0, 256)``), one (row, half) a thread of :data:`BULK_ROWS`: ``dst`` the global address (int64) of the half-row in
    ``combine[slot][token]`` of the row's source rank (:func:`_combine_rows`; its loads are issued here and waited
    for where ``dst`` is first used), ``src`` its byte offset in ``l2_stage``, ``go`` 1 for rows below
    ``valid``."""
    r = gl.arange(0, WM, layout=gl.SliceLayout(1, BULK_ROWS))
    h = gl.arange(0, 2, layout=gl.SliceLayout(0, BULK_ROWS))
    ok = r < valid
    dst_row = _combine_rows(buf, buffer_ptrs, me, row0 + r, ok, n0, OFF_META, T, H)
    dst = ((buf + OFF_COMBINE).to(gl.pointer_type(gl.int16)) + gl.expand_dims(dst_row, 1)
           + gl.expand_dims(h * HN, 0)).to(gl.int64)
    src = gl.expand_dims((wg * WM + r) * (STAGE_PITCH * 2), 1) + gl.expand_dims(h * (HN * 2), 0)
    go = gl.expand_dims(ok.to(gl.int32), 1) + gl.expand_dims(h * 0, 0)
    return dst, src, go


@gluon.jit
def _l2_epilogue_staged(acc_lo, acc_hi, l2_stage, staged, freed, n, wg: gl.constexpr):
    """``COPIER``'s L2 epilogue (math side): the warpgroup's bf16 rows into its staging rows (``l2_stage`` rows
    ``[64 wg, +64)``, straight from the wgmma layout, as :func:`_l2_epilogue_bulk`) once the copier has read them
    for its previous L2 tile (``freed[wg]``, this warpgroup's ``n``-th staged tile), then ``fence.proxy.async``,
    barrier and one arrive on ``staged[wg]``: the copier (:func:`_copy_rows`) computes the destinations and
    issues the copies, and the warpgroup goes straight back to its MMAs."""
    v_lo = _to_bf16_bits(acc_lo)
    v_hi = _to_bf16_bits(acc_hi)
    mbarrier.wait(freed.index(wg), (n & 1) ^ 1)  # (a fresh barrier passes parity 1: the first tile does not wait)
    st = l2_stage.slice(wg * WM, WM, dim=0)
    st.slice(0, HN, dim=1).store(v_lo)
    st.slice(HN, HN, dim=1).store(v_hi)
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(staged.index(wg), count=1)


@gluon.jit
def _copy_rows(buf, buffer_ptrs, me, tiles, num_l1, num_tiles, staged, freed, OFF_META: gl.constexpr,
               OFF_COMBINE: gl.constexpr, T: gl.constexpr, H: gl.constexpr, MC: gl.constexpr):
    """``COPIER`` (4 warps, one (row, half) a thread): for every L2 slot of this program's schedule (the math
    partitions' own, :func:`_schedule` / :func:`_slot`; MC's padding slots have no epilogue) and each math
    warpgroup: the rows' destinations (their loads in flight while it waits), the wait for the warpgroup's staged
    rows (``staged[wg]``), one 256-byte ``cp.async.bulk`` a (row, half) (:func:`_bulk_rows`) as one bulk group of
    each thread; once a warpgroup's copies have read its staging rows (``wait_group.read``, then a partition
    barrier) one arrive on ``freed[wg]``. The copies complete before the partition exits."""
    n = 0
    first, stop, step = _schedule(tiles, num_tiles, MC)
    for i in range(first, stop, step):
        t, b, nt, e, valid, kind = _slot(tiles, num_tiles, i, MC)
        if (t >= num_l1) & (valid >= 0):
            for wg in gl.static_range(2):
                dst, src, go = _bulk_rows(buf, buffer_ptrs, me, b * TILE_M + wg * WM, nt * TILE_N, valid - wg * WM,
                                          wg, OFF_META, OFF_COMBINE, T, H)
                mbarrier.wait(staged.index(wg), n & 1)
                gl.inline_asm_elementwise(BULK_STORE_ASM, "=r,l,r,r", [dst, src, go], dtype=gl.int32,
                                          is_pure=False, pack=1)
            _bulk_wait(True, 1)  # warpgroup 0's copies (the older bulk group of each thread) have read its rows
            gl.thread_barrier()
            mbarrier.arrive(freed.index(0), count=1)
            _bulk_wait(True)
            gl.thread_barrier()
            mbarrier.arrive(freed.index(1), count=1)
            n += 1
    _bulk_wait(False)


@gluon.jit
def _l2_epilogue_bulk(acc_lo, acc_hi, l2_stage, buf, buffer_ptrs, me, row0, n0, valid, wg: gl.constexpr,
                      OFF_META: gl.constexpr, OFF_COMBINE: gl.constexpr, T: gl.constexpr, H: gl.constexpr):
    """:func:`_l2_epilogue` through shared memory (``BULK``): the same bf16 rows written by the copy engine.

    The rows' destinations first (:func:`_combine_rows`, one (row, half) a thread of :data:`BULK_ROWS`, their loads
    in flight across what follows); then wait until this warpgroup's copies of its previous L2 tile have read
    its staging rows (``l2_stage`` rows ``[64 wg, +64)``, :data:`STAGE_LAYOUT`), barrier, store both halves' bf16
    bits into them straight from the wgmma layout (no layout change), ``fence.proxy.async`` and barrier; then each
    thread issues one 256-byte ``cp.async.bulk`` of its (row, half) to the row's ``combine[slot][token]`` in the
    source rank's buffer, rows past ``valid`` skipped. The warpgroup goes back to its MMAs while the copies run."""
    v_lo = _to_bf16_bits(acc_lo)
    v_hi = _to_bf16_bits(acc_hi)
    dst, src, go = _bulk_rows(buf, buffer_ptrs, me, row0, n0, valid, wg, OFF_META, OFF_COMBINE, T, H)
    _bulk_wait(True)
    gl.thread_barrier()
    st = l2_stage.slice(wg * WM, WM, dim=0)
    st.slice(0, HN, dim=1).store(v_lo)
    st.slice(HN, HN, dim=1).store(v_hi)
    fence_async_shared()
    gl.thread_barrier()
    gl.inline_asm_elementwise(BULK_STORE_ASM, "=r,l,r,r", [dst, src, go], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _combine_rows(buf, buffer_ptrs, me, pool_rows, ok, n0, OFF_META: gl.constexpr, T: gl.constexpr,
                  H: gl.constexpr):
    """Where pool rows' L2 outputs go: per row (int32 ``pool_rows``, ``ok`` the real ones) the int16 offset, from
    this rank's combine buffer, of column ``n0`` of ``combine[slot][token]`` in the row's **source** rank's buffer
    (``token_src_metadata``: source rank, token, top-k slot). ``sym_map``: the same byte offset in the source rank's
    buffer; bases are 16-byte aligned, so the delta in int16s is a multiple of 8, written so the compiler sees it
    (16-byte stores). int64, the layout of ``pool_rows``."""
    meta = (buf + OFF_META).to(gl.pointer_type(gl.int32)) + pool_rows * 3
    src = gl.load(meta, mask=ok, other=0)
    token = gl.load(meta + 1, mask=ok, other=0)
    slot = gl.load(meta + 2, mask=ok, other=0)
    delta = (gl.load(buffer_ptrs + src, mask=ok, other=0) - gl.load(buffer_ptrs + me)) // 16 * 8
    return (slot * T + token).to(gl.int64) * H + n0 + delta


@gluon.jit
def _l1_epilogue_m64(acc, buf, clamp, b, nt, valid, l2_mask, xch, xbar, k1, wg: gl.constexpr,
                     OFF_L1_W: gl.constexpr, OFF_L2: gl.constexpr, OFF_L2_SF: gl.constexpr, I: gl.constexpr,
                     SP: gl.constexpr, HAS_CLAMP: gl.constexpr):
    """BM = 64: this warpgroup's 64 intermediate columns ``[128 nt + 64 wg, +64)`` of the tile's 64 rows. The
    requant's amax runs over the tile's 128 columns, half of them in the other warpgroup: each writes its row maxima
    to shared memory (``xch``, two slots by L1-tile parity ``k1``), arrives on ``xbar[slot]`` (count 2) and waits for
    the other; warpgroup 0 stores the scales."""
    act = _l1_half(acc, clamp, HAS_CLAMP)
    L: gl.constexpr = act.type.layout
    row, row_ok, topk_w = _l1_rows(L, buf, b, valid, 0, WM, OFF_L1_W)  # both warpgroups: the block's 64 rows
    act = act * gl.expand_dims(topk_w, 1)
    rmax = gl.max(gl.abs(act), axis=1)
    slot = k1 % 2
    xch.index(slot * 2 + wg).store(rmax)
    gl.thread_barrier()  # the warpgroup's maxima are in shared memory before it arrives
    mbarrier.arrive(xbar.index(slot), count=1)
    mbarrier.wait(xbar.index(slot), (k1 // 2) & 1)
    other = xch.index(slot * 2 + 1 - wg).load(gl.SliceLayout(1, L))
    scale = gl.maximum(gl.maximum(rmax, other), AMAX_FLOOR) / FP8_MAX
    inv = gl.expand_dims(1.0 / scale, 1)
    q = gl.convert_layout(_to_e4m3(act * inv), STORE_E4M3)
    r = gl.arange(0, WM, layout=gl.SliceLayout(1, STORE_E4M3))
    c = gl.arange(0, 64, layout=gl.SliceLayout(0, STORE_E4M3))
    out = (buf + OFF_L2).to(gl.pointer_type(gl.uint8)) + gl.expand_dims((b * WM + r).to(gl.int64) * I + nt * 128
                                                                         + wg * 64, 1) + gl.expand_dims(c, 0)
    gl.store(out, q, mask=gl.expand_dims(r < valid, 1))
    if wg == 0:
        gl.store((buf + OFF_L2_SF).to(gl.pointer_type(gl.float32)) + nt * SP + row, scale, mask=row_ok)
    _l1_publish(l2_mask, b, nt, wg, 1)


@gluon.jit
def _math_partition_m64(buf, w1_sf, w2_sf, buffer_ptrs, me, clamp, a_bufs, w_bufs, sa_bufs, ready, empty, xch, xbar,
                        tiles, num_l1, num_tiles, l2_mask, wg: gl.constexpr,
                        OFF_L1_W: gl.constexpr, OFF_L2: gl.constexpr, OFF_L2_SF: gl.constexpr,
                        OFF_META: gl.constexpr, OFF_COMBINE: gl.constexpr, T: gl.constexpr, H: gl.constexpr,
                        I: gl.constexpr, SP: gl.constexpr, STAGES: gl.constexpr, HAS_CLAMP: gl.constexpr):
    """BM = 64 (few tokens per expert, where a 128-row tile would be half padding): both warpgroups read the tile's
    64 pool rows, warpgroup ``wg`` its half of the 256 weight rows -- L1 intermediate columns ``[128 nt + 64 wg,
    +64)``, L2 hidden columns ``[256 nt + 128 wg, +128)``: one [64, 128] dot tile and accumulator each."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 32])
    rows_l: gl.constexpr = gl.SliceLayout(1, mma)
    cols = gl.arange(0, HN, layout=gl.SliceLayout(0, mma))
    gate_col = gl.expand_dims((cols // 8) % 2 == 0, 0)
    spare = gl.zeros([WM, HN], gl.float32, mma)
    it = 0
    k1 = 0  # L1 tiles done (the row-max exchange's slot and phase)
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        b, nt, e, valid = _tile(tiles, t)
        is_l2 = t >= num_l1
        if is_l2:
            KB = I // BK
            sw_a = w2_sf + (e * (H // 128) + 2 * nt + wg) * KB  # this warpgroup's block row: one scale a K block
            sw_b = sw_a
        else:
            KB = H // BK
            sw_a = w1_sf + (e * (2 * I // 128) + nt) * KB  # gate block row nt, up block row I/128 + nt
            sw_b = sw_a + (I // 128) * KB
        acc = gl.zeros([WM, HN], gl.float32, mma)
        for kb in range(KB):
            s = it % STAGES
            ph = (it // STAGES) & 1
            x = gl.load(sw_a + kb)
            y = gl.load(sw_b + kb)
            mbarrier.wait(ready.index(s), ph)
            dot = warpgroup_mma(a_bufs.index(s), w_bufs.index(s).slice(wg * HN, HN).permute((1, 0)), spare,
                                use_acc=False, is_async=True)
            sa = sa_bufs.index(s).load(rows_l)
            acc, spare = _retire(dot, empty, s, acc, sa, x, y, gate_col)
            it += 1
        if is_l2:
            v = _l2_values(acc)
            dst_row, ok = _l2_rows(buf, buffer_ptrs, me, b * WM, nt * TILE_N + wg * HN, valid, OFF_META, T, H, mma)
            _l2_store(v, buf, dst_row, ok, OFF_COMBINE)
        else:
            _l1_epilogue_m64(acc, buf, clamp, b, nt, valid, l2_mask, xch, xbar, k1, wg, OFF_L1_W, OFF_L2, OFF_L2_SF,
                             I, SP, HAS_CLAMP)
            k1 += 1


@gluon.jit
def _lead_step(lead, it, wg: gl.constexpr, LEAD: gl.constexpr):
    """Warpgroup 0, once it has taken ``LEAD`` ring stages: let warpgroup 1 start (:func:`_math_partition`)."""
    if LEAD > 0 and wg == 0:
        if it == LEAD:
            mbarrier.arrive(lead.index(0), count=1)


@gluon.jit
def _math_partition(buf, w1_sf, w2_sf, buffer_ptrs, me, clamp, a_bufs, w_bufs, sa_bufs, ready, empty, lead,
                    l2_stage, tiles, num_l1, num_tiles, l2_mask, wg: gl.constexpr,
                    OFF_L1_W: gl.constexpr, OFF_L2: gl.constexpr, OFF_L2_SF: gl.constexpr, OFF_META: gl.constexpr,
                    OFF_COMBINE: gl.constexpr, T: gl.constexpr, H: gl.constexpr, I: gl.constexpr, SP: gl.constexpr,
                    STAGES: gl.constexpr, HAS_CLAMP: gl.constexpr, LEAD: gl.constexpr, MC: gl.constexpr = False,
                    BULK: gl.constexpr = False, staged=None, freed=None, COPIER: gl.constexpr = False):
    """One math warpgroup: rows ``[64*wg, 64*wg + 64)`` of every tile, its 256 weight rows as two halves of 128.

    ``BULK`` (``megamoe.fused.FP8_WS_BULK``): the L2 epilogue through ``l2_stage`` and the copy engine
    (:func:`_l2_epilogue_bulk`); the warpgroup's copies are waited for (complete) before it exits. With ``COPIER``
    (``megamoe.fused.FP8_WS_COPIER``) the warpgroup only stages its rows (:func:`_l2_epilogue_staged`, the
    handshake on ``staged`` / ``freed``) and the pull warps issue the copies (:func:`_copy_rows`).

    ``MC``: the slots of the cluster's pair schedule (:func:`_slot`); each stage released in both CTAs (the arrive
    of count 2, :mod:`megamoe.multicast`); a padding slot passes its stages through and has no epilogue.

    ``LEAD`` > 0 (``megamoe.fused.FP8_WS_LEAD``): warpgroup 1 starts once warpgroup 0 has taken ``LEAD`` ring stages
    (one arrive on ``lead``, or at its end if it takes fewer). The two then stay about that many stages apart (the
    ring bounds how far 0 runs ahead; when 0 is in its epilogue 1 issues alone and catches up, and the other way
    round after), so their epilogues no longer coincide and the tensor cores do not idle for a whole epilogue.
    Same bits either way (the order of a warpgroup's own work is unchanged). Measured on an H200: no gain beyond the
    run's spread, so off by default (``FP8_WS_LEAD``'s comment cites the rows)."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 32])
    rows_l: gl.constexpr = gl.SliceLayout(1, mma)
    cols = gl.arange(0, HN, layout=gl.SliceLayout(0, mma))
    gate_col = gl.expand_dims((cols // 8) % 2 == 0, 0)
    spare = gl.zeros([WM, HN], gl.float32, mma)  # the one dot register tile (use_acc=False wgmma writes into it)
    it = 0
    n2 = 0  # (COPIER) L2 tiles staged so far: the phase of the staged / freed handshake
    ARRIVE: gl.constexpr = 2 if MC else 1
    if LEAD > 0 and wg == 1:
        mbarrier.wait(lead.index(0), 0)
    first, stop, step = _schedule(tiles, num_tiles, MC)
    for i in range(first, stop, step):
        t, b, nt, e, valid, kind = _slot(tiles, num_tiles, i, MC)
        is_l2 = t >= num_l1
        if is_l2:
            KB = I // BK
            # weight scale rows 2nt (left half) and 2nt+1 (right half) of [El, H/128, I/128]
            sw_a = w2_sf + (e * (H // 128) + 2 * nt) * KB
            sw_b = sw_a + KB
        else:
            KB = H // BK
            # gate block row nt and up block row I/128 + nt of [El, 2I/128, H/128]
            sw_a = w1_sf + (e * (2 * I // 128) + nt) * KB
            sw_b = sw_a + (I // 128) * KB
        acc_lo = gl.zeros([WM, HN], gl.float32, mma)
        acc_hi = gl.zeros([WM, HN], gl.float32, mma)
        # a warpgroup whose 64 rows are all padding (a block's last tile) issues no MMA: it passes the ring's
        # stages through (below); its epilogue then stores nothing (every row masked) but still publishes its bit
        kb_mma = gl.where(valid > wg * WM, KB, 0)
        for kb in range(kb_mma):
            s = it % STAGES
            ph = (it // STAGES) & 1
            x = gl.load(sw_a + kb)  # issued before the wait: its latency hides behind it
            y = gl.load(sw_b + kb)
            # L1: both halves (gate x, up y); L2: left half x, right half y
            lo_u = gl.where(is_l2, x, y)
            hi_g = gl.where(is_l2, y, x)
            mbarrier.wait(ready.index(s), ph)
            a_s = a_bufs.index(s).slice(wg * WM, WM)
            w_s = w_bufs.index(s)
            dot = warpgroup_mma(a_s, w_s.slice(0, HN).permute((1, 0)), spare, use_acc=False, is_async=True)
            sa = sa_bufs.index(s).slice(wg * WM, WM).load(rows_l)
            d_lo = warpgroup_mma_wait(num_outstanding=0, deps=(dot, ))
            acc_lo = _pin(_promote(acc_lo, d_lo, sa, x, lo_u, gate_col))
            dot = warpgroup_mma(a_s, w_s.slice(HN, HN).permute((1, 0)), d_lo, use_acc=False, is_async=True)
            acc_hi, spare = _retire(dot, empty, s, acc_hi, sa, hi_g, y, gate_col, ARRIVE)
            it += 1
            _lead_step(lead, it, wg, LEAD)
        for kb in range(kb_mma, KB):
            mbarrier.wait(ready.index(it % STAGES), (it // STAGES) & 1)
            mbarrier.arrive(empty.index(it % STAGES), count=ARRIVE)
            it += 1
            _lead_step(lead, it, wg, LEAD)
        if valid >= 0:  # (always but for MC's padding slots)
            if is_l2:
                row0 = b * TILE_M + wg * WM
                if COPIER:
                    _l2_epilogue_staged(acc_lo, acc_hi, l2_stage, staged, freed, n2, wg)
                    n2 += 1
                elif BULK:
                    _l2_epilogue_bulk(acc_lo, acc_hi, l2_stage, buf, buffer_ptrs, me, row0, nt * TILE_N,
                                      valid - wg * WM, wg, OFF_META, OFF_COMBINE, T, H)
                else:
                    _l2_epilogue(acc_lo, acc_hi, buf, buffer_ptrs, me, row0, nt * TILE_N, valid - wg * WM, OFF_META,
                                 OFF_COMBINE, T, H, mma)
            else:
                _l1_epilogue(acc_lo, acc_hi, buf, clamp, b, nt, valid, l2_mask, wg, OFF_L1_W, OFF_L2, OFF_L2_SF, I,
                             SP, HAS_CLAMP, TILE_M, 2, False)
    if LEAD > 0 and wg == 0:
        if it < LEAD:  # fewer stages than LEAD in all: warpgroup 1 must not wait for more
            mbarrier.arrive(lead.index(0), count=1)
    if BULK:  # the rows written before the launch ends (and the staging buffer read before the CTA leaves)
        _bulk_wait(False)


@gluon.jit
def fp8_gemm_phase_kernel(a1_desc, a2_desc, w1_desc, w2_desc, sa1_desc, sa2_desc, a1m_desc, a2m_desc, w1u_desc,
                          w2u_desc, buf, w1_sf, w2_sf, tiles,
                          buffer_ptrs, me, clamp, timeout_ns,
                          OFF_GRID: gl.constexpr, OFF_STATE: gl.constexpr, OFF_L2_MASK: gl.constexpr,
                          OFF_ARRIVAL: gl.constexpr,
                          OFF_X: gl.constexpr, OFF_X_SF: gl.constexpr,
                          OFF_L1: gl.constexpr, OFF_L1_SF: gl.constexpr, OFF_L1_W: gl.constexpr,
                          OFF_L2: gl.constexpr, OFF_L2_SF: gl.constexpr, OFF_META: gl.constexpr,
                          OFF_COMBINE: gl.constexpr, T: gl.constexpr, H: gl.constexpr, I: gl.constexpr,
                          SP: gl.constexpr, HAS_CLAMP: gl.constexpr, STAGES: gl.constexpr,
                          MATH_REGS: gl.constexpr, LOAD_REGS: gl.constexpr, PULL_WARPS: gl.constexpr,
                          PULL_REGS: gl.constexpr, PULL_CHUNK: gl.constexpr, PDL: gl.constexpr = False,
                          LEAD: gl.constexpr = 0, GROUP_SYNC: gl.constexpr = False, MC: gl.constexpr = False,
                          BULK: gl.constexpr = False, COPIER: gl.constexpr = False):
    """One rank's GEMM phase (module docstring). Descriptors: ``a1`` L1 pool ``[P, H]`` / ``a2`` L2 pool ``[P, I]``
    fp8, box [128, 128]; ``w1`` / ``w2`` the blocked weights as ``[El*2I*H/128, 128]`` / ``[El*H*I/128, 128]`` fp8,
    box [128, 128] (one weight block, :func:`_load_partition`); ``sa1`` / ``sa2`` the
    pools' float32 scales, 1-D ``[K/128 * SP]``, box [128]; ``a1m`` / ``a2m`` the pools again, box [BM/2, 128], and
    ``w1u`` / ``w2u`` the weights again (``MC``: the loads the PTX pass multicasts are those through ``a*m`` and
    ``w*``; those through ``a*`` and ``w*u`` stay in their CTA; without ``MC`` unused). ``buf``: the rank's
    symmetric buffer (uint8); ``w1_sf`` / ``w2_sf``: float32 weight scales ``[El, 2I/128, H/128]`` / ``[El, H/128,
    I/128]``; ``tiles``: the int32 tile table (header + entries); ``buffer_ptrs``: int64 base addresses of every
    rank's buffer.

    ``MC`` (pool block 128 only; ``megamoe.fused.FP8_WS_MULTICAST``): launched in clusters of two CTAs that take
    the front launch's **pairs** of tiles (``TILE_PAIR_WORDS``: two pool blocks on one weight tile, or one pool block
    on two) and stream the shared operand of each stage once for both, half each, multicast
    (:mod:`megamoe.multicast`: the PTX pass this kernel is registered with, the handshake after the barriers' init,
    the count-2 arrives of the math partitions, the loader's drain).
    Same bits as without: each tile's math is unchanged."""
    if PDL:  # launched as a programmatic dependent of the front launch (megamoe.fused.WS_PDL): wait for it to finish
        gdc_wait()  # (and its writes to be visible) before reading anything it wrote; let the back launch be
        gdc_launch_dependents()  # scheduled as this grid's programs exit (it waits likewise)
    state = (buf + OFF_STATE).to(gl.pointer_type(gl.int32))
    l2_mask = (buf + OFF_L2_MASK).to(gl.pointer_type(gl.int64))
    arrival = (buf + OFF_ARRIVAL).to(gl.pointer_type(gl.int32))
    progress = (buf + OFF_GRID).to(gl.pointer_type(gl.int32)) + 1  # grid-sync word 1 (megamoe.kernels.fused)
    num_l1 = gl.load(tiles)
    num_tiles = num_l1 + gl.load(tiles + 1)
    num_blocks = gl.load(tiles + 2)
    failed = gl.load(state + 1)
    # the front launch failed (a barrier timed out): no tile, no pull (read once, before the roles split, so every
    # partition sees the same counts). A failure this launch's own waits recorded (TAG_GEMM_PHASE_WAIT: a CTA that
    # started late may see one) is not the front's: its tiles still run, so that the two CTAs of a cluster (MC)
    # take the same slots and neither waits for a multicast half that never comes
    if (failed != 0) & (failed != TAG_INTERNAL_WAIT):
        num_tiles = 0
        num_blocks = 0
    BM: gl.constexpr = a1_desc.block_type.shape[0]  # pool rows per tile: 128, or 64 (_math_partition_m64)
    a_bufs = gl.allocate_shared_memory(a1_desc.dtype, [STAGES, BM, BK], a1_desc.layout)
    w_bufs = gl.allocate_shared_memory(w1_desc.dtype, [STAGES, TILE_N, BK], w1_desc.layout)
    sa_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BM], sa1_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)  # the loader's expect + the TMA bytes
        mbarrier.init(empty.index(i), count=4 if MC else 2)  # one arrive per math warpgroup (of both CTAs: MC)
    # BM = 64: the two math warpgroups' row maxima of an L1 tile (two slots) and the barriers of their exchange
    xch = gl.allocate_shared_memory(gl.float32, [4, WM], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    xbar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(xbar.index(i), count=2)
    lead = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())  # BM = 128: LEAD's start signal
    if BULK:  # (named: its offset is resolved into the copies' inline PTX, megamoe.shared_address)
        l2_stage = gl.allocate_shared_memory(gl.int16, [2 * WM, 2 * HN], STAGE_LAYOUT)
    else:  # (a 32-byte placeholder the math partitions take and never touch)
        l2_stage = gl.allocate_shared_memory(gl.int16, [2, 8], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    mbarrier.init(lead.index(0), count=1)
    # COPIER: per math warpgroup, its L2 rows staged (arrived by the warpgroup) / read by the copies (by the copier)
    staged = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    freed = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(staged.index(i), count=1)
        mbarrier.init(freed.index(i), count=1)
    fence_async_shared()  # barrier inits visible to the async proxy before first use
    if MC:  # the peer CTA's barriers are initialised before anything lands in or arrives on them
        gl.inline_asm_elementwise(CLUSTER_READY, "=r", [], dtype=gl.int32, is_pure=False, pack=1)
    if BM == 64:
        gl.warp_specialize([
            (_math_partition_m64, (buf, w1_sf, w2_sf, buffer_ptrs, me, clamp, a_bufs, w_bufs, sa_bufs, ready, empty,
                                   xch, xbar, tiles, num_l1, num_tiles, l2_mask, 0, OFF_L1_W, OFF_L2, OFF_L2_SF,
                                   OFF_META, OFF_COMBINE, T, H, I, SP, STAGES, HAS_CLAMP)),
            (_math_partition_m64, (buf, w1_sf, w2_sf, buffer_ptrs, me, clamp, a_bufs, w_bufs, sa_bufs, ready, empty,
                                   xch, xbar, tiles, num_l1, num_tiles, l2_mask, 1, OFF_L1_W, OFF_L2, OFF_L2_SF,
                                   OFF_META, OFF_COMBINE, T, H, I, SP, STAGES, HAS_CLAMP)),
            (_load_partition, (a1_desc, a2_desc, w1_desc, w2_desc, sa1_desc, sa2_desc, a1m_desc, a2m_desc, w1u_desc,
                               w2u_desc, a_bufs, w_bufs, sa_bufs, ready, empty, tiles, num_l1, num_tiles, l2_mask,
                               arrival, progress, state, timeout_ns, I // 128, H, I, SP, STAGES, GROUP_SYNC)),
            (_pull_partition, (buf, buffer_ptrs, me, tiles, arrival, num_blocks, OFF_META, OFF_X, OFF_X_SF, OFF_L1,
                               OFF_L1_SF, H, SP, PULL_WARPS, BM, PULL_CHUNK)),
        ], [4, 1, PULL_WARPS], [MATH_REGS, LOAD_REGS, PULL_REGS])
        return
    COPY: gl.constexpr = BULK and COPIER
    gl.warp_specialize([
        (_math_partition, (buf, w1_sf, w2_sf, buffer_ptrs, me, clamp, a_bufs, w_bufs, sa_bufs, ready, empty, lead,
                           l2_stage, tiles, num_l1, num_tiles, l2_mask, 0, OFF_L1_W, OFF_L2, OFF_L2_SF, OFF_META,
                           OFF_COMBINE, T, H, I, SP, STAGES, HAS_CLAMP, LEAD, MC, BULK, staged, freed, COPY)),
        (_math_partition, (buf, w1_sf, w2_sf, buffer_ptrs, me, clamp, a_bufs, w_bufs, sa_bufs, ready, empty, lead,
                           l2_stage, tiles, num_l1, num_tiles, l2_mask, 1, OFF_L1_W, OFF_L2, OFF_L2_SF, OFF_META,
                           OFF_COMBINE, T, H, I, SP, STAGES, HAS_CLAMP, LEAD, MC, BULK, staged, freed, COPY)),
        (_load_partition, (a1_desc, a2_desc, w1_desc, w2_desc, sa1_desc, sa2_desc, a1m_desc, a2m_desc, w1u_desc,
                           w2u_desc, a_bufs, w_bufs, sa_bufs, ready, empty, tiles, num_l1, num_tiles, l2_mask,
                           arrival, progress, state, timeout_ns, I // 128, H, I, SP, STAGES, GROUP_SYNC, MC)),
        (_pull_copy_partition, (buf, buffer_ptrs, me, tiles, arrival, num_blocks, num_l1, num_tiles, staged,
                                freed, OFF_META, OFF_X, OFF_X_SF, OFF_L1, OFF_L1_SF, OFF_COMBINE, T, H, SP,
                                PULL_WARPS, BM, PULL_CHUNK, MC, COPY)),
    ], [4, 1, PULL_WARPS], [MATH_REGS, LOAD_REGS, PULL_REGS])
