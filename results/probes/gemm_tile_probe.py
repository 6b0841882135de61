"""Probe: one L1-shaped grouped GEMM (48 experts, N=2I=6144, K=H=7168) in several tile variants.

MODE 0  swap-AB, FP4 decode + fold through fp16 (today's fused 'hopper' _mma_step)
MODE 1  swap-AB, FP4 decode with a per-(row, group) PRMT table (fold folded into the LUT)
MODE 2  non-swap (tokens = A [BM, K], W^T = B), FP4 PRMT-table fold
MODE 3  swap-AB, FP8 weights (one K=128 dot per step)
MODE 4  non-swap, FP8 weights
MODE 5  exact per-32 promotion tile (today's staged/fused 'exact' _weight_step)
MODE 6  swap-AB FP8 weights through a TMA tensor descriptor
MODE 7  swap-AB FP4 PRMT-table fold, packed bytes through a TMA tensor descriptor
"""
import json, os, sys, time
import torch
import triton
import triton.language as tl
from megamoe.kernels.fused import _row_exponent_max, _mma_step, _load_a4
from megamoe.kernels.gemm import _load_a_step, _load_w, _weight_step

_DEC = """
    and.b32 v, {src}, 0x0F0F0F0F;
    and.b32 m, v, 0x07070707;
    shr.b32 sel, m, 4;
    or.b32 sel, sel, m;
    and.b32 sel, sel, 0x00FF00FF;
    shr.b32 t, sel, 8;
    or.b32 sel, sel, t;
    prmt.b32 {dst}, {l0}, {l1}, sel;
    and.b32 t, v, 0x08080808;
    shl.b32 t, t, 4;
    or.b32 {dst}, {dst}, t;
"""
# operands: $0 $1 outputs (4 x u8 each), $2 packed (4 x u8), $3..$6 lo-lut0, $7..$10 lo-lut1, $11..$14 hi-lut0, $15..$18 hi-lut1
_FOLD_ASM = tl.constexpr("{\n.reg .b32 v, m, sel, t, src;\n" + _DEC.format(src="$2", dst="$0", l0="$3", l1="$7")
                         + "shr.b32 src, $2, 4;\n" + _DEC.format(src="src", dst="$1", l0="$11", l1="$15") + "}")


@triton.jit
def fold_decode(packed, la0, la1, lb0, lb1):
    lo, hi = tl.inline_asm_elementwise(asm=_FOLD_ASM, constraints="=r,=r," + "r," * 16 + "r",
                                       args=[packed, la0, la1, lb0, lb1], dtype=(tl.uint8, tl.uint8),
                                       is_pure=True, pack=4)
    return lo.to(tl.float8e4nv, bitcast=True), hi.to(tl.float8e4nv, bitcast=True)


@triton.jit
def _luts(tab, word, rmax, c: tl.constexpr):
    d0 = tl.minimum(rmax - ((word >> (16 * c)) & 0xFF), 15)
    d1 = tl.minimum(rmax - ((word >> (16 * c + 8)) & 0xFF), 15)
    return (tl.load(tab + 2 * d0)[:, None], tl.load(tab + 2 * d0 + 1)[:, None],
            tl.load(tab + 2 * d1)[:, None], tl.load(tab + 2 * d1 + 1)[:, None])


@triton.jit
def _chunk(packed, tab, word, rmax, c: tl.constexpr):
    la0, la1, lb0, lb1 = _luts(tab, word, rmax, c)
    z = tl.zeros(packed.shape, tl.int32)
    return fold_decode(packed, la0 + z, la1 + z, lb0 + z, lb1 + z)


