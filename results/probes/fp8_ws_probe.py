"""Where the FP8 x FP8 Gluon GEMM phase (tile kind "fp8_ws", ``megamoe.kernels.gemm_fp8_ws``) spends its time, and
the back launch's combine work item, on one EP8 rank's 48 experts of V4-Pro (world size 1, H 7168, I 3072, top-6,
uniform routing). The whole ``fp8_mega_moe(impl="fused")`` call is timed (µs: median of ``triton.testing.do_bench``
with its L2 flush, as the bench).

* ``phase [T1,..]``: the kernel as it is and text-patched copies (written to a temporary file and imported in its
  place; a patched kernel's results are wrong and not checked, except ``noskip``):

  - ``noskip``: a warpgroup whose 64 rows of a 128-row tile are all padding issues its MMAs anyway (the kernel
    before it passed such tiles' stages through); output compared bitwise with ``as_is``;
  - ``nomma``: the math warpgroups wait for each stage and release it, no wgmma, no promotion (what the ring's
    bytes, the pull and the epilogues take alone);
  - ``nopromote``: the wgmma accumulate in the tensor cores across K (``use_acc``), one wait per K block, no
    float32 promotion;
  - ``noepi``: no epilogue stores (the L1 tiles still publish their arrival bits);
  - ``noa`` / ``now``: the loader does not load the A (activation) / W (weight) box of each stage (the stage's
    expected bytes shrink with it): how much each operand's bytes cost. These and ``halfw`` patch the single-CTA
    loads: run them with ``PROBE_MC=0`` (below).
  - ``halfw``: the loader loads only the left 128-row half of W (the right half's MMA reads a stale stage): the
    bytes a CTA would load if a 2-CTA cluster multicast each weight tile, half from each CTA (the same MMA work).
  - ``nopull``: the pull partition copies nothing and the L1 loader waits for no row, on a buffer an as-is call
    filled first (``PREFILL``): what the pull costs the phase.
  - ``dupw`` / ``dupa``: each W (A) box of a stage loaded twice into the same place (twice the bytes into each SM,
    the same operand data: same bits); ``samew``: every W box read from the weights' first block (the same bytes
    into each SM, one constant W operand). With ``halfw``: is the power the bytes delivered or the MMA's data?
  - ``nol2epi`` / ``nol1epi``: one GEMM's epilogue alone knocked out (``noepi`` takes both; the L1 tiles still
    publish their bits); ``l2nomem``: the L2 epilogue's every instruction issued, its stores predicated off (what
    its memory traffic costs against its instructions); ``stream``: after its pull each CTA's pull warps read the
    combine reduce's bytes (6 rows of 2 H bytes a token, 704 MB at T = 8192) from the L1 pool: what an in-phase
    combine's reads would cost the phase under the cap; ``l2contig``: the L2 rows stored in pool order into slot
    0's rows, no metadata loads (session 46). ``uncoalesced``, ``old_epilogue``, ``l2_rows_twice`` and ``l2nomem``
    patch the L2 epilogue that stores from registers, so they run with ``FP8_WS_BULK`` off (``PATCH_SETTINGS``).
  - ``stages3``: the kernel as it is with a 3-stage ring at 128-row tiles instead of 4 (same bits; session 47: the
    price of the shared memory a staged L2 epilogue would need); ``bulk`` / ``nobulk``: ``FP8_WS_BULK`` on / off
    (the L2 epilogue through shared memory and ``cp.async.bulk``, on 3 stages; same bits).

  ``PROBE_REP_MS`` (default 300) sets each timing's window; under the board's power cap (T = 8192) use ~3000, as
  ``clock_probe.py`` does, so that every variant is timed at the limiter's steady clock; ``PROBE_CLOCKS=1`` adds
  the clock and power nvidia-smi sampled during each timing to its row (session 43's rows in
  ``knockout_runs/fp8_phase*_h100.jsonl`` merged an nvidia-smi log by timestamps instead: ``smi_samples``).

  At T = 512 also with 128-row tiles (``FP8_WS_BLOCK64_MAX_EXPECTED = -1``), and at 128-row tiles 3 ring stages.
* ``fp4 [T1,..]``: the FP8 x FP4 Gluon phase ("fp4_ws", which imports this kernel's epilogues) with the epilogues
  as they are and as before (``old_epilogue``), whole ``fp8_fp4_mega_moe`` call; ``as_is`` twice (first and last).
* ``threshold [T1,..]``: the host's choice (the one-launch swap-AB kernel up to ``FP8_SWAP_MAX_EXPECTED``) against
  "fp8_ws" forced at pool blocks 64 and 128, error of each against the reference, ``graph_us`` / ``host_us`` as the
  bench (not yet run).
* ``fp4_threshold [T1,..]``: the same for the FP8 x FP4 format: the host's choice against "fp4_ws" forced at blocks
  64 / 128 below T = 2048, per-block decode against predecoded weights from 2048 (``FP4_MAX_TOKENS`` as ``fp4``).
* ``multicast [T1,..]``: the FP8 phase's 2-CTA weight multicast (``FP8_WS_MULTICAST``) off / on / off / on
  (``probe_multicast``); ``sync_fp8 [T1,..]``: its group sync likewise (``probe_sync_fp8``); ``place [T1,..]``: the
  front launch's placement tasks of 16 / 128 pairs (``probe_place``). (``prefetch``, session 46 at f2a3976: the
  epilogue words prefetched into L1, ``FP8_WS_PREFETCH``, likewise; no gain, removed with the option.)
* ``host [T1,..]``: the host's enqueue time of one eager call of each format and where it goes (cProfile: per
  function calls, own and cumulative µs per call).
* (``prefetch``, at f56e1d4 and in session 15: the front launch's L2 prefetch of the GEMM phase's first tiles, removed
  with it.)
* (``tiled``, at 64ecc8d only: the FP8 GEMM phase reading the weights row-major or from a copy blocked by 128 x 128,
  alternating; the blocked layout then became ``transform_weights_for_mega_moe_sm90``'s.)
* (``decoders`` / ``packed_swizzle``, session 35 at e83c92a: two decode partitions at block 128 and the packed FP4
  weight stage 64-byte swizzled, each against the default; both slower, and removed with the options.)
* ``halves [T1,..]``: the block-128 decode-partition tile's decoded stage as two halves (``FP4_WS_DECODE_HALVES``)
  off / on / off / on, and up to T = 512 the register-operand tile beside it (``probe_halves``).
* ``l2_per_block [T1,..]``: the two Hopper numerics of the FP8 x FP4 call side by side (``probe_l2_per_block``).
* ``as_is [T1,..]``: the FP8 x FP4 call as the host runs it, twice at each T, bits compared (``probe_as_is``).
* ``tiles [T1,..]``: the FP8 x FP4 call in the default GPU numerics with the tile the host picks at T = 512 against
  the other tiles there, both routings (``probe_tiles``).
* (``blocked``, at 9c425dd only: the FP8 x FP4 call with its packed weights row-major or from a copy blocked by 256
  rows x 128 K, alternating, ``results/probes/blocked_runs/``; the blocked layout then became
  ``transform_weights_for_mega_moe``'s.)
* ``combine [T1,..]``: ``COMBINE_TOKENS`` x ``COMBINE_COLUMNS`` of the combine reduce (front and back launches
  recompile), output compared bitwise with the first.

    python results/probes/fp8_ws_probe.py [phase [T1,..] [variant,..] | fp4 [T1,..] | threshold [T1,..]
                                           | fp4_threshold [T1,..] | host [T1,..]
                                           | combine [T1,..] | halves [T1,..]] >> fp8_ws_probe_h200.jsonl
"""
import contextlib
import functools
import importlib.util
import json
import os
import pathlib
import sys
import tempfile
from unittest import mock

