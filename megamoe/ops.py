"""The public op: ``fp8_fp4_mega_moe`` (DeepGEMM's name and arguments) and the ``MegaMoE`` module-style wrapper.

One call runs the staged pipeline below on every rank; each step is one kernel launch, so the step boundaries are
exactly where a persistent fused kernel would put its grid syncs::

    count_and_publish_indices -> publish_counts -> barrier(1)
    -> dispatch (pull; or push + barrier(4) for the DeepEP-style baseline)
    -> L1 GEMM + SwiGLU + top-k weight + FP8 requant -> L2 GEMM + write-back into the source rank's combine buffer
    -> barrier(2) -> combine reduce into y -> workspace cleanup (+ recv stats) -> barrier(3)

Every call runs inside :func:`guarded_call` (an interrupted call is repaired or refused next time, see
:func:`fp8_fp4_mega_moe`), and every argument is validated by :func:`bind_calls` before any kernel runs.

Backends: with one process per rank (``cuda``, ``cpu``) each process runs its own rank's steps. With the ``local``
backend the caller passes lists (one entry per rank) and the steps run in lock-step -- step s for every rank before
step s+1 -- so a barrier's arrive for all ranks precedes any wait, and N ranks need no concurrency (one GPU, or the
Triton interpreter in one process).
"""
from __future__ import annotations

import contextlib
import math
import numbers
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch
import triton

from megamoe.env import interpreting
from megamoe.kernels import combine as kc
from megamoe.kernels import dispatch as kd
from megamoe.kernels import gemm as kg
from megamoe.kernels.symm import (
    TAG_AFTER_WORKSPACE_CLEAN,
    TAG_BEFORE_COMBINE_REDUCE,
    TAG_BEFORE_DISPATCH_PULL,
    ProgressBeacon,
    barrier_arrive,
    barrier_wait,
    check_barrier_state,
    heartbeat,
    reset_workspace,
)
from megamoe.quant import TaggedWeights, TransformedWeights, per_token_cast_to_fp8, transform_weights_for_mega_moe
from megamoe.symm import SymmBuffer

#: Barrier after a push dispatch: the owner may only read its pool once every source has pushed.
TAG_AFTER_DISPATCH_PUSH = 4

WeightPair = tuple[torch.Tensor, torch.Tensor]

#: Suffix of the names of the barrier-wait steps in :func:`pipeline_steps` (waiting is not progress).
WAIT_STEP_SUFFIX = "_wait"
#: FP8 e4m3fn NaN: exponent and mantissa bits all set (0x7F / 0xFF); UE8M0 NaN: the byte 0xFF.
FP8_E4M3FN_NAN_BITS = 0x7F
UE8M0_NAN = 0xFF


class WorkspaceStateError(RuntimeError):
    """A call refused to run because an earlier call on this buffer did not complete (interrupted, raised, timed
    out at a barrier, or its process died): the workspace counters and barrier epochs may disagree across ranks.
    The fix is the collective :meth:`megamoe.symm.SymmBuffer.reset` on every rank."""


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
    """Everything one rank's steps need for one call. ``index``: ``""`` (one buffer) or ``"[r]"`` (the entry of
    the per-rank lists of the local backend), used to name arguments in errors."""

    sb: SymmBuffer
    y: torch.Tensor
    l1: WeightPair
    l2: WeightPair
    stats: torch.Tensor | None
    clamp: float | None
    index: str = ""

    @property
    def n(self) -> int:
        return self.y.shape[0]


IMPLS = ("auto", "fused", "staged")
NUMERICS = ("exact", "hopper")


