"""The pool schedule: where each local expert's rows live in the L1/L2 pools.

Every kernel that touches the pool derives the same schedule from the ``expert_recv_count[R][El]`` matrix (filled
by the source ranks before barrier 1), so no schedule needs to be stored or broadcast:

* ``n[e]``      = sum over source ranks of pairs received by local expert ``e``;
* ``blocks[e]`` = ceil(n[e] / BLOCK_M): the expert's rows are padded to whole blocks;
* expert ``e`` owns pool blocks ``[cum[e] - blocks[e], cum[e])`` (``cum`` = inclusive prefix sum), i.e. the pool is
  expert-major;
* inside an expert, the pairs of the source ranks are interleaved round-robin ("iterative min-peeling"): pair ``j``
  of source ``r`` sits at ``sum_r' min(c[r'], j) + #{r' < r : c[r'] > j}``, so consecutive rows come from different
  ranks and the pull spreads its NVLink reads over all peers.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def expert_blocks(recv_count_ptr, R: tl.constexpr, El, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_E: tl.constexpr):
    """From ``recv_count_ptr`` (int64 [R, El]) -> (n int32 [BLOCK_E], blocks int32 [BLOCK_E], cum int32 [BLOCK_E]),
    entries past El are 0 (cum keeps the total)."""
    r = tl.arange(0, BLOCK_R)
    e = tl.arange(0, BLOCK_E)
    mask = (r[:, None] < R) & (e[None, :] < El)
    cnt = tl.load(recv_count_ptr + r[:, None] * El + e[None, :], mask=mask, other=0).to(tl.int32)
    n = tl.sum(cnt, axis=0)
    blocks = (n + BLOCK_M - 1) // BLOCK_M
    cum = tl.cumsum(blocks, axis=0)
    return n, blocks, cum


@triton.jit
def pick(vec, idx, BLOCK: tl.constexpr):
    """vec[idx] for a 1-D register tensor ``vec`` of length BLOCK and a scalar ``idx``."""
    return tl.sum(tl.where(tl.arange(0, BLOCK) == idx, vec, 0), axis=0)


@triton.jit
def locate_block(block, n, blocks, cum, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """Pool block index -> (local expert, first pool row of the block, valid rows in it).

    Returns expert = BLOCK_E (and 0 valid rows) for a block past the last used one."""
    expert = tl.sum((cum <= block).to(tl.int32), axis=0)
    first_block = pick(cum - blocks, expert, BLOCK_E)
    n_e = pick(n, expert, BLOCK_E)
    valid = tl.minimum(n_e - (block - first_block) * BLOCK_M, BLOCK_M)
    return expert, block * BLOCK_M, tl.where(expert < BLOCK_E, valid, 0)


@triton.jit
def sf_row(row, BLOCK_M: tl.constexpr, SF_BLOCK_M: tl.constexpr):
    """Scale row of pool row ``row`` (the device side of ``megamoe.layout.Layout.sf_row``)."""
    return (row // BLOCK_M) * SF_BLOCK_M + row % BLOCK_M


@triton.jit
def interleaved_position(counts, src, j, BLOCK_R: tl.constexpr):
    """Row offset inside an expert of pair ``j`` (int32 [BLOCK_J]) of source rank ``src``; ``counts`` (int32
    [BLOCK_R]) = pairs each source rank sends to this expert. Round-robin over sources, shortest lists drop out."""
    r = tl.arange(0, BLOCK_R)
    before = tl.sum(tl.minimum(counts[None, :], j[:, None]), axis=1)
    ahead = tl.sum(((r[None, :] < src) & (counts[None, :] > j[:, None])).to(tl.int32), axis=1)
    return before + ahead


@triton.jit
def schedule_kernel(recv_count_ptr, out_ptr, R: tl.constexpr, El, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK_E: tl.constexpr):
    """One program: :func:`expert_blocks` of ``recv_count_ptr``, stored as int32 ``out[3, El]`` = (n, blocks,
    first pool row) per local expert."""
    n, blocks, cum = expert_blocks(recv_count_ptr, R, El, BLOCK_M, BLOCK_R, BLOCK_E)
    e = tl.arange(0, BLOCK_E)
    mask = e < El
    tl.store(out_ptr + e, n, mask=mask)
    tl.store(out_ptr + El + e, blocks, mask=mask)
    tl.store(out_ptr + 2 * El + e, (cum - blocks) * BLOCK_M, mask=mask)


def pool_schedule(recv_count: torch.Tensor, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The schedule the kernels use, read back to the host: ``(n, blocks, first_row)``, int32 ``[El]`` each, from
    ``recv_count`` (int64 ``[R, El]``, e.g. a rank's ``expert_recv_count`` view) by the same device function
    (:func:`expert_blocks`) every pool kernel calls."""
    R, El = recv_count.shape
    out = torch.empty(3, El, dtype=torch.int32, device=recv_count.device)
    schedule_kernel[(1,)](recv_count.contiguous(), out, R, El, BLOCK_M=block_m,
                          BLOCK_R=max(2, triton.next_power_of_2(R)), BLOCK_E=max(2, triton.next_power_of_2(El)))
    return out[0].cpu(), out[1].cpu(), out[2].cpu()