import torch

import megamoe  # noqa: F401  (before triton)
import megamoe.fused as mf
import megamoe.kernels as mk
from megamoe import direct_launch
from megamoe.bench import _events_median_us, _median_ms
from megamoe.cases import MoECase, prepare_rank
from megamoe.ops import fp8_fp4_mega_moe
from megamoe.ops_fp8 import fp8_mega_moe
from megamoe.symm import SymmBuffer

REP_MS = float(os.environ.get("PROBE_REP_MS", 300))  #: each ``phase`` timing's window (ms)
#: ``PROBE_CLOCKS=1``: each ``phase`` row also carries the SM clock / power / throttle reasons that nvidia-smi
#: sampled during its timing (``clock_probe.py``'s ``Sampler``)
CLOCKS = os.environ.get("PROBE_CLOCKS") == "1"
#: ``PROBE_MC=0`` / ``1``: ``phase`` runs with ``megamoe.fused.FP8_WS_MULTICAST`` off / on (unset: the host's default,
#: on since session 44). The load knock-outs (``noa``, ``now``, ``halfw``) patch the single-CTA loads: run them with 0.
PROBE_MC = os.environ.get("PROBE_MC")
SHAPE = dict(num_ranks=1, hidden=7168, intermediate=3072, num_experts=48, num_topk=6, block_m=128)

# -- the math loops' wgmma + promotion, as in the kernel (each old text must occur exactly once)
MMA128 = """            dot = warpgroup_mma(a_s, w_s.slice(0, HN).permute((1, 0)), spare, use_acc=False, is_async=True)
            sa = sa_bufs.index(s).slice(wg * WM, WM).load(rows_l)
            d_lo = warpgroup_mma_wait(num_outstanding=0, deps=(dot, ))
            acc_lo = _pin(_promote(acc_lo, d_lo, sa, x, lo_u, gate_col))
            dot = warpgroup_mma(a_s, w_s.slice(HN, HN).permute((1, 0)), d_lo, use_acc=False, is_async=True)
            acc_hi, spare = _retire(dot, empty, s, acc_hi, sa, hi_g, y, gate_col, ARRIVE)
"""
MMA64 = """            dot = warpgroup_mma(a_bufs.index(s), w_bufs.index(s).slice(wg * HN, HN).permute((1, 0)), spare,
                                use_acc=False, is_async=True)
            sa = sa_bufs.index(s).load(rows_l)
            acc, spare = _retire(dot, empty, s, acc, sa, x, y, gate_col)
"""
RELEASE = "            mbarrier.arrive(empty.index(s), count=1)\n"
RELEASE128 = "            mbarrier.arrive(empty.index(s), count=ARRIVE)\n"  # (2 with MC: this CTA's and the peer's)
NOPROMOTE128 = """            acc_lo = warpgroup_mma(a_s, w_s.slice(0, HN).permute((1, 0)), acc_lo, is_async=True)
            acc_hi = warpgroup_mma(a_s, w_s.slice(HN, HN).permute((1, 0)), acc_hi, is_async=True)
            acc_lo, acc_hi = warpgroup_mma_wait(num_outstanding=0, deps=(acc_lo, acc_hi))
            mbarrier.arrive(empty.index(s), count=ARRIVE)
"""
NOPROMOTE64 = """            acc = warpgroup_mma(a_bufs.index(s), w_bufs.index(s).slice(wg * HN, HN).permute((1, 0)),
                                acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            mbarrier.arrive(empty.index(s), count=1)
"""
# -- the epilogues: kept alive behind a condition that never holds (so the accumulators are not dead code)
EPI128 = ("""            if is_l2:
                row0 = b * TILE_M + wg * WM
""", """            else:
                _l1_epilogue(acc_lo, acc_hi, buf, clamp, b, nt, valid, l2_mask, wg, OFF_L1_W, OFF_L2, OFF_L2_SF, I,
                             SP, HAS_CLAMP, TILE_M, 2, False)
""")
NOEPI128 = ("""            if nt < 0:
                row0 = b * TILE_M + wg * WM
""", """            elif not is_l2:
                _l1_publish(l2_mask, b, nt, wg, 1)
""")
EPI64 = ("""        if is_l2:
            v = _l2_values(acc)""", """        else:
            _l1_epilogue_m64(acc, buf, clamp, b, nt, valid, l2_mask, xch, xbar, k1, wg, OFF_L1_W, OFF_L2, OFF_L2_SF,
                             I, SP, HAS_CLAMP)
""")
NOEPI64 = ("""        if nt < 0:
            v = _l2_values(acc)""", """        elif not is_l2:
            _l1_publish(l2_mask, b, nt, wg, 1)
""")
NBYTES = ("nbytes: gl.constexpr = (a1_desc.block_type.nbytes + 2 * w1_desc.block_type.nbytes + "
          "sa1_desc.block_type.nbytes)")


def _tma(desc: str, coord: str, buf: str) -> str:
    """A TMA load of ``_load_stage``'s single-CTA branch (without ``MC``: run the load knock-outs with
    ``PROBE_MC=0``), with its line's leading newline and indentation, so the text is that branch's alone."""
    return f"\n        tma.async_copy_global_to_shared({desc}, {coord}, bar, {buf})"


A_LOADS = (_tma("a_desc", "[a_row, kb * BK]", "a_s"), )
W_LOADS = tuple(_tma("w_desc", c, b) for c, b in (("[w_lo, 0]", "w_s.slice(0, HN)"),  # two blocked boxes a stage
                                                  ("[w_hi, 0]", "w_s.slice(HN, HN)")))
W_HI_LOADS = tuple(t for t in W_LOADS if "[w_hi, 0]" in t)  # each stage's right half of W, both GEMMs
SWCVT = [("from megamoe.kernels.numerics import BF16X2_ROUND_ASM, ceil_ue8m0\n",
          "from megamoe.kernels.numerics import BF16X2_ROUND_ASM, ceil_ue8m0, f32_to_bf16_bits, f32_to_e4m3_bits, "
          "round_to_bf16\n"),
         ("    return x.to(gl.float8e4nv).to(gl.uint8, bitcast=True)\n",
          "    return f32_to_e4m3_bits(x).to(gl.uint8)\n"),
         ("    return x.to(gl.bfloat16).to(gl.int16, bitcast=True)\n", "    return f32_to_bf16_bits(x).to(gl.int16)\n"),
         ('    return gl.inline_asm_elementwise(BF16X2_ROUND_ASM, "=r,=r,r,r", [x], dtype=gl.float32, is_pure=True, '
          'pack=2)\n', "    return round_to_bf16(x)\n")]
UNCOALESCED = [("HAS_CLAMP: gl.constexpr, BM: gl.constexpr, NWG: gl.constexpr, UE8M0: gl.constexpr,\n"
                "                 COALESCED: gl.constexpr = True, ACQ: gl.constexpr = False):",
                "HAS_CLAMP: gl.constexpr, BM: gl.constexpr, NWG: gl.constexpr, UE8M0: gl.constexpr,\n"
                "                 COALESCED: gl.constexpr = False, ACQ: gl.constexpr = False):"),
               ("mma: gl.constexpr, COALESCED: gl.constexpr = True):",
                "mma: gl.constexpr, COALESCED: gl.constexpr = False):")]
