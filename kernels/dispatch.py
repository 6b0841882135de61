"""Dispatch: count and publish (step 1), then move tokens into the owning rank's L1 pool (step 2).

Step 1a ``count_and_publish_indices`` (one launch, programs over the rank's (token, slot) pairs):
    for each valid pair ``(t, j)`` with expert ``e``: ``slot = atomic_add(expert_send_count[e], 1)`` hands out the
    pair's index among this rank's pairs for ``e``; ``t*k + j`` is stored straight into the owner's
    ``src_token_topk_idx[e % El][me][slot]`` through ``sym_map`` (a plain remote store, as in DeepGEMM).
Step 1b ``publish_counts``: ``expert_send_count[e]`` is written into the owner's ``expert_recv_count[me][e % El]``
    and atomically added into its ``expert_recv_count_sum[e % El]``. Then barrier tag 1.
Step 2 ``dispatch_copy`` with ``PUSH=False`` (Mega MoE): program ``(src, e)`` on the *owner* reads source rank
    ``src``'s pair list for local expert ``e`` and **pulls** each token's FP8 row, its scales, its top-k weight from
    ``src``'s input buffer into the local L1 pool at the interleaved, expert-major row (see ``megamoe.kernels.pool``),
    recording (src rank, token, slot) for the combine write-back.
    With ``PUSH=True`` (the DeepEP-style baseline) the same program runs on the *source*: program ``(dst, e)``
    **pushes** its own tokens into rank ``dst``'s pool. Only who executes, and so which side of each copy is remote,
    changes; the row arithmetic is shared. Push needs one more barrier afterwards so the owner knows data landed.
"""
import triton
import triton.language as tl

from megamoe.kernels.pool import expert_blocks, interleaved_position, pick, sf_row
from megamoe.kernels.symm import sym_map


