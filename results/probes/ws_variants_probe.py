"""Where the FP8 x FP4 Gluon GEMM phase (tile kind "fp4_ws") spends its time, and two host choices of the Gluon
kinds, on one EP8 rank's 48 experts of V4-Pro (world size 1, H 7168, I 3072, top-6, uniform routing):

* ``fp4``: the whole ``fp8_fp4_mega_moe(impl="fused", numerics="hopper")`` call with the kernel as it is and with
  text-patched copies of ``megamoe.kernels.gemm_fp4_ws`` (written to a temporary file and imported in its place;
  the results of a patched kernel are wrong and are not checked): ``nodecode`` (the decode partition waits and
  arrives but neither decodes W nor folds the L2 A stage: what the phase takes if the decode were free),
  ``nopromote`` (each math warpgroup issues both halves' wgmma into its float32 accumulators and waits once per K
  block: the cost of the per-K-block add), both.
* ``back``: ``WS_BACK_PROGRAMS_PER_SM`` 1 / 2 / 4 for the "fp8_ws" and "fp4_ws" back launch (output checked
  bitwise against 1: the combine sums in the same order).
* ``threshold``: at T = 8 / 32 / 128 the one-launch "hopper" kernel against "fp4_ws" forced
  (``FP4_WS_MIN_EXPECTED = -1``), error of each against ``reference(numerics="hopper")``.
* ``block``: at T = 64 / 128 / 256 / 512 / 1024 "fp4_ws" forced at pool block 64 (one math warpgroup, two decode
  partitions) and 128 (``FP4_BLOCK64_MAX_EXPECTED`` = inf / -1), error of each against the reference: where the
  64-row tile should take over (``FP4_BLOCK64_MAX_EXPECTED``).

* ``predecode``: at T = 512 / 2048 / 8192 the predecoded path (weights decoded once per call by
  ``megamoe.fold_decode``) against decoding per pool block, at 3 stages and the most that fit; the decode pass alone.
* ``scale_words``: at T = 128 / 512 (block 64) and 2048 (block 128) where the decode partitions get each K block's
  scale words: a load in the stage, one K block ahead (``FP4_WS_PREFETCH``, block 64), by TMA with the stage
  (``FP4_WS_SF_TMA``); at block 64 also 4 ring stages; error of each against the reference.
* ``knockout [T1,..]``: the decode partition's stage piece by piece (``probe_knockout``): the fold tables computed
  (as is) or gathered (as before, bitwise compared), then knock-outs of the table, the fence, the W decode, the
  whole decode, the wgmma.
* ``knockout2 [T1,..]`` (session 40, ``probe_knockout2``): in the default GPU numerics, the stage's shared-memory
  streams one at a time: no packed-W load in the decode warps, no packed-W TMA, both, no token-row TMA, half the
  wgmma, against session 36's whole-decode and whole-wgmma knock-outs.
* ``fold_decode``: the decode pass alone at rows a program / warps / K-loop pipeline stages and the access-pattern
  variants of ``megamoe.kernels.fold_decode`` (``FOLD_DECODE_VARIANTS``), outputs compared bitwise with the first.

    python results/probes/ws_variants_probe.py [fp4 [T1,..] | knockout [T1,..] | knockout2 [T1,..] | back | threshold | block [T1,..] | scale_words [T1,..] | predecode [T1,..] | fold_decode] \
        >> ws_variants_probe_h200.jsonl

One JSON line per measurement (µs: median of ``triton.testing.do_bench`` with its L2 flush, as the bench).
"""
import contextlib
import importlib.util
import json
import os
import pathlib
import sys
import tempfile

import torch

import megamoe  # noqa: F401  (before triton)
import megamoe.fused as mf
import megamoe.kernels as mk
from megamoe.bench import _median_ms
from megamoe.cases import MoECase, prepare_rank
from megamoe.ops import fp8_fp4_mega_moe
from megamoe.ops_fp8 import fp8_mega_moe
from megamoe.symm import SymmBuffer
from megamoe.testing import moe_error_stats

SHAPE = dict(num_ranks=1, hidden=7168, intermediate=3072, num_experts=48, num_topk=6, block_m=128)
MATH_AS_IS = """            dot = warpgroup_mma(a_s, w_lo.permute((1, 0)), spare, use_acc=False, is_async=True)
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
"""
MATH_NOPROMOTE = """            acc_lo = warpgroup_mma(a_s, w_lo.permute((1, 0)), acc_lo, is_async=True)
            acc_hi = warpgroup_mma(a_s, w_hi.permute((1, 0)), acc_hi, is_async=True)
            acc_lo, acc_hi = warpgroup_mma_wait(num_outstanding=0, deps=(acc_lo, acc_hi))
            mbarrier.arrive(empty.index(s), count=1)
"""
_FOLD = "_fold_a_stage(a_bufs.index(s), smax_s.index(slot), l2_sf + kb * SP + b * BM, valid, A0, NA)\n"
_FOLD_SMEM = ("_fold_tile_smem(a_bufs.index(s), smax_s.index(slot), asf_bufs.index(s), valid, A0, NA,\n"
              + " " * 40 + "HALVES, IDLE_DECODE)\n")
_HALVES_CALL = ("_decode_tile_halves(wp_bufs.index(s), wd_bufs.index(s), wd2_bufs.index(s),\n" + " " * 44
                + "rmax_s.index(slot), wsf_bufs.index(s), lut, valid, IDLE_DECODE)\n")
