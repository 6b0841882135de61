"""The Gluon GEMM phases of the fused path in pure torch, tile by tile: :func:`run_gemm_phase` for the FP8 format's
(:mod:`megamoe.kernels.gemm_fp8_ws`, tile kind ``"fp8_ws"``), :func:`run_gemm_phase_fp4` for the FP8 x FP4 format's
with "hopper" numerics (:mod:`megamoe.kernels.gemm_fp4_ws`, ``"fp4_ws"``; described at the end). Each goes tile
by tile from the tile table the front launch wrote: what each Gluon tile reads and writes, with the reference's
numerics (:func:`megamoe.reference.block_scaled_matmul`, SwiGLU, the per-128 requant), so that

    front launch (PHASE=1)  ->  :func:`run_gemm_phase`  ->  back launch (PHASE=2)

runs the three-launch call on CPU ranks under Triton's interpreter, bit-exact against the reference
(``tests/test_fp8_mega_moe.py``): it checks the front launch's tile table (which blocks, which expert, how many valid
rows, in which order) and the split of the fused kernel into its two phases without a GPU. On a GPU the Gluon kernel
itself is checked against the reference (``tests/gpu/test_fp8_gpu.py``).

First the pull: the valid rows of every pool block (the table's block list) from the source rank's ``x`` /
``x_sf`` (``token_src_metadata``) into the L1 pool and its scales. Then per tile ``(b, nt, e, valid)`` of the
table (layout: :data:`megamoe.kernels.formats.TILE_HEADER`):

* L1: pool rows ``[block_m b, block_m b + valid)`` x intermediate columns ``[128 nt, 128 nt + 128)`` of expert
  ``e``: gate and up rows of the transformed weight (interleaved by 8) with their untransformed 128x128 scale
  blocks; bf16 round, clamp, SwiGLU, top-k weight, requant into ``l2_acts`` / ``l2_acts_sf``.
* L2: the same rows x hidden columns ``[256 nt, 256 nt + 256)``: bf16 rows into ``combine[slot][token]`` of each
  row's source rank (``token_src_metadata``).

The FP8 x FP4 phase (``"fp4_ws"``, ``megamoe.reference`` with ``numerics="hopper"`` as the model) has no pull: the
front launch copied and folded the rows (one scale word per row, the token's largest exponent). Per tile, with the
weight rows of the *transformed* weights (gate/up interleaved by 8, register-order nibbles) decoded and folded relative
to each row's largest exponent (:func:`megamoe.quant.fold_scales`, what the decode warps' table lookup computes):

* L1: ``acc = a @ w^T`` in float32, then ``(acc * 2^(s_row - 127)) * 2^(s_token - 127)`` (exact powers of two:
  the reference's ``(a 2^..) @ (w 2^..)^T`` bit for bit), bf16 round, gate / up from the interleave, clamp,
  SwiGLU, top-k weight, per-128 UE8M0 requant (:func:`megamoe.quant.per_128_cast_to_fp8`) into ``l2_acts`` /
  ``l2_acts_sf``.
* L2: the pool's per-128 L2 rows folded per token relative to their largest exponent (the decode warps fold the A
  stage), or with ``numerics="hopper_l2_per_block"`` each K block times its own token scale (the math warpgroups'
  per-K-block add), the same sums and scales, bf16 rows into the source rank's ``combine``.

The one thing not modelled is the order of the float32 sums: the model sums all of K in one IEEE matmul, as the
reference does, so the CPU test is bit-exact even on data whose sums round (``tests/test_fused.py`` spreads the
scales for that); the kernel adds one wgmma chain per 128-wide K block into its accumulator, and the tensor cores
sum inside a chain in their own order -- the difference the GPU tests bound with ``accumulation="fp8_mma"``.
"""
from __future__ import annotations

import torch

from megamoe.kernels.formats import TILE_GROUP_SIZES, TILE_HEADER, TILE_WORDS, WS_TILE_N
from megamoe.quant import (
    L1_INTERLEAVE_ROWS,
    _unrepack_nibbles,
    e2m1_decode,
    fold_scales,
    fp4_weight_rows,
    per_128_cast_to_fp8,
    unpack_nibbles,
)
from megamoe.quant_fp8 import FP8_BLOCK, per_token_cast_to_fp8_128, unblock_weights
from megamoe.reference import _ieee_fp32_matmul, block_scaled_matmul, l2_folded, swiglu