@triton.jit
def count_and_publish_indices_kernel(buf, buffer_ptrs, me, num_pairs,
                                     OFF_SEND: tl.constexpr, OFF_SRC_IDX: tl.constexpr, OFF_TOPK_IDX: tl.constexpr,
                                     R: tl.constexpr, El: tl.constexpr, T: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < num_pairs
    expert = tl.load((buf + OFF_TOPK_IDX).to(tl.pointer_type(tl.int64)) + offs, mask=inb, other=-1)
    valid = inb & (expert >= 0)
    expert = tl.where(valid, expert, 0)
    send = (buf + OFF_SEND).to(tl.pointer_type(tl.int64))
    slot = tl.atomic_add(send + expert, tl.full([BLOCK], 1, tl.int64), mask=valid, sem="relaxed")
    owner = tl.where(valid, expert // El, me).to(tl.int32)
    local_e = expert % El
    dst = (buf + OFF_SRC_IDX).to(tl.pointer_type(tl.int32)) + (local_e * R + me) * T + tl.where(valid, slot, 0)
    tl.store(sym_map(dst, buffer_ptrs, me, owner), offs.to(tl.int32), mask=valid)


@triton.jit
def publish_counts_kernel(buf, buffer_ptrs, me, OFF_SEND: tl.constexpr, OFF_RECV: tl.constexpr,
                          OFF_RECV_SUM: tl.constexpr, E: tl.constexpr, El: tl.constexpr, BLOCK: tl.constexpr):
    e = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inb = e < E
    count = tl.load((buf + OFF_SEND).to(tl.pointer_type(tl.int64)) + e, mask=inb, other=0)
    owner = tl.where(inb, e // El, me)
    local_e = tl.where(inb, e % El, 0)
    recv = (buf + OFF_RECV).to(tl.pointer_type(tl.int64)) + me * El + local_e
    tl.store(sym_map(recv, buffer_ptrs, me, owner), count, mask=inb)
    recv_sum = (buf + OFF_RECV_SUM).to(tl.pointer_type(tl.int64)) + local_e
    tl.atomic_add(sym_map(recv_sum, buffer_ptrs, me, owner), count, mask=inb, sem="relaxed", scope="sys")


@triton.jit
def dispatch_copy_kernel(buf, buffer_ptrs, me,
                         OFF_RECV: tl.constexpr, OFF_SRC_IDX: tl.constexpr, OFF_X: tl.constexpr,
                         OFF_X_SF: tl.constexpr, OFF_TOPK_W: tl.constexpr, OFF_L1: tl.constexpr,
                         OFF_L1_SF: tl.constexpr, OFF_L1_W: tl.constexpr, OFF_META: tl.constexpr,
                         R: tl.constexpr, El: tl.constexpr, T: tl.constexpr, K: tl.constexpr, H: tl.constexpr,
                         SP: tl.constexpr, BLOCK_M: tl.constexpr, SF_BLOCK_M: tl.constexpr,
                         BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_J: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr, PUSH: tl.constexpr):
    peer = tl.program_id(0)
    local_e = tl.program_id(1)
    if PUSH:
        owner = peer
        source = me
    else:
        owner = me
        source = peer
    # The owner's schedule: where expert local_e starts, how many pairs each source sends it.
    recv = sym_map((buf + OFF_RECV).to(tl.pointer_type(tl.int64)), buffer_ptrs, me, owner)
    n, blocks, cum = expert_blocks(recv, R, El, BLOCK_M, BLOCK_R, BLOCK_E)
    first_row = pick(cum - blocks, local_e, BLOCK_E) * BLOCK_M
    r = tl.arange(0, BLOCK_R)
    counts = tl.load(recv + r * El + local_e, mask=r < R, other=0).to(tl.int32)
    count = pick(counts, source, BLOCK_R)

    src_idx = sym_map((buf + OFF_SRC_IDX).to(tl.pointer_type(tl.int32)), buffer_ptrs, me, owner) \
        + (local_e * R + source) * T
    x = sym_map(buf + OFF_X, buffer_ptrs, me, source)
    x_sf = sym_map((buf + OFF_X_SF).to(tl.pointer_type(tl.int32)), buffer_ptrs, me, source)
    topk_w = sym_map((buf + OFF_TOPK_W).to(tl.pointer_type(tl.float32)), buffer_ptrs, me, source)
    l1 = sym_map(buf + OFF_L1, buffer_ptrs, me, owner)
    l1_sf = sym_map((buf + OFF_L1_SF).to(tl.pointer_type(tl.int32)), buffer_ptrs, me, owner)
    l1_w = sym_map((buf + OFF_L1_W).to(tl.pointer_type(tl.float32)), buffer_ptrs, me, owner)
    meta = sym_map((buf + OFF_META).to(tl.pointer_type(tl.int32)), buffer_ptrs, me, owner)

    j0 = 0
    while j0 < count:
        j = j0 + tl.arange(0, BLOCK_J)
        mj = j < count
        row = first_row + interleaved_position(counts, source, j, BLOCK_R)
        pair = tl.load(src_idx + j, mask=mj, other=0)
        token = pair // K
        slot = pair % K
        # FP8 row: H bytes
        for h0 in tl.static_range(0, H, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            v = tl.load(x + token[:, None].to(tl.int64) * H + h[None, :], mask=mj[:, None])
            tl.store(l1 + row[:, None].to(tl.int64) * H + h[None, :], v, mask=mj[:, None])
        # scales: H/128 int32 words, K-major in x_sf -> MN-major in the pool (row = block*SF_BLOCK_M + offset)
        w = tl.arange(0, BLOCK_W)
        mw = mj[:, None] & (w[None, :] < H // 128)
        sf = tl.load(x_sf + token[:, None] * (H // 128) + w[None, :], mask=mw)
        tl.store(l1_sf + w[None, :].to(tl.int64) * SP + sf_row(row, BLOCK_M, SF_BLOCK_M)[:, None], sf, mask=mw)
        tl.store(l1_w + row, tl.load(topk_w + pair, mask=mj), mask=mj)
        tl.store(meta + row * 3, tl.full([BLOCK_J], 0, tl.int32) + source, mask=mj)
        tl.store(meta + row * 3 + 1, token, mask=mj)
        tl.store(meta + row * 3 + 2, slot, mask=mj)
        j0 += BLOCK_J