# -- session 35's epilogue changes undone, each alone (timing only; the same bits either way)
GUARDED = [("    return _silu_mul(gate, up)\n", "    return gate / (1.0 + gl.exp(-gate)) * up\n"),
           ('    return gl.inline_asm_elementwise(BF16X2_ROUND_ASM, "=r,=r,r,r", [x], dtype=gl.float32, is_pure=True, '
            'pack=2)\n', "    return x.to(gl.bfloat16).to(gl.float32)\n")]
L2_ROWS_TWICE = [("    _l2_store(v_hi, buf, dst_row + HN, ok, OFF_COMBINE)\n",
                  "    dst_hi, ok = _l2_rows(buf, buffer_ptrs, me, row0, n0 + HN, valid, OFF_META, T, H, mma, COALESCED)\n"
                  "    _l2_store(v_hi, buf, dst_hi, ok, OFF_COMBINE)\n")]
# -- the second math warpgroup starts its first tile late, so the two run a few ring stages apart and their epilogues
#    no longer coincide (one issues MMAs while the other is in its epilogue); timing only, same bits
START = ("    spare = gl.zeros([WM, HN], gl.float32, mma)  # the one dot register tile (use_acc=False wgmma writes "
         "into it)\n")


def _stagger(ns: int) -> list:
    return [(START, START + f"""    if wg == 1:
        t_go = _globaltimer_ns() + {ns}
        while _globaltimer_ns() < t_go:
            pass
""")]


#: ``stream``: appended to the pull partition, after its last row's arrival
STREAM_AT = '            gl.atomic_add(arrival + b, ok.to(gl.int32), mask=ok, sem="release", scope="gpu")\n'
STREAM = """    NT = num_rows // 6
    L4: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [PULL_WARPS, 1], [1, 0])
    l1w = l1.to(gl.pointer_type(gl.int32))
    cc = gl.arange(0, 128, layout=gl.SliceLayout(0, L4))
    tok0 = gl.arange(0, ROWS, layout=gl.SliceLayout(1, L4))
    acc = gl.zeros([ROWS, 128], gl.int32, L4)
    for g2 in range(gl.program_id(0), gl.cdiv(NT, ROWS), gl.num_programs(0)):
        tok = g2 * ROWS + tok0
        okt = gl.expand_dims(tok < NT, 1)
        for rep in range(2):
            for h0 in range(0, H // 4, 128):
                for j in gl.static_range(6):
                    src = l1w + gl.expand_dims((j * NT + tok).to(gl.int64) * (H // 4) + h0, 1) + gl.expand_dims(cc, 0)
                    acc = acc ^ gl.load(src, mask=okt, other=0)
    total = gl.sum(gl.sum(acc, axis=1), axis=0)
    if total == 123456789:
        gl.store(arrival, total)
"""

PATCHES = {
    "stagger2us": _stagger(2000),
    "stagger20us": _stagger(20000),
    "swcvt": SWCVT,  # the epilogues' conversions by integer rounding (numerics), as before 2026-12-02 (session 11)
    "uncoalesced": UNCOALESCED,  # the epilogues store from the wgmma layout (BM 64's L1 epilogue stays coalesced)
    "old_epilogue": SWCVT + UNCOALESCED,
    "guarded": GUARDED,  # SwiGLU and the bf16 rounding as before session 35 (ptxas's subnormal guards; same bits)
    "l2_rows_twice": L2_ROWS_TWICE,  # each L2 half makes its rows' destinations itself, as before session 35
    "noskip": [("kb_mma = gl.where(valid > wg * WM, KB, 0)", "kb_mma = gl.where(valid > -1, KB, 0)")],
    "nomma": [(MMA128, RELEASE128), (MMA64, RELEASE)],
    "nopromote": [(MMA128, NOPROMOTE128), (MMA64, NOPROMOTE64)],
    "noepi": [*zip(EPI128, NOEPI128), *zip(EPI64, NOEPI64)],
    "noa": [(NBYTES, NBYTES.replace("a1_desc.block_type.nbytes + ", ""))] + [(t, "") for t in A_LOADS],
    "now": [(NBYTES, NBYTES.replace("2 * w1_desc.block_type.nbytes + ", ""))] + [(t, "") for t in W_LOADS],
    # the bytes a CTA would load if a 2-CTA cluster multicast each weight tile (each CTA one half): W's right half
    # not loaded, its MMA reads whatever the stage held (session 43)
    "halfw": [(NBYTES, NBYTES.replace("2 * w1_desc", "w1_desc")), *[(t, "") for t in W_HI_LOADS]],
    # session 45: whether the power at T = 8192 is the bytes each SM receives or the tensor cores' operand data.
    # dupw / dupa: every W (A) box of a stage loaded twice into the same place -- twice the bytes delivered, the same
    # data in the stage (same bits); samew: every W box read from the weights' first 128 x 128 block -- the same bytes
    # delivered, one constant W operand (and an L2-resident one)
    "dupw": [(NBYTES, NBYTES.replace("2 * w1_desc", "4 * w1_desc")), *[(t, t + t) for t in W_LOADS]],
    "dupa": [(NBYTES, NBYTES.replace("a1_desc.block_type.nbytes + ", "2 * a1_desc.block_type.nbytes + ")),
             *[(t, t + t) for t in A_LOADS]],
    "samew": [(t, t.replace("[w_lo, 0]", "[0, 0]").replace("[w_hi, 0]", "[0, 0]")) for t in W_LOADS],
    # session 45: the pull partition copies nothing and the L1 loader waits for no row (the pool keeps the rows an
    # as-is call pulled before: PREFILL, so that the MMAs see real data)
    "nopull": [("    num_rows = num_blocks * BM\n", "    num_rows = num_blocks * BM * 0\n"),
               ('            landed = gl.atomic_add(arrival + b, 0, sem="acquire", scope="gpu")\n'
                "            if landed < valid:\n",
                "            landed = valid\n            if landed < valid:\n")],
    # session 46: what each epilogue costs the phase (is a TMA-store epilogue worth building?): ``nol2epi`` no L2
    # epilogue at all (the L1 epilogue kept), ``nol1epi`` the converse (pool block 128); ``l2nomem`` every
    # instruction of the L2 epilogue issued, its stores predicated off
    "nol2epi": [("            if is_l2:\n                row0 = b * TILE_M + wg * WM\n",
                 "            if is_l2:\n              if nt < 0:\n                row0 = b * TILE_M + wg * WM\n")],
    "nol1epi": [(EPI128[1], NOEPI128[1])],  # no SwiGLU, requant or stores; the arrival bits still published
    "l2nomem": [("    gl.store(dst, v, mask=gl.expand_dims(ok, 1))\n",
                 "    gl.store(dst, v, mask=gl.expand_dims(ok & (dst_row < 0), 1))\n")],
    # session 46: what the combine reduce's reads would cost inside the phase (an in-phase combine): once its pull is
    # done, each CTA's pull warps read K = 6 rows of 2 H bytes a token (the reduce's 704 MB at T = 8192) from the L1
    # pool, 6 x 16 bytes a thread in flight, and keep an XOR of them (never stored)
    "stream": [(STREAM_AT, STREAM_AT + STREAM)],
    # session 46: the L2 rows stored in pool order into slot 0's rows (row % T): no metadata loads, no scatter
    "l2contig": [("    return (slot * T + token).to(gl.int64) * H + n0 + delta\n",
                  "    return (pool_rows % T).to(gl.int64) * H + n0\n")],
    # session 49: the staged L2 rows copied one 512-byte copy a row from 16 rows a warp (lanes 16-31 predicated off,
    # so ptxas's one-lane-at-a-time issue loop runs 16 times a warp) instead of one 256-byte copy a (row, half) from
    # 32 rows a warp (same bits)
    "rowcopies": [("BULK_ROWS: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [2, 2], [0, 1])",
                   "BULK_ROWS: gl.constexpr = gl.BlockedLayout([1, 1], [16, 2], [4, 1], [0, 1])"),
                  ("BULK_BYTES = 2 * HN.value", "BULK_BYTES = 4 * HN.value"),
                  ("    go = gl.expand_dims(ok.to(gl.int32), 1) + gl.expand_dims(h * 0, 0)",
                   "    go = gl.expand_dims(ok.to(gl.int32), 1) * gl.expand_dims((h == 0).to(gl.int32), 0)")],
}
#: session 50: the row copies issued by the pull warps (``rowcopies`` under ``FP8_WS_COPIER``)
PATCHES["copier_rowcopies"] = PATCHES["rowcopies"]
#: variants timed on a buffer an as-is call has filled first (their own calls do not write all that they read)
PREFILL = ("nopull", )
#: variants that are the kernel as it is under other constants of ``megamoe.fused`` (same bits): ``stages3`` a 3-stage
#: ring at 128-row tiles (what freeing a stage's 48.5 KB of shared memory for an epilogue's staging costs), ``bulk``
#: the L2 epilogue staged and written by ``cp.async.bulk`` (``FP8_WS_BULK``, which takes that stage), ``lead`` math
#: warpgroup 1 started a ring behind warpgroup 0 (``FP8_WS_LEAD``: their epilogues apart), ``nomc`` without the 2-CTA
#: multicast (``FP8_WS_MULTICAST``), ``nobulk_nomc`` without either, ``copier`` / ``nocopier`` the staged L2 copies
#: issued by the pull warps or by the math warpgroups (``FP8_WS_COPIER``)
SETTING_VARIANTS = {"stages3": {"FP8_WS_STAGES": {128: 3, 64: 5}, "FP8_WS_BULK": False},
                    "bulk": {"FP8_WS_BULK": True}, "nobulk": {"FP8_WS_BULK": False}, "lead": {"FP8_WS_LEAD": True},
                    "nomc": {"FP8_WS_MULTICAST": False},
                    "nobulk_nomc": {"FP8_WS_BULK": False, "FP8_WS_MULTICAST": False},
                    "copier": {"FP8_WS_COPIER": True}, "nocopier": {"FP8_WS_COPIER": False}}