def resolve_impl(impl: str, sym_buffers: list, dispatch: str, num_tokens: int | None = None) -> str:
    """Which path runs: ``"staged"``, or ``"fused"`` where it can run (a Hopper GPU, pull dispatch, see
    ``megamoe.fused.unsupported_reason``). ``"auto"`` takes the fused kernel wherever it can run (on an H200 it
    measured 1.0-1.7x faster than the staged pipeline from 8 to 2048 tokens per rank and 5% slower at 8192 with
    uniform routing, ``results/layer_h200.json``); ``"fused"`` where it cannot run raises
    ValueError saying why. ``num_tokens`` (this rank's) is accepted for size-dependent choices."""
    from megamoe.fused import unsupported_reason

    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} must be one of {IMPLS}")
    if impl == "staged":
        return impl
    reason = unsupported_reason(sym_buffers, sym_buffers[0].buffer.device)
    if reason is None and dispatch != "pull":
        reason = f"dispatch={dispatch!r}: the fused kernel pulls (push is the staged baseline)"
    if impl == "fused":
        if reason:
            raise ValueError(f"impl='fused' cannot run here: {reason}")
        return impl
    return "staged" if reason is not None or interpreting() else "fused"


def fp8_fp4_mega_moe(y, l1_weights, l2_weights, sym_buffer, *, activation: str = "swiglu",
                     activation_clamp: float | None = None, cumulative_local_expert_recv_stats=None,
                     dispatch: str = "pull", check: bool = True, impl: str = "auto",
                     numerics: str = "exact") -> None:
    """Run one Mega MoE layer forward.

    Before the call each rank copies its inputs into its buffer: ``sym_buffer.x[:n]`` (FP8 e4m3 [n, H]),
    ``x_sf[:n]`` (int32 [n, H/128], packed UE8M0 per 32), ``topk_idx[:n]`` (int64 [n, k], -1 = masked) and
    ``topk_weights[:n]`` (float32 [n, k]). Only these first n rows are inputs.

    Args:
        y: bf16 [n, H], contiguous (n = this rank's token count, n <= num_max_tokens_per_rank; n may be 0).
        l1_weights: the L1 :class:`~megamoe.quant.TransformedWeights` ``(w int8 [El, 2I, H/2], sf int32
            [El, 2I, H/128] MN-major)`` returned by :func:`megamoe.quant.transform_weights_for_mega_moe` (this
            rank's El local experts). Plain ``(w, sf)`` tuples are rejected: the op cannot tell untransformed (or
            twice-transformed) weights from transformed ones by their shapes, and would compute garbage.
        l2_weights: the L2 ``TransformedWeights`` ``(w int8 [El, H, I/2], sf int32 [El, H, I/128] MN-major)``.
        sym_buffer: this rank's :class:`SymmBuffer`; with the ``local`` backend, the list of all ranks' buffers of
            one ``SymmBuffer.local`` group in rank order, and then ``y``, the weights and the stats are lists too
            (one entry per rank; no two may share memory).
        activation: only ``"swiglu"``.
        activation_clamp: a finite number > 0 (not a bool): ``gate <= c`` and ``-c <= up <= c`` before SwiGLU;
            None = no clamp.
        cumulative_local_expert_recv_stats: optional contiguous int32 [El]; received pairs per local expert are
            added to it.
        dispatch: ``"pull"`` (Mega MoE) or ``"push"`` (DeepEP-style baseline: sources write into the owner's pool).
        check: ``True`` reads device memory before any kernel runs (one host sync per rank) and rejects, naming the
            argument: expert ids outside [-1, E) or repeated within a token in ``topk_idx[:n]``, non-finite
            ``topk_weights[:n]`` of unmasked slots, NaN scale bytes (0xFF) in ``x_sf[:n]``, NaN FP8 bytes
            (0x7F/0xFF) in ``x[:n]``, and a workspace left by an unfinished call (``call_state``) or a failed
            barrier; after the call it raises :class:`megamoe.kernels.symm.BarrierTimeout` if a barrier timed out
            (on CUDA a timeout is only recorded on the device). ``False`` (benchmarks) reads no device memory: such
            inputs then give unspecified results (ids out of range write out of bounds; NaNs become finite
            garbage or NaN rows), a failed GPU barrier goes unreported until a later checked call, and an
            unfinished call is detected only through the host-side :attr:`SymmBuffer.fault`. Shapes, dtypes,
            devices, contiguity, aliasing, weight tags and the buffer's fault state are always validated.

        impl: ``"staged"`` (the portable pipeline: one launch per step), ``"fused"`` (one persistent launch per call
            on a Hopper GPU, ``megamoe.fused``) or ``"auto"`` (the one measured faster for this call's size, see
            :func:`resolve_impl`).
        numerics: ``"exact"`` (both paths; the seeds' per-32 scales, ``megamoe.reference``'s default) or
            ``"hopper"`` (fused path only: per-32 scales folded into the 8-bit operands, no scale multiply inside the
            K loops; ``megamoe.reference`` with ``numerics="hopper"`` models it).

    Interruption: a call either completes or leaves the buffer marked (``SymmBuffer.fault`` host side, and
    ``call_state`` in the workspace). With the ``local`` backend every rank is in this process, so the workspace of
    every rank is repaired before the exception (KeyboardInterrupt included) propagates, and the next call is
    correct. With one process per rank the next call raises :class:`WorkspaceStateError` until
    ``sym_buffer.reset()`` has been called on every rank.
    """
    if numerics not in NUMERICS:
        raise ValueError(f"numerics={numerics!r} must be one of {NUMERICS}")
    calls = bind_calls(y, l1_weights, l2_weights, sym_buffer, cumulative_local_expert_recv_stats, activation,
                       activation_clamp, dispatch, check)
    chosen = resolve_impl(impl, [c.sb for c in calls], dispatch, calls[0].n)
    if numerics == "hopper" and chosen != "fused":
        raise ValueError(f"numerics='hopper' is the fused kernel's; impl={impl!r} resolved to {chosen!r} here")
    if chosen == "staged":
        run_steps(calls, pipeline_steps(dispatch), check)
        return
    from megamoe.fused import run_fused

    with guarded_call(calls):  # the kernel beats its own heartbeat (one launch: nothing to do between steps)
        run_fused(calls, numerics=numerics)
        if check:
            for call in calls:
                check_barrier_state(call.sb)


