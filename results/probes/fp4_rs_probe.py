"""Probe: the FP4 decode *inside* the math warps, feeding ``wgmma`` from registers (swap-AB, "RS" wgmma), at the
few-tokens sizes where the FP8 x FP4 path is decode-bound (issue #7: T <= 512).

Why. The ``fp4_ws`` Gluon phase (``megamoe.kernels.gemm_fp4_ws``) decodes each FP4 weight stage in 4-8 dedicated
warps into a swizzled shared-memory stage that the math warpgroups then read as the MMA's B operand: the decode
round-trips through shared memory and runs in the few warps the math's 192-208 accumulator registers leave. With
few tokens per expert the accumulator is tiny (swap-AB: 64 weight rows x BM tokens, BM / 2 registers a thread at
BM 16-32), so every warp can decode, and Hopper's ``wgmma`` takes its A operand (here: the weights) from
registers: LDS packed bytes -> PRMT table decode -> wgmma, nothing written back. This is how CUTLASS's mixed-input
Hopper GEMMs (vLLM's "machete") feed narrow weights. The probe measures how fast that streams FP4.

The kernel (``fp4_rs_kernel``, L1- or L2-shaped, one grouped GEMM, no epilogue): a CTA owns ``ROWS`` = 64 x
warpgroups weight rows of one expert and its ``BM`` tokens; per 128-wide K block a TMA ring stage brings the packed
rows (two boxes ``[ROWS, 32]`` bytes: ``transform_weights_for_mega_moe``'s two 64-value chunks) and the tokens
(four boxes ``[BM, 32]`` e4m3, one per 32-wide K step); each warp loads its rows' packed bytes straight into the
wgmma A-operand layout (``DotOperandLayout(0, ..., k_width=4)``: four consecutive K values a register, which is
what one byte word's low or high nibbles decode to), decodes through the per-(row, 32-group) fold tables
(``megamoe.quant.fold_lut``, the same ``prmt`` string as ``fp4_ws``), and issues four ``m64nBMk32`` wgmmas
(one fresh chain a K block, added into the float32 accumulator: the ``hopper`` numerics' per-128 structure). The
output is the accumulator ``out[e, n, t] = sum_k W'[n, k] A[t, k]`` (W' the folded e4m3 weights), checked against
torch on the same bits.

    python results/probes/fp4_rs_probe.py compile            (offline sm_90a: registers, spills, SASS of the loop)
    python results/probes/fp4_rs_probe.py run                (GPU: one JSON row per shape and CONFIGS entry)

Rows (``fp4_rs_probe_h200.jsonl``): ``us`` (median, L2 flushed, ``triton.testing.do_bench``), ``fp4_gb_per_s``
(packed weight + scale bytes / us), ``max_rel_err`` (max |out - ref| / max |ref|) against the torch decode, 32
experts, uniform random FP4 codes, scales spread over 7 binades.

Measured on the H200 (session 17, five device calls; with the per-128 chains every row agrees with the torch
decode to 2.4-2.7e-4):

* plain (one CTA per tile, the K loop issues its own TMA): 2.0-2.2 TB/s of FP4 at BM 16 (L1 337 us, L2 173 us at
  4 stages), BM 32 ~10 % slower, 8 warps / 3, 6, 10 stages no better. ``SF_TMA`` +4 % (the scale words' global
  load was on the chain).
* what it is bound by, same kernel (``DECODE``): without the fold-table gathers 2.5 TB/s, with no decode at all
  2.7 TB/s (L1 278 us) -- the loop structure itself (a CTA barrier and an elected TMA issue a K block, small
  boxes: 2 KB of weights, 512 B of tokens) caps it well below the HBM's 4.8 TB/s (nominal).
* warp-specialised + persistent (``fp4_rs_ws_kernel``: a loader warp, 4 CTAs an SM at ``maxnreg`` 64): 2.5 TB/s
  with the full decode (L1 298 us, L2 155 us at 6 stages; 2 CTAs an SM 2.3 TB/s).
* ``PIPE`` (one chain over K; the next block decodes while the MMAs run): no faster (300 / 155 us) and 17x the
  error (4.5e-3: the tensor cores' FP8 accumulation over 7168 values without the per-128 promotion -- why the
  model and DeepGEMM promote per 128; presumably not a register hazard, which would garble whole values).

Reading: the whole FP8 x FP4 call at T = 8 / 32 / 128 streams ~1.8 / 1.96 / 1.93 TB/s of FP4 with its front and
back launches (``results/probes/layer_variants/layer_h200_83d4293_second_run.json``: 1.02 / 1.68 / 1.68 GB in 572 /
860 / 871 us), so a tile kind built on this loop (2.4-2.5 TB/s for the GEMMs alone) would bring those calls to an
estimated ~460 / 720 / 730 us, 0.83 / – / 0.90x DeepGEMM's, not yet issue #7's 0.8x. Not built this session.

Session 18 (rows at 96e579a): in the warp-specialised kernel ``DECODE`` 3 (register order) 287 / 149 us at 16 tokens,
252 / 132 at 8 (L1 / L2: 2.97 / 2.85 TB/s), against ``DECODE`` 2's 301 / 156 and 274 / 145: ~8 % more, for a second
packing of the weights. The tile kind this probe led to is ``megamoe.kernels.gemm_fp4_rs`` (``DECODE`` 2's split
packing, no copy of the weights). Since session 25 the register order is the one packing of
``transform_weights_for_mega_moe`` (no second copy), so ``DECODE`` 2 here is that decode and ``DECODE`` 3, its
``PRMT_REG_ASM`` and the repack ``to_register_order`` were removed (the rows above were taken at 96e579a).

Offline (Triton 3.6 for sm_90a): ``DECODE`` 3's register-order packing takes the plain loop's K
body from 216 to 176 SASS instructions a thread (PRMT 36 -> 20, LOP3 37 -> 29, LEA 36 -> 20; 52 registers, no
spill), BM 8 to 166; the warp-specialised kernel compiles with it at ``maxnreg`` 64 without spill (38628 B of shared
memory at BM 16, 32484 at BM 8). ``CONFIGS`` holds those rows for the next device call.
"""
import json
import os
import sys