#: patched variants whose patches are in the L2 epilogue that stores from registers (``_l2_epilogue``): run with
#: ``FP8_WS_BULK`` off, the kernel they were written against (with it on their L2 part would patch unused code)
PATCH_SETTINGS = {v: {"FP8_WS_BULK": False} for v in ("uncoalesced", "old_epilogue", "l2_rows_twice", "l2nomem")}
PATCH_SETTINGS["copier_rowcopies"] = {"FP8_WS_COPIER": True}  # (its patches are in the copies both paths issue)


def variant_settings(variant: str) -> dict:
    """The constants of ``megamoe.fused`` that ``variant`` runs under (name -> value; empty: the host's)."""
    return SETTING_VARIANTS.get(variant) or PATCH_SETTINGS.get(variant) or {}


def _under(settings: dict):
    """A context in which ``megamoe.fused``'s constants ``settings`` hold (put back on leaving, however left)."""
    return mock.patch.multiple(mf, **settings) if settings else contextlib.nullcontext()
import megamoe.kernels.gemm_fp8_ws as AS_IS  # noqa: E402  (the module as installed: every variant patches its file)


def emit(**row):
    print(json.dumps(row), flush=True)


def patched_source(variant: str) -> str:
    """The text of ``megamoe.kernels.gemm_fp8_ws`` with ``variant``'s patches (each old text exactly once;
    ``tests/test_probes.py`` checks every variant on CPU)."""
    src = pathlib.Path(AS_IS.__file__).read_text()
    for old, new in PATCHES[variant]:
        assert src.count(old) == 1, (variant, old[:70])
        src = src.replace(old, new)
    return src


def _import_file(name: str, path) -> object:
    """The Python file at ``path`` imported afresh as module ``name`` (not entered in ``sys.modules``)."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@functools.lru_cache(maxsize=None)
def kernel_module(variant: str):
    """``megamoe.kernels.gemm_fp8_ws`` as it is, or ``variant``'s text-patched copy (imported from a temporary file)."""
    if variant == "as_is" or variant in SETTING_VARIANTS:
        return AS_IS
    path = pathlib.Path(tempfile.mkdtemp(prefix="fp8_ws_probe_")) / f"gemm_fp8_ws_{variant}.py"
    path.write_text(patched_source(variant))
    return _import_file(f"gemm_fp8_ws_{variant}", path)


@functools.cache
def _clock_sampler_class():
    """``clock_probe.py``'s ``Sampler``, the file beside this one loaded once (it loads this module in turn, by file,
    for its own runs)."""
    return _import_file("clock_probe", pathlib.Path(__file__).with_name("clock_probe.py")).Sampler


def _clock_sampler():
    """An nvidia-smi sampler running from now until its ``stop()`` (``PROBE_CLOCKS``)."""
    return _clock_sampler_class().now()


def use_kernel(mod):
    sys.modules["megamoe.kernels.gemm_fp8_ws"] = mod
    mk.gemm_fp8_ws = mod


def rank(T: int, fmt: str = "fp8", max_tokens: int = 0, numerics: str = "hopper", routing: str = "uniform"):
    """A fresh one-rank buffer (for ``max(T, max_tokens)`` tokens: the launch keywords are cached on it) with case
    ``T`` of format ``fmt`` placed in it: ``(buffer, problem, y, call)``, ``call`` the fused layer (``numerics``, by
    default "hopper", for ``fp8_fp4``). Without CUDA (``tests/test_probes.py``'s dry run of the modes) a one-process CPU
    rank, where the fused kernel runs under the interpreter."""
    case = MoECase(num_tokens=T, format=fmt, routing=routing, **SHAPE)
    shape = (case.num_experts, max(T, max_tokens), case.num_topk, case.hidden, case.intermediate)
    if torch.cuda.is_available():
        sb = SymmBuffer.local(1, *shape, block_m=case.block_m, device="cuda", format=fmt)[0]
    else:
        sb = SymmBuffer(None, *shape, block_m=case.block_m, backend="cpu", format=fmt)
    problem = case.problem(device=sb.buffer.device)
    y, l1, l2, _ = prepare_rank(sb, problem, 0)
    if fmt == "fp8":
        return sb, problem, y, lambda: fp8_mega_moe(y, l1, l2, sb, impl="fused", check=False)
    return sb, problem, y, lambda: fp8_fp4_mega_moe(y, l1, l2, sb, impl="fused", numerics=numerics, check=False)


#: How many times the alternating modes (``rs_threshold``, ``l2_per_block``, ``tiles``, ``rs_ctas``, the block-128
#: options' register-operand rows) run their sequence of choices at each T: twice on the GPU, so that a drift of the
#: clock shows as a difference between the two passes; once in ``tests/test_probes.py``'s dry runs.
ALTERNATIONS = 2


def _tokens(default):
    return [int(t) for t in sys.argv[2].split(",")] if len(sys.argv) > 2 else default


#: The variants each T runs (``as_is`` first: the others' outputs compare with it where they should be equal), and
#: those with 128-row tiles where the host picks 64. (Session 11's first run: "as_is", "noskip", "nomma",
#: "nopromote", "noepi", "noa", "now"; "as_is", "noskip", "nomma"; and 3 stages at T = 8192.)
VARIANTS = tuple(sys.argv[3].split(",")) if len(sys.argv) > 3 else ("as_is", "old_epilogue", "swcvt", "uncoalesced",
                                                                     "noepi")