# (each text starts at its line's start: "\n" + indentation, so that a deeper copy of the same call is not matched)
DECODE_AS_IS = ("\n" + " " * 20 + "_fold_a_rows(a_bufs.index(s).slice(A0, NA), smax_s.index(slot).slice(A0, NA).load(\n"
                + " " * 24 + "gl.SliceLayout(1, A_LAYOUT)), a_word)\n",
                "\n" + " " * 16 + "_decode_rows(wp_bufs.index(s), wd_bufs.index(s), rmax_s.index(slot), word, lut, R0,"
                " NR)\n",
                "\n" + " " * 24 + _FOLD_SMEM,
                "\n" + " " * 24 + _FOLD,
                "\n" + " " * 24 + _HALVES_CALL,
                "\n" + " " * 24 + "_decode_stage_smem(wp_bufs.index(s), wd_bufs.index(s), rmax_s.index(slot),"
                " wsf_bufs.index(s),\n" + " " * 43 + "R0, NR, lut)\n",
                "\n" + " " * 24 + "_decode_stage(wp_bufs.index(s), wd_bufs.index(s), rmax_s.index(slot), w_sf + kb * N,"
                " lut, R0,\n" + " " * 38 + "NR)\n")
DECODE_NONE = ("\n                    s = s + 0\n", "\n                s = s + 0\n") + (
    "\n                        s = s + 0\n",) * 5
PATCHES = {"nodecode": [*zip(DECODE_AS_IS, DECODE_NONE)], "nopromote": [(MATH_AS_IS, MATH_NOPROMOTE)]}
PATCHES["nodecode+nopromote"] = PATCHES["nodecode"] + PATCHES["nopromote"]
# -- session 36's knock-outs of the decode stage (``knockout``): each removes one piece of a decode warp's stage
TABLE_ASM = ('    return gl.inline_asm_elementwise(FOLD_TABLE_ASM, "=r,=r,r", [d], dtype=(gl.int32, gl.int32), '
             'is_pure=True,\n                                     pack=1)\n')
TABLE_SHIFT = "    d = gl.minimum(rmax - ((word >> (8 * g)) & 0xFF), FOLD_TABLE_MAX_SHIFT)\n"
STAGE_FENCE = "            fence_async_shared()  # generic-proxy stores to shared memory, then wgmma (async proxy) reads them\n"
IDLE_FENCE = "        fence_async_shared()  # generic-proxy stores, then wgmma (warpgroup 0) reads them\n"
HALVES_STORES = """    wd_lo.store(_decode_values(wp, rmax, wsf.slice(0, HR).load(gl.SliceLayout(1, D_LAYOUT)), lut, 0, HR))
    if HI:
        wd_hi.store(_decode_values(wp, rmax, wsf.slice(HR, HR).load(gl.SliceLayout(1, D_LAYOUT)), lut, HR, HR))
"""
IDLE_STORE = "        wd2_bufs.index(s).store(_decode_values_rm(wp_bufs.index(s), rm, word, lut, HR, HR))\n"
PATCHES.update({
    # the table gathered from ``fold_lut`` (the kernel before session 36): one 8-byte load a group and row
    "lut_gather": [(TABLE_SHIFT, TABLE_SHIFT.replace("FOLD_TABLE_MAX_SHIFT", "15")),
                   (TABLE_ASM, "    pair = gl.load(lut.to(gl.pointer_type(gl.int64)) + d)\n"
                               "    return pair.to(gl.int32), (pair >> 32).to(gl.int32)\n")],
    # the table neither gathered nor computed: two integer operations on the shift (wrong values)
    "lut_const": [(TABLE_ASM, "    return d * 0x08080808 + 0x3C383000, d + 0x4C484440\n")],
    # no fence.proxy.async after a stage's stores (a race: timing only)
    "nofence": [(STAGE_FENCE, ""), (IDLE_FENCE, "")],
    # no W decode (neither the decode partition's nor the idle warpgroup's); the L2 A fold stays
    "nowdecode": [(HALVES_STORES, "    pass\n"), (IDLE_STORE, "")],
    # no wgmma: each math warpgroup waits for a decoded stage and releases it
    "nomma": [(MATH_AS_IS, "            mbarrier.arrive(empty.index(s), count=1)\n")],
})
# -- session 40's knock-outs (``knockout2``): which of the stage's shared-memory streams the decode and the wgmma
# contend for. Each keeps the instructions of the rest of the stage; all give wrong results (timing only).
W_LOAD_LO = "    g0, g1 = _decode_prmt(p.slice(0, 32, dim=1).load(D_LAYOUT), t00, t01, t10, t11)\n"
W_LOAD_HI = "    g2, g3 = _decode_prmt(p.slice(32, 32, dim=1).load(D_LAYOUT), t20, t21, t30, t31)\n"
# packed bytes made in registers from the rows' tables (no shared-memory load, the same PRMT work after it)
_REG_BYTES = "_bc({} ^ {}, gl.full([ROWS, 32], 0, gl.int32, D_LAYOUT)).to(gl.uint8)"
W_TMA_NBYTES = ("        nbytes: gl.constexpr = (a1_desc.block_type.nbytes + w1_desc.block_type.nbytes + "
                "ws1_desc.block_type.nbytes\n")
W_TMAS = tuple(" " * 16 + f"tma.async_copy_global_to_shared({d}, _w_coord(w_row, kb, KB, BKP, 0, W_BLOCKED), bar,\n"
               + " " * 48 + "wp_bufs.index(s))\n" for d in ("w2_desc", "w1_desc"))