import megamoe  # noqa: F401  (sets the interpreter flag on CPU machines before triton)

# isort: split
import torch  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from megamoe.kernels.formats import FOLD_LUT_MAX_SHIFT  # noqa: E402
from megamoe.kernels.gemm_fp4_rs import _k_block_chain  # noqa: E402
from megamoe.kernels.gemm_fp4_ws import _bc, _decode_prmt, _fold_table  # noqa: E402

#: (N, K) of the two GEMMs of V4-Pro's expert: L1 gate/up (2I x H), L2 down (H x I).
SHAPES = {"L1": (6144, 7168), "L2": (7168, 3072)}
#: (warps, BM, stages, SF_TMA, DECODE, WS CTAs an SM or 0, PIPE) of a ``run``; earlier sweeps (rows in
#: fp4_rs_probe_h200.jsonl) also ran stages 3 / 4 / 8 / 10, 8 warps, BM 32, DECODE 1 / 0, 2 / 3 CTAs an SM and PIPE.
CONFIGS = ((4, 16, 6, True, 2, 4, False), (4, 8, 6, True, 2, 4, False), (4, 16, 4, True, 2, 0, False))


@gluon.jit
def _issue_stage(w_desc, a_desc, s_desc, wp, ab, sw, bar, row0, e, nt, kb, s, N: gl.constexpr, KB: gl.constexpr,
                 BM: gl.constexpr, ROWS: gl.constexpr, SF_TMA: gl.constexpr):
    """TMA of K block ``kb`` into ring stage ``s`` (completing on ``bar``, whose byte count the caller set): the
    two packed boxes, the four token boxes, and with ``SF_TMA`` the rows' scale words."""
    for c in gl.static_range(2):
        tma.async_copy_global_to_shared(w_desc, [row0, kb * 64 + 32 * c], bar, wp.index(2 * s + c))
    for j in gl.static_range(4):
        tma.async_copy_global_to_shared(a_desc, [e * BM, kb * 128 + 32 * j], bar, ab.index(4 * s + j))
    if SF_TMA:
        tma.async_copy_global_to_shared(s_desc, [(e * KB + kb) * N + nt * ROWS], bar, sw.index(s))