VARIANTS_128_AT_64 = ("as_is", "old_epilogue")


def probe_phase(tokens=(512, 2048, 8192)):
    saved = mf.FP8_WS_BLOCK64_MAX_EXPECTED, dict(mf.FP8_WS_STAGES), mf.FP8_WS_MULTICAST
    if PROBE_MC is not None:
        mf.FP8_WS_MULTICAST = PROBE_MC == "1"
    runs = []  # (T, block-64 limit, stages at 128, variants)
    for T in _tokens(tokens):
        runs.append((T, saved[0], saved[1][128], VARIANTS))
        if T * SHAPE["num_topk"] / SHAPE["num_experts"] <= saved[0]:  # also the 128-row tile
            runs.append((T, -1, saved[1][128], VARIANTS_128_AT_64))
    for T, limit, stages, variants in runs:
        mf.FP8_WS_BLOCK64_MAX_EXPECTED, mf.FP8_WS_STAGES[128] = limit, stages
        want = None
        for variant in variants:
            with _under(variant_settings(variant)):
                sb, _, y, call = rank(T)
                cfg = mf.fused_config(sb.layout, T, 1, sb.buffer.device)
                try:
                    if variant in PREFILL:
                        use_kernel(AS_IS)
                        call()
                        torch.cuda.synchronize()
                    use_kernel(kernel_module(variant))
                    y.zero_()
                    call()
                    torch.cuda.synchronize()
                except Exception as exc:  # a variant that does not compile is reported, not fatal
                    emit(probe="phase", T=T, variant=variant, error=repr(exc)[:300])
                    sb.destroy()
                    continue
                row = dict(probe="phase", T=T, kind=cfg.kind, block_m=cfg.block_m,
                           stages=mf.fp8_ws_stages(cfg.block_m), bulk=mf.FP8_WS_BULK,
                           copier=mf.FP8_WS_COPIER, variant=variant,
                           multicast=mf.fp8_ws_multicast(cfg.kind, cfg.block_m))
                if (variant in ("as_is", "noskip", "swcvt", "uncoalesced", "old_epilogue", "guarded", "l2_rows_twice",
                                "dupw", "dupa", "rowcopies", "copier_rowcopies", *SETTING_VARIANTS)
                        or variant.startswith("stagger")):
                    want = y.clone() if want is None else want
                    row["bitwise_equal_to_as_is"] = bool(torch.equal(y, want))
                sampler = _clock_sampler() if CLOCKS else None
                us = _median_ms(call, rep_ms=REP_MS) * 1e3
                emit(**row, us=us, **(sampler.stop() if sampler else {}))
                sb.destroy()
        use_kernel(AS_IS)
    mf.FP8_WS_BLOCK64_MAX_EXPECTED = saved[0]
    mf.FP8_WS_STAGES.update(saved[1])
    mf.FP8_WS_MULTICAST = saved[2]


def fp4_kernel_module(variant: str):
    """``megamoe.kernels.gemm_fp4_ws`` loaded afresh against ``variant``'s ``gemm_fp8_ws`` (whose epilogues it
    imports), installed in place of both."""
    use_kernel(kernel_module(variant))
    import megamoe.kernels.gemm_fp4_ws as k4

    mod = _import_file(f"gemm_fp4_ws_{variant}", k4.__file__)
    sys.modules["megamoe.kernels.gemm_fp4_ws"] = mod
    mk.gemm_fp4_ws = mod


#: ``fp4``'s variants (env ``FP4_VARIANTS``, comma-separated) and the buffer's token capacity (env
#: ``FP4_MAX_TOKENS``: the layer bench sizes one buffer for its largest T, 8192).
FP4_VARIANTS = tuple(os.environ.get("FP4_VARIANTS", "as_is,old_epilogue,as_is").split(","))
FP4_MAX_TOKENS = int(os.environ.get("FP4_MAX_TOKENS", 0))


def probe_fp4(tokens=(32, 128, 512)):
    """The FP8 x FP4 Gluon phase ("fp4_ws", "hopper" numerics, the host's pool block) with the epilogues as they are
    and as before (``old_epilogue``): whole ``fp8_fp4_mega_moe`` call, output compared bitwise."""
    for T in _tokens(tokens):
        want = None
        for variant in FP4_VARIANTS:
            fp4_kernel_module(variant)
            sb, _, y, call = rank(T, "fp8_fp4", FP4_MAX_TOKENS)
            cfg = mf.fused_config(sb.layout, T, 1, sb.buffer.device, "hopper")
            y.zero_()
            call()
            torch.cuda.synchronize()
            want = y.clone() if want is None else want
            emit(probe="fp4", T=T, max_tokens=max(T, FP4_MAX_TOKENS), kind=cfg.kind, block_m=cfg.block_m,
                 variant=variant, us=_median_ms(call) * 1e3, bitwise_equal_to_as_is=bool(torch.equal(y, want)))
            sb.destroy()


def _timed(call) -> dict:
    """``us`` (eager, as the bench) and the bench's ``host_us`` / ``graph_us`` (``megamoe.bench._timing_fields``) of a
    warmed-up call."""
    from megamoe.bench import _timing_fields

    return dict(us=_median_ms(call) * 1e3, **_timing_fields(call, graph=True))


def _choice_row(probe: str, T: int, label: str, fmt: str, overrides: dict, noflush: bool = False,
                numerics: str = "hopper", want: torch.Tensor | None = None, routing: str = "uniform") -> torch.Tensor:
    """One row of a threshold probe: ``megamoe.fused``'s constants ``overrides`` (name -> value) set for the call and
    put back after it; the configuration the host picks under them, one call on a fresh buffer, its error against
    the format's reference (``numerics``, by default "hopper", for ``fp8_fp4``) and its timings (``noflush``: also
    ``us_noflush``, ``megamoe.bench._events_median_us`` of 20 calls; ``want``: an earlier row's output, compared
    bit for bit, ``bitwise_equal_to_first``; ``routing``: the case's, as the bench's). Returns the call's output (a
    copy)."""
    from megamoe.testing import moe_error_stats

    saved = {n: getattr(mf, n) for n in overrides}
    for n, v in overrides.items():
        setattr(mf, n, v)
    try:
        numerics = numerics if fmt == "fp8_fp4" else "exact"
        sb, problem, y, call = rank(T, fmt, FP4_MAX_TOKENS if fmt == "fp8_fp4" else 0, numerics, routing)
        cfg = mf.fused_config(sb.layout, T, 1, sb.buffer.device, numerics)
        y.fill_(float("nan"))
        call()
        torch.cuda.synchronize()
        err = moe_error_stats(y, problem.reference(numerics=numerics)[0])
        emit(probe=probe, T=T, choice=label, numerics=numerics, routing=routing, kind=cfg.kind, block_m=cfg.block_m,
             predecode=cfg.predecode, idle_decode=cfg.idle_decode,
             rs_block_n=cfg.rs_block_n, **_timed(call), **({"us_noflush": _events_median_us(call, 20)} if noflush else {}),
             rel_fro=err["rel_fro"], max_row_rel=err["max_row_rel"],
             **({} if want is None else {"bitwise_equal_to_first": bool(torch.equal(y, want))}))
        out = y.clone()
        sb.destroy()
        return out
    finally:
        for n, v in saved.items():
            setattr(mf, n, v)


