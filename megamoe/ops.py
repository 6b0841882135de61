"""The public op: ``fp8_fp4_mega_moe`` (DeepGEMM's name and arguments) and the ``MegaMoE`` module-style wrapper.

One call runs the staged pipeline below on every rank; each step is one kernel launch, so the step boundaries are
exactly where a persistent fused kernel would put its grid syncs::

    count_and_publish_indices -> publish_counts -> barrier(1)
    -> dispatch (pull; or push + barrier(4) for the DeepEP-style baseline)
    -> L1 GEMM + SwiGLU + top-k weight + FP8 requant -> L2 GEMM + write-back into the source rank's combine buffer
    -> barrier(2) -> combine reduce into y -> workspace cleanup (+ recv stats) -> barrier(3)

Backends: with one process per rank (``cuda``, ``cpu``) each process runs its own rank's steps. With the ``local``
backend the caller passes lists (one entry per rank) and the steps run in lock-step -- step s for every rank before
step s+1 -- so a barrier's arrive for all ranks precedes any wait, and N ranks need no concurrency (one GPU, or the
Triton interpreter in one process).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import triton

from megamoe.kernels import combine as kc
from megamoe.kernels import dispatch as kd
from megamoe.kernels import gemm as kg
from megamoe.kernels.symm import (TAG_AFTER_WORKSPACE_CLEAN, TAG_BEFORE_COMBINE_REDUCE, TAG_BEFORE_DISPATCH_PULL,
                                  barrier_arrive, barrier_wait, check_barrier_state)
from megamoe.env import interpreting
from megamoe.quant import per_token_cast_to_fp8, transform_weights_for_mega_moe
from megamoe.symm import SymmBuffer

#: Barrier after a push dispatch: the owner may only read its pool once every source has pushed.
TAG_AFTER_DISPATCH_PUSH = 4

WeightPair = tuple[torch.Tensor, torch.Tensor]

#: Launch configuration of the GEMM steps on CUDA (``python -m megamoe.bench --suite tune`` sweeps it).
#: ``programs_per_sm``: size of the persistent grid (0 = one program per tile, early exit past the used blocks).
#: Measured on an H200 (block_m 128, results/tune_h200.json at 1d14d2f and earlier sweeps noted here):
#: * PRMT FP4 decode: L1 -25..27%, L2 -29..30% vs the arithmetic decode -- on by default.
#: * L1 with 4 warps: ~20% faster than with 8 (arithmetic decode, sweep at f1a2c28).
#: * scaled-operand (bf16) mode: within ~5% of the FP8 mode with arithmetic decode; FP8 stays the default.
#: * tried and removed: register double-buffering of the weight loads (1d14d2f: ~3x slower, it defeated the
#:   pipelining of the activation loads) and unrolling the K loop 2-4x (9e5ac3d: 1.8-10x slower, shared memory).
GEMM_CONFIG = {
    "l1": {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "programs_per_sm": 2, "scaled_operands": False,
           "prmt_decode": True},
    "l2": {"BLOCK_N": 128, "num_warps": 8, "num_stages": 3, "programs_per_sm": 2, "scaled_operands": False,
           "prmt_decode": True},
}


def _dot_meta(cfg: dict) -> dict:
    """Kernel constexprs for the scale mode (see ``megamoe.kernels.gemm``): bf16 operands on GPU, fp32 when
    interpreting (the interpreter's bf16 dot multiplies bit patterns); the PRMT FP4 decode (inline PTX) on GPU only."""
    import triton.language as tl

    return {"SCALED_OPERANDS": cfg["scaled_operands"], "PRMT_DECODE": cfg["prmt_decode"] and not interpreting(),
            "DOT_DTYPE": tl.float32 if interpreting() else tl.bfloat16}


@dataclass
class _RankCall:
    """Everything one rank's steps need for one call."""

    sb: SymmBuffer
    y: torch.Tensor
    l1: WeightPair
    l2: WeightPair
    stats: torch.Tensor | None
    clamp: float | None

    @property
    def n(self) -> int:
        return self.y.shape[0]


def fp8_fp4_mega_moe(y, l1_weights, l2_weights, sym_buffer, *, activation: str = "swiglu",
                     activation_clamp: float | None = None, cumulative_local_expert_recv_stats=None,
                     dispatch: str = "pull", check: bool = True) -> None:
    """Run one Mega MoE layer forward.

    Before the call each rank copies its inputs into its buffer: ``sym_buffer.x[:n]`` (FP8 e4m3 [n, H]),
    ``x_sf[:n]`` (int32 [n, H/128], packed UE8M0 per 32), ``topk_idx[:n]`` (int64 [n, k], -1 = masked) and
    ``topk_weights[:n]`` (float32 [n, k]).

    Args:
        y: bf16 [n, H] output (n = this rank's token count, n <= num_max_tokens_per_rank; n may be 0).
        l1_weights: ``(w int8 [El, 2I, H/2], sf int32 [El, 2I, H/128] MN-major)`` from
            :func:`megamoe.quant.transform_weights_for_mega_moe` (this rank's El local experts).
        l2_weights: ``(w int8 [El, H, I/2], sf int32 [El, H, I/128] MN-major)``, likewise.
        sym_buffer: this rank's :class:`SymmBuffer`; with the ``local`` backend, the list of all ranks' buffers,
            and then ``y``, the weights and the stats are lists too (one entry per rank).
        activation: only ``"swiglu"``.
        activation_clamp: if set, ``gate <= c`` and ``-c <= up <= c`` before SwiGLU (None = no clamp).
        cumulative_local_expert_recv_stats: optional int32 [El]; received pairs per local expert are added to it.
        dispatch: ``"pull"`` (Mega MoE) or ``"push"`` (DeepEP-style baseline: sources write into the owner's pool).
        check: validate expert ids in ``topk_idx`` before any kernel runs and raise
            :class:`megamoe.kernels.symm.BarrierTimeout` if a barrier timed out. Both read device memory (host syncs);
            benchmarks pass ``check=False``. Shapes and dtypes are always validated.
    """
    calls = bind_calls(y, l1_weights, l2_weights, sym_buffer, cumulative_local_expert_recv_stats, activation,
                  activation_clamp, dispatch, check)
    for _, step in pipeline_steps(dispatch):
        for call in calls:
            step(call)
    if check:
        for call in calls:
            check_barrier_state(call.sb)


# ---------------------------------------------------------------------------------------------------- the steps
def pipeline_steps(dispatch: str) -> list[tuple[str, Callable[[_RankCall], None]]]:
    """The ordered (name, step) list of one call; each step is one launch for one rank."""
    def arrive(c):
        barrier_arrive(c.sb)

    def wait(tag):
        return lambda c: barrier_wait(c.sb, tag)

    steps = [("count", _count_and_publish_indices), ("publish", _publish_counts),
             ("barrier1_arrive", arrive), ("barrier1_wait", wait(TAG_BEFORE_DISPATCH_PULL))]
    if dispatch == "pull":
        steps.append(("pull", lambda c: _dispatch_copy(c, push=False)))
    else:
        steps += [("push", lambda c: _dispatch_copy(c, push=True)),
                  ("barrier4_arrive", arrive), ("barrier4_wait", wait(TAG_AFTER_DISPATCH_PUSH))]
    steps += [("l1", _l1), ("l2", _l2),
              ("barrier2_arrive", arrive), ("barrier2_wait", wait(TAG_BEFORE_COMBINE_REDUCE)),
              ("combine", _combine), ("cleanup", _cleanup),
              ("barrier3_arrive", arrive), ("barrier3_wait", wait(TAG_AFTER_WORKSPACE_CLEAN))]
    return steps


def _offsets(sb: SymmBuffer, **names: str) -> dict[str, int]:
    return {key: sb.layout.offset(seg) for key, seg in names.items()}


def _count_and_publish_indices(c: _RankCall) -> None:
    L, k = c.sb.layout, c.sb.layout.num_topk
    if c.n == 0:
        return
    block = 128
    kd.count_and_publish_indices_kernel[(triton.cdiv(c.n * k, block),)](
        c.sb.buffer, c.sb.buffer_ptrs, c.sb.rank, c.n * k,
        **_offsets(c.sb, OFF_SEND="expert_send_count", OFF_SRC_IDX="src_token_topk_idx", OFF_TOPK_IDX="topk_idx"),
        R=L.num_ranks, El=L.num_experts_per_rank, T=L.num_max_tokens_per_rank, BLOCK=block)


def _publish_counts(c: _RankCall) -> None:
    L = c.sb.layout
    block = min(1024, triton.next_power_of_2(L.num_experts))
    kd.publish_counts_kernel[(triton.cdiv(L.num_experts, block),)](
        c.sb.buffer, c.sb.buffer_ptrs, c.sb.rank,
        **_offsets(c.sb, OFF_SEND="expert_send_count", OFF_RECV="expert_recv_count",
                   OFF_RECV_SUM="expert_recv_count_sum"),
        E=L.num_experts, El=L.num_experts_per_rank, BLOCK=block)


def _schedule_meta(L) -> dict:
    return dict(R=L.num_ranks, El=L.num_experts_per_rank, SP=L.num_padded_sf_pool_tokens, BLOCK_M=L.block_m,
                SF_BLOCK_M=L.sf_block_m, BLOCK_R=max(2, triton.next_power_of_2(L.num_ranks)),
                BLOCK_E=max(2, triton.next_power_of_2(L.num_experts_per_rank)))


def _dispatch_copy(c: _RankCall, push: bool) -> None:
    L = c.sb.layout
    H = L.hidden
    block_h = _largest_pow2_tile(H, 1024)  # H = 128 * m: a power-of-two tile (the interpreter's arange needs one)
    kd.dispatch_copy_kernel[(L.num_ranks, L.num_experts_per_rank)](
        c.sb.buffer, c.sb.buffer_ptrs, c.sb.rank,
        **_offsets(c.sb, OFF_RECV="expert_recv_count", OFF_SRC_IDX="src_token_topk_idx", OFF_X="x", OFF_X_SF="x_sf",
                   OFF_TOPK_W="topk_weights", OFF_L1="l1_acts", OFF_L1_SF="l1_acts_sf",
                   OFF_L1_W="l1_topk_weights", OFF_META="token_src_metadata"),
        T=L.num_max_tokens_per_rank, K=L.num_topk, H=H, BLOCK_J=16, BLOCK_H=block_h,
        BLOCK_W=max(2, triton.next_power_of_2(H // 128)), PUSH=push, **_schedule_meta(L))


def _num_programs(max_tiles: int, device: torch.device, programs_per_sm: int) -> int:
    """Persistent grid size: a few programs on the interpreter (they run one after another anyway)."""
    if device.type != "cuda":
        return max(1, min(max_tiles, 4))
    if programs_per_sm == 0:
        return max_tiles
    return max(1, min(max_tiles, programs_per_sm * torch.cuda.get_device_properties(device).multi_processor_count))


def _gemm_launch(c: _RankCall, step: str, n_total: int) -> tuple[tuple[int], dict]:
    """Persistent grid and the launch keywords shared by the GEMM steps (``step`` = "l1"/"l2", N extent
    ``n_total``): tile sizes, warps, stages, scale/decode mode and the pool-schedule constexprs."""
    L, cfg = c.sb.layout, GEMM_CONFIG[step]
    grid = (_num_programs(L.num_max_pool_blocks * (n_total // cfg["BLOCK_N"]), c.sb.buffer.device,
                          cfg["programs_per_sm"]),)
    meta = dict(H=L.hidden, I=L.intermediate_hidden, BLOCK_N=cfg["BLOCK_N"], num_warps=cfg["num_warps"],
                num_stages=cfg["num_stages"], **_dot_meta(cfg), **_schedule_meta(L))
    return grid, meta


def _l1(c: _RankCall) -> None:
    grid, meta = _gemm_launch(c, "l1", c.sb.layout.intermediate_hidden)
    kg.l1_swiglu_kernel[grid](
        c.sb.buffer, *c.l1, float(c.clamp) if c.clamp is not None else 0.0,
        **_offsets(c.sb, OFF_RECV="expert_recv_count", OFF_L1="l1_acts", OFF_L1_SF="l1_acts_sf",
                   OFF_L1_W="l1_topk_weights", OFF_L2="l2_acts", OFF_L2_SF="l2_acts_sf"),
        HAS_CLAMP=c.clamp is not None, **meta)


def _l2(c: _RankCall) -> None:
    grid, meta = _gemm_launch(c, "l2", c.sb.layout.hidden)
    kg.l2_combine_kernel[grid](
        c.sb.buffer, c.sb.buffer_ptrs, c.sb.rank, *c.l2,
        **_offsets(c.sb, OFF_RECV="expert_recv_count", OFF_L2="l2_acts", OFF_L2_SF="l2_acts_sf",
                   OFF_META="token_src_metadata", OFF_COMBINE="combine"),
        T=c.sb.layout.num_max_tokens_per_rank, **meta)


def _combine(c: _RankCall) -> None:
    L = c.sb.layout
    if c.n == 0:
        return
    block_t, block_h = 16, _largest_pow2_tile(L.hidden, 1024 if interpreting() else 256)
    kc.combine_reduce_kernel[(triton.cdiv(c.n, block_t), L.hidden // block_h)](
        c.sb.buffer, c.y, c.n, **_offsets(c.sb, OFF_COMBINE="combine", OFF_TOPK_IDX="topk_idx"),
        T=L.num_max_tokens_per_rank, K=L.num_topk, H=L.hidden, BLOCK_T=block_t, BLOCK_H=block_h)


def _cleanup(c: _RankCall) -> None:
    L = c.sb.layout
    stats = c.stats if c.stats is not None else c.sb.buffer  # placeholder pointer when HAS_STATS is False
    kc.cleanup_kernel[(1,)](
        c.sb.buffer, stats,
        **_offsets(c.sb, OFF_SEND="expert_send_count", OFF_RECV="expert_recv_count",
                   OFF_RECV_SUM="expert_recv_count_sum"),
        E=L.num_experts, R=L.num_ranks, El=L.num_experts_per_rank, HAS_STATS=c.stats is not None, BLOCK=256)


def _largest_pow2_tile(n: int, cap: int) -> int:
    """Largest power of two <= cap dividing n (n is a multiple of 128)."""
    t = cap
    while n % t:
        t //= 2
    return t


# ---------------------------------------------------------------------------------------------------- validation
def _as_list(value, name: str, count: int, is_list: bool) -> list:
    if not is_list:
        return [value]
    if not isinstance(value, (list, tuple)) or len(value) != count:
        raise TypeError(f"{name} must be a list of {count} entries (one per local rank) with a list of sym_buffers")
    return list(value)


def bind_calls(y, l1_weights, l2_weights, sym_buffer, stats, activation, clamp, dispatch, check) -> list[_RankCall]:
    """Validate the arguments of :func:`fp8_fp4_mega_moe` (same meaning, positional) and return one bound call per
    rank. Stepping through a call by hand -- as the benchmarks' per-step timing and the notebooks do -- is
    ``for name, step in pipeline_steps(dispatch): for c in calls: step(c)``."""
    is_list = isinstance(sym_buffer, (list, tuple))
    buffers = list(sym_buffer) if is_list else [sym_buffer]
    if not buffers or not all(isinstance(b, SymmBuffer) for b in buffers):
        raise TypeError("sym_buffer must be a SymmBuffer (or, for the local backend, a list of them)")
    if is_list:
        ranks = sorted(b.rank for b in buffers)
        if ranks != list(range(buffers[0].num_ranks)) or any(b.backend != "local" for b in buffers):
            raise ValueError(f"a list of sym_buffers must hold every rank of one local group in order, got ranks {ranks} "
                             f"of world size {buffers[0].num_ranks}")
    if activation != "swiglu":
        raise ValueError(f"activation={activation!r}: only 'swiglu' is supported")
    if dispatch not in ("pull", "push"):
        raise ValueError(f"dispatch={dispatch!r} must be 'pull' or 'push'")
    if clamp is not None and not (float(clamp) > 0):
        raise ValueError(f"activation_clamp={clamp} must be positive (or None)")
    n = len(buffers)
    calls = [_RankCall(sb, yy, tuple(a), tuple(b), s, clamp) for sb, yy, a, b, s in zip(
        buffers, _as_list(y, "y", n, is_list), _as_list(l1_weights, "l1_weights", n, is_list),
        _as_list(l2_weights, "l2_weights", n, is_list),
        _as_list(stats, "cumulative_local_expert_recv_stats", n, is_list) if stats is not None else [None] * n)]
    for c in calls:
        _validate(c)
        if check:
            _validate_topk_idx(c)
    return calls


def _check_tensor(name: str, t, dtype: torch.dtype, shape: tuple, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")


def _validate(c: _RankCall) -> None:
    L, dev = c.sb.layout, c.sb.buffer.device
    E, El, H, I, T = L.num_experts, L.num_experts_per_rank, L.hidden, L.intermediate_hidden, L.num_max_tokens_per_rank
    if not isinstance(c.y, torch.Tensor) or c.y.dim() != 2:
        raise ValueError(f"y must be a 2-D bf16 tensor [num_tokens, {H}]")
    if c.y.shape[0] > T:
        raise ValueError(f"y has {c.y.shape[0]} tokens, more than num_max_tokens_per_rank={T} of the buffer")
    _check_tensor("y", c.y, torch.bfloat16, (c.y.shape[0], H), dev)
    if not c.y.is_contiguous():
        raise ValueError("y must be contiguous")
    for name, pair, n_rows, k in (("l1_weights", c.l1, 2 * I, H), ("l2_weights", c.l2, H, I)):
        if len(pair) != 2:
            raise TypeError(f"{name} must be a (weights, scales) pair")
        w, sf = pair
        if isinstance(w, torch.Tensor) and w.dim() == 3 and w.shape[0] != El:
            raise ValueError(f"{name} holds {w.shape[0]} experts but the buffer has {El} experts per rank "
                             f"(num_experts={E} over {L.num_ranks} ranks): mismatched world size?")
        _check_tensor(f"{name}[0]", w, torch.int8, (El, n_rows, k // 2), dev)
        _check_tensor(f"{name}[1]", sf, torch.int32, (El, n_rows, k // 128), dev)
        if not w.is_contiguous() or not sf.transpose(1, 2).is_contiguous():
            raise ValueError(f"{name} must come from transform_weights_for_mega_moe (contiguous weights, MN-major scales)")
    if c.stats is not None:
        _check_tensor("cumulative_local_expert_recv_stats", c.stats, torch.int32, (El,), dev)


def _validate_topk_idx(c: _RankCall) -> None:
    """Expert ids in [-1, E) and distinct per token (one host sync)."""
    L = c.sb.layout
    E = L.num_experts
    idx = c.sb.topk_idx[:c.n]
    if c.n:
        bad_range = ((idx < -1) | (idx >= E)).any()
        s = idx.sort(dim=1).values
        dup = ((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)).any() if L.num_topk > 1 else torch.zeros((), dtype=torch.bool)
        flags = torch.stack([bad_range, dup.to(bad_range.device)]).tolist()
        if flags[0]:
            lo, hi = int(idx.min()), int(idx.max())
            raise ValueError(f"topk_idx (sym_buffer.topk_idx[:{c.n}]) holds expert ids in [{lo}, {hi}]; valid are "
                             f"-1 (masked) and 0..{E - 1}")
        if flags[1]:
            raise ValueError("topk_idx has a token that selects the same expert twice; a token's top-k experts "
                             "must be distinct")


# ---------------------------------------------------------------------------------------------------- wrapper
class MegaMoE:
    """One rank's Mega MoE layer: a SymmBuffer plus transformed weights.

    Args:
        sym_buffer: this rank's :class:`SymmBuffer` (one process per rank).
        l1_weights: untransformed FP4 ``(w int8 [El, 2I, H/2], sf int32 [El, 2I, H/128])``, rows [0, I) = gate,
            [I, 2I) = up (as returned by ``megamoe.quant.cast_grouped_weights_to_fp4``).
        l2_weights: untransformed FP4 ``(w int8 [El, H, I/2], sf int32 [El, H, I/128])``.
        activation_clamp: see :func:`fp8_fp4_mega_moe`.
        dispatch: ``"pull"`` or ``"push"``.
    """

    def __init__(self, sym_buffer: SymmBuffer, l1_weights: WeightPair, l2_weights: WeightPair, *,
                 activation_clamp: float | None = None, dispatch: str = "pull"):
        self.sym_buffer = sym_buffer
        dev = sym_buffer.buffer.device
        l1 = tuple(t.to(dev) for t in l1_weights)
        l2 = tuple(t.to(dev) for t in l2_weights)
        self.l1_weights, self.l2_weights = transform_weights_for_mega_moe(l1, l2)
        self.activation_clamp = activation_clamp
        self.dispatch = dispatch

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                cumulative_local_expert_recv_stats: torch.Tensor | None = None) -> torch.Tensor:
        """x bf16/float32 [n, H], topk_idx int64 [n, k] (-1 = masked), topk_weights float32 [n, k] -> y bf16 [n, H]."""
        sb, L = self.sym_buffer, self.sym_buffer.layout
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != L.hidden:
            raise ValueError(f"x must be a [num_tokens, {L.hidden}] tensor, got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        n = x.shape[0]
        if n > L.num_max_tokens_per_rank:
            raise ValueError(f"x has {n} tokens, more than num_max_tokens_per_rank={L.num_max_tokens_per_rank}")
        _check_tensor("topk_idx", topk_idx, torch.int64, (n, L.num_topk), topk_idx.device)
        _check_tensor("topk_weights", topk_weights, torch.float32, (n, L.num_topk), topk_weights.device)
        load_inputs(sb, *per_token_cast_to_fp8(x.to(sb.buffer.device)), topk_idx, topk_weights)
        y = torch.empty(n, L.hidden, dtype=torch.bfloat16, device=sb.buffer.device)
        fp8_fp4_mega_moe(y, self.l1_weights, self.l2_weights, sb, activation_clamp=self.activation_clamp,
                         cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats,
                         dispatch=self.dispatch)
        return y

    __call__ = forward


def load_inputs(sym_buffer: SymmBuffer, x: torch.Tensor, x_sf: torch.Tensor, topk_idx: torch.Tensor,
                topk_weights: torch.Tensor) -> None:
    """The caller protocol: copy one rank's quantized inputs into its buffer (``x[:n]``, ``x_sf[:n]``, ...)."""
    n = x.shape[0]
    dev = sym_buffer.buffer.device
    sym_buffer.x[:n].copy_(x.to(dev))
    sym_buffer.x_sf[:n].copy_(x_sf.to(dev))
    sym_buffer.topk_idx[:n].copy_(topk_idx.to(dev))
    sym_buffer.topk_weights[:n].copy_(topk_weights.to(dev))


__all__: Sequence[str] = ["fp8_fp4_mega_moe", "MegaMoE", "load_inputs", "bind_calls", "pipeline_steps",
                          "TAG_AFTER_DISPATCH_PUSH", "GEMM_CONFIG"]
