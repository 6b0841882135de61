"""The block-scaled formats' constants as Triton ``constexpr`` globals, read from :mod:`megamoe.quant` (their one
definition, shared with the host quantizers and the reference), so a kernel writes ``FP8_MAX``, not ``448.0``.

The kernels' tiling is built around the 32-wide scale group (one K=32 FP8 MMA per group, 64-wide K steps of two
groups, four groups per packed int32 scale word), so the values are checked here rather than merely passed on.
"""
import triton
import triton.language as tl

from megamoe import quant

#: Largest finite FP8 e4m3 magnitude: a scale is ``2^ceil(log2(amax / FP8_MAX))``.
FP8_MAX = tl.constexpr(quant.FP8_E4M3_MAX)
#: Lower bound on a group's amax before its scale is computed.
AMAX_FLOOR = tl.constexpr(quant.AMAX_FLOOR)
#: Elements along K per UE8M0 scale (one scale group).
SF_GRAN_K = tl.constexpr(quant.SF_GRAN_K)
#: Gate and up rows of the transformed L1 weight alternate in runs of this many rows.
L1_INTERLEAVE = tl.constexpr(quant.L1_INTERLEAVE_ROWS)

assert quant.SF_GRAN_K == 32 and quant.SF_PACK == 4, "the GEMM tiles assume 32-wide scale groups, 4 per int32 word"
#: Weight rows of one block and packed bytes of one block row of the transformed FP4 weights
#: (``megamoe.quant.block_fp4_weights``).
FP4_BLOCK_ROWS = tl.constexpr(quant.FP4_BLOCK_ROWS)
FP4_BLOCK_BYTES = tl.constexpr(quant.FP4_BLOCK_BYTES)


@triton.jit
def fp4_weight_offset(n, b0, lane, N: tl.constexpr, KH: tl.constexpr):
    """Byte offset (int64) of packed byte ``b0 + lane`` of weight row ``n`` (broadcastable integer tensors: ``n`` the
    rows, ``b0`` a piece's first byte, ``lane`` a ``tl.arange`` along it) inside one expert's transformed FP4
    weights ``[N, KH]``: ``megamoe.quant.fp4_weight_offset`` (256-row blocks, each 128-wide K block a run of ``rows x
    64`` bytes; the last ``N % 256`` rows one shorter block). A piece must not cross a 64-byte block row unless it
    starts on one (``b0 % 64 + lane % 64 < 64``: 32-byte pieces at multiples of 32, or ``b0 % 64 == 0``); ``lane``
    is kept apart from ``b0`` so that the compiler still sees runs of contiguous bytes (16-byte loads)."""
    n = n.to(tl.int64)
    n0 = n // FP4_BLOCK_ROWS * FP4_BLOCK_ROWS
    rows = tl.minimum(N - n0, FP4_BLOCK_ROWS)
    q = b0 // FP4_BLOCK_BYTES
    # (b0 - 64 q, not b0 % 64: Triton's alignment analysis knows nothing of a remainder's divisibility, and the loads
    # fell to single bytes; a difference keeps the divisibility both terms share: 16-byte loads)
    return (n0 * KH + (q + lane // FP4_BLOCK_BYTES) * rows * FP4_BLOCK_BYTES + (n - n0) * FP4_BLOCK_BYTES
            + (b0 - q * FP4_BLOCK_BYTES) + lane % FP4_BLOCK_BYTES)


#: Largest fold shift held by the fused kernel's weight-decode table (``megamoe.quant.fold_lut``).
FOLD_LUT_MAX_SHIFT = tl.constexpr(quant.FOLD_LUT_MAX_SHIFT)
#: The tile table the fused FP8 path's front launch writes for its Gluon GEMM phase (``megamoe.kernels.fused``
#: ``_write_tile_table``, read by ``megamoe.kernels.gemm_fp8_ws``): int32 words before the entries ``(L1 tiles, L2
#: tiles, pool blocks, word offset of the block table)`` and per entry ``(pool block, n-tile, local expert, valid
#: rows)``; after the entries, one word per pool block (its valid rows); after those, one **group word** per entry
#: (``first * TILE_GROUP_SIZES + size``: the entries ``[first, first + size)`` that share the entry's weight tile --
#: one GEMM, expert and n-tile, consecutive in the table) and one **group counter** per entry, zeroed by the front
#: launch (``megamoe.fused.WS_GROUP_SYNC``: the programs that share a weight tile start it together).
TILE_HEADER = tl.constexpr(4)
TILE_WORDS = tl.constexpr(4)
TILE_GROUP_SIZES = tl.constexpr(1024)
#: The pair table after the group counters (``PAIRS`` of the front launch; the FP8 phase's 2-CTA clusters,
#: ``megamoe.fused.FP8_WS_MULTICAST``): with ``n`` entries in the table, int32 words ``(L1 pairs, all pairs)``, then
#: room for ``n`` pairs of two words ``(4 t0 + kind, t1)`` -- the entries the cluster's CTAs 0 and 1 take, of one
#: kind: 1 a **weight pair** (two pool blocks of an expert on one weight tile: the weights multicast), 2 a **token
#: pair** (one pool block, two n-tiles: the pool rows multicast), 0 a **single** (CTA 1 pads) --, ``n`` words for
#: the pairs' group words (as the entries', over pair indices) and ``n`` for their group counters. L1 pairs first.
#: ``TILE_PAIR_WORDS``: the table's words per entry of room.
TILE_PAIR_WORDS = 4
#: The Gluon GEMM phase's tile: pool rows (one pool block, two math warpgroups of 64) x weight rows (two halves).
WS_TILE_M = tl.constexpr(128)
WS_TILE_N = tl.constexpr(256)