def run_steps(calls: list["_RankCall"], steps: list[tuple[str, Callable[["_RankCall"], None]]],
              check: bool) -> None:
    """Run ``steps`` (from :func:`pipeline_steps`) for the bound ``calls`` in lock-step inside
    :func:`guarded_call`: before every step that is not a barrier wait each rank beats its heartbeat (so that peers
    waiting on it see progress; a no-op for one rank and the local backend); with ``check`` every rank's barrier
    state is checked at the end."""
    with guarded_call(calls) as beacon:
        for name, step in steps:
            waiting = name.endswith(WAIT_STEP_SUFFIX)
            beacon.active = not waiting
            for call in calls:
                if not waiting:
                    heartbeat(call.sb)
                step(call)
        beacon.active = False
        if check:
            for call in calls:
                check_barrier_state(call.sb)


@contextlib.contextmanager
def guarded_call(calls: list["_RankCall"]) -> Iterator[ProgressBeacon]:
    """Bracket one call's kernels (any implementation) on the bound ``calls``; yields a
    :class:`~megamoe.kernels.symm.ProgressBeacon` (set ``active`` while computing, clear it while waiting).

    Marks every buffer before the first kernel (``SymmBuffer.fault``, and ``call_state[0] += 1`` in the workspace)
    and clears the marks after the body completes (``call_state[1] += 1``). If anything escapes the body -- an
    exception, a ``KeyboardInterrupt``, a ``BarrierTimeout`` -- the ``fault`` names it and the exception propagates;
    with the ``local`` backend (every rank in this process, nothing running concurrently) every rank's workspace is
    first zeroed (counters, barrier epochs/signals/state, call state) and the fault cleared, so the next call is
    correct. A second interrupt during that repair leaves the fault set: the next call then asks for ``reset()``.
    """
    sbs = [c.sb for c in calls]
    for sb in sbs:
        sb.fault = "a call was started and never completed"
    try:
        for sb in sbs:
            sb.view("call_state")[0] += 1
        with ProgressBeacon(sbs, min(sb.barrier_timeout_s for sb in sbs)) as beacon:
            yield beacon
        for sb in sbs:
            sb.view("call_state")[1] += 1
    except BaseException as e:
        reason = f"the previous call was stopped by {type(e).__name__}" + (f" ({e})" if str(e) else "")
        for sb in sbs:
            sb.fault = reason
        if sbs[0].backend == "local":
            for sb in sbs:
                reset_workspace(sb)
            for sb in sbs:
                sb.fault = None
        raise
    for sb in sbs:
        sb.fault = None


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
    block_h = largest_pow2_tile(H, 1024)  # H = 128 * m: a power-of-two tile (the interpreter's arange needs one)
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
        HAS_CLAMP=c.clamp is not None, F64_EXP=interpreting(), **meta)


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
    block_t, block_h = 16, largest_pow2_tile(L.hidden, 1024 if interpreting() else 256)
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


