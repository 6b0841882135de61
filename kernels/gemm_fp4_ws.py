"""The GEMM phase of the fused FP8 x FP4 path with ``"hopper"`` numerics, warp-specialised in Gluon (tile kind
``"fp4_ws"``): both grouped GEMMs (L1 + SwiGLU + top-k weight + per-128 requant, then L2 + write-back into the
source ranks' combine buffers) in one persistent launch, between the front and back launches of
:func:`megamoe.kernels.fused.fused_mega_moe_kernel` (``PHASE=1`` / ``2``), as :mod:`megamoe.kernels.gemm_fp8_ws`
does for the SM90 FP8 x FP8 format. The 128-row tile is tested on an H200 (``tests/gpu/test_fp4_ws_gpu.py``); the
64-row tile (one math warpgroup, two decode partitions) too. The CPU tests run
its torch model (:mod:`megamoe.gemm_phase`) in its place, at both blocks.

Why: the one-launch Triton kernel's "hopper" tiles (``_l1_tile_hopper`` / ``_l2_tile_hopper``) decode FP4 inside
the math warps and are 2.7-4.6x slower than DeepGEMM on an H200 (issue #7); the FP8 x FP8 Gluon phase of the same
structure runs at 1.0-1.04x DeepGEMM. Here the FP4 decode moves into its own warps, off the tensor cores' path.

Numerics (``megamoe.reference`` with ``numerics="hopper"`` is the model, :mod:`megamoe.gemm_phase` the per-tile
torch twin): every operand of both MMAs is an e4m3 value *folded* to one power-of-two scale per row over all of K,
so a dot needs no scale inside its K loop:

* L1 A (pool rows): folded by the **front launch** (``FOLDED`` pull, as the one-launch kernel: ``x' = e4m3(x *
  2^(s_g - s_max))``, scale words ``s_max`` in all four bytes). The FP8 phase's pull partition copies rows raw,
  which is wrong for folded rows, so this kernel has **no pull**: the front launch copies and folds every row
  (``fused_mega_moe_kernel`` copies rows in ``PHASE=1`` when ``FOLDED``), and the rows are in the pool when this
  launch starts (stream order), so L1 tiles do not wait on ``l1_arrival_count`` at all. (Cost: the pull no longer
  overlaps the GEMMs; for the FP8 phase that overlap was a small gain, same-run DeepGEMM ratio 1.13 / 1.10 / 1.09
  -> 1.10 / 1.09 / 1.04 at T = 512 / 2048 / 8192 (README). A folding pull partition is a later step.)
* W (FP4 e2m1, two per byte, UE8M0 per 32): folded by the **decode partition** relative to each weight row's
  largest exponent over all of K (``megamoe.fused._fp4_row_maxima``: uint8 per weight row, made once per weight set;
  until session 30 each tile re-derived it from the rows' 56 / 24 scale words, ~230 cycles a stage of the decode
  partition and all of the tile's 184 B of spills), one byte-table lookup per value (a row of
  ``megamoe.quant.fold_lut`` through ``prmt``, as the one-launch kernel's ``_decode_chunk``; since session 36 the
  row computed per weight row and 32-group, ``_fold_table``, not gathered), into an FP8 ``[256, 128]``
  NVMMA-swizzled buffer (at BM 128 two ``[128, 128]`` buffers, one per half that a wgmma reads, each written by
  one store: ``DECODE_HALVES``, ``megamoe.fused.FP4_WS_DECODE_HALVES`` says why).
* L2 A: the L1 epilogue quantises per 128 columns (UE8M0, as ``_l1_tile_hopper``); the reference folds the L2
  input per token relative to the largest of its I/128 scales, which the L1 epilogue of one 128-column tile cannot
  know. So the L2 A operand is folded in place (``e4m3(a * 2^(s_kb - s_max))`` through fp16, exact as
  ``_fold_e4m3``), which needs every L1 tile of the block first: an L2 tile waits for the whole block (the FP8 phase
  waits per K block; here the per-token maximum needs all of them). The **decode partition folds each L2 A stage in
  shared memory**, in every L2 tile of the block (28 at H = 7168), after the block's whole arrival mask. Option
  ``FOLD_ONCE`` (``megamoe.fused.FP4_WS_FOLD_ONCE``, off: measured slower, the constant says why): **once per pool
  block, in the L2 pool**, by the math warpgroup whose L1 epilogue completes its 64 rows' arrival bits
  (``_l1_fold_once``); the L2 loader then waits for the folds (``_wait_folded``). **``L2_FOLDED`` off**
  (``numerics="hopper_l2_per_block"``, session 31; DeepGEMM SM90's way with its per-128 activation scales): no fold
  at all. The L2 A operand is multiplied as stored, and the math warpgroups add each K block's partial sums times
  their tokens' ``2^(s_kb - 127)`` (one FFMA where the folded operand's add is an FADD; the K block's words from
  the stage's ``asf_bufs`` with ``SF_TMA``, else loaded one K block ahead after the math's own acquire of the
  block's mask). The decode partition's L2 stage is then its W decode alone: offline sm_90a (Triton 3.6) its stage
  loop 648 -> 377 SASS instructions at BM 128 (the A fold's 132 F2FP and 64 HMUL2 gone), 299 -> 218 at BM 64, the
  math's 186 -> 200 (FADD -> FFMA and the scale reads); no per-tile pool-row maxima, no mask wait in the decode
  partition. Not yet run on a GPU (``tests/gpu/test_l2_per_block_gpu.py``).

The epilogues apply ``2^(s_row - 127)`` per weight row (column) and ``2^(s_max - 127)`` per token (row) and then
do what ``_l1_tile_hopper`` / ``_l2_tile_hopper`` do (bf16 round, clamp, SwiGLU, top-k weight, per-128 UE8M0
requant, :func:`gemm_fp8_ws._l1_epilogue` with ``UE8M0``; bf16 rows into the source rank's ``combine`` through
``sym_map`` arithmetic, :func:`gemm_fp8_ws._l2_epilogue`).

Summation: each 128-wide K block is one wgmma chain into a fresh register tile, added into the float32 accumulator
(the FP8 phase's "halves" structure with the scale product dropped). That is ``PROMOTE_EVERY = 1`` of the
one-launch "hopper" tile (which chains 4 K blocks, 512 values, before adding): a shorter in-MMA chain, so the GPU
tolerance of that tile (``accumulation="fp8_mma"``) holds a fortiori; the model's float32 sums are the same
(exact power-of-two scales commute with them).

Roles (``gl.warp_specialize``; one CTA per SM, static stride over the front launch's tile table, L1 tiles first).
Pool blocks of ``BM`` = 128 rows, or 64 (``FP4_BLOCK64_MAX_EXPECTED`` in ``megamoe.fused``: few tokens per expert,
where a 128-row block is mostly padding; the pool is sized for 128, as for the FP8 phase's 64-row tile):

* math warpgroups (``NWG = BM / 64`` x 4 warps, ``MATH_REGS``): rows ``[64 wg, +64)`` of a tile x its 256 weight rows
  as two halves of 128; wait ``ready[s]`` (A + packed W landed) and ``decoded[s]`` (W decoded, L2 A folded),
  release ``empty[s]`` (count ``NWG``). At BM 64 the one warpgroup holds all of an L1 tile's rows and columns, so
  it sets both of the tile's arrival bits (the mask, and every wait on it, are those of BM 128);
* loader (1 warp, ``LOAD_REGS``): TMA of A ``[BM, 128]`` e4m3 and packed W ``[256, 64]`` bytes (128 K values of
  256 rows) per stage; before an L2 tile, the wait for the block's full arrival mask;
* decode partitions (4 warps each, ``DECODE_REGS``; one at BM 128, two at BM 64, splitting each stage: weight rows
  ``[0, 128)`` / ``[128, 256)``, and for L2 A rows ``[0, 32)`` / ``[32, 64)``): per tile their weight rows' largest
  exponents (and for L2 their pool rows' largest per-128 exponents) into shared memory (two slots by tile parity,
  ``rfree`` mbarriers: the math warpgroups read them in their epilogue and release the slot), per stage their rows'
  decode (and L2 fold), ``fence.proxy.async``, one arrive each on ``decoded[s]`` (count = the number of decode
  partitions: the math reads a stage only when every partition's W rows and folded A rows are in). The partitions
  never wait on each other: each waits ``ready[s]`` / ``rfree`` itself and reads back only what it wrote (its rows'
  maxima); a partition cannot run a whole ring ahead of the other, since the stage's next ``ready`` needs the
  math's ``empty``, which needs every partition's ``decoded``.
* ``IDLE_DECODE`` (BM 128 with ``DECODE_HALVES``; ``megamoe.fused.FP4_WS_IDLE_DECODE``): in a tile whose pool block
  holds no row past its first 64 (an expert's last block, ``valid <= 64``) math warpgroup 1 has nothing to
  multiply, so it decodes the high half of each stage's weights (``_idle_decode_tile``, at its own registers) and
  arrives on ``decoded2[s]``; the decode partition decodes the low half and folds only the first 64 L2 A rows;
  warpgroup 0 waits on both barriers. The tile's stage then has two decoding warpgroups, one warp of each on every
  scheduler.

Shared memory per stage: A 16 KB (BM 64: 8 KB) + packed W 16 KB + decoded W 32 KB = 64 KB (56 KB); 3 stages = 192
KB (168 KB) + 3 KB (2.5 KB) of row exponents and barriers.

Registers: ``setmaxnreg`` per warpgroup, launched at ``maxnreg`` 128 with 16 warps (the loader's warpgroup is one
warp and three idle ones): 512 = 64 K registers / 128 threads. BM 128: math 208 + 208, loader 24, decode 72. BM 64:
math 232 (the default partition: what the workers leave, 512 - 24 - 2 x 128), loader 24, decode 128 + 128 -- the
second math warpgroup's registers go to a second decode partition. (A third or fourth decode partition does not
fit: 5 or 6 warpgroups cap the launch at ``maxnreg`` 96 / 80, and ptxas needs at least 90 for the wgmma of the
math; 256 weight rows do not split in three evenly either.) Two decode partitions at BM 128 (a 128-row half of
each stage each, the math warpgroups in four 64-row wgmma chains so that 5 warpgroups fit ``maxnreg`` 96) were
built and measured 2-5 % slower on an H100 (session 35, ``results/probes/README.md``): removed.

Offline sm_90a compile (``python results/probes/gemm_fp4_ws_compile.py 3``, Triton 3.6, H = 7168, I = 3072, 3
stages, BM 128, 208 / 24 / 72): 200092 B of shared memory (of 232448); ptxas "136 bytes stack frame, 140 bytes spill
stores, 152 bytes spill loads", all of them in the decode partition's per-tile row maxima (``_row_exponent_max``:
ptxas hoists the four unrolled 16-word loads; 33 STL / 38 LDL once per tile, none inside its K loop; since session
30 the maxima are read from ``megamoe.fused._fp4_row_maxima`` and the tile spills 8 B), none in the math or loader
partitions; SASS per K block and warpgroup: 2 x 4 ``QGMMA.64x128x32`` (16 in the binary), 648
``PRMT`` in the binary. (With math 200 / loader 40 / decode 72 the math partitions spill in the epilogue and the
decode partition the same 140 B; 200 / 24 / 88 spills 80 B, some in the math epilogue.) BM 64 (``BM=64 python
results/probes/gemm_fp4_ws_compile.py``, 3 stages, 232 / 24 / 128 + 128): 174988 B of shared memory, no stack, no
spill anywhere; setmaxnreg 232 (math), 24 (loader), 128 (both decode partitions); SASS 8 ``QGMMA.64x128x32`` (one
warpgroup, two halves, 4 K steps), 520 ``PRMT``, 32 ``HMUL2`` (the A fold, two partitions of 32 rows), 66 ``F2FP``.
4 stages also compile without spill at BM 64 (232332 B of 232448: 116 B to spare), not the default. (Decode 120,
math 248 compiles without spill too; which split is faster is not measured.)

What BM 64 was expected to buy, and bought: the probe (``results/probes/ws_variants_probe_h200.jsonl``)
puts the BM-128 phase's time in its one decode partition at every T (2108 us at T = 512 with the decode, 998 us
without). At BM 64 a stage holds half the MMA work (one warpgroup, 64 rows) and the same 256 weight rows to decode,
split over 8 warps (2 a scheduler instead of 1). Offline SASS, one stage of an L2 tile from the ``ready`` wait to
the ``decoded`` arrive: 462 / 467 instructions a thread in each BM-64 partition (164 LOP3, 82 LEA, 36 PRMT, 33 F2FP,
16 HMUL2, 20 LDG) against 1049 in the BM-128 partition. So a scheduler issues about the same decode instructions a
stage (2 warps x ~465 against 1 x ~1049, 12 % fewer): BM 64 gains only as far as the decode is latency-bound (a
second warp on each scheduler to hide the gathers' and shared memory's latency), up to 2x per stage if it is
entirely latency-bound, ~1.1x if it is issue-bound. And each pool block of 64 decodes the expert's weights again:
at 64 expected tokens per expert (T = 512) about half of the experts need two blocks of 64 where one of 128
sufficed (~1.5x the decoded stages), so there it can lose; at 16 expected (T = 128) one block of 64 replaces one of
128. Measured on an H200 (``block`` rows of the probe file): block 64 / 128 take 1277 / 2005 us at T = 32,
1298 / 2022 at T = 128, 1329 / 2051 at T = 256 -- 1.55x, more than the 12 % fewer instructions, so the one decode
warp a scheduler was latency-bound -- and at T = 512 2058 against 2108-2118 us (block 128 from earlier calls):
there the second decode of half the experts' weights eats most of the gain. After the prefetch, scale-TMA and
decode changes block 128 wins at T = 512 (1347 against 1379 us, session 13): FP4_BLOCK64_MAX_EXPECTED = 32.

Open questions (for the GPU session): the decode partition does not keep up with the two math warpgroups at BM 128
(the probe above). Per K block the math needs ~1.1 us of wgmma at ~1000 TFLOP/s (2 x 2 x 64 x 128 x 128 x 2 flop at
~7.5 TFLOP/s an SM); the decode's stage body (BM 128) was ~1050 SASS instructions a thread with the L2 fold (333
LOP3, 168 LEA, 132 F2FP, 72 PRMT, 64 HMUL2, 44 LDG of which 32 are table gathers), ~800 without: ~0.45-0.6 us at one
instruction a cycle per scheduler only if its 4 warps, one a scheduler, never stall -- latency-bound. The leaner
PRMT string of ``megamoe.kernels.numerics`` (selector by one byte PRMT instead of five masks and shifts; equal to
the old one on CPU through ``megamoe.inline_asm``) takes 224 SASS instructions off each stage body at both blocks
(whole kernel 13840 -> 13616 at BM 128, 8552 -> 8328 at BM 64: 192 LOP3, 64 LEA, 32 IMAD fewer, 64 PRMT more), ~21 %
of the BM-128 decode; on an H200 it took T = 128 / 512 from 1298 / 2058 to 1153 / 1824 us
(``results/layer_h200.json`` as of 5bee5a1).
Where each stage's scale words come from. The stage body's dependency chain starts with a global load of the K
block's 256 scale words (one per weight row, from L2 or HBM while the TMA streams saturate it), then the fold-table
gathers, then the PRMTs; at one or two warps a scheduler nothing hides it. On the H200 the BM-64 phase spends ~2400
cycles a stage (T = 128: ~1000 us of GEMM phase over ~730 stages an SM) against ~750 issue cycles of its two warps a
scheduler (373 SASS instructions a thread). Two ways off the chain, both constexprs: ``PREFETCH``
(``FP4_WS_PREFETCH``, BM 64 only: the words of K block kb + 1 loaded before the wait for kb, a partition's 128 rows
as one chunk; 20 B spilled once a tile, none in the K loop) and ``SF_TMA`` (``FP4_WS_SF_TMA``: the loader's TMA
brings them with the stage, 1 KB of weight-row words + the pool rows' words, and the decode reads shared memory, as
DeepGEMM's SM90 kernel loads its scales; BM 64 178892 B of shared memory, no spill, 359 SASS instructions in the K
loop; BM 128 204764 B, 156 B spilled once a tile, 816 in the K loop). The fold-table pair is one 8-byte gather
(``_fold_table``) in every variant (until session 36: now computed in registers, the same bits).
``results/probes/ws_variants_probe.py scale_words`` timed them against each other on an H200: PREFETCH (with a
fourth stage) at BM 64, SF_TMA at BM 128 (``megamoe.fused.FP4_WS_PREFETCH`` /
``FP4_WS_SF_TMA`` cite the rows); the others stay selectable and GPU-tested (SF_TMA at BM 64 with 3 stages: with 4
it needs 237516 B of shared memory, over sm_90's 232448).
Predecoded calls (GPU-tested; ``megamoe.fused.FP4_PREDECODE_MIN_EXPECTED`` cites the timings): from that many
expected tokens per expert the host decodes both weights once per call (``megamoe.fold_decode``, the same table
lookups in one elementwise Triton pass) and passes e4m3 descriptors (box [256, 128]); the kernel sees
``w1_desc.dtype`` and takes ``PREDECODED``: the loader's weight stage is what the math reads (no packed ring, no
decoded ring), and the decode partitions only fold the L2 A stage. At T = 8192 every weight is otherwise decoded
once per pool block (eight times); offline sm_90a: BM 64 129708 B of shared memory (room for 5 stages), BM 128
155580 B (4).
Whether the per-tile row maxima (56 scale words a row at H = 7168, re-read per tile from L2) stall the ring at tile
boundaries (a per-weights cache of the row maxima, e.g. computed by ``transform_weights_for_mega_moe``, would remove
them). Bank conflicts of the unswizzled packed-W reads (2-way by estimate; a 64-byte swizzle that removes them was
measured 1-2 % slower on an H100, session 35, and removed). 3 stages against a 4-deep A/W ring with
a 2-deep decoded ring. Whether the two decode partitions at BM 64 decode a stage in half the time (and whether
a 64-row block of one math warpgroup then keeps up). A folding pull partition (the rows would then
overlap the GEMMs again).

Where the block-128 tile's time goes at T = 512 (session 36, one H100, ``ws_variants_probe.py knockout``, whole
calls): as is 1058 us; without the fold-table arithmetic 1023, without the ``fence.proxy.async`` 1036; **without
the W decode 815, without any decode 814, without the wgmma 817**. The decode and the MMA each alone fit in ~815 us;
together they take 1058: they do not overlap, they contend (the stage profile: the decode partition's W decode 1398
cycles a stage, the math's wgmma 1247, each waiting on the other ~800). Both stream shared memory (a full stage:
TMA 32 KB in, the decode 16 KB read + 32 KB written, the wgmma 96 KB read -- 176 KB, ~1400 cycles at 128 B a cycle)
and share each scheduler (one decode warp beside two math warps). The gathered tables were not the limit: computing
them (``FOLD_TABLE_ASM``) took the W decode from 1592 to 1398 cycles a stage and the call not at all (1056 / 1057 us
gathered, bits equal). And the floor without the decode is the target's neighbourhood (815 us on an H100 against
0.8 x DeepGEMM's 1025 on the H200): what is left for T = 512 is the MMA's own cost at 64 tokens an expert (a 128-row
block half padding; idle tiles' one warpgroup issuing both halves in series), not the decode alone.
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

from megamoe.kernels.formats import FP4_BLOCK_ROWS
from megamoe.kernels.fused import _pow2_f32
from megamoe.kernels.gemm_fp8_ws import (
    BK,
    HN,
    TAG_INTERNAL_WAIT,
    TILE_N,
    WM,
    _fence_proxy_async_global,
    _group_sync,
    _l1_epilogue,
    _l2_epilogue,
    _pin,
    _tile,
)
from megamoe.kernels.numerics import _PRMT_LUT_ASM, FOLD_TABLE_ASM, FOLD_TABLE_MAX_SHIFT
from megamoe.kernels.symm import _globaltimer_ns

DEC_ROWS = gl.constexpr(64)  #: weight rows the decode partition converts at once without PREFETCH (4 chunks a stage)
KW_CHUNK = gl.constexpr(16)  #: scale words per row read at once for the row maxima
#: Packed W ``[rows, 32]`` bytes as the decode reads them: 16 consecutive bytes of one row a thread, two threads a
#: row, 64 rows over the 4 warps (a 128-row chunk: two rows a thread).
D_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 16], [16, 2], [4, 1], [1, 0]))
#: The L2 A stage ``[rows, 128]`` e4m3 as the fold reads it: 16 bytes a thread, 8 threads a row.
A_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0]))


@gluon.jit
def _full_mask(N1: gl.constexpr):
    """The arrival-mask bits of a complete pool block: two per L1 tile (one per math warpgroup), ``2 N1 <= 64``."""
    if N1 == 32:
        return gl.to_tensor(-1).to(gl.int64)
    else:
        return (gl.to_tensor(1).to(gl.int64) << (2 * N1)) - 1


@gluon.jit
def _wait_mask(ptr, need, state, timeout_ns):
    """Spin (acquire, gpu) until every bit of ``need`` is set in the int64 at ``ptr``; bounded: on expiry record
    ``TAG_GEMM_PHASE_WAIT`` in ``state[1]`` and carry on (the call is failed; nothing may hang)."""
    seen = gl.atomic_or(ptr, 0, sem="acquire", scope="gpu")
    if (seen & need) != need:
        t0 = _globaltimer_ns()
        alive = True
        while ((seen & need) != need) & alive:
            seen = gl.atomic_or(ptr, 0, sem="acquire", scope="gpu")
            alive = (_globaltimer_ns() - t0) <= timeout_ns
        if (seen & need) != need:
            gl.atomic_cas(state + 1, 0, TAG_INTERNAL_WAIT)


#: ``FOLD_ONCE``: a pool block's ``l1_arrival_count`` (the rows the front launch landed, < 2^16) gains ``1 <<
#: FOLD_SHIFT`` per math warpgroup whose rows' L2 A operand is folded; an L2 tile waits for ``NWG`` of them.
FOLD_SHIFT = gl.constexpr(16)


@gluon.jit
def _wait_folded(ptr, nwg, state, timeout_ns):
    """Spin (acquire, gpu) until the int32 at ``ptr`` counts ``nwg`` folded warpgroup row sets (``FOLD_SHIFT``);
    bounded as :func:`_wait_mask`."""
    seen = gl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
    if (seen >> FOLD_SHIFT) < nwg:
        t0 = _globaltimer_ns()
        alive = True
        while ((seen >> FOLD_SHIFT) < nwg) & alive:
            seen = gl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
            alive = (_globaltimer_ns() - t0) <= timeout_ns
        if (seen >> FOLD_SHIFT) < nwg:
            gl.atomic_cas(state + 1, 0, TAG_INTERNAL_WAIT)


@gluon.jit
def _fold_rows(buf, row0, nrows, OFF_L2: gl.constexpr, OFF_L2_SF: gl.constexpr, I: gl.constexpr, SP: gl.constexpr):
    """``FOLD_ONCE``: the L2 A operand of pool rows ``[row0, row0 + nrows)`` (``nrows`` <= 64, one math warpgroup)
    folded **once**, in place in the L2 pool: every 128-column block ``kb``, ``e4m3(a * 2^(s_kb - s_max))`` through
    fp16 (``_fold_a_rows``' arithmetic, so the same bytes as the per-stage fold), ``s_max`` the row's largest
    per-128 exponent over all ``I / 128`` words (one unrolled pass, every load in flight at once). The words stay as
    the L1 epilogues wrote them (the decode partition's L2 preamble takes ``s_max`` from them for the epilogue's token
    scale). ``[64, 128]`` bytes a K block, 64 a thread in flight (``A_LAYOUT``; no layout change, so no shared
    memory: block 64's four stages leave 116 B)."""
    KB: gl.constexpr = I // 128
    l2 = (buf + OFF_L2).to(gl.pointer_type(gl.uint8))
    l2_sf = (buf + OFF_L2_SF).to(gl.pointer_type(gl.int32))
    r = gl.arange(0, WM, layout=gl.SliceLayout(1, A_LAYOUT))
    ok = r < nrows
    s_mx = gl.zeros([WM], gl.int32, gl.SliceLayout(1, A_LAYOUT))
    for kb in gl.static_range(KB):
        s_mx = gl.maximum(s_mx, gl.load(l2_sf + kb * SP + row0 + r, mask=ok, other=0) & 0xFF)
    col = gl.arange(0, 128, layout=gl.SliceLayout(0, A_LAYOUT))
    rows = l2 + gl.expand_dims((row0 + r).to(gl.int64) * I, 1) + gl.expand_dims(col, 0)
    for kb in range(KB):
        s_kb = gl.load(l2_sf + kb * SP + row0 + r, mask=ok, other=0) & 0xFF
        scale = gl.expand_dims(_pow2_f32(s_kb - s_mx).to(gl.float16), 1)
        a = gl.load(rows + kb * 128, mask=gl.expand_dims(ok, 1), other=0).to(gl.float8e4nv, bitcast=True)
        gl.store(rows + kb * 128, (a.to(gl.float16) * scale).to(gl.float8e4nv).to(gl.uint8, bitcast=True),
                 mask=gl.expand_dims(ok, 1))


@gluon.jit
def _l1_fold_once(old, buf, arrival, b, nt, valid, wg: gl.constexpr, NWG: gl.constexpr, BM: gl.constexpr,
                  OFF_L2: gl.constexpr, OFF_L2_SF: gl.constexpr, I: gl.constexpr, SP: gl.constexpr):
    """``FOLD_ONCE``, after math warpgroup ``wg``'s L1 epilogue of tile ``nt`` of block ``b`` OR-ed its bits into the
    arrival mask (acquire-release; ``old``: the mask before): the warpgroup that completes its rows' bits (every L1
    tile's bit ``2 nt + wg``; at ``NWG`` 1 every bit) is the last to write those rows' L2 bytes and scales, so it
    folds them (``_fold_rows``) and then adds ``1 << FOLD_SHIFT`` to the block's ``l1_arrival_count`` (release):
    the L2 tiles' loader waits for ``NWG`` of those (``_wait_folded``) instead of the full mask."""
    full = _full_mask(I // 128)
    if NWG == 1:
        mine = gl.to_tensor(3).to(gl.int64) << (2 * nt)
        lane = full
        seen = old | mine
    else:
        mine = gl.to_tensor(1).to(gl.int64) << (2 * nt + wg)
        lane = full & 0x5555555555555555
        seen = (old | mine) >> wg
    if (seen & lane) == lane:
        gl.thread_barrier()  # (the acquiring thread's view, to the whole warpgroup)
        _fold_rows(buf, b * BM + wg * WM, gl.minimum(valid - wg * WM, WM), OFF_L2, OFF_L2_SF, I, SP)
        _fence_proxy_async_global()  # the fold's generic stores, then the L2 tiles' TMA reads
        gl.thread_barrier()
        gl.atomic_add(arrival + b, 1 << FOLD_SHIFT, sem="release", scope="gpu")


@gluon.jit
def _w_coord(w_row, kb, KB, BKP: gl.constexpr, col: gl.constexpr, W_BLOCKED: gl.constexpr):
    """The TMA coordinate of weight rows from ``w_row`` (a row of the ``[El * N, K * BKP / 128]`` weight matrix,
    ``BKP`` bytes a K block: 64 packed FP4, 128 predecoded e4m3), K block ``kb`` (of ``KB``), byte column ``col``
    of the block: row-major ``[w_row, BKP kb + col]`` (``_predecode``'s e4m3 weights); with ``W_BLOCKED`` (the
    transformed packed weights, ``megamoe.quant.block_fp4_weights``, seen as ``[El * N / 256 * KB * 256, 64]``: each
    256 rows' K block one contiguous 16 KB run; ``N`` a multiple of 256, as the Gluon kinds require)
    ``[256 (w_row // 256 * KB + kb) + w_row % 256, col]``."""
    if W_BLOCKED:
        return [(w_row // FP4_BLOCK_ROWS * KB + kb) * FP4_BLOCK_ROWS + w_row % FP4_BLOCK_ROWS, col]
    else:
        return [w_row, kb * BKP + col]


@gluon.jit
def _load_partition(a1_desc, a2_desc, w1_desc, w2_desc, ws1_desc, ws2_desc, as1_desc, as2_desc, a_bufs, wp_bufs,
                    wsf_bufs, asf_bufs, ready, empty, tiles, num_l1, num_tiles, l2_mask, progress, state, timeout_ns,
                    H: gl.constexpr, I: gl.constexpr, SP: gl.constexpr, STAGES: gl.constexpr,
                    SF_TMA: gl.constexpr, GROUP_SYNC: gl.constexpr, arrival, FOLD_ONCE: gl.constexpr,
                    W_BLOCKED: gl.constexpr):
    """TMA producer (1 warp): per K block of each tile, A ``[BM, 128]`` e4m3 + packed W ``[256, 64]`` bytes into
    the next ring stage (``ready[s]`` completes on the bytes). L1 tiles do not wait (the front launch landed the
    rows); an L2 tile first waits for its block's full arrival mask (the decode partition's fold needs every
    per-128 scale of the row). ``SF_TMA``: the stage also carries the K block's scale words of the tile's 256 weight
    rows (``ws*_desc``, 1 KB) and of the block's pool rows (``as*_desc``: L2 the per-128 exponents the decode folds
    with; L1 the front launch's folded words, unused, so that every stage has the same byte count). ``FOLD_ONCE``:
    an L2 tile waits for its block's rows to be folded (``_wait_folded`` on ``arrival``, the pool blocks'
    ``l1_arrival_count``) instead of for the full arrival mask. ``W_BLOCKED``: the packed weights blocked by 256
    rows x 128 K (``_w_coord``)."""
    if SF_TMA:
        nbytes: gl.constexpr = (a1_desc.block_type.nbytes + w1_desc.block_type.nbytes + ws1_desc.block_type.nbytes
                                + as1_desc.block_type.nbytes)
    else:
        nbytes: gl.constexpr = a1_desc.block_type.nbytes + w1_desc.block_type.nbytes
    BM: gl.constexpr = a1_desc.block_type.shape[0]
    BKP: gl.constexpr = w1_desc.block_type.shape[1]  # packed bytes per K block (64)
    full = _full_mask(I // 128)
    it = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        gl.atomic_add(progress, 1, sem="relaxed", scope="gpu")  # the rank's heartbeat (see gemm_fp8_ws)
        if GROUP_SYNC:  # (megamoe.fused.WS_GROUP_SYNC["fp4_ws"]: off, measured no gain)
            _group_sync(tiles, t, num_tiles, state, timeout_ns)
        b, nt, e, valid = _tile(tiles, t)
        is_l2 = t >= num_l1
        if is_l2:
            KB = I // BK
            w_row = e * H + nt * TILE_N
            if FOLD_ONCE:
                _wait_folded(arrival + b, BM // WM, state, timeout_ns)
            else:
                _wait_mask(l2_mask + b, full, state, timeout_ns)
            _fence_proxy_async_global()  # the L1 epilogues' generic stores, then this warp's TMA reads
        else:
            KB = H // BK
            w_row = e * 2 * I + nt * TILE_N
        for kb in range(KB):
            s = it % STAGES
            ph = (it // STAGES) & 1
            mbarrier.wait(empty.index(s), ph ^ 1)  # a fresh mbarrier passes the wait for the phase before 0
            bar = ready.index(s)
            mbarrier.expect(bar, nbytes)
            if is_l2:
                tma.async_copy_global_to_shared(a2_desc, [b * BM, kb * BK], bar, a_bufs.index(s))
                tma.async_copy_global_to_shared(w2_desc, _w_coord(w_row, kb, KB, BKP, 0, W_BLOCKED), bar,
                                                wp_bufs.index(s))
                if SF_TMA:  # MN-major [El][I/128][H] and [I/128][SP] words
                    tma.async_copy_global_to_shared(ws2_desc, [(e * KB + kb) * H + nt * TILE_N], bar,
                                                    wsf_bufs.index(s))
                    tma.async_copy_global_to_shared(as2_desc, [kb * SP + b * BM], bar, asf_bufs.index(s))
            else:
                tma.async_copy_global_to_shared(a1_desc, [b * BM, kb * BK], bar, a_bufs.index(s))
                tma.async_copy_global_to_shared(w1_desc, _w_coord(w_row, kb, KB, BKP, 0, W_BLOCKED), bar,
                                                wp_bufs.index(s))
                if SF_TMA:  # [El][H/128][2I] and [H/128][SP] words
                    tma.async_copy_global_to_shared(ws1_desc, [(e * KB + kb) * (2 * I) + nt * TILE_N], bar,
                                                    wsf_bufs.index(s))
                    tma.async_copy_global_to_shared(as1_desc, [kb * SP + b * BM], bar, asf_bufs.index(s))
            it += 1


@gluon.jit
def _fold_table(lut, word, rmax, g: gl.constexpr):
    """The decode table words (codes 0-3, codes 4-7) of per-32 group ``g`` of each row: ``fold_lut`` at the fold
    shift ``min(s_row - s_g, FOLD_LUT_MAX_SHIFT)`` (the one-launch kernel's ``_fold_tables``), computed in registers
    (``FOLD_TABLE_ASM``: shifts past ``FOLD_TABLE_MAX_SHIFT`` have the same all-zero row), not gathered from ``lut``:
    the gather's load was a dependent memory round trip in the middle of the decode warp's stage (two a 128-row
    half), which one warp a scheduler cannot hide."""
    d = gl.minimum(rmax - ((word >> (8 * g)) & 0xFF), FOLD_TABLE_MAX_SHIFT)
    return gl.inline_asm_elementwise(FOLD_TABLE_ASM, "=r,=r,r", [d], dtype=(gl.int32, gl.int32), is_pure=True,
                                     pack=1)


@gluon.jit
def _bc(x, like):
    """Row vector ``x`` ``[R]`` broadcast to the shape of ``like`` ``[R, C]``."""
    return gl.broadcast(gl.expand_dims(x, 1), like)[0]


@gluon.jit
def _decode_prmt(packed, t0, t1, u0, u1):
    """The low and high values of ``packed`` (uint8 ``[R, 32]``, register order: each thread's 4 bytes an aligned
    word) through per-row byte tables (low ``t0``/``t1``, high ``u0``/``u1``, int32 ``[R]``):
    ``megamoe.kernels.numerics.e2m1x2_lut_prmt``'s PTX, 7 instructions per 8 values. Returns (low values, high
    values) as e4m3."""
    lo, hi = gl.inline_asm_elementwise(asm=_PRMT_LUT_ASM, constraints="=r,=r," + "r," * 16 + "r",
                                       args=[packed, _bc(t0, packed), _bc(t1, packed), _bc(u0, packed),
                                             _bc(u1, packed)], dtype=(gl.uint8, gl.uint8), is_pure=True, pack=4)
    return lo.to(gl.float8e4nv, bitcast=True), hi.to(gl.float8e4nv, bitcast=True)


@gluon.jit
def _cat(x, y):
    """``[R, C]``, ``[R, C]`` -> ``[R, 2C]`` (x's columns first), a register relabelling."""
    R: gl.constexpr = x.shape[0]
    C: gl.constexpr = x.shape[1]
    return gl.reshape(gl.permute(gl.join(x, y), (0, 2, 1)), [R, 2 * C])


@gluon.jit
def _fold_a_rows(a_view, s_mx, s_kb):
    """``e4m3(a * 2^(s_kb - s_mx))`` in place for the rows of ``a_view`` (``[CR, 128]`` e4m3 shared memory), through
    fp16 and the hardware's RNE conversion (exact for every value that survives into e4m3, as ``_fold_e4m3``);
    ``s_mx`` / ``s_kb``: int32 ``[CR]`` in ``SliceLayout(1, A_LAYOUT)``."""
    scale = gl.expand_dims(_pow2_f32(s_kb - s_mx).to(gl.float16), 1)
    a = a_view.load(A_LAYOUT)
    a_view.store((a.to(gl.float16) * scale).to(gl.float8e4nv))


@gluon.jit
def _a_scales(sf, valid, c: gl.constexpr, CR: gl.constexpr, live):
    """This K block's UE8M0 exponents of pool rows ``[c, c + CR)`` (``sf``: the block's scale words; rows past
    ``valid``, or every row when ``live`` is false, read as 0 without a memory access), int32 ``[CR]``."""
    rows = gl.arange(0, CR, layout=gl.SliceLayout(1, A_LAYOUT))
    return gl.load(sf + c + rows, mask=(c + rows < valid) & live, other=0) & 0xFF


@gluon.jit
def _fold_a_stage(a_buf, smax, sf, valid, A0: gl.constexpr, NA: gl.constexpr):
    """L2: fold rows ``[A0, A0 + NA)`` of the A stage ``a_buf`` ``[BM, 128]`` (e4m3) in place per row
    (``_fold_a_rows``). ``smax``: the block's rows' largest per-128 exponents (shared memory); ``sf``: this K
    block's scale words of the block's rows."""
    CR: gl.constexpr = DEC_ROWS if NA > DEC_ROWS else NA  # rows a chunk
    for c in gl.static_range(A0, A0 + NA, CR):
        _fold_a_rows(a_buf.slice(c, CR), smax.slice(c, CR).load(gl.SliceLayout(1, A_LAYOUT)),
                     _a_scales(sf, valid, c, CR, True))


@gluon.jit
def _decode_values(wp, rmax, word, lut, r0: gl.constexpr, ROWS: gl.constexpr):
    """Rows ``[r0, r0 + ROWS)`` of packed W ``wp`` ``[256, 64]`` -> folded e4m3 values ``[ROWS, 128]`` (registers,
    ``D_LAYOUT``): packed bytes ``[0, 32)`` hold K elements ``[0, 32)`` (the low values) and ``[32, 64)`` (the high),
    bytes ``[32, 64)`` K ``[64, 96)`` and ``[96, 128)`` (``transform_weights_for_mega_moe``); ``word``: this K
    block's scale word of each of the rows (int32 ``[ROWS]``, ``SliceLayout(1, D_LAYOUT)``; groups in its four
    bytes); ``rmax``: the 256 rows' largest exponents (shared memory; this partition's rows written by it). ``ROWS``
    64: one row a thread; 128: two."""
    return _decode_values_rm(wp, rmax.slice(r0, ROWS).load(gl.SliceLayout(1, D_LAYOUT)), word, lut, r0, ROWS)


@gluon.jit
def _decode_values_rm(wp, rm, word, lut, r0: gl.constexpr, ROWS: gl.constexpr):
    """``_decode_values`` with the rows' largest exponents ``rm`` in registers (int32 ``[ROWS]``,
    ``SliceLayout(1, D_LAYOUT)``)."""
    p = wp.slice(r0, ROWS)
    t00, t01 = _fold_table(lut, word, rm, 0)
    t10, t11 = _fold_table(lut, word, rm, 1)
    g0, g1 = _decode_prmt(p.slice(0, 32, dim=1).load(D_LAYOUT), t00, t01, t10, t11)
    t20, t21 = _fold_table(lut, word, rm, 2)
    t30, t31 = _fold_table(lut, word, rm, 3)
    g2, g3 = _decode_prmt(p.slice(32, 32, dim=1).load(D_LAYOUT), t20, t21, t30, t31)
    return _cat(_cat(g0, g1), _cat(g2, g3))


@gluon.jit
def _decode_rows(wp, wd, rmax, word, lut, r0: gl.constexpr, ROWS: gl.constexpr):
    """``_decode_values`` stored into rows ``[r0, r0 + ROWS)`` of the e4m3 stage ``wd`` ``[256, 128]``."""
    wd.slice(r0, ROWS).store(_decode_values(wp, rmax, word, lut, r0, ROWS))


@gluon.jit
def _decode_stage(wp, wd, rmax, w_sf, lut, R0: gl.constexpr, NR: gl.constexpr):
    """Rows ``[R0, R0 + NR)`` of a stage (``_decode_rows``), 64 at a time, each chunk's scale words loaded here
    (``w_sf``: this K block's scale words of the tile's 256 rows, one per row)."""
    rows = gl.arange(0, DEC_ROWS, layout=gl.SliceLayout(1, D_LAYOUT))
    for r0 in gl.static_range(R0, R0 + NR, DEC_ROWS):
        _decode_rows(wp, wd, rmax, gl.load(w_sf + r0 + rows), lut, r0, DEC_ROWS)


@gluon.jit
def _decode_stage_smem(wp, wd, rmax, wsf, R0: gl.constexpr, NR: gl.constexpr, lut):
    """``_decode_stage`` with the stage's scale words in shared memory (``wsf``: int32 ``[256]``, TMA'd with the
    stage, ``SF_TMA``)."""
    for r0 in gl.static_range(R0, R0 + NR, DEC_ROWS):
        _decode_rows(wp, wd, rmax, wsf.slice(r0, DEC_ROWS).load(gl.SliceLayout(1, D_LAYOUT)), lut, r0, DEC_ROWS)


@gluon.jit
def _fold_a_stage_smem(a_buf, smax, asf, valid, A0: gl.constexpr, NA: gl.constexpr, HALVES: gl.constexpr = False):
    """``_fold_a_stage`` with the K block's pool-row words in shared memory (``asf``: int32 ``[BM]``, ``SF_TMA``;
    rows past ``valid`` fold by 1). ``HALVES`` (``DECODE_HALVES``): all ``NA`` rows as one load and one store (no
    shared-memory barrier between chunks; ``NA`` bytes of registers a thread)."""
    CR: gl.constexpr = NA if HALVES else (DEC_ROWS if NA > DEC_ROWS else NA)
    rows = gl.arange(0, CR, layout=gl.SliceLayout(1, A_LAYOUT))
    for c in gl.static_range(A0, A0 + NA, CR):
        s_mx = smax.slice(c, CR).load(gl.SliceLayout(1, A_LAYOUT))
        s_kb = gl.where(c + rows < valid, asf.slice(c, CR).load(gl.SliceLayout(1, A_LAYOUT)) & 0xFF, s_mx)
        _fold_a_rows(a_buf.slice(c, CR), s_mx, s_kb)


@gluon.jit
def _decode_stage_halves(wp, wd_lo, wd_hi, rmax, wsf, lut, HI: gl.constexpr = True):
    """``_decode_stage_smem`` of a whole stage (256 rows, one decode partition: BM 128) with ``DECODE_HALVES``: the
    two 128-row halves (two rows a thread) into two buffers (``wd_lo`` / ``wd_hi`` ``[128, 128]`` e4m3, the halves
    the math warpgroups' two wgmmas read), one store each. One buffer written in 64-row chunks makes Triton's
    shared-memory barrier pass put a ``bar.sync`` before each chunk's store (a write after a write to one
    allocation: it cannot tell the chunks' rows apart); stores to two allocations need none. ``HI`` false: the low
    half only (``IDLE_DECODE``: the idle math warpgroup decodes the high one)."""
    HR: gl.constexpr = TILE_N // 2
    wd_lo.store(_decode_values(wp, rmax, wsf.slice(0, HR).load(gl.SliceLayout(1, D_LAYOUT)), lut, 0, HR))
    if HI:
        wd_hi.store(_decode_values(wp, rmax, wsf.slice(HR, HR).load(gl.SliceLayout(1, D_LAYOUT)), lut, HR, HR))


@gluon.jit
def _fold_tile_smem(a_buf, smax, asf, valid, A0: gl.constexpr, NA: gl.constexpr, HALVES: gl.constexpr,
                    IDLE_DECODE: gl.constexpr):
    """The decode partition's ``_fold_a_stage_smem`` of a stage of an L2 tile with ``valid`` pool rows: with
    ``IDLE_DECODE`` and ``valid <= 64`` only the first 64 rows (math warpgroup 0's; warpgroup 1 multiplies none)."""
    if IDLE_DECODE:
        if valid > WM:
            _fold_a_stage_smem(a_buf, smax, asf, valid, A0, NA, HALVES)
        else:
            _fold_a_stage_smem(a_buf, smax, asf, valid, A0, WM, HALVES)
    elif A0 > 0:  # (the second of two partitions: rows [A0, A0 + NA), none of them real where valid <= A0)
        if valid > A0:
            _fold_a_stage_smem(a_buf, smax, asf, valid, A0, NA, HALVES)
    else:
        _fold_a_stage_smem(a_buf, smax, asf, valid, A0, NA, HALVES)


@gluon.jit
def _decode_tile_halves(wp, wd_lo, wd_hi, rmax, wsf, lut, valid, IDLE_DECODE: gl.constexpr):
    """The decode partition's ``_decode_stage_halves`` of a stage of a tile with ``valid`` pool rows: with
    ``IDLE_DECODE`` and ``valid <= 64`` the low half only (math warpgroup 1 decodes the high one). Two calls under
    one branch, not a branch between the halves: each call's code stays one basic block, in which ptxas overlaps the
    high half's loads with the low half's arithmetic (a branch inside cost ~3 % at T = 2048 on an H200)."""
    if IDLE_DECODE:
        if valid > WM:
            _decode_stage_halves(wp, wd_lo, wd_hi, rmax, wsf, lut)
        else:
            _decode_stage_halves(wp, wd_lo, wd_hi, rmax, wsf, lut, False)
    else:
        _decode_stage_halves(wp, wd_lo, wd_hi, rmax, wsf, lut)


@gluon.jit
def _idle_decode_tile(wp_bufs, wd2_bufs, wsf_bufs, ready, decoded2, empty, rm, lut, it, KB, STAGES: gl.constexpr):
    """``IDLE_DECODE``: math warpgroup 1's part of a tile whose pool block has no row of its own (``valid <= 64``):
    per stage, the high half of the weights (rows ``[128, 256)``, ``_decode_values_rm`` with the rows' largest
    exponents ``rm`` in registers) into ``wd2_bufs`` instead of the decode partition, then ``fence.proxy.async``, a
    warpgroup barrier, one arrive on ``decoded2[s]`` (count 1: warpgroup 0 waits on it in such tiles, after
    ``decoded[s]``) and, since this warpgroup reads nothing of the stage after that, one on ``empty[s]``. (Its own
    barrier, not one more arrive on ``decoded[s]`` in every tile: that tied the two math warpgroups together stage by
    stage, and full tiles lost 2 % at T = 2048 on an H200.) Returns the ring position after the tile."""
    HR: gl.constexpr = TILE_N // 2
    for kb in range(KB):
        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        word = wsf_bufs.index(s).slice(HR, HR).load(gl.SliceLayout(1, D_LAYOUT))
        wd2_bufs.index(s).store(_decode_values_rm(wp_bufs.index(s), rm, word, lut, HR, HR))
        fence_async_shared()  # generic-proxy stores, then wgmma (warpgroup 0) reads them
        gl.thread_barrier()  # every warp has stored and fenced before the one arrive
        mbarrier.arrive(decoded2.index(s), count=1)
        mbarrier.arrive(empty.index(s), count=1)
        it += 1
    return it


@gluon.jit
def _decode_partition(buf, w1_sf, w2_sf, rmax1, rmax2, lut, a_bufs, wp_bufs, wd_bufs, wd2_bufs, wsf_bufs, asf_bufs,
                      ready, decoded, rmax_s, smax_s, rfree,
                      tiles, num_l1, num_tiles, l2_mask, state, timeout_ns, OFF_L2_SF: gl.constexpr,
                      H: gl.constexpr, I: gl.constexpr, SP: gl.constexpr, STAGES: gl.constexpr,
                      KW2_PAD: gl.constexpr, BM: gl.constexpr, R0: gl.constexpr,
                      NR: gl.constexpr, A0: gl.constexpr, NA: gl.constexpr, PREFETCH: gl.constexpr,
                      SF_TMA: gl.constexpr, PREDECODED: gl.constexpr, HALVES: gl.constexpr,
                      FOLD_ONCE: gl.constexpr = False, L2_FOLDED: gl.constexpr = True,
                      IDLE_DECODE: gl.constexpr = False):
    """One FP4 decode partition (4 warps), see the module docstring: weight rows ``[R0, R0 + NR)`` of each tile's 256
    and, for L2, pool rows ``[A0, A0 + NA)`` of its ``BM`` (BM 128: one partition, all rows; BM 64: two, each half of
    both). Per tile: the slot ``j % 2`` of the row maxima (waits until the math warpgroups released it, ``rfree``), its
    weight rows' largest exponents into ``rmax_s``, for L2 the block's full arrival mask (acquire) and its pool rows'
    largest per-128 exponents into ``smax_s``. Per stage: for L2 its rows of the A stage folded in place, then its W
    rows: per 64 rows, packed bytes ``[0, 32)`` (K elements ``[0, 32)`` in the low values, ``[32, 64)`` in the high
    ones, register order: ``transform_weights_for_mega_moe``) and ``[32, 64)`` (K ``[64, 96)``, ``[96, 128)``) through
    the fold table into the e4m3 ``[256, 128]`` stage of ``wd_bufs`` (``HALVES``: below); ``fence.proxy.async``
    (wgmma reads it), a partition barrier, one arrive on ``decoded[s]`` (its count: the number of decode partitions,
    so the math reads the stage only when every partition's rows -- W and the folded A -- are in). ``HALVES``
    (``DECODE_HALVES``, one partition with ``SF_TMA``): the stage's W as ``_decode_stage_halves`` into ``wd_bufs`` /
    ``wd2_bufs`` (the two halves) and the A fold as one load and one store. ``FOLD_ONCE``: no A fold here (the math
    warpgroups folded the block's L2 rows once, ``_l1_fold_once``). ``L2_FOLDED`` off (``"hopper_l2_per_block"``): no
    A fold, no pool-row maxima and no wait for the arrival mask either (the partition then reads nothing the L1
    epilogues wrote): an L2 stage is its W decode alone. ``IDLE_DECODE`` (``HALVES``): in a tile whose pool block has
    no row past the first 64 (``valid <= 64``) only the low half of each stage's weights (math warpgroup 1, idle
    there, decodes the high half: ``_idle_decode_tile``)."""
    gl.static_assert((not IDLE_DECODE) or (HALVES and not FOLD_ONCE), "IDLE_DECODE: DECODE_HALVES, no FOLD_ONCE")
    gl.static_assert((not HALVES) or (SF_TMA and NR == TILE_N and not PREFETCH),
                     "DECODE_HALVES decodes a whole stage in one partition, its scale words TMA'd with it")
    RL: gl.constexpr = gl.BlockedLayout([KW_CHUNK, 1], [1, 32], [1, 4], [0, 1])  # [KW_CHUNK, 128 a tile] scale words
    gl.static_assert(L2_FOLDED or not FOLD_ONCE, "FOLD_ONCE folds the L2 A operand: L2_FOLDED")
    FOLD_A: gl.constexpr = L2_FOLDED and not FOLD_ONCE  # this partition folds each L2 A stage
    l2_sf = (buf + OFF_L2_SF).to(gl.pointer_type(gl.int32))
    full = _full_mask(I // 128)
    it = 0
    j = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        b, nt, e, valid = _tile(tiles, t)
        is_l2 = t >= num_l1
        slot = j % 2
        mbarrier.wait(rfree.index(slot), ((j // 2) & 1) ^ 1)  # tile j - 2's epilogues have read the slot
        if is_l2:
            KB = I // BK
            N = H
            w_sf = w2_sf + (e * (I // 128) * H + nt * TILE_N)
            rmax = gl.load(rmax2 + e * H + nt * TILE_N + R0
                           + gl.arange(0, NR, layout=gl.SliceLayout(0, RL))).to(gl.int32)
            if L2_FOLDED:
                _wait_mask(l2_mask + b, full, state, timeout_ns)
                kw = gl.arange(0, KW_CHUNK, layout=gl.SliceLayout(1, RL))
                r = A0 + gl.arange(0, NA, layout=gl.SliceLayout(0, RL))
                smax = gl.zeros([NA], gl.int32, gl.SliceLayout(0, RL))
                for k0 in gl.static_range(0, KW2_PAD, KW_CHUNK):
                    k = gl.expand_dims(k0 + kw, 1)
                    m = (k < I // 128) & gl.expand_dims(r < valid, 0)
                    words = gl.load(l2_sf + k * SP + b * BM + gl.expand_dims(r, 0), mask=m, other=0)
                    smax = gl.maximum(smax, gl.max(words & 0xFF, axis=0))
                smax_s.index(slot).slice(A0, NA).store(smax)
        else:
            KB = H // BK
            N = 2 * I
            w_sf = w1_sf + (e * (H // 128) * (2 * I) + nt * TILE_N)
            rmax = gl.load(rmax1 + e * (2 * I) + nt * TILE_N + R0
                           + gl.arange(0, NR, layout=gl.SliceLayout(0, RL))).to(gl.int32)
        rmax_s.index(slot).slice(R0, NR).store(rmax)
        if PREFETCH:  # K block 0's scale words (W rows; L2: A rows), then each K block loads the next one's
            w_rows = R0 + gl.arange(0, NR, layout=gl.SliceLayout(1, D_LAYOUT))
            word = gl.load(w_sf + w_rows)
            a_word = _a_scales(l2_sf + b * BM, valid, A0, NA, is_l2 & FOLD_A)
        gl.thread_barrier()  # every warp's row maxima are in shared memory before any warp reads them back
        for kb in range(KB):
            s = it % STAGES
            ph = (it // STAGES) & 1
            if PREFETCH:  # issued before the wait: the next K block's words are in flight during this one's decode
                more = kb + 1 < KB
                word_next = gl.load(w_sf + (kb + 1) * N + w_rows, mask=(w_rows >= 0) & more, other=0)
                a_word_next = _a_scales(l2_sf + (kb + 1) * SP + b * BM, valid, A0, NA, is_l2 & more & FOLD_A)
            mbarrier.wait(ready.index(s), ph)
            if PREFETCH:
                if is_l2 and FOLD_A:  # fold the A stage per row (_fold_a_rows), this K block's exponents
                    _fold_a_rows(a_bufs.index(s).slice(A0, NA), smax_s.index(slot).slice(A0, NA).load(
                        gl.SliceLayout(1, A_LAYOUT)), a_word)
                _decode_rows(wp_bufs.index(s), wd_bufs.index(s), rmax_s.index(slot), word, lut, R0, NR)
                word = word_next
                a_word = a_word_next
            else:  # this K block's words: with the stage (SF_TMA) or loaded here
                if is_l2 and FOLD_A:  # fold the A stage per row: e4m3(a * 2^(s_kb - s_max)) (_fold_e4m3)
                    if SF_TMA:
                        _fold_tile_smem(a_bufs.index(s), smax_s.index(slot), asf_bufs.index(s), valid, A0, NA,
                                        HALVES, IDLE_DECODE)
                    else:
                        _fold_a_stage(a_bufs.index(s), smax_s.index(slot), l2_sf + kb * SP + b * BM, valid, A0, NA)
                if not PREDECODED:  # (predecoded weights came decoded: only the L2 A stage's fold was left)
                    if HALVES:
                        _decode_tile_halves(wp_bufs.index(s), wd_bufs.index(s), wd2_bufs.index(s),
                                            rmax_s.index(slot), wsf_bufs.index(s), lut, valid, IDLE_DECODE)
                    elif SF_TMA:
                        _decode_stage_smem(wp_bufs.index(s), wd_bufs.index(s), rmax_s.index(slot), wsf_bufs.index(s),
                                           R0, NR, lut)
                    else:
                        _decode_stage(wp_bufs.index(s), wd_bufs.index(s), rmax_s.index(slot), w_sf + kb * N, lut, R0,
                                      NR)
            fence_async_shared()  # generic-proxy stores to shared memory, then wgmma (async proxy) reads them
            gl.thread_barrier()  # every warp has stored and fenced before the one arrive
            mbarrier.arrive(decoded.index(s), count=1)
            it += 1
        j += 1


@gluon.jit
def _math_partition(buf, buffer_ptrs, me, clamp, a_bufs, wd_bufs, wd2_bufs, ready, decoded, empty, rmax_s, smax_s,
                    rfree, tiles, num_l1, num_tiles, l2_mask, wg: gl.constexpr, OFF_L1_SF: gl.constexpr,
                    OFF_L1_W: gl.constexpr, OFF_L2: gl.constexpr, OFF_L2_SF: gl.constexpr, OFF_META: gl.constexpr,
                    OFF_COMBINE: gl.constexpr, T: gl.constexpr, H: gl.constexpr, I: gl.constexpr, SP: gl.constexpr,
                    STAGES: gl.constexpr, HAS_CLAMP: gl.constexpr, BM: gl.constexpr, NWG: gl.constexpr,
                    TWO_WD: gl.constexpr, arrival=None, FOLD_ONCE: gl.constexpr = False,
                    L2_FOLDED: gl.constexpr = True, asf_bufs=None, SF_TMA: gl.constexpr = False, state=None,
                    timeout_ns=None, IDLE_DECODE: gl.constexpr = False, decoded2=None, wp_bufs=None, wsf_bufs=None,
                    rmax1=None, rmax2=None, lut=None):
    """One math warpgroup of ``NWG`` (BM 128: two, BM 64: one): rows ``[64 wg, 64 wg + 64)`` of every tile's ``BM``,
    its 256 weight rows as two halves of 128; per K block one wgmma into a fresh register tile per half, added into
    the half's float32 accumulator (no scale: the operands are folded). The halves: rows ``[0, 128)`` / ``[128,
    256)`` of ``wd_bufs``' stage, or (``TWO_WD``: ``DECODE_HALVES``) the stages of ``wd_bufs`` / ``wd2_bufs``.
    ``FOLD_ONCE``: after an L1 epilogue, the fold of the block's L2 rows once it is the last (``_l1_fold_once``).
    ``L2_FOLDED`` off (``"hopper_l2_per_block"``): an L2 K block's partial sums are added times their tokens'
    ``2^(s_kb - 127)`` (one FFMA where the folded operand needs an FADD; L1 blocks times 1), the K block's words of
    the warpgroup's rows from the stage (``asf_bufs``, ``SF_TMA``) or else loaded one K block ahead from the pool's
    scale words (after this partition's own acquire of the block's arrival mask at the tile's start), and the L2
    epilogue has no token scale left to apply. ``IDLE_DECODE`` (BM 128, ``TWO_WD``): in a tile whose pool block has
    no row past the first 64 (``valid <= 64``), warpgroup 1 has no rows to multiply; it decodes the high half of each
    stage's weights instead (``_idle_decode_tile``, from ``wp_bufs`` / ``wsf_bufs`` with the rows' maxima from
    ``rmax1`` / ``rmax2`` and the table ``lut``; arrives on ``decoded2[s]``), then runs its epilogue on zero sums: no
    valid row, so it stores nothing (the scales it multiplies by may be read before the decode partition wrote the
    slot: zero times anything, in rows no store takes), releases the maxima slot and, for L1, publishes its rows'
    arrival bit. Warpgroup 0 then waits on ``decoded2[s]`` after ``decoded[s]``, its phase per ring slot in a bit
    mask (``ph2``: the slot's idle stages so far, mod 2)."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 32])
    rows_l: gl.constexpr = gl.SliceLayout(1, mma)
    cols_l: gl.constexpr = gl.SliceLayout(0, mma)
    # the epilogues' 16-byte stores need a shared-memory scratch for their layout change: BM 64's 4 ring stages
    # leave no room for it (240520 B > 232448 with it, offline sm_90a compile)
    COALESCED: gl.constexpr = BM == 128
    l1_sf = (buf + OFF_L1_SF).to(gl.pointer_type(gl.int32))
    l2_sf = (buf + OFF_L2_SF).to(gl.pointer_type(gl.int32))
    spare = gl.zeros([WM, HN], gl.float32, mma)
    r = gl.arange(0, WM, layout=rows_l)
    it = 0
    j = 0
    IDLE: gl.constexpr = IDLE_DECODE and wg == 1  # this warpgroup decodes where its rows are empty
    ph2 = 0  # IDLE_DECODE, warpgroup 0: the phase of decoded2[s] in bit s
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        b, nt, e, valid = _tile(tiles, t)
        is_l2 = t >= num_l1
        if is_l2:
            KB = I // BK
        else:
            KB = H // BK
        KB_MMA = KB  # the K blocks this warpgroup multiplies
        if IDLE:
            if valid <= WM:  # no row of its own: decode the tile's high halves, multiply nothing
                if is_l2:
                    rm_ptr = rmax2 + e * H + nt * TILE_N + HN
                else:
                    rm_ptr = rmax1 + e * (2 * I) + nt * TILE_N + HN
                rm = gl.load(rm_ptr + gl.arange(0, HN, layout=gl.SliceLayout(1, D_LAYOUT))).to(gl.int32)
                it = _idle_decode_tile(wp_bufs, wd2_bufs, wsf_bufs, ready, decoded2, empty, rm, lut, it, KB, STAGES)
                KB_MMA = 0  # (the epilogue below then stores nothing: no valid row; an L1 tile's bit is published)
        acc_lo = gl.zeros([WM, HN], gl.float32, mma)
        acc_hi = gl.zeros([WM, HN], gl.float32, mma)
        if not L2_FOLDED and not SF_TMA:  # the K block scales from the pool: acquire them, then one block ahead
            row_ok = r < valid - wg * WM
            if is_l2:
                _wait_mask(l2_mask + b, _full_mask(I // 128), state, timeout_ns)
            sk_next = gl.load(l2_sf + b * BM + wg * WM + r, mask=row_ok & is_l2, other=127)
        for kb in range(KB_MMA):
            s = it % STAGES
            ph = (it // STAGES) & 1
            if not L2_FOLDED and not SF_TMA:  # this K block's token scales, the next block's load in flight
                sk = sk_next & 0xFF
                sk_next = gl.load(l2_sf + (kb + 1) * SP + b * BM + wg * WM + r,
                                  mask=row_ok & is_l2 & (kb + 1 < KB), other=127)
            mbarrier.wait(ready.index(s), ph)
            mbarrier.wait(decoded.index(s), ph)
            if IDLE_DECODE and wg == 0:
                if valid <= WM:  # warpgroup 1 decoded the stage's high half
                    mbarrier.wait(decoded2.index(s), (ph2 >> s) & 1)
                    ph2 = ph2 ^ (1 << s)
            if not L2_FOLDED and SF_TMA:  # this K block's token scales, landed with the stage (L1: 1)
                sk = gl.where(is_l2, asf_bufs.index(s).slice(wg * WM, WM).load(rows_l) & 0xFF, 127)
            a_s = a_bufs.index(s).slice(wg * WM, WM)
            if TWO_WD:
                w_lo = wd_bufs.index(s)
                w_hi = wd2_bufs.index(s)
            else:
                w_lo = wd_bufs.index(s).slice(0, HN)
                w_hi = wd_bufs.index(s).slice(HN, HN)
            dot = warpgroup_mma(a_s, w_lo.permute((1, 0)), spare, use_acc=False, is_async=True)
            d_lo = warpgroup_mma_wait(num_outstanding=0, deps=(dot, ))
            if L2_FOLDED:
                acc_lo = _pin(acc_lo + d_lo)
            else:
                tsk = gl.expand_dims(_pow2_f32(sk - 127), 1)
                acc_lo = _pin(acc_lo + d_lo * tsk)
            dot = warpgroup_mma(a_s, w_hi.permute((1, 0)), d_lo, use_acc=False, is_async=True)
            d_hi = warpgroup_mma_wait(num_outstanding=0, deps=(dot, ))
            mbarrier.arrive(empty.index(s), count=1)
            if L2_FOLDED:
                acc_hi = acc_hi + d_hi
            else:
                acc_hi = acc_hi + d_hi * tsk
            spare = d_hi
            it += 1
        # the scales: weight rows (columns) from the decode partition's slot (written before its first decoded[s]
        # of the tile), tokens (rows): L1 the pool's folded scale word, L2 the slot's row maxima. Applied one half at
        # a time (exact powers of two: the order is free), so only one half's column scales are live.
        slot = j % 2
        if is_l2:
            if L2_FOLDED:
                ts = _pow2_f32(smax_s.index(slot).slice(wg * WM, WM).load(rows_l) - 127)
            else:  # (applied per K block above)
                ts = gl.full([WM], 1.0, gl.float32, rows_l)
        else:
            word = gl.load(l1_sf + b * BM + wg * WM + r, mask=r < valid - wg * WM, other=127 * 0x01010101)
            ts = _pow2_f32((word & 0xFF) - 127)
        tsc = gl.expand_dims(ts, 1)
        acc_lo = acc_lo * gl.expand_dims(_pow2_f32(rmax_s.index(slot).slice(0, HN).load(cols_l) - 127), 0) * tsc
        acc_hi = acc_hi * gl.expand_dims(_pow2_f32(rmax_s.index(slot).slice(HN, HN).load(cols_l) - 127), 0) * tsc
        gl.thread_barrier()  # the whole warpgroup has read the slot before it is released
        mbarrier.arrive(rfree.index(slot), count=1)
        if is_l2:
            row0 = b * BM + wg * WM
            _l2_epilogue(acc_lo, acc_hi, buf, buffer_ptrs, me, row0, nt * TILE_N, valid - wg * WM, OFF_META,
                         OFF_COMBINE, T, H, mma, COALESCED)
        else:
            old = _l1_epilogue(acc_lo, acc_hi, buf, clamp, b, nt, valid, l2_mask, wg, OFF_L1_W, OFF_L2, OFF_L2_SF, I,
                               SP, HAS_CLAMP, BM, NWG, True, COALESCED, FOLD_ONCE)  # the per-128 UE8M0 requant
            if FOLD_ONCE:
                _l1_fold_once(old, buf, arrival, b, nt, valid, wg, NWG, BM, OFF_L2, OFF_L2_SF, I, SP)
        j += 1


@gluon.jit
def fp4_gemm_phase_kernel(a1_desc, a2_desc, w1_desc, w2_desc, ws1_desc, ws2_desc, as1_desc, as2_desc, buf, w1_sf,
                          w2_sf, rmax1, rmax2, lut, tiles, buffer_ptrs, me, clamp, timeout_ns,
                          OFF_GRID: gl.constexpr, OFF_STATE: gl.constexpr, OFF_L2_MASK: gl.constexpr,
                          OFF_L1_SF: gl.constexpr, OFF_L1_W: gl.constexpr, OFF_L2: gl.constexpr,
                          OFF_L2_SF: gl.constexpr, OFF_META: gl.constexpr, OFF_COMBINE: gl.constexpr,
                          OFF_ARRIVAL: gl.constexpr,
                          T: gl.constexpr, H: gl.constexpr, I: gl.constexpr, SP: gl.constexpr,
                          HAS_CLAMP: gl.constexpr, STAGES: gl.constexpr, MATH_REGS: gl.constexpr,
                          LOAD_REGS: gl.constexpr, DECODE_REGS: gl.constexpr,
                          KW2_PAD: gl.constexpr, PREFETCH: gl.constexpr, SF_TMA: gl.constexpr,
                          PDL: gl.constexpr = False, GROUP_SYNC: gl.constexpr = False,
                          DECODE_HALVES: gl.constexpr = False, FOLD_ONCE: gl.constexpr = False,
                          L2_FOLDED: gl.constexpr = True, IDLE_DECODE: gl.constexpr = False):
    """One rank's GEMM phase (module docstring). Descriptors: ``a1`` L1 pool ``[P, H]`` / ``a2`` L2 pool ``[P, I]``
    e4m3, box [BM, 128] (BM 128 or 64: the pool block, module docstring); ``w1`` / ``w2`` the packed FP4
    bytes of ``[El*2I, H/2]`` / ``[El*H, I/2]`` (transformed: interleaved gate/up rows, register-order nibbles, blocked
    by 256 rows x 128 K and seen as ``[rows, 64]``: ``_w_coord``), box [256, 64];
    ``ws1`` / ``ws2`` the weight scales below and ``as1`` / ``as2`` the pools' MN-major ``[K/128][SP]`` scale
    words, flat int32, boxes [256] / [BM] (read only with ``SF_TMA``). ``buf``: the rank's symmetric buffer (uint8);
    ``w1_sf`` / ``w2_sf``: the transformed (MN-major) int32 UE8M0 weight scales ``[El][H/128][2I]`` /
    ``[El][I/128][H]``; ``lut``: ``megamoe.quant.fold_lut`` (not read: ``_fold_table`` computes the rows; kept for
    ``results/probes/ws_variants_probe.py``'s ``lut_gather`` knock-out, which gathers from it, behind notebook 08's
    figure); ``tiles``: the int32 tile table of the front launch;
    ``buffer_ptrs``: int64 base addresses of every rank's buffer."""
    if PDL:  # launched as a programmatic dependent of the front launch (megamoe.fused.WS_PDL): wait for it to finish
        gdc_wait()  # (and its writes to be visible) before reading anything it wrote; let the back launch be
        gdc_launch_dependents()  # scheduled as this grid's programs exit (it waits likewise)
    state = (buf + OFF_STATE).to(gl.pointer_type(gl.int32))
    l2_mask = (buf + OFF_L2_MASK).to(gl.pointer_type(gl.int64))
    progress = (buf + OFF_GRID).to(gl.pointer_type(gl.int32)) + 1  # grid-sync word 1 (megamoe.kernels.fused)
    arrival = (buf + OFF_ARRIVAL).to(gl.pointer_type(gl.int32))  # FOLD_ONCE: the folded row sets per pool block
    num_l1 = gl.load(tiles)
    num_tiles = num_l1 + gl.load(tiles + 1)
    if gl.load(state + 1) != 0:  # the front launch failed (a barrier timed out): no tile
        num_tiles = 0
    BM: gl.constexpr = a1_desc.block_type.shape[0]
    gl.static_assert((BM == 128) | (BM == 64), "the FP4 Gluon phase runs pool blocks of 128 or 64 rows")
    gl.static_assert((not PREFETCH) or (BM == 64), "PREFETCH decodes a partition's 128 weight rows as one chunk: BM 64")
    gl.static_assert(not (PREFETCH and SF_TMA), "PREFETCH and SF_TMA are two sources of the same scale words")
    NWG: gl.constexpr = BM // WM  # math warpgroups: 2 at BM 128, 1 at BM 64
    NDEC: gl.constexpr = 1 if BM == 128 else 2  # decode partitions (4 warps each)
    WD_LAYOUT: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    XL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])  # (a 1-D layout: .index() views are 1-D)
    a_bufs = gl.allocate_shared_memory(a1_desc.dtype, [STAGES, BM, BK], a1_desc.layout)
    # PREDECODED (the host passes e4m3 weights, box [256, 128], ``megamoe.fold_decode``): the loader's weight stage
    # is already what the math reads, so the decode partitions only fold the L2 A stage
    PREDECODED: gl.constexpr = w1_desc.dtype == gl.float8e4nv
    gl.static_assert(not (PREDECODED and PREFETCH), "PREFETCH loads scale words that a predecoded call does not use")
    # the packed weights are blocked by 256 rows x 128 K (megamoe.quant.block_fp4_weights); predecoded ones row-major
    W_BLOCKED: gl.constexpr = w1_desc.dtype != gl.float8e4nv
    wp_bufs = gl.allocate_shared_memory(w1_desc.dtype, [STAGES, TILE_N, w1_desc.block_type.shape[1]], w1_desc.layout)
    gl.static_assert((not DECODE_HALVES) or (BM == 128 and SF_TMA), "DECODE_HALVES: BM 128, SF_TMA")
    TWO_WD: gl.constexpr = DECODE_HALVES and not PREDECODED  # the decoded stage as two [128, 128] halves
    # math warpgroup 1 decodes the high halves of tiles without rows of its own (megamoe.fused.FP4_WS_IDLE_DECODE)
    IDLE: gl.constexpr = IDLE_DECODE and TWO_WD and BM == 128
    if PREDECODED:
        wd_bufs = wp_bufs
        wd2_bufs = wp_bufs
    elif TWO_WD:
        wd_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, HN, BK], WD_LAYOUT)
        wd2_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, HN, BK], WD_LAYOUT)
    else:
        wd_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, TILE_N, BK], WD_LAYOUT)
        wd2_bufs = wd_bufs
    if SF_TMA:  # the stage's scale words (weight rows, pool rows)
        wsf_bufs = gl.allocate_shared_memory(gl.int32, [STAGES, TILE_N], ws1_desc.layout)
        asf_bufs = gl.allocate_shared_memory(gl.int32, [STAGES, BM], as1_desc.layout)
    else:
        wsf_bufs = gl.allocate_shared_memory(gl.int32, [1, 1], XL)
        asf_bufs = gl.allocate_shared_memory(gl.int32, [1, 1], XL)
    rmax_s = gl.allocate_shared_memory(gl.int32, [2, TILE_N], XL)
    smax_s = gl.allocate_shared_memory(gl.int32, [2, BM], XL)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    decoded = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    if IDLE:  # math warpgroup 1's decode of the high halves in tiles without its rows
        decoded2 = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    else:
        decoded2 = decoded  # (not used)
    rfree = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)  # the loader's expect + the TMA bytes
        mbarrier.init(decoded.index(i), count=NDEC)  # one arrive per decode partition
        if IDLE:
            mbarrier.init(decoded2.index(i), count=1)  # math warpgroup 1's arrive in a tile without its rows
        mbarrier.init(empty.index(i), count=NWG)  # one arrive per math warpgroup
    for i in gl.static_range(2):
        mbarrier.init(rfree.index(i), count=NWG)  # one arrive per math warpgroup
    fence_async_shared()  # barrier inits visible to the async proxy before first use
    if BM == 64:  # one math warpgroup (64 rows x 256), two decode partitions (weight rows and A rows halved)
        gl.warp_specialize([
            (_math_partition, (buf, buffer_ptrs, me, clamp, a_bufs, wd_bufs, wd2_bufs, ready, decoded, empty, rmax_s,
                               smax_s, rfree, tiles, num_l1, num_tiles, l2_mask, 0, OFF_L1_SF, OFF_L1_W, OFF_L2,
                               OFF_L2_SF, OFF_META, OFF_COMBINE, T, H, I, SP, STAGES, HAS_CLAMP, BM, NWG, TWO_WD,
                               arrival, FOLD_ONCE, L2_FOLDED, asf_bufs, SF_TMA, state, timeout_ns)),
            (_load_partition, (a1_desc, a2_desc, w1_desc, w2_desc, ws1_desc, ws2_desc, as1_desc, as2_desc, a_bufs,
                               wp_bufs, wsf_bufs, asf_bufs, ready, empty, tiles, num_l1, num_tiles, l2_mask, progress,
                               state, timeout_ns, H, I, SP, STAGES, SF_TMA, GROUP_SYNC, arrival, FOLD_ONCE,
                               W_BLOCKED)),
            (_decode_partition, (buf, w1_sf, w2_sf, rmax1, rmax2, lut, a_bufs, wp_bufs, wd_bufs, wd2_bufs, wsf_bufs,
                                 asf_bufs, ready, decoded, rmax_s, smax_s, rfree, tiles, num_l1, num_tiles, l2_mask,
                                 state, timeout_ns, OFF_L2_SF, H, I, SP,
                                 STAGES, KW2_PAD, BM, 0, TILE_N // 2, 0, BM // 2, PREFETCH, SF_TMA,
                                 PREDECODED, False, FOLD_ONCE, L2_FOLDED)),
            (_decode_partition, (buf, w1_sf, w2_sf, rmax1, rmax2, lut, a_bufs, wp_bufs, wd_bufs, wd2_bufs, wsf_bufs,
                                 asf_bufs, ready, decoded, rmax_s, smax_s, rfree, tiles, num_l1, num_tiles, l2_mask,
                                 state, timeout_ns, OFF_L2_SF, H, I, SP,
                                 STAGES, KW2_PAD, BM, TILE_N // 2, TILE_N // 2, BM // 2, BM // 2,
                                 PREFETCH, SF_TMA, PREDECODED, False, FOLD_ONCE, L2_FOLDED)),
        ], [1, 4, 4], [LOAD_REGS, DECODE_REGS, DECODE_REGS])
        return
    gl.warp_specialize([
        (_math_partition, (buf, buffer_ptrs, me, clamp, a_bufs, wd_bufs, wd2_bufs, ready, decoded, empty, rmax_s,
                           smax_s, rfree, tiles, num_l1, num_tiles, l2_mask, 0, OFF_L1_SF, OFF_L1_W, OFF_L2,
                           OFF_L2_SF, OFF_META, OFF_COMBINE, T, H, I, SP, STAGES, HAS_CLAMP, BM, NWG, TWO_WD,
                           arrival, FOLD_ONCE, L2_FOLDED, asf_bufs, SF_TMA, state, timeout_ns, IDLE, decoded2)),
        (_math_partition, (buf, buffer_ptrs, me, clamp, a_bufs, wd_bufs, wd2_bufs, ready, decoded, empty, rmax_s,
                           smax_s, rfree, tiles, num_l1, num_tiles, l2_mask, 1, OFF_L1_SF, OFF_L1_W, OFF_L2,
                           OFF_L2_SF, OFF_META, OFF_COMBINE, T, H, I, SP, STAGES, HAS_CLAMP, BM, NWG, TWO_WD,
                           arrival, FOLD_ONCE, L2_FOLDED, asf_bufs, SF_TMA, state, timeout_ns, IDLE, decoded2,
                           wp_bufs, wsf_bufs, rmax1, rmax2, lut)),
        (_load_partition, (a1_desc, a2_desc, w1_desc, w2_desc, ws1_desc, ws2_desc, as1_desc, as2_desc, a_bufs,
                           wp_bufs, wsf_bufs, asf_bufs, ready, empty, tiles, num_l1, num_tiles, l2_mask, progress,
                           state, timeout_ns, H, I, SP, STAGES, SF_TMA, GROUP_SYNC, arrival, FOLD_ONCE,
                           W_BLOCKED)),
        (_decode_partition, (buf, w1_sf, w2_sf, rmax1, rmax2, lut, a_bufs, wp_bufs, wd_bufs, wd2_bufs, wsf_bufs,
                             asf_bufs, ready, decoded, rmax_s, smax_s, rfree, tiles, num_l1, num_tiles, l2_mask,
                             state, timeout_ns, OFF_L2_SF, H, I, SP, STAGES,
                             KW2_PAD, BM, 0, TILE_N, 0, BM, PREFETCH, SF_TMA, PREDECODED, DECODE_HALVES,
                             FOLD_ONCE, L2_FOLDED, IDLE)),
    ], [4, 1, 4], [MATH_REGS, LOAD_REGS, DECODE_REGS])
