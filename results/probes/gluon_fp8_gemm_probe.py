"""Probe: one block-scaled FP8 grouped GEMM tile written in Gluon for Hopper (sm_90a), warp-specialised like
DeepGEMM's SM90 FP8 kernel, to see whether Gluon can close the gap the plain Triton tiles leave (see README, FP8).

What it computes (the L1 GEMM of the FP8 x FP8 format without SwiGLU; same numerics as
``megamoe.reference.block_scaled_matmul``):

    for every expert e < E:   C_e [M, N] = sum_kb  (A_e[:, kb] @ W_e[:, kb]^T) * (sa_e[kb, m] * sw_e[n // 128, kb])

* ``A``  fp8 e4m3 ``[E * M, K]`` row-major (expert e owns rows ``e*M .. e*M+M``; every expert has the same M here);
* ``SA`` fp32 ``[E, K/128, M]`` (one scale per row and 128 columns, MN-major like the pool), flattened to 1-D for TMA;
* ``W``  fp8 e4m3 ``[E * N, K]`` row-major (K contiguous);  ``SW`` fp32 ``[E * N/128, K/128]`` (128x128 blocks);
* ``C``  bf16 (or fp32) ``[E * M, N]``.
* Per K block of 128: one wgmma K=128 dot (4 x k32 instructions) into a *fresh* fp32 register tile (``use_acc=False``),
  then the float32 promotion ``acc += dot * (sa[m] * sw[n])`` -- the scale product first, then times the dot
  (DeepGEMM SM90's ``final_accum += scale_a * scale_b * accum``).

Kernel structure (``gluon_fp8_grouped_gemm_kernel``), one CTA per SM, persistent over tiles
``t = pid, pid + G, ...`` with ``t -> (expert, n-tile, m-tile)`` (m fastest, so consecutive CTAs share a W block):

* partition "load" (worker, 1 warp, ``LOAD_REGS`` registers): TMA-loads A ``[128, 128]``, W ``[BN, 128]`` and the 128
  A-scales ``[128]`` of one K block into stage ``s`` of a ``STAGES``-deep shared-memory ring, signalling ``ready[s]``
  (expect-tx bytes); waits ``empty[s]`` before refilling.
* partitions "math 0" (default partition, 4 warps = warpgroup 0) and "math 1" (worker, 4 warps, ``MATH_REGS``
  registers): each owns 64 rows of the 128-row tile (``a_bufs[s][64*wg : 64*wg+64]``) and all BN columns; waits
  ``ready[s]``, issues ``warpgroup_mma`` async, waits for it, arrives on ``empty[s]`` (count 2 = one per math
  warpgroup) and promotes. The two warpgroups are separate instruction streams (DeepGEMM's two math warpgroups), so
  one warpgroup's promotion FMAs run while the other's wgmma occupies the tensor cores.
* ``OVERLAP=True``: inside a warpgroup too -- issue block kb+1's wgmma, then ``warpgroup_mma_wait(1)`` for block kb
  and promote it while kb+1 runs (two dot register tiles: 64 + 2 x 64 fp32 registers per thread at BN=128; K loop
  unrolled by two so the tiles keep their registers). **As written it does not work in Triton 3.6**: ptxas
  serialises every wgmma of the kernel (note C7514, "non wgmma instructions reading accumulator registers of a
  wgmma between start and end of the pipeline stage") and spills 844 B; a first version with a loop-carried swap
  got C7515 ("... defining accumulator registers"). Kept so the lead can time it; not the candidate.
  ``OVERLAP=False`` is DeepGEMM's order (issue, wait 0, promote): 64 + 64 at BN=128, 128 + 128 at BN=256 (which
  does not fit 232 registers: BN=256 spills ~800 B). Offline compile numbers of every variant: the "Gluon FP8
  grouped GEMM tile" section of results/probes/README.md.
* ``HALVES=True`` (BN=256 only, ``_math_partition_halves``): BN=256 "in halves". The loader is unchanged (one
  [256, 128] W box per K block, so A is loaded once per 256 columns); per K block each math warpgroup issues the
  wgmma of W rows [0, 128) into one [64, 128] dot tile, waits, promotes into the left [64, 128] accumulator, then
  the same for rows [128, 256) into the right one: 64 + 64 + 64 = 192 accumulator / dot registers. LLVM moves the
  (pure) left-half promotion FMAs below the right-half wgmma, which puts 256 registers back in flight and spills
  660 B (``PIN=False``); ``PIN=True`` (default) passes the promoted left half through a side-effecting no-op inline
  asm (``_pin``) so it stays before the second wgmma: no spills. TMA epilogue through one [64, 128] staging tile per
  warpgroup, two stores with a ``store_wait`` between (32 KB instead of 64 KB: what lets 4 stages fit 227 KB).
* epilogue per warpgroup: ``EPI_TMA=True`` writes the [64, BN] tile to shared memory and TMA-stores it (waiting for
  the previous tile's store before reusing the buffer); ``EPI_TMA=False`` stores from registers with ``gl.store``.
* registers: ``gl.warp_specialize(..., worker_num_regs=[MATH_REGS, LOAD_REGS])`` plus the kernel's ``maxnreg``; Triton's
  AllocateWarpGroups pass turns these into ``setmaxnreg`` per warpgroup: workers get what they ask for (the 1-warp
  loader is padded to a warpgroup), the default partition gets ``(maxnreg * 12 warps - sum(worker regs)) / 4 warps``,
  i.e. 3 * 168 - 232 - 40 = 232 for the defaults (DeepGEMM: 40 producer / 232 math).

Modes:

* ``--compile-only`` (CPU, no GPU needed): ``triton.compile(GluonASTSource(...), target=GPUTarget("cuda", 90, 32))``
  for each configuration; prints registers / stack (``cuobjdump -res-usage``), shared memory, setmaxnreg values,
  spill instructions and a histogram of the wgmma / TMA / barrier SASS ops. One JSON line per configuration.
* GPU (default): seeded random inputs (block-quantised like DeepGEMM's ``per_token_cast_to_fp8`` /
  ``per_block_cast_to_fp8``), checks against the torch reference, times with ``triton.testing.do_bench`` (median,
  its L2 flush between runs), TFLOP/s = 2*M*N*K*E / t; the same for a plain Triton tile of the same numerics (the
  repo's style: ``tl.dot`` per K block + promotion, 8 warps) and, timing only, ``torch._scaled_grouped_mm`` with
  *row-wise* scales (different numerics: a speed reference for cuBLAS/CUTLASS FP8 grouped GEMM, not a check).

Error bound used by the check: every fp8 x fp8 product is exact in fp32 and the sums are fp32 (tensor-core FP8
accumulation inside one 128-wide block is the only reduced-precision step, ~2^-13 relative), so against the fp32
reference the fp32-output kernel should be within ~1e-4 relative Frobenius error (bound checked: 1e-3); a bf16
output adds its rounding, <= 2^-9 relative per element -- 1.67e-3 relative Frobenius for these inputs (measured on
the CPU: reference vs reference rounded to bf16) -- so the bf16 bound checked is 4e-3; the bf16 output is also
compared with the reference rounded to bf16 (expected ~1e-4 or below: only rounding-boundary flips).
``ok`` in the JSON is that check; nothing is asserted, every configuration is reported.

Run on the GPU (one H200), from the repo root of this worktree::

    python results/probes/gluon_fp8_gemm_probe.py --m 256,1024 > results/probes/gluon_fp8_gemm_probe_h200.jsonl

Offline (here)::

    python results/probes/gluon_fp8_gemm_probe.py --compile-only
"""
import argparse
import collections
import functools
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