A_TMAS = tuple(f"                tma.async_copy_global_to_shared({d}, [b * BM, kb * BK], bar, a_bufs.index(s))\n"
               for d in ("a2_desc", "a1_desc"))
MMA_HI = ("            dot = warpgroup_mma(a_s, w_hi.permute((1, 0)), d_lo, use_acc=False, is_async=True)\n"
          "            d_hi = warpgroup_mma_wait(num_outstanding=0, deps=(dot, ))\n")
PATCHES.update({
    # the decode warps load no packed bytes from shared memory (the PRMT work and the decoded stores stay)
    "nowload": [(W_LOAD_LO, W_LOAD_LO.replace("p.slice(0, 32, dim=1).load(D_LAYOUT)", _REG_BYTES.format("t00", "t10"))),
                (W_LOAD_HI, W_LOAD_HI.replace("p.slice(32, 32, dim=1).load(D_LAYOUT)",
                                              _REG_BYTES.format("t20", "t30")))],
    # the loader brings no packed weights (16 KB a stage less written by the TMA; the decode reads stale bytes)
    "nowtma": [(W_TMA_NBYTES, W_TMA_NBYTES.replace("w1_desc.block_type.nbytes + ", ""))]
    + [(t, "") for t in W_TMAS],
    # the loader brings no token rows (16 KB a stage less written by the TMA; the wgmma reads stale rows)
    "noatma": [(W_TMA_NBYTES, W_TMA_NBYTES.replace("a1_desc.block_type.nbytes + ", ""))]
    + [(t, "") for t in A_TMAS],
    # each math warpgroup multiplies the low half of the weights only (half the wgmma's shared-memory reads)
    "mma_half": [(MMA_HI, "            d_hi = d_lo\n")],
})
PATCHES["nowtma+nowload"] = PATCHES["nowtma"] + PATCHES["nowload"]
# -- session 41 (``lds_ahead``, exact): knockout2 put most of the decode's cost at T = 512 / 2048 in the decode
# warps' packed-W loads from shared memory (``nowload``: -11 % / -9 % of the call on an H100). The block-128 decode
# partition loads a stage's packed bytes after waiting for it and uses them at once: the load's latency (behind the
# wgmmas' shared-memory reads) is exposed once a stage, with one decode warp a scheduler to hide it. Here the high
# half's bytes are loaded first, the low half is decoded from bytes loaded during the previous stage, and the next
# stage's low-half bytes are loaded (its ready wait first) before the high half is decoded. The bytes travel as int32
# words (a uint8 tensor carried across the loop is one register a byte), decoded by the same PRMT asm a word at a
# time (pack 1) and stored through an int32 view of the decoded stage (the same 128-byte swizzle, bytes in place).
LDS_IMPORT = "from megamoe.kernels.numerics import _PRMT_LUT_ASM, FOLD_TABLE_ASM, FOLD_TABLE_MAX_SHIFT\n"
LDS_FIRST = "        gl.thread_barrier()  # every warp's row maxima are in shared memory before any warp reads them back\n"
LDS_HALVES = " " * 20 + "if HALVES:\n" + " " * 24 + _HALVES_CALL  # (the kernel's block-128 decode call)
LDS_HALVES_AHEAD = """                    if HALVES:
                        if IDLE_DECODE:
                            hi = valid > WM
                        else:
                            hi = valid >= 0
                        if hi:  # this stage's high-half words, in flight during the low half's decode
                            pc, pd = _packed_words(wp_bufs.index(s), HN)
                        else:
                            pc = gl.full([HN, 8], 0, gl.int32, I_LAYOUT)
                            pd = gl.full([HN, 8], 0, gl.int32, I_LAYOUT)
                        _store_words(wd_bufs.index(s), _decode_words(
                            pa, pb, rmax_s.index(slot).slice(0, HN).load(gl.SliceLayout(1, I_LAYOUT)),
                            wsf_bufs.index(s).slice(0, HN).load(gl.SliceLayout(1, I_LAYOUT)), lut))
                        if kb + 1 < KB:  # the next stage's low-half words, in flight during the high half's decode
                            s1 = (it + 1) % STAGES
                            mbarrier.wait(ready.index(s1), ((it + 1) // STAGES) & 1)
                            pa, pb = _packed_words(wp_bufs.index(s1), 0)
                        if hi:
                            _store_words(wd2_bufs.index(s), _decode_words(
                                pc, pd, rmax_s.index(slot).slice(HN, HN).load(gl.SliceLayout(1, I_LAYOUT)),
                                wsf_bufs.index(s).slice(HN, HN).load(gl.SliceLayout(1, I_LAYOUT)), lut))
"""
LDS_FIRST_AHEAD = LDS_FIRST + """        if HALVES and not PREDECODED:  # the tile's first stage's low-half words
            mbarrier.wait(ready.index(it % STAGES), (it // STAGES) & 1)
            pa, pb = _packed_words(wp_bufs.index(it % STAGES), 0)
"""
LDS_HELPER_AT = "@gluon.jit\ndef _decode_rows(wp, wd, rmax, word, lut, r0: gl.constexpr, ROWS: gl.constexpr):\n"
LDS_HELPER = """I_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 4], [16, 2], [4, 1], [1, 0]))  # D_LAYOUT's bytes as int32 words
_PRMT_WORD_ASM = gl.constexpr("{\\n.reg .b32 m, t;\\n" + _PRMT_DECODE.format(lo0="$3", lo1="$4", hi0="$5", hi1="$6")
                              + "}")


@gluon.jit
def _packed_words(wp, r0: gl.constexpr):
    \"\"\"Rows ``[r0, r0 + 128)`` of the packed stage ``wp`` (uint8 ``[256, 64]``, unswizzled) as int32 words: bytes
    ``[0, 32)`` and ``[32, 64)`` of each row, ``[128, 8]`` each in ``I_LAYOUT``.\"\"\"
    w = wp._reinterpret(gl.int32, [TILE_N, 16], gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32,
                                                                        rank=2)).slice(r0, HN)
    return w.slice(0, 8, dim=1).load(I_LAYOUT), w.slice(8, 8, dim=1).load(I_LAYOUT)


@gluon.jit
def _decode_words(pa, pb, rm, word, lut):
    \"\"\"``_decode_values_rm`` on packed int32 words (``_packed_words``) -> the e4m3 rows as int32 words ``[R, 32]``
    (bytes in K order).\"\"\"
    t00, t01 = _fold_table(lut, word, rm, 0)
    t10, t11 = _fold_table(lut, word, rm, 1)
    g0, g1 = gl.inline_asm_elementwise(asm=_PRMT_WORD_ASM, constraints="=r,=r,r,r,r,r,r",
                                       args=[pa, _bc(t00, pa), _bc(t01, pa), _bc(t10, pa), _bc(t11, pa)],
                                       dtype=(gl.int32, gl.int32), is_pure=True, pack=1)
    t20, t21 = _fold_table(lut, word, rm, 2)
    t30, t31 = _fold_table(lut, word, rm, 3)
    g2, g3 = gl.inline_asm_elementwise(asm=_PRMT_WORD_ASM, constraints="=r,=r,r,r,r,r,r",
                                       args=[pb, _bc(t20, pb), _bc(t21, pb), _bc(t30, pb), _bc(t31, pb)],
                                       dtype=(gl.int32, gl.int32), is_pure=True, pack=1)
    return _cat(_cat(g0, g1), _cat(g2, g3))


@gluon.jit
def _store_words(wd, words):
    \"\"\"``words`` (int32 ``[128, 32]``) into the decoded half ``wd`` (e4m3 ``[128, 128]``, 128-byte swizzle) through
    an int32 view of the same bytes.\"\"\"
    wd._reinterpret(gl.int32, [HN, 32], gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32,
                                                             rank=2)).store(words)


""" + LDS_HELPER_AT
LDS_IMPORT_PATCH = (LDS_IMPORT, LDS_IMPORT.replace("_PRMT_LUT_ASM,", "_PRMT_DECODE, _PRMT_LUT_ASM,"))
PATCHES["lds_ahead"] = [LDS_IMPORT_PATCH, (LDS_FIRST, LDS_FIRST_AHEAD), (LDS_HALVES, LDS_HALVES_AHEAD),
                        (LDS_HELPER_AT, LDS_HELPER)]