@gluon.jit
def _decode_stage(wp, s, word, rm, lut, dot_a: gl.constexpr):
    """The four K=32 register operands of ring stage ``s`` (e4m3 ``[ROWS, 32]`` in ``dot_a``): its two packed
    boxes through the fold tables of ``word`` (the rows' scale words) and ``rm`` (their maxima)."""
    t00, t01 = _fold_table(lut, word, rm, 0)
    t10, t11 = _fold_table(lut, word, rm, 1)
    t20, t21 = _fold_table(lut, word, rm, 2)
    t30, t31 = _fold_table(lut, word, rm, 3)
    g0, g1 = _decode_prmt(wp.index(2 * s).load(dot_a), t00, t01, t10, t11)
    g2, g3 = _decode_prmt(wp.index(2 * s + 1).load(dot_a), t20, t21, t30, t31)
    return g0, g1, g2, g3


@gluon.jit
def fp4_rs_kernel(w_desc, a_desc, s_desc, w_sf, rmax, lut, out, N: gl.constexpr, K: gl.constexpr,
                  BM: gl.constexpr, STAGES: gl.constexpr, SF_TMA: gl.constexpr, DECODE: gl.constexpr,
                  num_warps: gl.constexpr):
    """``out`` float32 ``[E, N, BM]`` = folded-e4m3 W ``[E, N, K]`` (packed FP4, ``w_desc`` boxes ``[ROWS, 32]``
    bytes of the ``[E*N, K/2]`` array) times A ``[E*BM, K]`` e4m3 (``a_desc`` boxes ``[BM, 32]``); ``w_sf`` int32
    MN-major ``[E][K/128][N]`` (four UE8M0 group bytes a word), ``rmax`` int32 ``[E*N]`` (each row's largest), ``lut``
    ``fold_lut``. One CTA per (expert, ``ROWS`` rows). ``SF_TMA``: the K block's scale words of the CTA's rows come
    with the stage (``s_desc``: boxes ``[ROWS]`` of the flat words) instead of a global load in the K loop.
    ``DECODE`` (timing only below 2): 2 the decode as described; 1 without the fold-table gathers (shift 0 for
    every group: wrong unless all of a row's scales are equal); 0 no decode at all (the packed bytes go to the MMA
    as they are: the stream and MMA without the decode's instructions)."""
    ROWS: gl.constexpr = 16 * num_warps
    NT: gl.constexpr = N // ROWS
    KB: gl.constexpr = K // 128
    pid = gl.program_id(0)
    e = pid // NT
    nt = pid % NT
    row0 = e * N + nt * ROWS
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BM, 32])
    dot_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=4)
    wp = gl.allocate_shared_memory(gl.uint8, [2 * STAGES, ROWS, 32], w_desc.layout)
    ab = gl.allocate_shared_memory(gl.float8e4nv, [4 * STAGES, BM, 32], a_desc.layout)
    sw = gl.allocate_shared_memory(gl.int32, [STAGES, ROWS], s_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    if SF_TMA:
        nbytes: gl.constexpr = 2 * w_desc.block_type.nbytes + 4 * a_desc.block_type.nbytes + s_desc.block_type.nbytes
    else:
        nbytes: gl.constexpr = 2 * w_desc.block_type.nbytes + 4 * a_desc.block_type.nbytes
    for i in gl.static_range(STAGES - 1):  # prologue: the first STAGES - 1 K blocks in flight
        mbarrier.expect(ready.index(i), nbytes)
        _issue_stage(w_desc, a_desc, s_desc, wp, ab, sw, ready.index(i), row0, e, nt, i, i, N, KB, BM, ROWS, SF_TMA)
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, dot_a))
    rm = gl.load(rmax + row0 + rows)
    acc = gl.zeros([ROWS, BM], gl.float32, mma)
    for kb in range(KB):
        # refill the stage the previous K block used (its wgmmas were waited for at the end of that block)
        nk = kb + STAGES - 1
        if nk < KB:
            sn = nk % STAGES
            mbarrier.expect(ready.index(sn), nbytes)
            _issue_stage(w_desc, a_desc, s_desc, wp, ab, sw, ready.index(sn), row0, e, nt, nk, sn, N, KB, BM, ROWS,
                         SF_TMA)
        s = kb % STAGES
        if SF_TMA:
            mbarrier.wait(ready.index(s), (kb // STAGES) & 1)
            word = sw.index(s).load(gl.SliceLayout(1, dot_a))
        else:
            word = gl.load(w_sf + (e * KB + kb) * N + nt * ROWS + rows)
            mbarrier.wait(ready.index(s), (kb // STAGES) & 1)
        if DECODE >= 2:
            g0, g1, g2, g3 = _decode_stage(wp, s, word, rm, lut, dot_a)
        elif DECODE == 1:
            c0 = gl.zeros_like(word) + 0x3C383000  # fold_lut at shift 0
            c1 = gl.zeros_like(word) + 0x4C484440
            g0, g1 = _decode_prmt(wp.index(2 * s).load(dot_a), c0 + (word & 0), c1, c0, c1)
            g2, g3 = _decode_prmt(wp.index(2 * s + 1).load(dot_a), c0 + (word & 0), c1, c0, c1)
        else:
            g0 = wp.index(2 * s).load(dot_a).to(gl.float8e4nv, bitcast=True)
            g1 = g0
            g2 = wp.index(2 * s + 1).load(dot_a).to(gl.float8e4nv, bitcast=True)
            g3 = g2
        part = _k_block_chain(g0, g1, g2, g3, ab, s, acc)
        acc = acc + part
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
    r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, mma))
    t = gl.arange(0, BM, layout=gl.SliceLayout(0, mma))
    gl.store(out + (row0 + gl.expand_dims(r, 1)).to(gl.int64) * BM + gl.expand_dims(t, 0), acc)


@gluon.jit
def _rs_load(w_desc, a_desc, s_desc, wp, ab, sw, ready, empty, num_tiles, N: gl.constexpr, K: gl.constexpr,
             BM: gl.constexpr, STAGES: gl.constexpr, ROWS: gl.constexpr):
    """Loader warp of ``fp4_rs_ws_kernel``: per K block of each tile the stage's packed rows, tokens and scale
    words (``empty[s]`` released by the math, ``ready[s]`` completes on the bytes)."""
    NT: gl.constexpr = N // ROWS
    KB: gl.constexpr = K // 128
    nbytes: gl.constexpr = 2 * w_desc.block_type.nbytes + 4 * a_desc.block_type.nbytes + s_desc.block_type.nbytes
    it = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        e = t // NT
        nt = t % NT
        row0 = e * N + nt * ROWS
        for kb in range(KB):
            s = it % STAGES
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), nbytes)
            _issue_stage(w_desc, a_desc, s_desc, wp, ab, sw, ready.index(s), row0, e, nt, kb, s, N, KB, BM, ROWS, True)
            it += 1