BK = gl.constexpr(128)  #: K block = scale block along K (and along N for the weights)
WM = gl.constexpr(64)  #: rows per math warpgroup (the wgmma M)
BM = gl.constexpr(128)  #: rows per tile: two math warpgroups


# --------------------------------------------------------------------------------------------------------------------
# Gluon kernel
# --------------------------------------------------------------------------------------------------------------------
@gluon.jit
def _tile_coords(t, m_tiles, n_tiles):
    """Tile index -> (expert, m-tile, n-tile); m-tiles fastest so neighbouring CTAs read the same W block."""
    per_e = m_tiles * n_tiles
    e = t // per_e
    r = t - e * per_e
    n_t = r // m_tiles
    m_t = r - n_t * m_tiles
    return e, m_t, n_t


@gluon.jit
def _load_partition(a_desc, w_desc, sa_desc, a_bufs, w_bufs, sa_bufs, ready, empty, E, M, N, K,
                    BN: gl.constexpr, STAGES: gl.constexpr):
    """TMA producer (1 warp). Stage s of the ring holds A [128, 128] fp8, W [BN, 128] fp8 and sa [128] fp32 of one
    K block; ``ready[s]`` completes when all three landed (expect-tx), ``empty[s]`` when both math warpgroups are done
    with it."""
    KB = K // BK
    m_tiles = M // BM
    n_tiles = N // BN
    num_tiles = E * m_tiles * n_tiles
    nbytes: gl.constexpr = a_desc.block_type.nbytes + w_desc.block_type.nbytes + sa_desc.block_type.nbytes
    it = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        e, m_t, n_t = _tile_coords(t, m_tiles, n_tiles)
        a_row = e * M + m_t * BM
        w_row = e * N + n_t * BN
        sa_off = e * KB * M + m_t * BM  # SA is [E, K/128, M] flattened: element (e, kb, m)
        for kb in range(KB):
            s = it % STAGES
            ph = (it // STAGES) & 1
            # A fresh mbarrier counts as having completed the phase before phase 0, so the first STAGES waits
            # (parity 1) pass at once and the ring starts full.
            mbarrier.wait(empty.index(s), ph ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, nbytes)
            tma.async_copy_global_to_shared(a_desc, [a_row, kb * BK], bar, a_bufs.index(s))
            tma.async_copy_global_to_shared(w_desc, [w_row, kb * BK], bar, w_bufs.index(s))
            tma.async_copy_global_to_shared(sa_desc, [sa_off + kb * M], bar, sa_bufs.index(s))
            it += 1


@gluon.jit
def _promote(acc, dot, sa, sw_lo, sw_hi, BN: gl.constexpr, mma: gl.constexpr):
    """acc [64, BN] += dot [64, BN] * (sa[m] * sw[n // 128]); sa [64] (SliceLayout(1, mma)), sw_* fp32 scalars (the
    weight scale of columns 0..127 and, at BN=256, 128..255 of the tile)."""
    s_lo = gl.expand_dims(sa * sw_lo, 1)  # [64, 1], scale product first
    if BN == 256:
        cols = gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
        s_hi = gl.expand_dims(sa * sw_hi, 1)
        scale = gl.where(gl.expand_dims(cols, 0) < 128, s_lo, s_hi)  # [64, 256]
    else:
        scale = s_lo
    return acc + dot * scale


@gluon.jit
def _issue(a_bufs, w_bufs, sa_bufs, ready, it, sw_row, kb, KB, acc_regs, WG: gl.constexpr, BN: gl.constexpr,
           STAGES: gl.constexpr, rows_l: gl.constexpr):
    """Wait for ring slot ``it % STAGES`` and issue block kb's wgmma (async, ``use_acc=False``: ``acc_regs`` only
    names the registers it writes). Returns the in-flight dot, this warpgroup's 64 A-scales, the weight scale(s) and
    the slot."""
    s = it % STAGES
    sw_lo = gl.load(sw_row + kb)  # issued before the wait: its latency hides behind it
    sw_hi = sw_lo
    if BN == 256:
        sw_hi = gl.load(sw_row + KB + kb)
    mbarrier.wait(ready.index(s), (it // STAGES) & 1)
    dot = warpgroup_mma(a_bufs.index(s).slice(WG * WM, WM), w_bufs.index(s).permute((1, 0)), acc_regs,
                        use_acc=False, is_async=True)
    sa = sa_bufs.index(s).slice(WG * WM, WM).load(rows_l)
    return dot, sa, sw_lo, sw_hi, s


@gluon.jit
def _math_partition(c_desc, c_ptr, sw_ptr, a_bufs, w_bufs, sa_bufs, c_smem, ready, empty, E, M, N, K,
                    BN: gl.constexpr, STAGES: gl.constexpr, WG: gl.constexpr, OVERLAP: gl.constexpr,
                    EPI_TMA: gl.constexpr):
    """One math warpgroup (4 warps): rows [64*WG, 64*WG+64) of every 128-row tile, all BN columns."""
    # wgmma accumulator layout: 4 warps along M, instruction m64nBNk32 (fp8: k = 256 bits / 8 = 32).
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 32])
    rows_l: gl.constexpr = gl.SliceLayout(1, mma)
    cols_l: gl.constexpr = gl.SliceLayout(0, mma)
    KB = K // BK
    m_tiles = M // BM
    n_tiles = N // BN
    num_tiles = E * m_tiles * n_tiles
    NB = N // 128  # weight-scale rows per expert
    spare = gl.zeros([WM, BN], gl.float32, mma)  # register tile a use_acc=False wgmma writes into
    it = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        e, m_t, n_t = _tile_coords(t, m_tiles, n_tiles)
        sw_row = sw_ptr + (e * NB + n_t * (BN // 128)) * KB  # SW[e, n-block, :]; the hi block is KB further
        acc = gl.zeros([WM, BN], gl.float32, mma)
        if OVERLAP:
            zero = gl.zeros([WM, BN], gl.float32, mma)
            # Two dot register tiles X (even blocks) and Y (odd blocks); the K loop is unrolled by two so each keeps
            # its registers (a loop-carried swap would be register copies into a wgmma accumulator, which makes
            # ptxas serialise every wgmma: C7515). Per step: issue the next block, wait until one wgmma is left
            # in flight, release + promote the older block. Requires K/128 even.
            X, sa_x, swl_x, swh_x, s_x = _issue(a_bufs, w_bufs, sa_bufs, ready, it, sw_row, 0, KB, zero, WG, BN,
                                                STAGES, rows_l)
            for kk in range(KB // 2 - 1):
                Y, sa_y, swl_y, swh_y, s_y = _issue(a_bufs, w_bufs, sa_bufs, ready, it + 1, sw_row, 2 * kk + 1, KB,
                                                    zero, WG, BN, STAGES, rows_l)
                Xw = warpgroup_mma_wait(num_outstanding=1, deps=(X, ))
                mbarrier.arrive(empty.index(s_x), count=1)
                acc = _promote(acc, Xw, sa_x, swl_x, swh_x, BN, mma)
                X, sa_x, swl_x, swh_x, s_x = _issue(a_bufs, w_bufs, sa_bufs, ready, it + 2, sw_row, 2 * kk + 2, KB,
                                                    zero, WG, BN, STAGES, rows_l)
                Yw = warpgroup_mma_wait(num_outstanding=1, deps=(Y, ))
                mbarrier.arrive(empty.index(s_y), count=1)
                acc = _promote(acc, Yw, sa_y, swl_y, swh_y, BN, mma)
                it += 2
            Y, sa_y, swl_y, swh_y, s_y = _issue(a_bufs, w_bufs, sa_bufs, ready, it + 1, sw_row, KB - 1, KB, zero,
                                                WG, BN, STAGES, rows_l)
            Xw = warpgroup_mma_wait(num_outstanding=1, deps=(X, ))
            mbarrier.arrive(empty.index(s_x), count=1)
            acc = _promote(acc, Xw, sa_x, swl_x, swh_x, BN, mma)
            Yw = warpgroup_mma_wait(num_outstanding=0, deps=(Y, ))
            mbarrier.arrive(empty.index(s_y), count=1)
            acc = _promote(acc, Yw, sa_y, swl_y, swh_y, BN, mma)
            it += 2
        else:
            for kb in range(KB):
                s = it % STAGES
                ph = (it // STAGES) & 1
                sw_lo = gl.load(sw_row + kb)  # issued before the waits: its latency hides behind them
                sw_hi = sw_lo
                if BN == 256:
                    sw_hi = gl.load(sw_row + KB + kb)
                mbarrier.wait(ready.index(s), ph)
                dot = warpgroup_mma(a_bufs.index(s).slice(WG * WM, WM), w_bufs.index(s).permute((1, 0)), spare,
                                    use_acc=False, is_async=True)
                sa = sa_bufs.index(s).slice(WG * WM, WM).load(rows_l)
                dot_w = warpgroup_mma_wait(num_outstanding=0, deps=(dot, ))
                mbarrier.arrive(empty.index(s), count=1)
                acc = _promote(acc, dot_w, sa, sw_lo, sw_hi, BN, mma)
                spare = dot_w
                it += 1
        # epilogue: this warpgroup's [64, BN] rows of C
        row0 = e * M + m_t * BM + WG * WM
        if EPI_TMA:
            tma.store_wait(pendings=0)  # the previous tile's TMA store has finished reading c_smem
            c_smem.store(acc.to(c_desc.dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(c_desc, [row0, n_t * BN], c_smem)
        else:
            rows = row0 + gl.arange(0, WM, layout=rows_l)
            cols = n_t * BN + gl.arange(0, BN, layout=cols_l)
            ptrs = c_ptr + gl.expand_dims(rows.to(gl.int64) * N, 1) + gl.expand_dims(cols, 0)
            gl.store(ptrs, acc.to(c_ptr.dtype.element_ty))
    if EPI_TMA:
        tma.store_wait(pendings=0)


@gluon.jit
def _pin(x):
    """Identity on a register tile (one ``mov.b32`` per element, which ptxas coalesces away) through a
    *side-effecting* inline asm: LLVM may not move the instructions that compute ``x`` below a later wgmma (also a
    side-effecting inline asm), which it otherwise does with the pure promotion FMAs (``_math_partition_halves``)."""
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=False, pack=1)


@gluon.jit
def _math_partition_halves(c_desc, c_ptr, sw_ptr, a_bufs, w_bufs, sa_bufs, c_smem, ready, empty, E, M, N, K,
                           STAGES: gl.constexpr, WG: gl.constexpr, EPI_TMA: gl.constexpr, PIN: gl.constexpr):
    """BN=256 "in halves" (``HALVES=True``): one math warpgroup, rows [64*WG, 64*WG+64), 256 columns kept as two
    [64, 128] fp32 accumulators (left = columns 0..127, right = 128..255: 64 + 64 registers per thread). Per K block:
    wgmma of the W stage's rows [0, 128) into the one [64, 128] dot tile (64 registers), wait 0, promote into the
    left half; then rows [128, 256) into the same dot tile, wait 0, release the stage, promote into the right half.
    128 + 64 = 192 accumulator / dot registers instead of 256 for the one-shot BN=256. The W stage [256, 128] is
    loaded once per K block (``_load_partition`` with BN=256), so each A block serves 256 columns.
    Epilogue (``EPI_TMA``): one [64, 128] staging tile per warpgroup (``c_desc`` box [64, 128]); left half stored,
    TMA-stored, ``store_wait(0)`` until the TMA has read it, then the right half through the same buffer: 32 KB of C
    staging for the CTA instead of 64 KB, which is what lets 4 ring stages fit 227 KB."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 32])
    rows_l: gl.constexpr = gl.SliceLayout(1, mma)
    cols_l: gl.constexpr = gl.SliceLayout(0, mma)
    HN: gl.constexpr = 128  # columns per half
    KB = K // BK
    m_tiles = M // BM
    n_tiles = N // (2 * HN)
    num_tiles = E * m_tiles * n_tiles
    NB = N // 128
    spare = gl.zeros([WM, HN], gl.float32, mma)  # the one dot register tile (use_acc=False wgmma writes into it)
    it = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        e, m_t, n_t = _tile_coords(t, m_tiles, n_tiles)
        sw_row = sw_ptr + (e * NB + n_t * 2) * KB  # SW[e, 2*n_t, :] (left half); the right half's row is KB further
        acc_lo = gl.zeros([WM, HN], gl.float32, mma)
        acc_hi = gl.zeros([WM, HN], gl.float32, mma)
        for kb in range(KB):
            s = it % STAGES
            ph = (it // STAGES) & 1
            sw_lo = gl.load(sw_row + kb)  # issued before the wait: its latency hides behind it
            sw_hi = gl.load(sw_row + KB + kb)
            mbarrier.wait(ready.index(s), ph)
            a_s = a_bufs.index(s).slice(WG * WM, WM)
            w_s = w_bufs.index(s)
            dot = warpgroup_mma(a_s, w_s.slice(0, HN).permute((1, 0)), spare, use_acc=False, is_async=True)
            sa = sa_bufs.index(s).slice(WG * WM, WM).load(rows_l)
            d_lo = warpgroup_mma_wait(num_outstanding=0, deps=(dot, ))
            acc_lo = _promote(acc_lo, d_lo, sa, sw_lo, sw_lo, 128, mma)
            if PIN:  # keep the left promotion before the right wgmma, so d_lo is dead when d_hi is written
                acc_lo = _pin(acc_lo)
            dot = warpgroup_mma(a_s, w_s.slice(HN, HN).permute((1, 0)), d_lo, use_acc=False, is_async=True)
            d_hi = warpgroup_mma_wait(num_outstanding=0, deps=(dot, ))
            mbarrier.arrive(empty.index(s), count=1)
            acc_hi = _promote(acc_hi, d_hi, sa, sw_hi, sw_hi, 128, mma)
            spare = d_hi
            it += 1
        # epilogue: this warpgroup's [64, 256] rows of C, one half at a time
        row0 = e * M + m_t * BM + WG * WM
        col0 = n_t * (2 * HN)
        if EPI_TMA:
            tma.store_wait(pendings=0)  # the previous store has finished reading c_smem
            c_smem.store(acc_lo.to(c_desc.dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(c_desc, [row0, col0], c_smem)
            tma.store_wait(pendings=0)
            c_smem.store(acc_hi.to(c_desc.dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(c_desc, [row0, col0 + HN], c_smem)
        else:
            rows = row0 + gl.arange(0, WM, layout=rows_l)
            cols = col0 + gl.arange(0, HN, layout=cols_l)
            ptrs = c_ptr + gl.expand_dims(rows.to(gl.int64) * N, 1) + gl.expand_dims(cols, 0)
            gl.store(ptrs, acc_lo.to(c_ptr.dtype.element_ty))
            gl.store(ptrs + HN, acc_hi.to(c_ptr.dtype.element_ty))
    if EPI_TMA:
        tma.store_wait(pendings=0)


@gluon.jit
def gluon_fp8_grouped_gemm_kernel(a_desc, w_desc, sa_desc, c_desc, c_ptr, sw_ptr, E, M, N, K,
                                  BN: gl.constexpr, STAGES: gl.constexpr, OVERLAP: gl.constexpr,
                                  EPI_TMA: gl.constexpr, MATH_REGS: gl.constexpr, LOAD_REGS: gl.constexpr,
                                  HALVES: gl.constexpr = False, PIN: gl.constexpr = True):
    # shared memory: the ring (STAGES x (16 KB A + BN*128 B W + 512 B sa)), barriers, per-warpgroup C tiles
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, BK], w_desc.layout)
    sa_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BM], sa_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)  # the loader's expect + TMA tx bytes
        mbarrier.init(empty.index(i), count=2)  # one arrive per math warpgroup
    fence_async_shared()  # barrier inits visible to the async proxy (TMA) before first use
    # one C staging tile per math warpgroup, of c_desc's box ([64, BN]; [64, 128] with HALVES) (TMA-store epilogue);
    # with EPI_TMA=False it is never used and the compiler drops the allocation (shared_bytes = the ring only)
    c_smem = gl.allocate_shared_memory(c_desc.dtype, [2, WM, c_desc.block_type.shape[1]], c_desc.layout)
    if HALVES:  # BN=256 as two 128-column halves (the loader is the same: one [256, 128] W box per K block)
        gl.warp_specialize([
            (_math_partition_halves, (c_desc, c_ptr, sw_ptr, a_bufs, w_bufs, sa_bufs, c_smem.index(0), ready, empty,
                                      E, M, N, K, STAGES, 0, EPI_TMA, PIN)),
            (_math_partition_halves, (c_desc, c_ptr, sw_ptr, a_bufs, w_bufs, sa_bufs, c_smem.index(1), ready, empty,
                                      E, M, N, K, STAGES, 1, EPI_TMA, PIN)),
            (_load_partition, (a_desc, w_desc, sa_desc, a_bufs, w_bufs, sa_bufs, ready, empty, E, M, N, K, BN,
                               STAGES)),
        ], [4, 1], [MATH_REGS, LOAD_REGS])
    else:
        gl.warp_specialize([
            (_math_partition, (c_desc, c_ptr, sw_ptr, a_bufs, w_bufs, sa_bufs, c_smem.index(0), ready, empty, E, M, N,
                               K, BN, STAGES, 0, OVERLAP, EPI_TMA)),
            (_math_partition, (c_desc, c_ptr, sw_ptr, a_bufs, w_bufs, sa_bufs, c_smem.index(1), ready, empty, E, M, N,
                               K, BN, STAGES, 1, OVERLAP, EPI_TMA)),
            (_load_partition, (a_desc, w_desc, sa_desc, a_bufs, w_bufs, sa_bufs, ready, empty, E, M, N, K, BN,
                               STAGES)),
        ], [4, 1], [MATH_REGS, LOAD_REGS])


# --------------------------------------------------------------------------------------------------------------------
# Host side: layouts, descriptors, launch
# --------------------------------------------------------------------------------------------------------------------
def _c_block(cfg):
    """TMA box of C: [64, BN] (one store per warpgroup and tile); [64, 128] with HALVES (two stores)."""
    return [WM.value, 128 if cfg.get("HALVES") else cfg["BN"]]


def _layouts(BN, out_dtype, c_block=None):
    """Shared-memory layouts of the TMA boxes: A [128, 128] and W [BN, 128] fp8 with 128-byte swizzle (one 128-byte
    row per K block: what wgmma reads K-major); sa [128] fp32 unswizzled (1-D); C ``c_block`` (default [64, BN])
    with the default swizzle."""
    return dict(
        a=gl.NVMMASharedLayout.get_default_for([BM.value, BK.value], gl.float8e4nv),
        w=gl.NVMMASharedLayout.get_default_for([BN, BK.value], gl.float8e4nv),
        sa=gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1),
        c=gl.NVMMASharedLayout.get_default_for(c_block or [WM.value, BN], out_dtype),
    )


_GL_OUT = {"bf16": gl.bfloat16, "fp32": gl.float32}
_TORCH_OUT = {"bf16": torch.bfloat16, "fp32": torch.float32}


def kernel_options(cfg):
    """num_warps of the default partition (math warpgroup 0) and the kernel's maxnreg (see the module docstring)."""
    return {"num_warps": 4, "maxnreg": cfg["maxnreg"]}


def launch_gluon(A, W, SA, SW, C, E, M, N, K, cfg, num_sms):
    """A fp8 [E*M, K], W fp8 [E*N, K], SA fp32 [E, K/128, M], SW fp32 [E*N/128, K/128], C [E*M, N] (bf16 / fp32)."""
    BN = cfg["BN"]
    L = _layouts(BN, _GL_OUT[cfg["out"]], _c_block(cfg))
    a_desc = TensorDescriptor.from_tensor(A, [BM.value, BK.value], L["a"])
    w_desc = TensorDescriptor.from_tensor(W, [BN, BK.value], L["w"])
    sa_flat = SA.reshape(-1)
    sa_desc = TensorDescriptor(sa_flat, [sa_flat.numel()], [1], [BM.value], L["sa"])
    c_desc = TensorDescriptor.from_tensor(C, _c_block(cfg), L["c"])
    tiles = E * (M // BM.value) * (N // BN)
    grid = (min(num_sms, tiles), )
    gluon_fp8_grouped_gemm_kernel[grid](a_desc, w_desc, sa_desc, c_desc, C, SW, E, M, N, K, BN, cfg["STAGES"],
                                        cfg["OVERLAP"], cfg["EPI_TMA"], cfg["MATH_REGS"], cfg["LOAD_REGS"],
                                        cfg["HALVES"], cfg["PIN"], **kernel_options(cfg))


# --------------------------------------------------------------------------------------------------------------------
# Plain Triton tile of the same numerics (the repo's style: pointer loads, one tl.dot per K block + promotion)
# --------------------------------------------------------------------------------------------------------------------
@triton.jit
def triton_fp8_grouped_gemm_kernel(A, W, SA, SW, C, M, N: tl.constexpr, K: tl.constexpr, BM_: tl.constexpr,
                                   BN_: tl.constexpr):
    pid_em = tl.program_id(0)
    n_t = tl.program_id(1)
    m_tiles = M // BM_
    e = pid_em // m_tiles
    m_t = pid_em % m_tiles
    KB: tl.constexpr = K // 128
    rows = e * M + m_t * BM_ + tl.arange(0, BM_)
    ncols = n_t * BN_ + tl.arange(0, BN_)
    kk = tl.arange(0, 128)
    acc = tl.zeros([BM_, BN_], tl.float32)
    for kb in range(KB):
        a = tl.load(A + rows[:, None].to(tl.int64) * K + kb * 128 + kk[None, :])
        b = tl.load(W + (e * N + ncols)[:, None].to(tl.int64) * K + kb * 128 + kk[None, :])
        sa = tl.load(SA + (e * KB + kb) * M + m_t * BM_ + tl.arange(0, BM_))
        sw = tl.load(SW + (e * (N // 128) + ncols // 128) * KB + kb)
        acc = acc + tl.dot(a, tl.trans(b)) * (sa[:, None] * sw[None, :])
    tl.store(C + rows[:, None].to(tl.int64) * N + ncols[None, :], acc.to(C.dtype.element_ty))


def launch_triton(A, W, SA, SW, C, E, M, N, K, BN=128, num_warps=8, num_stages=3):
    grid = (E * (M // BM.value), N // BN)
    triton_fp8_grouped_gemm_kernel[grid](A, W, SA, SW, C, M, N, K, BM.value, BN, num_warps=num_warps,
                                         num_stages=num_stages)


# --------------------------------------------------------------------------------------------------------------------
# Offline compile for sm_90a (no GPU)
# --------------------------------------------------------------------------------------------------------------------
_BIN = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
_OPS = ("QGMMA", "HGMMA", "WARPGROUP", "WARPSYNC", "UTMALDG", "UTMASTG", "UTMACMDFLUSH", "UBLKCP", "SYNCS", "BAR",
        "USETMAXREG",
        "STL", "LDL", "LDS", "STS", "STSM", "LDSM", "FFMA", "FMUL", "FADD", "FSEL", "LDG", "STG", "DEPBAR")


def _tensordesc_sig(dtype, block, layout):
    return f"tensordesc<{dtype}{list(block)},{layout!r}>"


def compile_offline(cfg, keep=None):
    """Compile ``gluon_fp8_grouped_gemm_kernel`` for GPUTarget("cuda", 90, 32) and summarise the cubin."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    BN = cfg["BN"]
    L = _layouts(BN, _GL_OUT[cfg["out"]], _c_block(cfg))
    fn = gluon_fp8_grouped_gemm_kernel
    out_ty = {"bf16": "bf16", "fp32": "fp32"}[cfg["out"]]
    sig = {
        "a_desc": _tensordesc_sig("fp8e4nv", [BM.value, BK.value], L["a"]),
        "w_desc": _tensordesc_sig("fp8e4nv", [BN, BK.value], L["w"]),
        "sa_desc": _tensordesc_sig("fp32", [BM.value], L["sa"]),
        "c_desc": _tensordesc_sig(out_ty, _c_block(cfg), L["c"]),
        "c_ptr": f"*{out_ty}", "sw_ptr": "*fp32", "E": "i32", "M": "i32", "N": "i32", "K": "i32",
    }
    consts = {"BN": BN, "STAGES": cfg["STAGES"], "OVERLAP": cfg["OVERLAP"], "EPI_TMA": cfg["EPI_TMA"],
              "MATH_REGS": cfg["MATH_REGS"], "LOAD_REGS": cfg["LOAD_REGS"], "HALVES": cfg["HALVES"],
              "PIN": cfg["PIN"]}
    for k in consts:
        sig[k] = "constexpr"
    names = fn.arg_names
    attrs = {(names.index(p), ): [["tt.divisibility", 16]] for p in ("c_ptr", "sw_ptr", "M", "N", "K")}
    k = triton.compile(GluonASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                       options=kernel_options(cfg))
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    ru = subprocess.run([f"{_BIN}/cuobjdump", "-res-usage", f.name], capture_output=True, text=True).stdout
    sass = subprocess.run([f"{_BIN}/cuobjdump", "-sass", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    # ptxas -v on Triton's PTX: spill bytes and the C75xx notes (e.g. C7514/C7515 "wgmma serialized"), which Triton
    # does not surface. Same ptxas, same sm_90a; Triton's own ptxas call adds only its usual flags.
    with tempfile.TemporaryDirectory() as d:
        open(os.path.join(d, "k.ptx"), "w").write(k.asm["ptx"])
        pv = subprocess.run([f"{_BIN}/ptxas", "-arch=sm_90a", "-v", os.path.join(d, "k.ptx"), "-o",
                             os.path.join(d, "k.cubin")], capture_output=True, text=True)
    pv = pv.stdout + pv.stderr
    spill = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", pv)
    notes = sorted(set(re.findall(r"\((C75\d\d)\)", pv)))
    if keep:
        os.makedirs(keep, exist_ok=True)
        tag = cfg_tag(cfg)
        for ext in ("ttgir", "ptx"):
            open(os.path.join(keep, f"{tag}.{ext}"), "w").write(k.asm[ext])
        open(os.path.join(keep, f"{tag}.sass"), "w").write(sass)
    ops = collections.Counter(re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]+)", sass, re.M))
    hist = {op: n for op, n in sorted(ops.items()) if op.startswith(_OPS)}
    res = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", ru)
    ptx = k.asm["ptx"]
    return {
        "config": cfg_tag(cfg), **cfg,
        "ptxas_REG": int(res.group(1)), "ptxas_STACK": int(res.group(2)), "ptxas_SHARED": int(res.group(3)),
        "shared_bytes": k.metadata.shared, "total_warps": _total_warps(k),
        "setmaxnreg_ptx": sorted(set(re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx))),
        "ptxas_spill_stores": int(spill.group(2)) if spill else None,
        "ptxas_spill_loads": int(spill.group(3)) if spill else None,
        "ptxas_notes": notes, "wgmma_serialized": any(n in ("C7514", "C7515", "C7516", "C7510") for n in notes)
        or "serialized" in pv,
        "regions": _regions(sass), "sass_instrs": sum(ops.values()), "sass_ops": hist,
    }


def _total_warps(k):
    """Warps of the launch (default partition + workers, workers padded to whole warpgroups): PTX ``.reqntid``."""
    m = re.search(r"\.reqntid (\d+)", k.asm["ptx"])
    return int(m.group(1)) // 32 if m else None


def _regions(sass):
    """Split the SASS at every USETMAXREG and report, per stretch, the register budget it sets and the highest
    register index used before the next one (ptxas reports one REG count for the whole kernel: the entry maxnreg).
    Spill evidence is STL/LDL in the histogram (ptxas's -v spill line is not kept by Triton)."""
    out, cur, hi, n = [], "entry", -1, 0
    for line in sass.splitlines():
        m = re.search(r"USETMAXREG\.(\w+)\.CTAPOOL\s+(?:UP\d,\s*)?(0x[0-9a-f]+)", line)
        if m:
            if n:
                out.append({"set": cur, "max_R": hi, "instrs": n})
            cur, hi, n = f"{m.group(1)} {int(m.group(2), 16)}", -1, 0
            continue
        if re.match(r"^\s+/\*[0-9a-f]+\*/", line):
            n += 1
            regs = [int(r) for r in re.findall(r"\bR(\d+)\b", line)]
            hi = max([hi] + regs)
    if n:
        out.append({"set": cur, "max_R": hi, "instrs": n})
    return [r for r in out if r["instrs"] > 8]


def cfg_tag(cfg):
    order = ("halves" + ("" if cfg["PIN"] else "-nopin")) if cfg["HALVES"] else "ovl" if cfg["OVERLAP"] else "wait0"
    return (f"BN{cfg['BN']}_S{cfg['STAGES']}_{order}_"
            f"{'tma' if cfg['EPI_TMA'] else 'direct'}_{cfg['out']}_"
            f"r{cfg['MATH_REGS']}-{cfg['LOAD_REGS']}-{cfg['maxnreg']}")


def make_cfg(BN=128, STAGES=4, OVERLAP=False, EPI_TMA=True, out="bf16", MATH_REGS=232, LOAD_REGS=40, maxnreg=168,
             HALVES=False, PIN=True):
    assert not HALVES or (BN == 256 and not OVERLAP), "HALVES is the BN=256 wait-0 tile in two 128-column halves"
    return dict(BN=BN, STAGES=STAGES, OVERLAP=OVERLAP, EPI_TMA=EPI_TMA, out=out, MATH_REGS=MATH_REGS,
                LOAD_REGS=LOAD_REGS, maxnreg=maxnreg, HALVES=HALVES, PIN=PIN)


# --------------------------------------------------------------------------------------------------------------------
# GPU mode: inputs, reference, check, timing
# --------------------------------------------------------------------------------------------------------------------
def make_inputs(E, M, N, K, seed=0, device="cuda"):
    """Block-quantised random operands: A rows scaled per 128 columns (amax / 448), W per 128x128 block; row and
    block magnitudes vary (log-normal) so the scales differ. Returns A fp8 [E*M, K], SA fp32 [E, K/128, M],
    W fp8 [E*N, K], SW fp32 [E*N/128, K/128]."""
    g = torch.Generator(device=device).manual_seed(seed)
    KB, NB = K // 128, N // 128
    f8 = torch.float8_e4m3fn
    A = torch.empty(E * M, K, dtype=f8, device=device)
    SA = torch.empty(E, KB, M, dtype=torch.float32, device=device)
    W = torch.empty(E * N, K, dtype=f8, device=device)
    SW = torch.empty(E * NB, KB, dtype=torch.float32, device=device)
    for e in range(E):  # one expert at a time: the fp32 staging of W would be 8 GB at E = 48
        a = torch.randn(M, K, generator=g, device=device) * torch.exp(torch.randn(M, 1, generator=g, device=device))
        sa = a.view(M, KB, 128).abs().amax(-1).clamp(min=1e-4) / 448.0  # [M, KB]
        A[e * M:(e + 1) * M] = (a.view(M, KB, 128) / sa[..., None]).view(M, K).to(f8)
        SA[e] = sa.t()
        w = torch.randn(N, K, generator=g, device=device) * 0.02
        w = w * torch.exp(0.5 * torch.randn(NB, 1, KB, 1, generator=g, device=device)).expand(NB, 128, KB, 128) \
            .reshape(N, K)
        sw = w.view(NB, 128, KB, 128).abs().amax(dim=(1, 3)).clamp(min=1e-4) / 448.0  # [NB, KB]
        W[e * N:(e + 1) * N] = (w.view(NB, 128, KB, 128) / sw[:, None, :, None]).view(N, K).to(f8)
        SW[e * NB:(e + 1) * NB] = sw
    return A, SA, W, SW


def reference(A, SA, W, SW, E, M, N, K):
    """fp32 [E*M, N]: per expert, for kb in order, acc += (sa[kb, m] * sw[n/128, kb]) * (A[:, kb] @ W[:, kb]^T), the
    block dot an IEEE fp32 matmul (TF32 off) of the exact fp8 values (megamoe.reference.block_scaled_matmul)."""
    KB = K // 128
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        a = A.view(E, M, K).float()
        out = torch.zeros(E, M, N, dtype=torch.float32, device=A.device)
        for e in range(E):
            w = W[e * N:(e + 1) * N].float()
            swn = SW[e * (N // 128):(e + 1) * (N // 128)].repeat_interleave(128, dim=0)  # [N, KB]
            acc = out[e]
            for kb in range(KB):
                c = slice(kb * 128, (kb + 1) * 128)
                acc += (SA[e, kb][:, None] * swn[:, kb][None, :]) * (a[e][:, c] @ w[:, c].T)
        return out.view(E * M, N)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def rel_fro(x, ref):
    d = (x.double() - ref.double()).norm()
    return (d / ref.double().norm()).item()


def _provenance(argv):
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", os.path.abspath(__file__)], capture_output=True,
                               text=True, cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except OSError:
        commit, dirty = None, None
    return {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "torch": torch.__version__, "triton": triton.__version__, "commit": commit,
            "probe_modified": bool(dirty), "command": " ".join([os.path.basename(sys.executable)] + argv)}


#: ``PROBE_REP_MS`` (default 300): each timing's window; ~3000 times a power-capped GEMM at the limiter's steady clock
#: (as ``clock_probe.py``). ``PROBE_CLOCKS=1``: each row also carries the SM clock / power nvidia-smi sampled
#: meanwhile (``clock_probe.Sampler``), so that rows compare in cycles (us x MHz) as well as in time.
#: ``PROBE_SKIP_TRITON=1``: no plain Triton tile rows.
REP_MS = float(os.environ.get("PROBE_REP_MS", 300))
CLOCKS = os.environ.get("PROBE_CLOCKS") == "1"
SKIP_TRITON = os.environ.get("PROBE_SKIP_TRITON") == "1"


@functools.cache
def _clock_probe():
    """``clock_probe.py`` beside this file, loaded once."""
    spec = importlib.util.spec_from_file_location("clock_probe", os.path.join(os.path.dirname(__file__),
                                                                             "clock_probe.py"))
    cp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cp)
    return cp


def _bench(fn, row: dict) -> float:
    """Median ms of ``fn`` over ``REP_MS`` (L2 flushed between runs); the clocks into ``row`` with ``CLOCKS``."""
    sampler = _clock_probe().Sampler.now() if CLOCKS else None
    ms = triton.testing.do_bench(fn, warmup=50, rep=REP_MS, return_mode="median")
    if sampler is not None:
        row.update(sampler.stop(), rep_ms=REP_MS)
    return ms


def _scaled_grouped_mm_fn(A, W, E, M, N, K):
    """torch._scaled_grouped_mm with ROW-WISE scales (ones): different numerics, timing reference only."""
    a = A  # [E*M, K] fp8
    b = W.view(E, N, K).transpose(-2, -1)  # [E, K, N], column-major per expert as the op wants
    offs = torch.arange(M, E * M + 1, M, device=A.device, dtype=torch.int32)
    sa = torch.ones(E * M, device=A.device, dtype=torch.float32)
    sb = torch.ones(E, N, device=A.device, dtype=torch.float32)
    return lambda: torch._scaled_grouped_mm(a, b, sa, sb, offs=offs, out_dtype=torch.bfloat16)


def run_gpu(args):
    E, N, K = args.E, args.N, args.K
    dev = torch.cuda.current_device()
    num_sms = torch.cuda.get_device_properties(dev).multi_processor_count
    prov = _provenance(sys.argv)
    cfgs = [make_cfg(**eval(f"dict({c})")) for c in args.configs.split(";")]
    for M in [int(m) for m in args.m.split(",")]:
        assert M % 128 == 0 and N % 256 == 0 and K % 256 == 0
        A, SA, W, SW = make_inputs(E, M, N, K, seed=args.seed)
        ref = reference(A, SA, W, SW, E, M, N, K)
        ref_bf16 = ref.to(torch.bfloat16)
        flop = 2.0 * M * N * K * E
        rows = []
        for cfg in cfgs:
            row = {"kind": "gluon", "config": cfg_tag(cfg), "cfg": cfg, "E": E, "M": M, "N": N, "K": K}
            try:
                C = torch.empty(E * M, N, dtype=_TORCH_OUT[cfg["out"]], device="cuda")
                fn = lambda: launch_gluon(A, W, SA, SW, C, E, M, N, K, cfg, num_sms)  # noqa: E731
                C.fill_(float("nan"))
                fn()
                torch.cuda.synchronize()
                err = rel_fro(C, ref)
                bound = 1e-3 if cfg["out"] == "fp32" else 4e-3
                row.update(rel_fro_err=err, bound=bound, ok=bool(err <= bound),
                           rel_fro_err_vs_bf16_ref=rel_fro(C.to(torch.bfloat16), ref_bf16) if cfg["out"] == "bf16"
                           else None)
                ms = _bench(fn, row)
                row.update(us=ms * 1e3, tflops=flop / (ms * 1e-3) / 1e12)
            except Exception as ex:  # report and continue with the next configuration
                row.update(error=f"{type(ex).__name__}: {str(ex)[:400]}")
            rows.append(row)
        for bn, nw, ns in [] if SKIP_TRITON else [(128, 8, 3), (128, 8, 4)]:  # plain Triton tile, same numerics
            row = {"kind": "triton_tile", "config": f"BN{bn}_w{nw}_s{ns}", "E": E, "M": M, "N": N, "K": K}
            try:
                C = torch.empty(E * M, N, dtype=torch.bfloat16, device="cuda")
                fn = lambda: launch_triton(A, W, SA, SW, C, E, M, N, K, bn, nw, ns)  # noqa: E731
                fn()
                torch.cuda.synchronize()
                row.update(rel_fro_err=rel_fro(C, ref))
                ms = _bench(fn, row)
                row.update(us=ms * 1e3, tflops=flop / (ms * 1e-3) / 1e12)
            except Exception as ex:
                row.update(error=f"{type(ex).__name__}: {str(ex)[:400]}")
            rows.append(row)
        row = {"kind": "torch_scaled_grouped_mm_rowwise", "config": "rowwise scales (timing only)", "E": E, "M": M,
               "N": N, "K": K}
        try:
            fn = _scaled_grouped_mm_fn(A, W, E, M, N, K)
            fn()
            torch.cuda.synchronize()
            ms = _bench(fn, row)
            row.update(us=ms * 1e3, tflops=flop / (ms * 1e-3) / 1e12)
        except Exception as ex:
            row.update(error=f"{type(ex).__name__}: {str(ex)[:400]}")
        rows.append(row)
        for r in rows:
            print(json.dumps({**r, **prov}), flush=True)
        del A, SA, W, SW, ref, ref_bf16
        torch.cuda.empty_cache()


DEFAULT_CONFIGS = ("BN=128,STAGES=4;BN=128,STAGES=3;BN=128,STAGES=4,EPI_TMA=False;"
                   "BN=128,STAGES=4,out='fp32',EPI_TMA=False;BN=128,STAGES=4,OVERLAP=True;BN=256,STAGES=3;"
                   "BN=256,STAGES=3,HALVES=True;BN=256,STAGES=4,HALVES=True;BN=256,STAGES=4,HALVES=True,EPI_TMA=False")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compile-only", action="store_true", help="offline sm_90a compile + resource report (no GPU)")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS,
                    help="';'-separated make_cfg keyword lists, e.g. \"BN=128,STAGES=4;BN=256,STAGES=3\"")
    ap.add_argument("--m", default="256,1024", help="rows per expert (GPU mode)")
    ap.add_argument("--E", type=int, default=48)
    ap.add_argument("--N", type=int, default=6144)
    ap.add_argument("--K", type=int, default=7168)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", default=None, help="compile-only: directory for ttgir / ptx / sass of each config")
    args = ap.parse_args()
    if args.compile_only:
        for c in args.configs.split(";"):
            cfg = make_cfg(**eval(f"dict({c})"))
            try:
                print(json.dumps(compile_offline(cfg, keep=args.keep)), flush=True)
            except Exception as ex:
                print(json.dumps({"config": cfg_tag(cfg), "error": f"{type(ex).__name__}: {str(ex)[-600:]}"}),
                      flush=True)
    else:
        run_gpu(args)


if __name__ == "__main__":
    main()