def probe_threshold(tokens=(32, 128, 256)):
    """Where the Gluon phase should take over from the one-launch swap-AB kernel (``FP8_WS_MIN_EXPECTED``): at each T
    the host's choice, then "fp8_ws" forced at pool block 64 and 128; error of each against the FP8 reference."""
    forced = dict(FP8_WS_MIN_EXPECTED=-1, FP8_SWAP_MAX_EXPECTED=-1)
    for T in _tokens(tokens):
        for label, overrides in (("host", {}), ("fp8_ws 64", dict(forced, FP8_WS_BLOCK64_MAX_EXPECTED=float("inf"))),
                                 ("fp8_ws 128", dict(forced, FP8_WS_BLOCK64_MAX_EXPECTED=-1))):
            _choice_row("threshold", T, label, "fp8", overrides)


#: ``fp4_threshold``: from this T on, per-block decode against predecoded weights instead of the tile kinds.
PREDECODE_FROM_T = 2048


def probe_fp4_threshold(tokens=(8, 32)):
    """Where the FP8 x FP4 Gluon phase ("fp4_ws") should take over from the one-launch "hopper" kernel
    (``FP4_WS_MIN_EXPECTED``, set in session 8 when "fp4_ws" took 1304 us at T = 8, block 128): at each T the host's
    choice, then "fp4_ws" forced at pool blocks 64 and 128; and at T >= 2048 per-block decode against the predecoded
    weights (``FP4_PREDECODE_MIN_EXPECTED``, set with a 1867 us decode pass that now takes 1329). Error of each
    against the "hopper" reference; ``us``, ``graph_us`` and ``host_us`` as the bench."""
    for T in _tokens(tokens):
        if T < PREDECODE_FROM_T:
            choices = (("fp4_ws 64", dict(FP4_WS_MIN_EXPECTED=-1, FP4_BLOCK64_MAX_EXPECTED=float("inf"),
                                          FP4_RS_MAX_EXPECTED=-1)),  # (the decode-partition tile at each block)
                       ("fp4_ws 128", dict(FP4_WS_MIN_EXPECTED=-1, FP4_BLOCK64_MAX_EXPECTED=-1, FP4_RS_MAX_EXPECTED=-1)))
        else:
            choices = (("per-block decode", dict(FP4_PREDECODE_MIN_EXPECTED=float("inf"))),
                       ("predecoded", dict(FP4_PREDECODE_MIN_EXPECTED=0)))
        for label, overrides in (("host", {}), *choices):
            _choice_row("fp4_threshold", T, label, "fp8_fp4", overrides)


def probe_pdl(tokens=(32, 128)):
    """Programmatic dependent launch between a Gluon kind's three launches (``WS_PDL``) off and on, whole call at
    the host's tile choice, both formats at each T (the FP8 x FP4 one also at T = 8); ``us``, ``graph_us`` and
    ``host_us`` as the bench, error against the reference (the bits are compared in
    ``tests/gpu/test_ws_launch_options_gpu.py``)."""
    rows = [(fmt, T) for T in _tokens(tokens) for fmt in ("fp8", "fp8_fp4")]
    for fmt, T in rows + ([("fp8_fp4", 8)] if ("fp8_fp4", 8) not in rows else []):
        for pdl in (False, True):
            _choice_row("pdl", T, f"pdl {'on' if pdl else 'off'}", fmt, {"WS_PDL": pdl})


def probe_lead(tokens=(2048, 8192)):
    """The FP8 phase's math warpgroups started a ring apart (``FP8_WS_LEAD``) off / on / off / on, whole call, rows
    as ``pdl`` (first run, session 16 at 4af2dae, by a separate script with the bench's timing only)."""
    for T in _tokens(tokens):
        for lead in (False, True, False, True):
            _choice_row("lead", T, f"lead {'on' if lead else 'off'}", "fp8", {"FP8_WS_LEAD": lead})


def probe_multicast(tokens=(512, 2048, 8192)):
    """The FP8 phase at pool block 128 in 2-CTA clusters with the weight stream multicast (``FP8_WS_MULTICAST``,
    ``megamoe.multicast``) off / on / off / on, whole call (:func:`_off_on`); then the grids (clusters) the "on"
    rows launched. (The first run, at 5a7d2ee, timed ``pdl``'s way: ``us`` / ``graph_us`` / ``host_us`` as the
    bench.)"""
    _off_on("multicast", tokens, "FP8_WS_MULTICAST", (False, True))
    emit(probe="multicast", clusters=sorted(set(mf._CLUSTERS.values())))


def probe_sync_fp8(tokens=(2048, 8192)):
    """The FP8 phase's group sync (``WS_GROUP_SYNC["fp8_ws"]``) off / on / off / on at the host's defaults (since
    session 44 with ``FP8_WS_MULTICAST``: its weight pairs already load each weight tile once for two pool blocks),
    whole call (:func:`_off_on`)."""
    _off_on("sync_fp8", tokens, "WS_GROUP_SYNC", tuple({"fp8_ws": v, "fp4_ws": False} for v in (False, True)))


def probe_place(tokens=(2048, 8192)):
    """The FP8 front launch's placement tasks of ``PLACE_BLOCK_PAIRS`` 16 (the pull's) / 128 pairs, whole call
    (:func:`_off_on`; session 45)."""
    _off_on("place", tokens, "PLACE_BLOCK_PAIRS", (16, 128))


def _off_on(probe: str, tokens, name: str, values) -> None:
    """Rows ``probe``: ``megamoe.fused.<name>`` at ``values`` (off, on) alternating twice at each T, the FP8 call on a
    fresh buffer each: ``us`` over ``PROBE_REP_MS`` windows (with ``PROBE_CLOCKS=1`` the clock and power sampled
    meanwhile), its error against the reference, its output compared bit for bit with the first."""
    from megamoe.testing import moe_error_stats

    saved = getattr(mf, name)
    for T in _tokens(tokens):
        want = None
        for value in (*values, *values):
            setattr(mf, name, value)
            sb, problem, y, call = rank(T)
            cfg = mf.fused_config(sb.layout, T, 1, sb.buffer.device)
            y.fill_(float("nan"))
            call()
            torch.cuda.synchronize()
            err = moe_error_stats(y, problem.reference()[0])
            want = y.clone() if want is None else want
            sampler = _clock_sampler() if CLOCKS else None
            us = _median_ms(call, rep_ms=REP_MS) * 1e3
            emit(probe=probe, T=T, **{name: value}, on=value == values[1], kind=cfg.kind, block_m=cfg.block_m,
                 rep_ms=REP_MS, us=us, rel_fro=err["rel_fro"], bitwise_equal_to_first=bool(torch.equal(y, want)),
                 **(sampler.stop() if sampler else {}))
            sb.destroy()
    setattr(mf, name, saved)


def probe_group_sync(tokens=(512, 2048, 8192)):
    """The Gluon phases' programs that share a weight tile starting it together (``WS_GROUP_SYNC``) off / on / off /
    on, both formats, whole call, rows as ``pdl`` (error against the reference at the real size; the bits on / off
    are compared in ``tests/gpu/test_ws_launch_options_gpu.py``)."""
    for T in _tokens(tokens):
        for fmt in ("fp8", "fp8_fp4"):
            for sync in (False, True, False, True):
                _choice_row("group_sync", T, f"group_sync {'on' if sync else 'off'}", fmt,
                            {"WS_GROUP_SYNC": {"fp8_ws": sync, "fp4_ws": sync}})