@gluon.jit
def _rs_math(wp, ab, sw, ready, empty, rmax, lut, out, num_tiles, N: gl.constexpr, K: gl.constexpr,
             BM: gl.constexpr, STAGES: gl.constexpr, ROWS: gl.constexpr, PIPE: gl.constexpr,
             DECODE: gl.constexpr):
    """Math warpgroup of ``fp4_rs_ws_kernel``: decode into the register A operand, four wgmmas a K block, release
    the stage once they are done, store the tile's float32 accumulator. ``PIPE`` (timing: not the ``hopper``
    model's per-128 chains): one wgmma chain over all of K, waited with the next block's four MMAs outstanding, so
    a block's decode overlaps the previous block's MMAs."""
    NT: gl.constexpr = N // ROWS
    KB: gl.constexpr = K // 128
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 32])
    dot_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=4)
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, dot_a))
    r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, mma))
    tok = gl.arange(0, BM, layout=gl.SliceLayout(0, mma))
    it = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        e = t // NT
        nt = t % NT
        row0 = e * N + nt * ROWS
        rm = gl.load(rmax + row0 + rows)
        acc = gl.zeros([ROWS, BM], gl.float32, mma)
        for kb in range(KB):
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            word = sw.index(s).load(gl.SliceLayout(1, dot_a))
            g0, g1, g2, g3 = _decode_stage(wp, s, word, rm, lut, dot_a)
            if PIPE:  # one chain over K; block kb's MMAs run while block kb + 1 decodes
                acc = warpgroup_mma(g0, ab.index(4 * s).permute((1, 0)), acc, use_acc=kb > 0, is_async=True)
                acc = warpgroup_mma(g1, ab.index(4 * s + 1).permute((1, 0)), acc, is_async=True)
                acc = warpgroup_mma(g2, ab.index(4 * s + 2).permute((1, 0)), acc, is_async=True)
                acc = warpgroup_mma(g3, ab.index(4 * s + 3).permute((1, 0)), acc, is_async=True)
                # (the register operands of the MMAs in flight: ptxas guards them, warpgroup_mma_wait takes no
                # 8-bit deps in Triton 3.6 -- "Unexpected bitwidth in WGMMAWaitGroupOp")
                acc = warpgroup_mma_wait(num_outstanding=4, deps=(acc, ))
                if kb > 0:
                    mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1)
            else:
                part = _k_block_chain(g0, g1, g2, g3, ab, s, acc)
                mbarrier.arrive(empty.index(s), count=1)
                acc = acc + part
            it += 1
        if PIPE:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1)
        gl.store(out + (row0 + gl.expand_dims(r, 1)).to(gl.int64) * BM + gl.expand_dims(tok, 0), acc)