def largest_pow2_tile(n: int, cap: int) -> int:
    """Largest power of two <= cap dividing n (n is a multiple of 128)."""
    t = cap
    while n % t:
        t //= 2
    return t


# ---------------------------------------------------------------------------------------------------- validation
def _as_list(value, name: str, count: int, is_list: bool) -> list:
    if not is_list:
        return [value]
    if not isinstance(value, (list, tuple)) or isinstance(value, TaggedWeights) or len(value) != count:
        raise TypeError(f"{name} must be a list of {count} entries (one per local rank) with a list of sym_buffers")
    return list(value)


def _check_buffers(sym_buffer) -> tuple[list[SymmBuffer], bool]:
    """The buffers of a call (one, or a whole local group in rank order) and whether they came as a list."""
    is_list = isinstance(sym_buffer, (list, tuple))
    buffers = list(sym_buffer) if is_list else [sym_buffer]
    if not buffers or not all(isinstance(b, SymmBuffer) for b in buffers):
        got = type(sym_buffer).__name__ if not is_list else f"a list of {[type(b).__name__ for b in buffers]}"
        raise TypeError(f"sym_buffer must be a SymmBuffer (or, for the local backend, a list of them), got {got}")
    for i, b in enumerate(buffers):
        if b._views is None:
            raise RuntimeError(f"sym_buffer{f'[{i}]' if is_list else ''} (rank {b.rank}) was destroyed "
                               "(SymmBuffer.destroy()); allocate a new one")
    if is_list:
        ranks = [b.rank for b in buffers]
        if ranks != list(range(buffers[0].num_ranks)) or any(b.backend != "local" for b in buffers):
            raise ValueError(f"a list of sym_buffers must hold every rank of one local group in order, got ranks "
                             f"{ranks} of world size {buffers[0].num_ranks}"
                             + ("" if all(b.backend == "local" for b in buffers) else
                                f" and backends {[b.backend for b in buffers]} (only 'local' buffers come in lists)"))
        group = [p.data_ptr() for p in buffers[0]._peers]
        for i, b in enumerate(buffers):
            if [p.data_ptr() for p in b._peers] != group or b.layout.num_bytes != buffers[0].layout.num_bytes:
                raise ValueError(f"sym_buffer[{i}] belongs to a different SymmBuffer.local group than sym_buffer[0]: "
                                 "pass the buffers of one SymmBuffer.local(...) call (mixing groups would leave "
                                 "barriers waiting on ranks that never arrive)")
    for i, b in enumerate(buffers):
        if b.fault is not None:
            raise _state_error(b, f"sym_buffer{f'[{i}]' if is_list else ''}", b.fault)
    return buffers, is_list