def probe_back_programs(tokens=(8, 128, 512, 2048, 8192)):
    """Programs an SM of the Gluon kinds' back launch (``WS_BACK_PROGRAMS_PER_SM``) 1 / 4 / 1 / 4, both formats,
    whole call, rows as ``pdl`` (the bits are compared in ``tests/gpu/test_ws_launch_options_gpu.py``). Why again:
    session 11 saw under 1 % whole call between 1, 2 and 4; session 22's profile of the back launch alone at
    T = 8192 (FP8) took 351 / 353 us at one program an SM and 204 / 203 at four."""
    for T in _tokens(tokens):
        for fmt in ("fp8", "fp8_fp4"):
            for programs in (1, 4, 1, 4):
                _choice_row("back_programs", T, f"back {programs}", fmt, {"WS_BACK_PROGRAMS_PER_SM": programs})


def probe_rs_threshold(tokens=(512, 1024)):
    """Where the register-operand tile should hand over to the decode-partition tile (``FP4_RS_MAX_EXPECTED``): at
    each T the register-operand tile at chunk 64 (``FP4_RS_MAX_EXPECTED`` raised past T's expected tokens per expert)
    against the decode-partition tile (-1), alternating twice, whole call with its error (``FP8 x FP4``, "hopper").
    Session 24's GEMM-phase sweep (``rs_variant_sweep``) had them at 1868 / 1911 us at T = 1024 (128 expected), the
    whole call at 2057 / 1997; ``us_noflush`` (calls back to back, no L2 flush, as the phase profile runs them) asks
    whether the flush before each timed call is what turns the phase's lead around."""
    for T in _tokens(tokens):
        for _ in range(ALTERNATIONS):
            for label, limit in (("rs 64", float("inf")), ("decode-partition", -1)):
                _choice_row("rs_threshold", T, label, "fp8_fp4", {"FP4_RS_MAX_EXPECTED": limit}, noflush=True)


def _block128_off_on(probe: str, option: str, tokens, **forced) -> None:
    """Rows ``probe`` of a block-128 option of the decode-partition tile (``megamoe.fused`` dict ``option``, block 64
    off): at each T off / on / off / on, the tile forced (``FP4_RS_MAX_EXPECTED = -1``), whole call with its error;
    up to T = 512 also the register-operand tile (chunk 64) twice, the tile the host runs there."""
    for T in _tokens(tokens):
        for on in (False, True, False, True):
            _choice_row(probe, T, f"{probe} {'on' if on else 'off'}", "fp8_fp4",
                        {option: {128: on, 64: False}, "FP4_RS_MAX_EXPECTED": -1, **forced})
        if T <= 512:
            for _ in range(ALTERNATIONS):
                _choice_row(probe, T, "rs 64", "fp8_fp4", {"FP4_RS_MAX_EXPECTED": float("inf")})


def probe_halves(tokens=(512, 1024, 2048, 8192)):
    """The block-128 decode-partition tile's decoded stage as two half buffers (``FP4_WS_DECODE_HALVES``: the stage
    loop's ``bar.sync`` 8 -> 3 offline, predecoded 5 -> 3) off / on / off / on, whole call at each T with its error
    (``FP8 x FP4``, "hopper"; the decode-partition tile forced: ``FP4_RS_MAX_EXPECTED = -1``; from T = 2048 the host
    predecodes, where only the L2 A fold changes). Up to T = 512 also the register-operand tile (chunk 64) twice,
    for ``FP4_RS_MAX_EXPECTED``: the hand-over sat between 32 and 64 expected tokens in session 28's ``rs_threshold``
    rows. The bits off and on are compared in ``tests/gpu/test_ws_launch_options_gpu.py``."""
    _block128_off_on("halves", "FP4_WS_DECODE_HALVES", tokens)


def probe_fold_once(tokens=(512, 2048, 8192)):
    """The block-128 decode-partition tile's L2 A operand folded once per pool block by the math warpgroups
    (``FP4_WS_FOLD_ONCE``) against per stage by the decode partition, off / on / off / on, whole call at each T with
    its error (``FP8 x FP4``, "hopper"; the decode-partition tile forced: ``FP4_RS_MAX_EXPECTED = -1``; at T = 8192
    the host predecodes). At T = 512 also the register-operand tile (chunk 64) twice, for ``FP4_RS_MAX_EXPECTED``.
    The bits off and on are compared in ``tests/gpu/test_ws_launch_options_gpu.py``."""
    _block128_off_on("fold_once", "FP4_WS_FOLD_ONCE", tokens)


def probe_idle_decode(tokens=(512, 1024, 2048)):
    """The block-128 decode-partition tile's idle math warpgroup decoding the high half of each stage where its 64
    rows of the pool block are empty (``FP4_WS_IDLE_DECODE``: the expert's last block holds <= 64 rows) off / on /
    off / on, whole call at each T with its error (``FP8 x FP4``, "hopper"; the decode-partition tile forced:
    ``FP4_RS_MAX_EXPECTED = -1``; "on" at every T: ``FP4_WS_IDLE_MAX_EXPECTED`` lifted). Up to T = 512 also the
    register-operand tile (chunk 64) twice. The bits off and on are compared in ``tests/gpu/test_ws_launch_options_gpu.py``."""
    _block128_off_on("idle_decode", "FP4_WS_IDLE_DECODE", tokens, FP4_WS_IDLE_MAX_EXPECTED=float("inf"))


def probe_as_is(tokens=(32, 128, 512, 2048)):
    """The FP8 x FP4 call as the host runs it (no constant changed: its tile, "hopper"), twice at each T, whole call
    with its error, the second output compared bit for bit with the first: the rows a layout or kernel change is
    compared against on the same kind of GPU (e.g. ``blocked_runs/``: the transform's blocked weights against the
    blocked copy's rows)."""
    for T in _tokens(tokens):
        want = _choice_row("as_is", T, "as is", "fp8_fp4", {})
        _choice_row("as_is", T, "as is", "fp8_fp4", {}, want=want)


#: ``l2_per_block``: the T at which the decode-partition tile is also timed in both numerics (where the host runs
#: the register-operand tile and the hand-over ``FP4_RS_MAX_EXPECTED`` sits).
L2PB_FORCED_T = 512


def probe_l2_per_block(tokens=(128, 512, 2048, 8192)):
    """The FP8 x FP4 call in ``numerics="hopper"`` (the L2 A operand folded per token: in the decode partitions'
    every L2 stage, or once per pool block in the register-operand tile) against ``"hopper_l2_per_block"`` (no fold;
    each K block's token scales in the math's per-K-block add), alternating twice, whole call with its error against
    its own model, the tile the host picks; at T = ``L2PB_FORCED_T`` also the decode-partition tile forced
    (``FP4_RS_MAX_EXPECTED = -1``), for ``FP4_RS_MAX_EXPECTED``. The bits of the two modes are compared in
    ``tests/gpu/test_l2_per_block_gpu.py``."""
    for T in _tokens(tokens):
        for _ in range(ALTERNATIONS):
            for numerics in ("hopper", "hopper_l2_per_block"):
                _choice_row("l2_per_block", T, f"{numerics} host", "fp8_fp4", {}, numerics=numerics)
        if T == L2PB_FORCED_T:
            for _ in range(ALTERNATIONS):
                for numerics in ("hopper", "hopper_l2_per_block"):
                    _choice_row("l2_per_block", T, f"{numerics} decode-partition", "fp8_fp4",
                                {"FP4_RS_MAX_EXPECTED": -1}, numerics=numerics)