@gluon.jit
def fp4_rs_ws_kernel(w_desc, a_desc, s_desc, w_sf, rmax, lut, out, num_tiles, N: gl.constexpr, K: gl.constexpr,
                     BM: gl.constexpr, STAGES: gl.constexpr, PIPE: gl.constexpr, DECODE: gl.constexpr,
                     num_warps: gl.constexpr):
    """``fp4_rs_kernel`` (``SF_TMA``, ``DECODE`` 2, one warpgroup) warp-specialised and persistent: a loader warp
    keeps the ring full (no CTA barrier or elected TMA issue in the math's K loop), the CTA walks tiles ``pid,
    pid + grid, ...`` (``num_tiles`` = E x N / 64). Launched at ``maxnreg`` 64 (8 warps: the math warpgroup and
    the loader's; offline sm_90a: no spill, setmaxnreg 24 / 40 loader, 88 / 104 math), so 4 CTAs fit an SM."""
    ROWS: gl.constexpr = 64
    wp = gl.allocate_shared_memory(gl.uint8, [2 * STAGES, ROWS, 32], w_desc.layout)
    ab = gl.allocate_shared_memory(gl.float8e4nv, [4 * STAGES, BM, 32], a_desc.layout)
    sw = gl.allocate_shared_memory(gl.int32, [STAGES, ROWS], s_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize([
        (_rs_math, (wp, ab, sw, ready, empty, rmax, lut, out, num_tiles, N, K, BM, STAGES, ROWS, PIPE,
                    DECODE)),
        (_rs_load, (w_desc, a_desc, s_desc, wp, ab, sw, ready, empty, num_tiles, N, K, BM, STAGES, ROWS)),
    ], [1], [40])


def layouts(rows: int, bm: int):
    """Shared layouts of the two TMA boxes: 32-byte swizzle (a box is one 32-byte run a row)."""
    lw = gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=8, rank=2)
    la = gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=8, rank=2)
    ls = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
    return lw, la, ls