@triton.jit
def probe_kernel(acts, w, w_sf, tab, out, M, MB,
                 N: tl.constexpr, K: tl.constexpr, KW_PAD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 MODE: tl.constexpr):
    pe = tl.program_id(0)
    e = pe // MB
    mb = pe % MB
    nt = tl.program_id(1)
    rows_n = nt * BN + tl.arange(0, BN)
    m = mb * BM + tl.arange(0, BM)
    mask_m = m < M
    arow = e * M + m
    if MODE == 0 or MODE == 1 or MODE == 2 or MODE == 7:
        wp = w + e.to(tl.int64) * N * (K // 2)
        wsf = w_sf + e.to(tl.int64) * (K // 128) * N
        rmax = _row_exponent_max(wsf, rows_n, N, K // 128, KW_PAD)
    if MODE == 0:
        acc = tl.zeros([BN, BM], tl.float32)
        for k0 in range(0, K, 128):
            a0, a1, a2, a3 = _load_a4(acts, arow, mask_m, k0, K)
            acc = _mma_step(acc, wp, wsf, rmax, rows_n, a0, a1, a2, a3, k0, K, N, True, True)
        res = tl.trans(acc)
    elif MODE == 1:
        acc = tl.zeros([BN, BM], tl.float32)
        for k0 in range(0, K, 128):
            a0, a1, a2, a3 = _load_a4(acts, arow, mask_m, k0, K)
            word = tl.load(wsf + (k0 // 128) * N + rows_n)
            base = wp + rows_n[:, None].to(tl.int64) * (K // 2) + k0 // 2 + tl.arange(0, 32)[None, :]
            b0, b1 = _chunk(tl.load(base), tab, word, rmax, 0)
            acc = tl.dot(b0, tl.trans(a0), acc)
            acc = tl.dot(b1, tl.trans(a1), acc)
            b2, b3 = _chunk(tl.load(base + 32), tab, word, rmax, 1)
            acc = tl.dot(b2, tl.trans(a2), acc)
            acc = tl.dot(b3, tl.trans(a3), acc)
        res = tl.trans(acc)
    elif MODE == 2:
        acc = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, K, 128):
            a0, a1, a2, a3 = _load_a4(acts, arow, mask_m, k0, K)
            word = tl.load(wsf + (k0 // 128) * N + rows_n)
            base = wp + rows_n[:, None].to(tl.int64) * (K // 2) + k0 // 2 + tl.arange(0, 32)[None, :]
            b0, b1 = _chunk(tl.load(base), tab, word, rmax, 0)
            acc = tl.dot(a0, tl.trans(b0), acc)
            acc = tl.dot(a1, tl.trans(b1), acc)
            b2, b3 = _chunk(tl.load(base + 32), tab, word, rmax, 1)
            acc = tl.dot(a2, tl.trans(b2), acc)
            acc = tl.dot(a3, tl.trans(b3), acc)
        res = acc
    elif MODE == 3:
        wp8 = w.to(tl.pointer_type(tl.float8e4nv)) + e.to(tl.int64) * N * K
        acc = tl.zeros([BN, BM], tl.float32)
        kk = tl.arange(0, 128)
        for k0 in range(0, K, 128):
            a = tl.load(acts + arow[:, None].to(tl.int64) * K + k0 + kk[None, :], mask=mask_m[:, None], other=0.0)
            b = tl.load(wp8 + rows_n[:, None].to(tl.int64) * K + k0 + kk[None, :])
            acc = tl.dot(b, tl.trans(a), acc)
        res = tl.trans(acc)
    elif MODE == 4:
        wp8 = w.to(tl.pointer_type(tl.float8e4nv)) + e.to(tl.int64) * N * K
        acc = tl.zeros([BM, BN], tl.float32)
        kk = tl.arange(0, 128)
        for k0 in range(0, K, 128):
            a = tl.load(acts + arow[:, None].to(tl.int64) * K + k0 + kk[None, :], mask=mask_m[:, None], other=0.0)
            b = tl.load(wp8 + rows_n[:, None].to(tl.int64) * K + k0 + kk[None, :])
            acc = tl.dot(a, tl.trans(b), acc)
        res = acc
    elif MODE == 5:
        wp = w + e.to(tl.int64) * N * (K // 2)
        wsf = w_sf + e.to(tl.int64) * (K // 128) * N
        acc = tl.zeros([BM, BN], tl.float32)
        acts_sf = tab  # unused scale words: all 127 bytes (1.0)
        for k0 in range(0, K, 64):
            a0, a1, sa0, sa1 = _load_a_step(acts, acts_sf, arow * 0 + 32, arow * 0 + 32, mask_m, k0, K, 0)
            packed, word = _load_w(wp, wsf, rows_n, k0, K, N)
            acc = _weight_step(acc, a0, a1, sa0, sa1, packed, word, k0, True)
        res = acc
    elif MODE == 6:
        desc = tl.make_tensor_descriptor(w.to(tl.pointer_type(tl.float8e4nv)) + e.to(tl.int64) * N * K,
                                         shape=[N, K], strides=[K, 1], block_shape=[BN, 128])
        acc = tl.zeros([BN, BM], tl.float32)
        kk = tl.arange(0, 128)
        for k0 in range(0, K, 128):
            a = tl.load(acts + arow[:, None].to(tl.int64) * K + k0 + kk[None, :], mask=mask_m[:, None], other=0.0)
            b = desc.load([nt * BN, k0])
            acc = tl.dot(b, tl.trans(a), acc)
        res = tl.trans(acc)
    else:
        desc = tl.make_tensor_descriptor(wp, shape=[N, K // 2], strides=[K // 2, 1], block_shape=[BN, 64])
        acc = tl.zeros([BN, BM], tl.float32)
        for k0 in range(0, K, 128):
            a0, a1, a2, a3 = _load_a4(acts, arow, mask_m, k0, K)
            word = tl.load(wsf + (k0 // 128) * N + rows_n)
            pk = desc.load([nt * BN, k0 // 2])
            p0, p1 = tl.split(tl.reshape(pk, [BN, 2, 32]).permute(0, 2, 1))
            b0, b1 = _chunk(p0, tab, word, rmax, 0)
            acc = tl.dot(b0, tl.trans(a0), acc)
            acc = tl.dot(b1, tl.trans(a1), acc)
            b2, b3 = _chunk(p1, tab, word, rmax, 1)
            acc = tl.dot(b2, tl.trans(a2), acc)
            acc = tl.dot(b3, tl.trans(a3), acc)
        res = tl.trans(acc)
    tl.store(out + arow[:, None].to(tl.int64) * N + rows_n[None, :], res, mask=mask_m[:, None])


def fold_table():
    mags = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float32)
    words = []
    for d in range(16):
        b = (mags * 2.0 ** -d).to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int64)
        words += [int(b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24), int(b[4] | b[5] << 8 | b[6] << 16 | b[7] << 24)]
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)


MODES = {0: "swapAB fp4 fp16-fold", 1: "swapAB fp4 lut-fold", 2: "nonswap fp4 lut-fold", 3: "swapAB fp8",
         4: "nonswap fp8", 5: "exact per-32", 6: "swapAB fp8 TMA", 7: "swapAB fp4 lut-fold TMA"}