def _state_error(sb: SymmBuffer, name: str, reason: str) -> WorkspaceStateError:
    fix = ("call reset() on every SymmBuffer of the local group" if sb.backend == "local" else
           "call sym_buffer.reset() on every rank of the group (collective)")
    return WorkspaceStateError(f"{name} (rank {sb.rank}) cannot run a call: {reason}. Its workspace counters and "
                               f"barrier epochs may disagree with the other ranks', so this call would compute "
                               f"garbage or time out. To recover, {fix}, then call again.")


def _check_clamp(clamp) -> None:
    if clamp is None:
        return
    if isinstance(clamp, bool) or not isinstance(clamp, numbers.Real):
        raise TypeError(f"activation_clamp must be a number > 0 or None, got {type(clamp).__name__} {clamp!r}")
    if not (math.isfinite(float(clamp)) and float(clamp) > 0):
        raise ValueError(f"activation_clamp={clamp} must be a finite number > 0 (or None)")


def bind_calls(y, l1_weights, l2_weights, sym_buffer, stats, activation, clamp, dispatch, check) -> list[_RankCall]:
    """Validate the arguments of :func:`fp8_fp4_mega_moe` (same meaning, positional) and return one bound call per
    rank: the single entry point that checks everything (for every implementation) before any kernel runs.
    Stepping through a call by hand -- as the benchmarks' per-step timing and the notebooks do -- is
    ``for name, step in pipeline_steps(dispatch): for c in calls: step(c)`` (without the interruption guard of
    :func:`run_steps`)."""
    buffers, is_list = _check_buffers(sym_buffer)
    for i, sb in enumerate(buffers):
        if sb.layout.format != "fp8_fp4":
            raise ValueError(f"sym_buffer{f'[{i}]' if is_list else ''} was made for format {sb.layout.format!r}; "
                             "fp8_fp4_mega_moe needs a format='fp8_fp4' SymmBuffer (megamoe.fp8_mega_moe runs 'fp8')")
    if activation != "swiglu":
        raise ValueError(f"activation={activation!r}: only 'swiglu' is supported")
    if dispatch not in ("pull", "push"):
        raise ValueError(f"dispatch={dispatch!r} must be 'pull' or 'push'")
    if not isinstance(check, bool):
        raise TypeError(f"check must be a bool, got {type(check).__name__}")
    _check_clamp(clamp)
    n = len(buffers)
    calls = [_RankCall(sb, yy, a, b, s, clamp, f"[{i}]" if is_list else "") for i, (sb, yy, a, b, s) in enumerate(zip(
        buffers, _as_list(y, "y", n, is_list), _as_list(l1_weights, "l1_weights", n, is_list),
        _as_list(l2_weights, "l2_weights", n, is_list),
        _as_list(stats, "cumulative_local_expert_recv_stats", n, is_list) if stats is not None else [None] * n))]
    for c in calls:
        _validate(c)
    _check_no_aliasing(calls)
    if check:
        for c in calls:
            _check_inputs(c)
    return calls