# ``words``: the same int32-word decode (pack 1), loaded where the kernel loads today (both halves' words at the
# stage's start, no look-ahead, nothing carried): ``lds_ahead``'s control, the same work a stage as the byte path
# (offline sm_90a with IDLE_DECODE off: both decode loops 459 SASS, 72 PRMT; session 41's "694 -> 473" was the byte
# path's two IDLE_DECODE arms kept apart).
WORDS_HALVES = """                    if HALVES:
                        if IDLE_DECODE:
                            if valid > WM:
                                _decode_half_words(wp_bufs.index(s), wd_bufs.index(s), rmax_s.index(slot),
                                                   wsf_bufs.index(s), lut, 0)
                                _decode_half_words(wp_bufs.index(s), wd2_bufs.index(s), rmax_s.index(slot),
                                                   wsf_bufs.index(s), lut, HN)
                            else:
                                _decode_half_words(wp_bufs.index(s), wd_bufs.index(s), rmax_s.index(slot),
                                                   wsf_bufs.index(s), lut, 0)
                        else:
                            _decode_half_words(wp_bufs.index(s), wd_bufs.index(s), rmax_s.index(slot),
                                               wsf_bufs.index(s), lut, 0)
                            _decode_half_words(wp_bufs.index(s), wd2_bufs.index(s), rmax_s.index(slot),
                                               wsf_bufs.index(s), lut, HN)
"""
WORDS_HELPER = LDS_HELPER.replace(LDS_HELPER_AT, """@gluon.jit
def _decode_half_words(wp, wd, rmax, wsf, lut, r0: gl.constexpr):
    \"\"\"Half ``r0`` (0 or 128) of a stage through ``_packed_words`` / ``_decode_words`` / ``_store_words``.\"\"\"
    pa, pb = _packed_words(wp, r0)
    _store_words(wd, _decode_words(pa, pb, rmax.slice(r0, HN).load(gl.SliceLayout(1, I_LAYOUT)),
                                   wsf.slice(r0, HN).load(gl.SliceLayout(1, I_LAYOUT)), lut))


""" + LDS_HELPER_AT)
PATCHES["words"] = [LDS_IMPORT_PATCH, (LDS_HALVES, WORDS_HALVES), (LDS_HELPER_AT, WORDS_HELPER)]
#: The exact variants (same bits as the kernel: compared bitwise in ``probe_knockout``).
EXACT_VARIANTS = ("as_is", "lut_gather", "lds_ahead", "words")
import megamoe.kernels.gemm_fp4_ws as AS_IS  # noqa: E402  (the module as installed: every variant patches its file)