def compile_offline(num_warps: int = 4, bm: int = 16, stages: int = 6, shape: str = "L1", sf_tma: bool = True,
                    decode: int = 2, ws: bool = False, pipe: bool = False) -> dict:
    """sm_90a compile on any machine (``megamoe.hopper_compile.compile_report``): registers, spills, shared memory
    and the K loop's SASS histogram of ``fp4_rs_kernel`` (``ws``: ``fp4_rs_ws_kernel`` at ``maxnreg`` 64)."""
    from megamoe.hopper_compile import compile_report
    N, K = SHAPES[shape]
    rows = 64 if ws else 16 * num_warps
    lw, la, ls = layouts(rows, bm)
    sig = {"w_desc": f"tensordesc<u8[{rows}, 32],{lw!r}>", "a_desc": f"tensordesc<fp8e4nv[{bm}, 32],{la!r}>",
           "s_desc": f"tensordesc<i32[{rows}],{ls!r}>", "w_sf": "*i32", "rmax": "*i32", "lut": "*i32",
           "out": "*fp32"}
    if ws:
        fn, options = fp4_rs_ws_kernel, {"num_warps": 4, "maxnreg": 64}
        sig["num_tiles"] = "i32"
        kw = dict(N=N, K=K, BM=bm, STAGES=stages, PIPE=pipe, DECODE=decode, num_warps=4)
    else:
        fn, options = fp4_rs_kernel, {"num_warps": num_warps}
        kw = dict(N=N, K=K, BM=bm, STAGES=stages, SF_TMA=sf_tma, DECODE=decode, num_warps=num_warps)
    attrs = {(fn.arg_names.index(p),): [["tt.divisibility", 16]] for p in ("w_sf", "rmax", "lut", "out")}
    r = compile_report(fn, sig, kw, attrs, options, "fp4_rs_ws" if ws else "fp4_rs", bm, keep=True)
    loops = [(n, dict(sorted(ops.items(), key=lambda x: -x[1])[:10])) for _, _, n, ops in r.loops]
    return {"mode": "compile", "shape": shape, "ws": ws, "num_warps": num_warps, "bm": bm, "stages": stages,
            "sf_tma": sf_tma, "decode": decode, "pipe": pipe, "shared": r.shared, "registers": r.registers,
            "spill_stores": r.spill_stores, "spill_loads": r.spill_loads, "loops": loops, "dir": r.directory}