#: ``tiles``: the T = 512 tile choices settled under "hopper", as overrides of ``megamoe.fused``'s constants.
TILE_CHOICES = (("as is", {}), ("idle decode off", {"FP4_WS_IDLE_DECODE": {128: False, 64: False}}),
                ("block 64", {"FP4_BLOCK64_MAX_EXPECTED": float("inf")}),
                ("register-operand", {"FP4_RS_MAX_EXPECTED": float("inf")}))


def probe_tiles(tokens=(512,)):
    """The FP8 x FP4 call in the default GPU numerics (``megamoe.ops.AUTO_GPU_NUMERICS``: "hopper_l2_per_block"
    since session 38) at T whose tile was chosen under "hopper" (T = 512: the decode-partition tile at block 128 with
    the idle warpgroup decoding): the host's tile against idle decode off, pool block 64 and the register-operand tile
    (at the chunk the expected count takes: 64 at T = 512) (:data:`TILE_CHOICES`), alternating twice, uniform and
    skewed routing, whole call with its error."""
    from megamoe.ops import AUTO_GPU_NUMERICS

    for T in _tokens(tokens):
        for routing in ("uniform", "skewed"):
            for _ in range(ALTERNATIONS):
                for label, overrides in TILE_CHOICES:
                    _choice_row("tiles", T, label, "fp8_fp4", overrides, numerics=AUTO_GPU_NUMERICS,
                                routing=routing)


def probe_rs_ctas(tokens=(128,)):
    """The register-operand tile at the token chunk each T takes (chunk 32 at T = 128: 16 expected tokens per expert)
    as is against that chunk's settings in ``megamoe.fused.FP4_RS_CANDIDATES`` (the measured alternatives, dropped
    ones in that dict's comment), alternating twice, whole call with its error (``FP8 x FP4``, "hopper")."""
    for T in _tokens(tokens):
        chunk = mf.fp4_rs_block_n(mf.expected_tokens_per_expert(MoECase(num_tokens=T, **SHAPE).layout(), T))
        variants = {"as is": {}, **{name: mf.fp4_rs_variant(chunk, *setting)
                                    for name, setting in mf.FP4_RS_CANDIDATES.get(chunk, {}).items()}}
        for _ in range(ALTERNATIONS):
            for label, overrides in variants.items():
                _choice_row("rs_ctas", T, label, "fp8_fp4", overrides)


def probe_host(tokens=(128, 512)):
    """Where the host's enqueue time of one eager call goes (session 7's wall-gap probe: 0.66-1.35 ms a call, about
    the GPU time of an FP8 x FP4 call at T <= 128): per T and format, ``host_us`` and the 25 functions of largest
    cumulative time under cProfile over ``HOST_PROFILE_CALLS`` calls (µs per call; each call from an idle stream).
    On a GPU also the same call with ``megamoe.direct_launch.ENABLED`` off, every launch through
    ``JITFunction.run`` (``jit_run``: ``host_us``, ``us``, and ``y`` bitwise equal to the direct launches'; until
    session 19 the row's ``direct`` was the reverse experiment, a probe-local ``DirectLaunch`` against the library's
    ``JITFunction.run`` launches), and with ``megamoe.direct_launch.RAW`` off, a hit through the compiled kernel's
    runner instead of its C launcher (``runner``: the same fields; session 32)."""
    import cProfile
    import pstats

    from megamoe.bench import _host_us

    for T in _tokens(tokens):
        for fmt in ("fp8", "fp8_fp4"):
            sb, _, y, call = rank(T, fmt)
            call()
            torch.cuda.synchronize()
            host_us = _host_us(call)
            jit_run = runner = None
            if torch.cuda.is_available():  # (the interpreter's launches always go through JITFunction)
                want = y.clone()
                jit_run = _host_variant(call, y, want, "ENABLED")
                runner = _host_variant(call, y, want, "RAW")
                jit_run["us_direct"] = _median_ms(call) * 1e3
            prof = cProfile.Profile()
            for _ in range(HOST_PROFILE_CALLS):
                torch.cuda.synchronize()
                prof.enable()
                call()
                prof.disable()
            torch.cuda.synchronize()
            stats = pstats.Stats(prof).stats  # {(file, line, name): (calls, prim calls, tottime, cumtime, callers)}
            top = sorted(stats.items(), key=lambda kv: -kv[1][3])[:25]
            cfg = mf.fused_config(sb.layout, T, 1, sb.buffer.device, "hopper" if fmt == "fp8_fp4" else "exact")
            emit(probe="host", T=T, format=fmt, kind=cfg.kind, host_us=host_us, jit_run=jit_run, runner=runner, top=[
                [f"{pathlib.Path(f).name}:{line}({name})", n // HOST_PROFILE_CALLS,
                 round(tot / HOST_PROFILE_CALLS * 1e6, 1), round(cum / HOST_PROFILE_CALLS * 1e6, 1)]
                for (f, line, name), (n, _, tot, cum, _) in top])
            sb.destroy()


def _host_variant(call, y, want, switch: str) -> dict:
    """``call`` with ``megamoe.direct_launch``'s ``switch`` (``"ENABLED"`` / ``"RAW"``) off: ``host_us``, ``us`` and
    ``y`` bitwise equal to ``want`` (or the error, reported in the row: the experiment, not the probe, failed)."""
    from megamoe.bench import _host_us

    try:
        setattr(direct_launch, switch, False)
        y.fill_(float("nan"))
        call()
        torch.cuda.synchronize()
        return dict(host_us=_host_us(call), us=_median_ms(call) * 1e3,
                    bitwise_equal=bool(torch.equal(y.view(torch.int16), want.view(torch.int16))))
    except Exception as exc:
        return dict(error=repr(exc)[:300])
    finally:
        setattr(direct_launch, switch, True)


#: Eager calls ``host`` profiles per row.
HOST_PROFILE_CALLS = 50


def probe_combine(tokens=(8192,), variants=((8, 256), (16, 512), (8, 1024))):
    saved = mf.COMBINE_TOKENS, mf.COMBINE_COLUMNS
    for T in _tokens(tokens):
        want = None
        for ct, ch in variants:
            mf.COMBINE_TOKENS, mf.COMBINE_COLUMNS = ct, ch
            sb, _, y, call = rank(T)
            y.zero_()
            call()
            torch.cuda.synchronize()
            want = y.clone() if want is None else want
            emit(probe="combine", T=T, combine_tokens=ct, combine_columns=ch, us=_median_ms(call) * 1e3,
                 bitwise_equal_to_first=bool(torch.equal(y, want)))
            sb.destroy()
    mf.COMBINE_TOKENS, mf.COMBINE_COLUMNS = saved


if __name__ == "__main__":
    which = sys.argv[1:2] or ["phase", "combine"]
    emit(probe="start", torch=torch.__version__, gpu=torch.cuda.get_device_name(), which=which,
         commit=os.environ.get("MEGAMOE_GIT_COMMIT"))
    for name in which:
        {"phase": probe_phase, "combine": probe_combine, "fp4": probe_fp4, "threshold": probe_threshold,
         "fp4_threshold": probe_fp4_threshold, "host": probe_host, "pdl": probe_pdl,
         "lead": probe_lead, "group_sync": probe_group_sync, "multicast": probe_multicast, "place": probe_place,
         "sync_fp8": probe_sync_fp8, "rs_ctas": probe_rs_ctas,
         "rs_threshold": probe_rs_threshold, "back_programs": probe_back_programs, "halves": probe_halves,
         "idle_decode": probe_idle_decode,
         "fold_once": probe_fold_once, "l2_per_block": probe_l2_per_block, "as_is": probe_as_is,
         "tiles": probe_tiles}[name]()