def emit(**row):
    print(json.dumps(row), flush=True)


def patched_source(variant: str) -> str:
    """The text of ``megamoe.kernels.gemm_fp4_ws`` with ``variant``'s patches (each old text must occur exactly once:
    ``tests/test_probes.py`` checks every variant on CPU, so a kernel edit cannot silently unpatch a probe)."""
    src = pathlib.Path(AS_IS.__file__).read_text()
    for old, new in PATCHES[variant]:
        assert src.count(old) == 1, (variant, old[:60])
        src = src.replace(old, new)
    return src


def kernel_module(variant: str):
    """``megamoe.kernels.gemm_fp4_ws`` as it is, or a text-patched copy imported from a temporary file."""
    if variant == "as_is":
        return AS_IS
    src = patched_source(variant)
    path = pathlib.Path(tempfile.mkdtemp(prefix="ws_variants_")) / f"gemm_fp4_ws_{variant.replace('+', '_')}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(f"gemm_fp4_ws_{variant.replace('+', '_')}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


import megamoe.kernels.gemm_fp4_rs as RS_AS_IS  # noqa: E402  (imports its fold table from gemm_fp4_ws)
_RS_COPIES = {}


def use_kernel(mod):
    """``mod`` in place of ``megamoe.kernels.gemm_fp4_ws``, and the register-operand tile's module (which imports
    ``_fold_table`` / ``_decode_prmt`` from it) loaded afresh against it, so that a patch of the decode reaches both
    FP8 x FP4 Gluon tiles."""
    sys.modules["megamoe.kernels.gemm_fp4_ws"] = mod
    mk.gemm_fp4_ws = mod
    if mod is AS_IS:
        rs = RS_AS_IS
    else:
        if id(mod) not in _RS_COPIES:
            spec = importlib.util.spec_from_file_location(f"gemm_fp4_rs_{mod.__name__}", RS_AS_IS.__file__)
            _RS_COPIES[id(mod)] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(_RS_COPIES[id(mod)])
        rs = _RS_COPIES[id(mod)]
    sys.modules["megamoe.kernels.gemm_fp4_rs"] = rs
    mk.gemm_fp4_rs = rs


def rank(fmt: str, T: int, numerics: str = "hopper"):
    case = MoECase(num_tokens=T, format=fmt, **SHAPE)
    sb = SymmBuffer.local(1, case.num_experts, T, case.num_topk, case.hidden, case.intermediate,
                          block_m=case.block_m, device="cuda", format=fmt)[0]
    problem = case.problem(device="cuda")
    y, l1, l2, _ = prepare_rank(sb, problem, 0)
    if fmt == "fp8":
        call = lambda: fp8_mega_moe(y, l1, l2, sb, impl="fused", check=False)  # noqa: E731
    else:
        call = lambda: fp8_fp4_mega_moe(y, l1, l2, sb, impl="fused", numerics=numerics, check=False)  # noqa: E731
    return sb, problem, y, call


def probe_fp4(tokens=(512, 2048, 8192)):
    tokens = [int(t) for t in sys.argv[2].split(",")] if len(sys.argv) > 2 else tokens
    for T in tokens:
        sb, _, y, call = rank("fp8_fp4", T)
        cfg = mf.fused_config(sb.layout, T, 1, sb.buffer.device, "hopper")
        for variant in ("as_is", "nodecode", "nopromote", "nodecode+nopromote"):
            use_kernel(kernel_module(variant))
            call()
            torch.cuda.synchronize()
            emit(probe="fp4", T=T, kind=cfg.kind, block_m=cfg.block_m, variant=variant, us=_median_ms(call) * 1e3)
        use_kernel(kernel_module("as_is"))
        sb.destroy()


#: ``knockout``'s variants in order (``as_is`` first and last; ``lut_gather`` is the exact one: compared bitwise).
KNOCKOUTS = ("as_is", "lut_gather", "lut_const", "nofence", "nowdecode", "nodecode", "nomma", "as_is")
#: ``knockout2``'s (session 40): the W stream's shared-memory load and TMA write, the A stream's TMA write, half the
#: wgmma, against the whole W decode and the whole wgmma of session 36.
KNOCKOUTS2 = ("as_is", "nowload", "nowtma", "nowtma+nowload", "noatma", "mma_half", "nowdecode", "nomma", "as_is")


