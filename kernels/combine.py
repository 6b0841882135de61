"""Combine: after barrier tag 2 every (token, slot) output row sits in this rank's ``combine[slot][token]``; reduce
over the top-k slots into ``y``, then clean the workspace for the next call.

``combine_reduce_kernel``: ``y[t] = bf16( sum_{j : topk_idx[t, j] >= 0} float32(combine[j][t]) )``, slots in
increasing ``j``, fp32 accumulate, one RTNE rounding. The top-k weight was applied before the L2 GEMM (in the L1
epilogue), so this is a plain sum, as in DeepGEMM.

``cleanup_kernel``: adds ``expert_recv_count_sum`` into the optional per-local-expert stats, then zeroes
``expert_send_count``, ``expert_recv_count`` and ``expert_recv_count_sum``, the only workspace fields that
accumulate. ``src_token_topk_idx``, the metadata and the pools are overwritten or count-gated, so they are left alone.
Barrier tag 3 follows so that no rank's next dispatch can write counts into a workspace not yet cleaned.
"""
import triton
import triton.language as tl

from megamoe.kernels.numerics import bf16_bits_to_f32, f32_to_bf16_bits


@triton.jit
def combine_reduce_kernel(buf, y, num_tokens, OFF_COMBINE: tl.constexpr, OFF_TOPK_IDX: tl.constexpr,
                          T: tl.constexpr, K: tl.constexpr, H: tl.constexpr, BLOCK_T: tl.constexpr,
                          BLOCK_H: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mt = t < num_tokens
    topk_idx = (buf + OFF_TOPK_IDX).to(tl.pointer_type(tl.int64))
    combine = (buf + OFF_COMBINE).to(tl.pointer_type(tl.int16))
    acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(K):
        valid = tl.load(topk_idx + t * K + j, mask=mt, other=-1) >= 0
        rows = combine + ((j * T + t).to(tl.int64) * H)[:, None] + h[None, :]
        acc += bf16_bits_to_f32(tl.load(rows, mask=valid[:, None], other=0))
    out = y.to(tl.pointer_type(tl.int16)) + (t.to(tl.int64) * H)[:, None] + h[None, :]
    tl.store(out, f32_to_bf16_bits(acc).to(tl.int16), mask=mt[:, None])


@triton.jit
def cleanup_kernel(buf, stats, OFF_SEND: tl.constexpr, OFF_RECV: tl.constexpr, OFF_RECV_SUM: tl.constexpr,
                   E: tl.constexpr, R: tl.constexpr, El: tl.constexpr, HAS_STATS: tl.constexpr,
                   BLOCK: tl.constexpr):
    send = (buf + OFF_SEND).to(tl.pointer_type(tl.int64))
    recv = (buf + OFF_RECV).to(tl.pointer_type(tl.int64))
    recv_sum = (buf + OFF_RECV_SUM).to(tl.pointer_type(tl.int64))
    zero = tl.zeros([BLOCK], dtype=tl.int64)
    for i0 in range(0, E, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        tl.store(send + i, zero, mask=i < E)
    for i0 in range(0, R * El, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        tl.store(recv + i, zero, mask=i < R * El)
    for i0 in range(0, El, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        m = i < El
        if HAS_STATS:
            s = tl.load(stats + i, mask=m, other=0)
            tl.store(stats + i, s + tl.load(recv_sum + i, mask=m, other=0).to(tl.int32), mask=m)
        tl.store(recv_sum + i, zero, mask=m)