#: Weight rows per tile, as the Gluon kernel (its rows per tile: one pool block of ``block_m`` = 128 or 64).
TILE_N = WS_TILE_N.value


def tile_table(tiles: torch.Tensor) -> tuple[list[tuple[int, int, int, int]], int, list[int]]:
    """The table as written by the front launch: ``([(block, n-tile, local expert, valid rows)], number of L1
    tiles, [valid rows of each pool block])``; L1 tiles first, then L2 tiles."""
    t = tiles.cpu()
    num_l1, num_l2, num_blocks, blk = (int(v) for v in t[:4])
    h, w = TILE_HEADER.value, TILE_WORDS.value
    entries = t[h: h + (num_l1 + num_l2) * w].view(-1, w).tolist()
    return [tuple(e) for e in entries], num_l1, t[blk: blk + num_blocks].tolist()


def tile_groups(tiles: torch.Tensor) -> tuple[list[tuple[int, int]], list[int]]:
    """The group words and counters after the block table, as written by the front launch: ``([(first entry of the
    entry's weight tile, entries of that weight tile)] per entry, [counter] per entry)``."""
    t = tiles.cpu()
    num_l1, num_l2, num_blocks, blk = (int(v) for v in t[:4])
    n, g = num_l1 + num_l2, TILE_GROUP_SIZES.value
    words = t[blk + num_blocks: blk + num_blocks + n].tolist()
    return [(w // g, w % g) for w in words], t[blk + num_blocks + n: blk + num_blocks + 2 * n].tolist()


def tile_pairs(tiles: torch.Tensor) -> tuple[list[tuple[int, int, int]], int, list[tuple[int, int]], list[int]]:
    """The pair table after the group counters (``megamoe.kernels.formats.TILE_PAIR_WORDS``, written by the front
    launch with ``PAIRS``): ``([(first entry, kind, second entry)] per pair, number of L1 pairs, [(first pair of the
    pair's group, its pairs)] per pair, [group counter] per pair)``; kind 1 a weight pair, 2 a token pair, 0 a
    single."""
    t = tiles.cpu()
    num_l1, num_l2, num_blocks, blk = (int(v) for v in t[:4])
    n, g = num_l1 + num_l2, TILE_GROUP_SIZES.value
    base = blk + num_blocks + 2 * n
    l1_pairs, num_pairs = int(t[base]), int(t[base + 1])
    words = t[base + 2: base + 2 + 2 * num_pairs].view(-1, 2).tolist()
    groups = t[base + 2 + 2 * n: base + 2 + 2 * n + num_pairs].tolist()
    return ([(w // 4, w % 4, t1) for w, t1 in words], l1_pairs, [(w // g, w % g) for w in groups],
            t[base + 2 + 3 * n: base + 2 + 3 * n + num_pairs].tolist())


def _l1_rows(e: int, nt: int, I: int, w1: torch.Tensor, sf1: torch.Tensor):
    """Gate and up weight rows (float32 values) and their per-row block scales for intermediate columns
    ``[128 nt, 128 nt + 128)`` of local expert ``e`` from the transformed ``w1`` ``[El, 2I, H]``."""
    c = torch.arange(nt * 128, nt * 128 + 128, device=w1.device)
    gate = (c // L1_INTERLEAVE_ROWS) * (2 * L1_INTERLEAVE_ROWS) + c % L1_INTERLEAVE_ROWS
    wg, wu = w1[e, gate].float(), w1[e, gate + L1_INTERLEAVE_ROWS].float()
    sg = sf1[e, c // FP8_BLOCK].float()  # scale blocks are not interleaved: gate blocks, then up blocks
    su = sf1[e, I // FP8_BLOCK + c // FP8_BLOCK].float()
    return wg, sg, wu, su


def run_gemm_phase(calls, tiles: list[torch.Tensor], block_m: int) -> None:
    """Every tile of every rank's table, L1 tiles before L2 tiles (a rank's L2 reads only its own L1 output).
    ``calls``: ``megamoe.ops`` bound calls; ``tiles``: their tile tables; ``block_m``: rows per pool block (the
    front launch's). L2 rows go to the source rank's
    ``combine`` through ``SymmBuffer.peer_view``."""
    for c, t in zip(calls, tiles):
        sb, I = c.sb, c.sb.layout.intermediate_hidden
        entries, num_l1, block_rows = tile_table(t)
        l1, l1_sf, l1_w = sb.view("l1_acts"), sb.view("l1_acts_sf"), sb.view("l1_topk_weights")
        l2, l2_sf, meta = sb.view("l2_acts"), sb.view("l2_acts_sf"), sb.view("token_src_metadata")
        w1, sf1 = unblock_weights(c.l1[0]), c.l1[1]  # (the weights are blocked by 128 x 128: megamoe.quant_fp8)
        w2, sf2 = unblock_weights(c.l2[0]), c.l2[1]
        # the pull: every block's rows from the source rank's input (the front launch wrote their metadata)
        for b, valid in enumerate(block_rows):
            for row, (src, token, _) in enumerate(meta[b * block_m: b * block_m + valid].tolist(), start=b * block_m):
                l1[row] = sb.peer_view(src, "x")[token]
                l1_sf[row] = sb.peer_view(src, "x_sf")[token]
        for i, (b, nt, e, valid) in enumerate(entries):
            rows = slice(b * block_m, b * block_m + valid)
            if i < num_l1:
                wg, sg, wu, su = _l1_rows(e, nt, I, w1, sf1)
                a, sa = l1[rows].float(), l1_sf[rows].float()
                gate = block_scaled_matmul(a, sa, wg, sg).to(torch.bfloat16)
                up = block_scaled_matmul(a, sa, wu, su).to(torch.bfloat16)
                act = swiglu(torch.cat([gate, up], dim=1), c.clamp) * l1_w[rows].unsqueeze(1)
                q, s = per_token_cast_to_fp8_128(act)
                l2[rows, nt * 128: nt * 128 + 128] = q
                l2_sf[rows, nt] = s[:, 0]
            else:
                n = slice(nt * TILE_N, nt * TILE_N + TILE_N)
                sw = sf2[e][torch.arange(n.start, n.stop, device=sf2.device) // FP8_BLOCK].float()
                out = block_scaled_matmul(l2[rows].float(), l2_sf[rows].float(), w2[e, n].float(), sw)
                for (src, token, slot), row in zip(meta[rows].tolist(), out.to(torch.bfloat16)):
                    sb.peer_view(src, "combine")[slot, token, n] = row


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2^e as float32 for an int tensor ``e`` (exact)."""
    return torch.pow(2.0, e.float())


def _folded_fp4_rows(w: torch.Tensor, sf: torch.Tensor, e: int, rows: torch.Tensor):
    """Rows ``rows`` of local expert ``e`` of transformed FP4 weights (``w`` int8 ``[El, N, K/2]`` in the
    transform's nibble order and blocked layout, ``sf`` int32 ``[El, N, K/128]``) as the decode warps write them: e4m3
    values folded relative to each row's largest scale exponent, float32 ``[len(rows), K]`` in K order, and that
    exponent (int32 ``[len(rows)]``)."""
    values = e2m1_decode(unpack_nibbles(_unrepack_nibbles(fp4_weight_rows(w, e, rows))))
    folded, row_exp = fold_scales(values, sf[e, rows])
    return folded.float(), row_exp


def _dot(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float32 ``a @ w^T`` over all of K in one IEEE matmul, as the reference sums (module docstring: the kernel's
    per-128 adds and the tensor cores' order inside a block are not modelled)."""
    with _ieee_fp32_matmul():
        return a @ w.T


def _weight_rows(weights, decoded, e: int, rows: torch.Tensor):
    """``_folded_fp4_rows`` of transformed ``weights``, or the same rows read from ``decoded`` = ``(folded e4m3 [El,
    N, K], row_exp int32 [El, N])`` of ``megamoe.fold_decode`` when given."""
    if decoded is None:
        return _folded_fp4_rows(*weights, e, rows)
    return decoded[0][e, rows].float(), decoded[1][e, rows]


def _l2_operand(q: torch.Tensor, sf: torch.Tensor, numerics: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The L2 A operand of pool rows as the Gluon tiles multiply it: ``q`` e4m3 ``[m, I]``, ``sf`` their per-128
    scale words int32 ``[m, I/128]`` (four equal UE8M0 bytes) -> ``(a float32 [m, I], s_tok int32 [m])`` with ``a *
    2^(s_tok - 127)`` the operand's value. ``"hopper"``: folded per token relative to its largest exponent
    (:func:`megamoe.quant.fold_scales`: the decode warps' A fold), ``s_tok`` that exponent. ``"hopper_l2_per_block"``:
    each K block times its own ``2^(s_kb - 127)`` (exact: the kernel's per-K-block add ``acc += dot * 2^(s_kb -
    127)``, whose power of two commutes with the float32 sums), ``s_tok`` = 127."""
    if l2_folded(numerics):
        a, s_tok = fold_scales(q.float(), sf)
        return a.float(), s_tok
    scale = _pow2((sf & 0xFF) - 127).repeat_interleave(128, dim=1)
    return q.float() * scale, torch.full((q.shape[0],), 127, dtype=torch.int32, device=q.device)


def run_gemm_phase_fp4(calls, tiles: list[torch.Tensor], block_m: int, predecoded=None,
                       numerics: str = "hopper") -> None:
    """The FP8 x FP4 (Hopper numerics) GEMM phase: every tile of every rank's table, L1 tiles before L2 tiles
    (module docstring). ``block_m``: rows per pool block (128, or 64: the Gluon kernel's tile of one math warpgroup;
    the model is the same per row). The rows are in the L1 pool already (the front launch copied and folded them).
    ``predecoded``: per call ``((folded1, exp1), (folded2, exp2))`` of ``megamoe.fold_decode`` (the predecoded path),
    read instead of decoding the weight rows here. ``numerics``: ``"hopper"`` or ``"hopper_l2_per_block"`` (the L2
    A operand folded per token, or each K block's token scale applied: :func:`_l2_operand`)."""
    for ci, (c, t) in enumerate(zip(calls, tiles)):
        sb, I = c.sb, c.sb.layout.intermediate_hidden
        pre = None if predecoded is None else predecoded[ci]
        entries, num_l1, _ = tile_table(t)
        l1, l1_sf, l1_w = sb.view("l1_acts"), sb.view("l1_acts_sf"), sb.view("l1_topk_weights")
        l2, l2_sf, meta = sb.view("l2_acts"), sb.view("l2_acts_sf"), sb.view("token_src_metadata")
        w1, sf1 = c.l1
        w2, sf2 = c.l2
        for i, (b, nt, e, valid) in enumerate(entries):
            rows = slice(b * block_m, b * block_m + valid)
            w_rows = torch.arange(nt * TILE_N, nt * TILE_N + TILE_N, device=w1.device)
            if i < num_l1:
                w, s_row = _weight_rows(c.l1, pre and pre[0], e, w_rows)
                s_tok = l1_sf[rows, 0] & 0xFF  # the folded row's scale word: s_max in all four bytes
                acc = _dot(l1[rows].float(), w)
                h = (acc * _pow2(s_row - 127)) * _pow2(s_tok - 127).unsqueeze(1)
                # tile columns: 16-row periods of 8 gate rows then 8 up rows -> gate | up, 128 columns each
                h = h.to(torch.bfloat16).view(valid, TILE_N // (2 * L1_INTERLEAVE_ROWS), 2, L1_INTERLEAVE_ROWS)
                gate, up = h[:, :, 0].reshape(valid, -1), h[:, :, 1].reshape(valid, -1)
                act = swiglu(torch.cat([gate, up], dim=1), c.clamp) * l1_w[rows].unsqueeze(1)
                q, s = per_128_cast_to_fp8(act)
                l2[rows, nt * 128: nt * 128 + 128] = q
                l2_sf[rows, nt] = s[:, 0]
            else:
                w, s_row = _weight_rows(c.l2, pre and pre[1], e, w_rows)
                a, s_tok = _l2_operand(l2[rows], l2_sf[rows, : I // 128], numerics)
                acc = _dot(a, w)
                out = ((acc * _pow2(s_row - 127)) * _pow2(s_tok - 127).unsqueeze(1)).to(torch.bfloat16)
                n = slice(nt * TILE_N, nt * TILE_N + TILE_N)
                for (src, token, slot), row in zip(meta[rows].tolist(), out):
                    sb.peer_view(src, "combine")[slot, token, n] = row