def probe_knockout(tokens=(512, 128, 2048), variants=KNOCKOUTS, numerics="hopper", probe="knockout"):
    """Session 36: what each piece of the decode partition's stage costs the whole ``fp8_fp4_mega_moe`` call
    ("hopper", the host's tile: the decode-partition tile at block 128 from T = 512, its idle decode where a block
    has <= 64 rows), one buffer for the largest T (one compile a variant). ``KNOCKOUTS``: the kernel as it is (its
    fold tables computed, ``FOLD_TABLE_ASM``) with its error against ``reference(numerics="hopper")``; the tables
    gathered as before, output compared bitwise; then wrong-result knock-outs (``PATCHES``). Env ``KNOCKOUTS``
    (comma-separated) replaces the list. Where the host runs the register-operand tile (T <= 256), which decodes
    through the same ``_fold_table``, only as is / gathered / as is. ``numerics``: the call's (rows say which).
    ``probe``: the rows' label."""
    tokens = [int(t) for t in sys.argv[2].split(",")] if len(sys.argv) > 2 else tokens
    variants = tuple(os.environ.get("KNOCKOUTS", ",".join(variants)).split(","))
    fmt = "fp8_fp4"
    case_max = MoECase(num_tokens=max(tokens), format=fmt, **SHAPE)
    sb = SymmBuffer.local(1, case_max.num_experts, max(tokens), case_max.num_topk, case_max.hidden,
                          case_max.intermediate, block_m=case_max.block_m, device="cuda", format=fmt)[0]
    for T in tokens:
        problem = MoECase(num_tokens=T, format=fmt, **SHAPE).problem(device="cuda")
        y, l1, l2, _ = prepare_rank(sb, problem, 0)
        call = lambda: fp8_fp4_mega_moe(y, l1, l2, sb, impl="fused", numerics=numerics, check=False)  # noqa: E731
        cfg = mf.fused_config(sb.layout, T, 1, sb.buffer.device, numerics)
        want = None
        for variant in variants if not cfg.rs_block_n else ("as_is", "lut_gather", "as_is"):
            use_kernel(kernel_module(variant))
            y.fill_(float("nan"))
            try:
                call()
                torch.cuda.synchronize()
            except Exception as exc:  # a variant that does not compile is reported, not fatal
                emit(probe=probe, T=T, numerics=numerics, variant=variant, error=repr(exc)[:300])
                continue
            row = dict(probe=probe, T=T, numerics=numerics, kind=cfg.kind, block_m=cfg.block_m,
                       rs_block_n=cfg.rs_block_n, idle_decode=cfg.idle_decode, variant=variant)
            if variant == "as_is" and want is None:
                want = y.clone()
                err = moe_error_stats(y, problem.reference(numerics=numerics)[0])
                row.update(rel_fro=err["rel_fro"], max_row_rel=err["max_row_rel"])
            if variant in EXACT_VARIANTS:
                row["bitwise_equal_to_as_is"] = bool(torch.equal(y, want))
            emit(**row, us=_median_ms(call) * 1e3)
        use_kernel(kernel_module("as_is"))
    sb.destroy()


def probe_knockout2(tokens=(512, 2048)):
    """Session 40: ``KNOCKOUTS2`` in the default GPU numerics (``megamoe.ops.AUTO_GPU_NUMERICS``) -- which of the
    decode-partition stage's shared-memory streams (the packed W's TMA write and load, the tokens' TMA write, the
    wgmma's reads) the decode and the MMA contend for (session 36: 815 µs at T = 512 without either, 1058 with
    both)."""
    from megamoe.ops import AUTO_GPU_NUMERICS

    probe_knockout(tokens, KNOCKOUTS2, AUTO_GPU_NUMERICS, "knockout2")


def probe_back(cases=(("fp8", 2048), ("fp8", 8192), ("fp8_fp4", 8192))):
    for fmt, T in cases:
        sb, _, y, call = rank(fmt, T)
        want = None
        for per_sm in (1, 2, 4):
            mf.WS_BACK_PROGRAMS_PER_SM = per_sm
            y.zero_()
            call()
            torch.cuda.synchronize()
            if want is None:
                want = y.clone()
            emit(probe="back", format=fmt, T=T, back_programs_per_sm=per_sm, us=_median_ms(call) * 1e3,
                 bitwise_equal_to_1=bool(torch.equal(y, want)))
        mf.WS_BACK_PROGRAMS_PER_SM = 1
        sb.destroy()


def probe_threshold(tokens=(8, 32, 128, 512)):
    saved = mf.FP4_WS_MIN_EXPECTED
    for T in tokens:
        sb, problem, y, call = rank("fp8_fp4", T)
        ref = problem.reference(numerics="hopper")[0]
        for kind, threshold in (("hopper", 10**9), ("fp4_ws", -1)):
            mf.FP4_WS_MIN_EXPECTED = threshold
            assert mf.fused_config(sb.layout, T, 1, sb.buffer.device, "hopper").kind == kind
            y.fill_(float("nan"))
            call()
            torch.cuda.synchronize()
            err = moe_error_stats(y, ref)
            emit(probe="threshold", T=T, kind=kind, us=_median_ms(call) * 1e3, rel_fro=err["rel_fro"],
                 max_row_rel=err["max_row_rel"])
        mf.FP4_WS_MIN_EXPECTED = saved
        sb.destroy()


def probe_block(tokens=(64, 128, 256, 512, 1024)):
    tokens = [int(t) for t in sys.argv[2].split(",")] if len(sys.argv) > 2 else tokens
    saved = mf.FP4_WS_MIN_EXPECTED, mf.FP4_BLOCK64_MAX_EXPECTED
    mf.FP4_WS_MIN_EXPECTED = -1
    for T in tokens:
        sb, problem, y, call = rank("fp8_fp4", T)
        ref = problem.reference(numerics="hopper")[0]
        for block, limit in ((64, float("inf")), (128, -1)):
            mf.FP4_BLOCK64_MAX_EXPECTED = limit
            cfg = mf.fused_config(sb.layout, T, 1, sb.buffer.device, "hopper")
            assert (cfg.kind, cfg.block_m) == ("fp4_ws", block)
            y.fill_(float("nan"))
            call()
            torch.cuda.synchronize()
            err = moe_error_stats(y, ref)
            emit(probe="block", T=T, kind="fp4_ws", block_m=block, us=_median_ms(call) * 1e3, rel_fro=err["rel_fro"],
                 max_row_rel=err["max_row_rel"])
        sb.destroy()
    mf.FP4_WS_MIN_EXPECTED, mf.FP4_BLOCK64_MAX_EXPECTED = saved