def decoded_weights(packed: torch.Tensor, sf: torch.Tensor, rmax: torch.Tensor, lut: torch.Tensor) -> torch.Tensor:
    """The kernel's decode in torch: packed uint8 ``[N, K/2]`` in ``transform_weights_for_mega_moe``'s nibble order
    (per 128-wide K block, chunk ``c`` little-endian word ``j`` = elements ``64c + 4j + i`` (low) and ``64c + 32 +
    4j + i`` (high), ``i`` < 4, in register order), UE8M0 bytes int32 ``[N, K/32]``, row maxima int32 ``[N]``,
    ``fold_lut`` -> the folded e4m3 weights as float32 ``[N, K]`` (``tests/test_probes.py`` checks it against
    ``megamoe.quant.fold_scales`` and against the library's ``_PRMT_LUT_ASM``)."""
    N, K = packed.shape[0], 2 * packed.shape[1]
    kk = torch.arange(K, device=packed.device)
    blk, r = kk // 128, kk % 128
    c, q = r // 64, r % 64
    hi = (q >= 32).long()
    words = packed.contiguous().view(torch.int32).long() & 0xFFFFFFFF  # [N, K/8], little-endian
    p = q % 32
    w = words[:, blk * 16 + c * 8 + p // 4]
    i = p % 4
    mag = (w >> (4 * i + 16 * hi)) & 7
    sign = (w >> (8 * i + 7 - 4 * hi)) & 1
    codes = mag | sign << 3
    table = lut.view(-1, 2).long() & 0xFFFFFFFF  # [shifts, 2] words
    tb = torch.stack([(table[:, 0] >> (8 * j)) & 0xFF for j in range(4)]
                     + [(table[:, 1] >> (8 * j)) & 0xFF for j in range(4)], dim=1)  # [shifts, 8] bytes
    d = rmax.view(N, 1).long() - sf.repeat_interleave(32, dim=1).long()
    bits = tb[d.clamp(max=FOLD_LUT_MAX_SHIFT.value), codes & 7] | ((codes & 8) << 4)
    return bits.to(torch.uint8).view(torch.float8_e4m3fn).float()


def make_inputs(E: int, N: int, K: int, bm: int, seed: int = 0, dev: str = "cuda"):
    """Random packed FP4 weights (the transform's nibble order), per-32 UE8M0 scales (a spread of 7 binades a row), tokens; and
    the torch model ``ref[e, n, t] = sum_k W'[n, k] A[t, k]`` with W' the folded e4m3 weights (``fold_lut``
    bytes)."""
    from megamoe.quant import fold_lut, pack_ue8m0
    g = torch.Generator(device=dev).manual_seed(seed)
    packed = torch.randint(0, 256, (E * N, K // 2), generator=g, device=dev, dtype=torch.uint8)
    sf = torch.randint(121, 128, (E, N, K // 32), generator=g, device=dev, dtype=torch.int32)
    rmax = sf.amax(dim=-1).reshape(-1).contiguous()
    w_sf = pack_ue8m0(torch.pow(2.0, (sf - 127).float())).permute(0, 2, 1).contiguous()  # MN-major [E][K/128][N]
    a = (torch.randn(E * bm, K, generator=g, device=dev) * 2).to(torch.float8_e4m3fn)
    lut = fold_lut(device=dev)
    ref = torch.empty(E, N, bm, device=dev)
    for x in range(E):  # one expert at a time (the decoded weights of all of them would be tens of GB)
        rows = slice(x * N, (x + 1) * N)
        wf = decoded_weights(packed[rows], sf[x], rmax[rows], lut)
        ref[x] = wf @ a[x * bm:(x + 1) * bm].float().t()
    return packed, w_sf, rmax, lut, a, ref


_INPUTS = {}


def run(num_warps: int, bm: int, stages: int, shape: str, E: int, sf_tma: bool, decode: int = 2,
        ws_ctas: int = 0, pipe: bool = False) -> dict:
    """One row. ``ws_ctas`` > 0: ``fp4_rs_ws_kernel`` with that many CTAs an SM (persistent) instead."""
    import triton
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    N, K = SHAPES[shape]
    rows = 64 if ws_ctas else 16 * num_warps  # the warp-specialised kernel: one math warpgroup, 64 rows a tile
    if (shape, bm, E) not in _INPUTS:
        _INPUTS.clear()
        _INPUTS[shape, bm, E] = make_inputs(E, N, K, bm)
    packed, w_sf, rmax, lut, a, ref = _INPUTS[shape, bm, E]
    lw, la, ls = layouts(rows, bm)
    wd = TensorDescriptor.from_tensor(packed, [rows, 32], lw)
    sd = TensorDescriptor(w_sf.view(-1), [w_sf.numel()], [1], [rows], ls)
    ad = TensorDescriptor.from_tensor(a.view(torch.uint8).view(torch.float8_e4m3fn), [bm, 32], la)
    out = torch.empty(E, N, bm, device="cuda", dtype=torch.float32)
    num_tiles = E * (N // rows)
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def call():
        if ws_ctas:
            fp4_rs_ws_kernel[(min(num_tiles, ws_ctas * sms), )](wd, ad, sd, w_sf, rmax, lut, out, num_tiles, N, K, bm,
                                                                stages, pipe, decode, num_warps=4, maxnreg=64)
        else:
            fp4_rs_kernel[(num_tiles, )](wd, ad, sd, w_sf, rmax, lut, out, N, K, bm, stages, sf_tma, decode,
                                         num_warps=num_warps)

    call()
    torch.cuda.synchronize()
    err = ((out - ref).abs().amax() / ref.abs().amax()).item()
    us = triton.testing.do_bench(call, warmup=25, rep=200) * 1e3
    nbytes = packed.numel() + w_sf.numel() * 4
    return {"mode": "run", "shape": shape, "E": E, "bm": bm, "num_warps": num_warps, "stages": stages,
            "sf_tma": sf_tma, "decode": decode, "ws_ctas": ws_ctas, "pipe": pipe, "us": us,
            "fp4_gb_per_s": nbytes / us / 1e3, "max_rel_err": err,
            "commit": os.environ.get("MEGAMOE_GIT_COMMIT", "unknown"), "device": torch.cuda.get_device_name()}


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "compile"
    if mode == "compile":
        for ws, bm, dec in ((False, 16, 2), (False, 16, 3), (False, 8, 3), (True, 16, 2), (True, 16, 3), (True, 8, 3)):
            print(json.dumps(compile_offline(bm=bm, stages=4, decode=dec, ws=ws)), flush=True)
    else:
        for shape in ("L1", "L2"):
            for nw, bm, st, sf, dec, ws, pipe in CONFIGS:
                try:
                    print(json.dumps(run(nw, bm, st, shape, 32, sf, dec, ws, pipe)), flush=True)
                except Exception as ex:  # a probe row per config, the failure named
                    print(json.dumps({"mode": "run", "shape": shape, "bm": bm, "num_warps": nw, "stages": st,
                                      "error": repr(ex)[:400]}), flush=True)