def _check_tensor(name: str, t, dtype: torch.dtype, shape: tuple, device: torch.device | None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.is_meta:
        raise ValueError(f"{name} is a meta tensor (shape only, no data); pass a real tensor")
    if t.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")


def _check_weights(name: str, pair, role: str, El: int, n_rows: int, k: int, dev: torch.device, L) -> None:
    """``pair`` must be the ``role`` TransformedWeights of this rank's experts."""
    if not isinstance(pair, TransformedWeights):
        if isinstance(pair, (tuple, list)):
            raise TypeError(f"{name} is a plain {type(pair).__name__}, not the output of "
                            "megamoe.transform_weights_for_mega_moe: the kernels read a re-laid-out form and would "
                            f"compute garbage from untransformed weights. Pass {name[:2]} of "
                            "`l1, l2 = transform_weights_for_mega_moe(l1_fp4, l2_fp4)` (MegaMoE does this itself)")
        raise TypeError(f"{name} must be the TransformedWeights (w, sf) returned by transform_weights_for_mega_moe, "
                        f"got {type(pair).__name__}")
    if pair.role != role:
        raise ValueError(f"{name} holds {pair.role} weights (role {pair.role!r}); l1_weights and l2_weights swapped?")
    w, sf = pair
    if isinstance(w, torch.Tensor) and w.dim() == 3 and w.shape[0] != El:
        raise ValueError(f"{name} holds {w.shape[0]} experts but the buffer has {El} experts per rank "
                         f"(num_experts={L.num_experts} over {L.num_ranks} ranks): mismatched world size?")
    _check_tensor(f"{name}[0]", w, torch.int8, (El, n_rows, k // 2), dev)
    _check_tensor(f"{name}[1]", sf, torch.int32, (El, n_rows, k // 128), dev)
    if not w.is_contiguous() or not sf.transpose(1, 2).is_contiguous():
        raise ValueError(f"{name} must come from transform_weights_for_mega_moe (contiguous weights, MN-major "
                         "scales); it was re-laid out since")


def _validate(c: _RankCall) -> None:
    L, dev = c.sb.layout, c.sb.buffer.device
    El, H, I, T = L.num_experts_per_rank, L.hidden, L.intermediate_hidden, L.num_max_tokens_per_rank
    y = f"y{c.index}"
    if not isinstance(c.y, torch.Tensor):
        raise TypeError(f"{y} must be a bf16 torch.Tensor [num_tokens, {H}], got {type(c.y).__name__}")
    if c.y.dim() != 2:
        raise ValueError(f"{y} must be a 2-D bf16 tensor [num_tokens, {H}], got shape {tuple(c.y.shape)}")
    if c.y.shape[0] > T:
        raise ValueError(f"{y} has {c.y.shape[0]} tokens, more than num_max_tokens_per_rank={T} of the buffer")
    _check_tensor(y, c.y, torch.bfloat16, (c.y.shape[0], H), dev)
    if not c.y.is_contiguous():
        raise ValueError(f"{y} must be contiguous (the kernel writes rows of {H} at a stride of {H}); got strides "
                         f"{c.y.stride()}")
    _check_weights(f"l1_weights{c.index}", c.l1, "l1", El, 2 * I, H, dev, L)
    _check_weights(f"l2_weights{c.index}", c.l2, "l2", El, H, I, dev, L)
    if c.stats is not None:
        name = f"cumulative_local_expert_recv_stats{c.index}"
        _check_tensor(name, c.stats, torch.int32, (El,), dev)
        if not c.stats.is_contiguous():
            raise ValueError(f"{name} must be contiguous (the kernel adds into {El} consecutive int32), got stride "
                             f"{c.stats.stride()}")
    for step, extent in (("l1", I), ("l2", H)):
        block_n = GEMM_CONFIG[step]["BLOCK_N"]
        if extent % block_n:
            raise ValueError(f"GEMM_CONFIG[{step!r}]['BLOCK_N']={block_n} does not divide the {step} N extent "
                             f"{extent} ({'intermediate_hidden' if step == 'l1' else 'hidden'})")


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    """[first, last) bytes a contiguous ``t`` covers."""
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def _check_no_aliasing(calls: list[_RankCall]) -> None:
    """Outputs must not overlap each other (two local ranks sharing y or stats) nor any symmetric buffer."""
    spans = []
    for c in calls:
        spans.append((f"y{c.index}", _byte_range(c.y)))
        if c.stats is not None:
            spans.append((f"cumulative_local_expert_recv_stats{c.index}", _byte_range(c.stats)))
    for c in calls:
        for i, p in enumerate(c.sb._peers):
            spans.append((f"the symmetric buffer of rank {i}", _byte_range(p)))
    for i, (name_a, (a0, a1)) in enumerate(spans):
        for name_b, (b0, b1) in spans[i + 1:]:
            if name_a.startswith("the symmetric") and name_b.startswith("the symmetric"):
                continue
            if a0 < b1 and b0 < a1:
                raise ValueError(f"{name_a} and {name_b} share memory; every output must have its own storage")


def _check_inputs(c: _RankCall) -> None:
    """``check=True``: the inputs in ``sym_buffer`` (first n rows) and the workspace marks, in one host sync."""
    L, sb, n = c.sb.layout, c.sb, c.n
    E = L.num_experts
    name = f"sym_buffer{c.index}"
    idx, w = sb.topk_idx[:n], sb.topk_weights[:n]
    x_bytes, sf_bytes = sb.x[:n].view(torch.uint8), sb.x_sf[:n].view(torch.uint8)
    call_state, barrier_state = sb.view("call_state"), sb.view("barrier_state")
    s = idx.sort(dim=1).values
    dup = ((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)).any()
    flags = torch.stack([((idx < -1) | (idx >= E)).any(), dup,
                         (~torch.isfinite(w) & (idx >= 0)).any(),
                         (sf_bytes == UE8M0_NAN).any(),
                         ((x_bytes & FP8_E4M3FN_NAN_BITS) == FP8_E4M3FN_NAN_BITS).any(),
                         call_state[0] != call_state[1], barrier_state[1] != 0]).tolist()
    if not any(flags):
        return
    bad_range, dup, bad_w, nan_sf, nan_x, unfinished, failed = flags
    if unfinished:
        begun, done = call_state.tolist()
        raise _state_error(sb, name, f"its workspace records {begun} calls begun but {done} completed: a call "
                           "never finished (its process was interrupted or died before this host object knew)")
    if failed:
        _, tag, missing, _ = barrier_state.tolist()
        raise _state_error(sb, name, f"barrier tag {tag} timed out in an earlier call (rank {missing} never arrived)")
    if bad_range:
        lo, hi = int(idx.min()), int(idx.max())
        raise ValueError(f"topk_idx ({name}.topk_idx[:{n}]) holds expert ids in [{lo}, {hi}]; valid are "
                         f"-1 (masked) and 0..{E - 1}")
    if dup:
        t = int(((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)).any(dim=1).nonzero()[0])
        raise ValueError(f"topk_idx ({name}.topk_idx[:{n}]) has a token ({t}: {idx[t].tolist()}) that selects the "
                         "same expert twice; a token's top-k experts must be distinct")
    if bad_w:
        t, j = (int(v) for v in (~torch.isfinite(w) & (idx >= 0)).nonzero()[0])
        raise ValueError(f"topk_weights ({name}.topk_weights[:{n}]) holds a non-finite weight ({float(w[t, j])}) at "
                         f"token {t}, slot {j} (expert {int(idx[t, j])}); router weights must be finite")
    if nan_sf:
        t, b = (int(v) for v in (sf_bytes == UE8M0_NAN).nonzero()[0])
        raise ValueError(f"x_sf ({name}.x_sf[:{n}]) holds a NaN UE8M0 scale (byte 0xFF) at token {t}, scale "
                         f"group {b} (of H/32); per_token_cast_to_fp8 never produces one")
    if nan_x:
        t, h = (int(v) for v in ((x_bytes & FP8_E4M3FN_NAN_BITS) == FP8_E4M3FN_NAN_BITS).nonzero()[0])
        raise ValueError(f"x ({name}.x[:{n}]) holds an FP8 NaN (byte 0x{int(x_bytes[t, h]):02X}) at token {t}, "
                         f"column {h}; the activations must be finite")


# ---------------------------------------------------------------------------------------------------- wrapper
class MegaMoE:
    """One rank's Mega MoE layer: a SymmBuffer plus transformed weights.

    Args:
        sym_buffer: this rank's :class:`SymmBuffer` (one process per rank).
        l1_weights: untransformed FP4 ``(w int8 [El, 2I, H/2], sf int32 [El, 2I, H/128])``, rows [0, I) = gate,
            [I, 2I) = up (as returned by ``megamoe.quant.cast_grouped_weights_to_fp4``); already transformed
            weights (:class:`~megamoe.quant.TransformedWeights`) are rejected, not transformed twice.
        l2_weights: untransformed FP4 ``(w int8 [El, H, I/2], sf int32 [El, H, I/128])``.
        activation_clamp: see :func:`fp8_fp4_mega_moe`.
        dispatch: ``"pull"`` or ``"push"``.
    """

    def __init__(self, sym_buffer: SymmBuffer, l1_weights: WeightPair, l2_weights: WeightPair, *,
                 activation_clamp: float | None = None, dispatch: str = "pull"):
        _check_buffers(sym_buffer)
        if isinstance(sym_buffer, (list, tuple)):
            raise TypeError("MegaMoE takes one rank's SymmBuffer (one process per rank); for the local backend call "
                            "fp8_fp4_mega_moe with lists")
        self.sym_buffer = sym_buffer
        dev = sym_buffer.buffer.device
        for name, pair in (("l1_weights", l1_weights), ("l2_weights", l2_weights)):
            if isinstance(pair, TransformedWeights):
                raise TypeError(f"MegaMoE({name}=...) got already transformed weights (the output of "
                                "transform_weights_for_mega_moe); MegaMoE transforms them itself. Pass the "
                                "untransformed FP4 weights (cast_grouped_weights_to_fp4)")
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2
                    and all(isinstance(t, torch.Tensor) and not t.is_meta for t in pair)):
                raise TypeError(f"MegaMoE({name}=...) must be an untransformed FP4 (weights, scales) pair of "
                                f"tensors with data, got {type(pair).__name__}")
        l1 = tuple(t.to(dev) for t in l1_weights)
        l2 = tuple(t.to(dev) for t in l2_weights)
        self.l1_weights, self.l2_weights = transform_weights_for_mega_moe(l1, l2)
        _check_clamp(activation_clamp)
        self.activation_clamp = activation_clamp
        self.dispatch = dispatch

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                cumulative_local_expert_recv_stats: torch.Tensor | None = None) -> torch.Tensor:
        """x bf16/float32 [n, H], topk_idx int64 [n, k] (-1 = masked), topk_weights float32 [n, k] -> y bf16 [n, H].

        Every argument is validated before anything is copied or launched (TypeError / ValueError naming it: None,
        meta tensors, wrong shapes or dtypes), then as in :func:`fp8_fp4_mega_moe` with ``check=True``."""
        _check_buffers(self.sym_buffer)
        sb, L = self.sym_buffer, self.sym_buffer.layout
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a [num_tokens, {L.hidden}] float tensor, got {type(x).__name__}")
        if x.is_meta:
            raise ValueError("x is a meta tensor (shape only, no data); pass a real tensor")
        if x.dim() != 2 or x.shape[1] != L.hidden or not x.is_floating_point():
            raise ValueError(f"x must be a [num_tokens, {L.hidden}] float tensor, got {tuple(x.shape)} {x.dtype}")
        n = x.shape[0]
        if n > L.num_max_tokens_per_rank:
            raise ValueError(f"x has {n} tokens, more than num_max_tokens_per_rank={L.num_max_tokens_per_rank}")
        _check_tensor("topk_idx", topk_idx, torch.int64, (n, L.num_topk), None)
        _check_tensor("topk_weights", topk_weights, torch.float32, (n, L.num_topk), None)
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


__all__: Sequence[str] = ["fp8_fp4_mega_moe", "MegaMoE", "load_inputs", "bind_calls", "pipeline_steps", "run_steps",
                          "guarded_call", "resolve_impl", "IMPLS", "NUMERICS", "WorkspaceStateError",
                          "TAG_AFTER_DISPATCH_PUSH", "GEMM_CONFIG"]