def probe_scale_words(tokens=(128, 512, 2048)):
    """Where the decode partitions get each K block's scale words, at the pool block the host picks for T (64 up to
    64 expected tokens per expert, 128 above): a global load in the stage (neither), one K block ahead
    (``FP4_WS_PREFETCH``, block 64 only), by TMA with the stage (``FP4_WS_SF_TMA``); at block 64 also 4 ring
    stages (``FP4_WS_STAGES[64]``, where shared memory allows). Error of each against the reference; each variant
    a fresh buffer (the launch keywords are cached on it)."""
    tokens = [int(t) for t in sys.argv[2].split(",")] if len(sys.argv) > 2 else tokens
    saved = dict(mf.FP4_WS_PREFETCH), dict(mf.FP4_WS_SF_TMA), dict(mf.FP4_WS_STAGES)
    for T in tokens:
        block = 64 if T * SHAPE["num_topk"] / SHAPE["num_experts"] <= mf.FP4_BLOCK64_MAX_EXPECTED else 128
        variants = [(False, False, 3), (False, True, 3)]
        if block == 64:
            variants += [(True, False, 3), (False, False, 4), (True, False, 4)]
        for prefetch, sf_tma, stages in variants:
            mf.FP4_WS_PREFETCH[block], mf.FP4_WS_SF_TMA[block], mf.FP4_WS_STAGES[block] = prefetch, sf_tma, stages
            sb, problem, y, call = rank("fp8_fp4", T)
            cfg = mf.fused_config(sb.layout, T, 1, sb.buffer.device, "hopper")
            assert (cfg.kind, cfg.block_m) == ("fp4_ws", block), cfg
            y.fill_(float("nan"))
            call()
            torch.cuda.synchronize()
            err = moe_error_stats(y, problem.reference(numerics="hopper")[0])
            emit(probe="scale_words", T=T, kind="fp4_ws", block_m=block, prefetch=prefetch, sf_tma=sf_tma,
                 stages=stages, us=_median_ms(call) * 1e3, rel_fro=err["rel_fro"], max_row_rel=err["max_row_rel"])
            sb.destroy()
    for d, v in zip((mf.FP4_WS_PREFETCH, mf.FP4_WS_SF_TMA, mf.FP4_WS_STAGES), saved):
        d.update(v)


def probe_predecode(tokens=(512, 2048, 8192)):
    """The predecoded path (``FP4_PREDECODE_MIN_EXPECTED``: weights decoded once per call by ``megamoe.fold_decode``,
    the Gluon phase streaming e4m3) against the phase decoding per pool block, at the block the host picks for T;
    the predecoded phase at 3 stages and at the most its shared memory takes (5 at block 64, 4 at 128); and the
    decode pass alone on the same weights. Error of each call against the reference."""
    from megamoe.fold_decode import fold_decode

    tokens = [int(t) for t in sys.argv[2].split(",")] if len(sys.argv) > 2 else tokens
    saved = mf.FP4_PREDECODE_MIN_EXPECTED, dict(mf.FP4_WS_STAGES)
    for T in tokens:
        block = 64 if T * SHAPE["num_topk"] / SHAPE["num_experts"] <= mf.FP4_BLOCK64_MAX_EXPECTED else 128
        for predecode, stages in ((False, 3), (True, 3), (True, 5 if block == 64 else 4)):
            mf.FP4_PREDECODE_MIN_EXPECTED = -1 if predecode else float("inf")
            mf.FP4_WS_STAGES[block] = stages
            sb, problem, y, call = rank("fp8_fp4", T)
            cfg = mf.fused_config(sb.layout, T, 1, sb.buffer.device, "hopper")
            assert (cfg.kind, cfg.block_m, cfg.predecode) == ("fp4_ws", block, predecode), cfg
            y.fill_(float("nan"))
            call()
            torch.cuda.synchronize()
            err = moe_error_stats(y, problem.reference(numerics="hopper")[0])
            row = dict(probe="predecode", T=T, kind="fp4_ws", block_m=block, predecode=predecode, stages=stages,
                       us=_median_ms(call) * 1e3, rel_fro=err["rel_fro"], max_row_rel=err["max_row_rel"])
            emit(**row)
            sb.destroy()
        mf.FP4_WS_STAGES.update(saved[1])
    mf.FP4_PREDECODE_MIN_EXPECTED = saved[0]
    probe_fold_decode(variants=(dict(rows=64, warps=4, loop_stages=1),))


#: ``probe_fold_decode``'s variant keys -> the ``megamoe.fold_decode`` constant each sets (a key left out of a variant:
#: the constant's default, i.e. the kernel as measured at 741e144).
FOLD_DECODE_KNOBS = {"rows": "FOLD_DECODE_ROWS", "warps": "FOLD_DECODE_WARPS", "loop_stages": "FOLD_DECODE_LOOP_STAGES",
                     "wide": "FOLD_DECODE_WIDE", "step_k": "FOLD_DECODE_STEP_K", "k_split": "FOLD_DECODE_K_SPLIT",
                     "rmax_chunk": "FOLD_DECODE_RMAX_CHUNK", "stream": "FOLD_DECODE_STREAM"}
#: The access-pattern variants (``megamoe.kernels.fold_decode.fold_decode_kernel``'s docstring), the kernel as it was
#: before them first (every other output is compared with its bytes): one contiguous 64-byte load / 128-byte store a row a K step
#: at 64 rows; 32 rows x 256 K and 16 rows x 512 K an iteration; 8 programs a row block on neighbouring K ranges
#: (as is and wide); the row exponent's scale words 8 at a time; streaming store hints (as is and wide).
FOLD_DECODE_VARIANTS = (
    dict(rows=64, warps=4, loop_stages=1, wide=False, step_k=128),
    dict(rows=64, warps=4, loop_stages=1, wide=True, step_k=128),
    dict(rows=32, warps=4, loop_stages=1, wide=True, step_k=256),
    dict(rows=16, warps=4, loop_stages=1, wide=True, step_k=512),
    dict(rows=64, warps=4, loop_stages=1, wide=False, step_k=128, k_split=8),
    dict(rows=64, warps=4, loop_stages=1, wide=True, step_k=128, k_split=8),
    dict(rows=64, warps=4, loop_stages=1, wide=False, step_k=128, rmax_chunk=8),
    dict(rows=64, warps=4, loop_stages=1, wide=False, step_k=128, stream=True),
    dict(rows=64, warps=4, loop_stages=1, wide=True, step_k=128, stream=True),
)


@contextlib.contextmanager
def fold_decode_variant(variant: dict):
    """``megamoe.fold_decode``'s constants set to ``variant`` (keys of ``FOLD_DECODE_KNOBS``; the others at their
    defaults) for the ``with`` block, restored after. Yields the full setting, every knob by its key."""
    import megamoe.fold_decode as fd

    unknown = set(variant) - set(FOLD_DECODE_KNOBS)
    assert not unknown, unknown
    saved = {name: getattr(fd, name) for name in FOLD_DECODE_KNOBS.values()}
    try:
        for key, name in FOLD_DECODE_KNOBS.items():
            setattr(fd, name, variant.get(key, saved[name]))
        yield {key: getattr(fd, name) for key, name in FOLD_DECODE_KNOBS.items()}
    finally:
        for name, value in saved.items():
            setattr(fd, name, value)


def probe_fold_decode(variants=FOLD_DECODE_VARIANTS):
    """The decode pass alone (``megamoe.fold_decode``: both weights of one EP8 rank of V4-Pro) at rows a program,
    warps and K-loop pipeline stages (``FOLD_DECODE_ROWS`` / ``_WARPS`` / ``_LOOP_STAGES``) and the access-pattern
    knobs (``FOLD_DECODE_KNOBS``); every variant's output checked bitwise against the first's. A variant is a dict
    of ``FOLD_DECODE_KNOBS`` keys or (as before) a ``(rows, warps, loop_stages)`` tuple; each row names every knob."""
    import megamoe.fold_decode as fd
    from megamoe.quant import transform_weights_for_mega_moe

    l1, l2 = MoECase(num_tokens=8, format="fp8_fp4", **SHAPE).problem(device="cuda").weights_for_rank(0)
    l1, l2 = transform_weights_for_mega_moe(tuple(t.cuda() for t in l1), tuple(t.cuda() for t in l2))
    outs = [(torch.empty((w.shape[0], w.shape[1], 2 * w.shape[2]), dtype=torch.float8_e4m3fn, device="cuda"),
             torch.empty(w.shape[:2], dtype=torch.int32, device="cuda")) for w, _ in (l1, l2)]
    nbytes = sum(w.numel() + sf.numel() * 4 + o.numel() + x.numel() * 4 for (w, sf), (o, x) in zip((l1, l2), outs))
    first = None
    for variant in variants:
        if not isinstance(variant, dict):
            variant = dict(zip(("rows", "warps", "loop_stages"), variant))
        with fold_decode_variant(variant) as knobs:
            run = lambda: [fd.fold_decode(w, out=o, row_exp=x) for w, (o, x) in zip((l1, l2), outs)]  # noqa: E731
            for o, x in outs:  # a variant that skipped some bytes would otherwise show the previous one's
                o.view(torch.uint8).fill_(0xFF)
                x.fill_(-1)
            try:
                run()
                torch.cuda.synchronize()
            except Exception as exc:  # a variant that does not compile or launch is reported, not fatal
                emit(probe="fold_decode", **knobs, error=repr(exc)[:200])
                continue
            got = [(o.view(torch.uint8).clone(), x.clone()) for o, x in outs]
            first = first or got
            same = all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(got, first))
            us = _median_ms(run) * 1e3
        emit(probe="fold_decode", what="fold_decode pass", **knobs, us=us, bytes=nbytes, tb_per_s=nbytes / us / 1e6,
             bitwise_equal_to_first=same)


if __name__ == "__main__":
    which = sys.argv[1:2] or ["fp4", "back", "threshold", "block", "scale_words", "predecode", "fold_decode"]
    emit(probe="start", torch=torch.__version__, gpu=torch.cuda.get_device_name(), which=which,
         commit=os.environ.get("MEGAMOE_GIT_COMMIT"))
    for name in which:
        {"fp4": probe_fp4, "back": probe_back, "threshold": probe_threshold, "block": probe_block,
         "scale_words": probe_scale_words, "predecode": probe_predecode, "fold_decode": probe_fold_decode,
         "knockout": probe_knockout, "knockout2": probe_knockout2}[name]()
