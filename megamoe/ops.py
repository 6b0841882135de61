"""The public op: ``fp8_fp4_mega_moe`` (DeepGEMM's name and arguments) and the ``MegaMoE`` module-style wrapper.

One call runs either the fused persistent kernel (``impl="fused"``, the default on sm_90: one launch,
:mod:`megamoe.fused`) or the staged pipeline below on every rank (``impl="staged"``: the portable path, CPU
interpreter included); each staged step is one kernel launch, and the step boundaries are where the fused kernel
puts its grid syncs::

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

(Just over 500 lines: the op, its argument binding and validation, the staged steps and the interruption guard are
one call's life; the fused kernel's host side lives in :mod:`megamoe.fused`, the FP8 x FP8 op in
:mod:`megamoe.ops_fp8`.)
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch
import triton

from megamoe.env import interpreting, sm_count
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
from megamoe.quant import TransformedWeights, per_token_cast_to_fp8, transform_weights_for_mega_moe
from megamoe.reference import HOPPER_NUMERICS, NUMERICS
from megamoe.symm import SymmBuffer
from megamoe.validation import (
    FP8_FP4,
    WeightFormat,
    WorkspaceStateError,
    as_list,
    check_buffers,
    check_call,
    check_clamp,
    check_inputs,
    check_no_aliasing,
    check_options,
    check_tensor,
)

#: Barrier after a push dispatch: the owner may only read its pool once every source has pushed.
TAG_AFTER_DISPATCH_PUSH = 4

WeightPair = tuple[torch.Tensor, torch.Tensor]

#: Suffix of the names of the barrier-wait steps in :func:`pipeline_steps` (waiting is not progress).
WAIT_STEP_SUFFIX = "_wait"
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
#: What ``numerics=`` accepts: ``"auto"`` (the default, :func:`resolve_numerics`) or one of ``megamoe.reference``'s.
NUMERICS_ARGS = ("auto", *NUMERICS)
#: ``numerics="auto"``'s choice where the fused kernel runs on a GPU (issue #7's targets are measured in it; the
#: layer files record it as ``config["default_numerics"]``): ``"hopper_l2_per_block"``, DeepGEMM SM90's way with
#: the L2 input's per-128 token scales (nothing folded, so nothing rounds there), since session 38. Alternating
#: with ``"hopper"`` twice in one call on an H100 (``results/probes/numerics_runs/l2_per_block_6d3f174_h100.jsonl``),
#: same error (3.7-3.9e-3): T = 512 1057 / 1063 -> 1016 / 1020 µs, 2048 2756 / 2780 -> 2576 / 2575, 128 690 / 690
#: -> 695 / 696, 8192 8224 / 8259 -> 8228 / 8264; the layer runs of that commit and the next on H100s
#: (``results/probes/layer_variants/layer_h100_6d3f174.json`` / ``layer_h100_8f2be81.json``) 2-8 % faster
#: at T = 8 / 32 / 512 / 2048 with both routings, within 1 % at 128 / 8192 (uniform). In the H200 file of 5996cc5
#: it was faster at every T but 128 (+2.6 %). Until session 37 ``"hopper"``: the L2 A operand folded per token in
#: the decode partition's every L2 stage, the work this removes.
AUTO_GPU_NUMERICS = "hopper_l2_per_block"


def resolve_impl(impl: str, sym_buffers: list, dispatch: str, num_tokens: int | None = None,
                 numerics: str = "exact") -> str:
    """Which path runs: ``"staged"``, or ``"fused"`` where it can run (a Hopper GPU, pull dispatch, see
    ``megamoe.fused.unsupported_reason``). ``"auto"`` takes the fused kernel wherever it can run (on an H200 it
    measured 1.0-1.7x faster than the staged pipeline from 8 to 2048 tokens per rank and 5% slower at 8192 with
    uniform routing, ``results/layer_h200.json``); ``"fused"`` where it cannot run raises
    ValueError saying why, and so does a Hopper ``numerics`` (the fused kernel's only) where the path is the
    staged one. ``num_tokens`` (this rank's) is accepted for size-dependent choices."""
    chosen = _resolve_path(impl, sym_buffers, dispatch)
    if numerics in HOPPER_NUMERICS and chosen != "fused":
        raise ValueError(f"numerics={numerics!r} is the fused kernel's; impl={impl!r} resolves to {chosen!r} here")
    return chosen


def check_numerics(numerics) -> None:
    """ValueError naming ``numerics`` unless it is one of :data:`NUMERICS_ARGS`."""
    if not isinstance(numerics, str) or numerics not in NUMERICS_ARGS:
        raise ValueError(f"numerics={numerics!r} must be one of {NUMERICS_ARGS}")


def resolve_numerics(numerics: str, impl: str, device: torch.device) -> str:
    """The numerics a call runs, given the path ``impl`` resolved to (:func:`resolve_impl`) on ``device``:
    ``"auto"`` is :data:`AUTO_GPU_NUMERICS` where the fused kernel runs on a GPU (Hopper), else ``"exact"`` (the
    staged path, and the fused kernel on CPU ranks under the interpreter: bit-exact against ``megamoe.reference``'s
    default); any other value is returned as given (:func:`resolve_impl` refuses a Hopper numerics on the staged
    path). Compare a call's output with ``megamoe.reference`` at the numerics this returns."""
    check_numerics(numerics)
    if numerics != "auto":
        return numerics
    return AUTO_GPU_NUMERICS if impl == "fused" and torch.device(device).type == "cuda" else "exact"


def _resolve_path(impl: str, sym_buffers: list, dispatch: str) -> str:
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
                     numerics: str = "auto") -> None:
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
        numerics: ``"auto"`` (default: ``"hopper_l2_per_block"`` where the fused kernel runs on a GPU, else ``"exact"``;
            :func:`resolve_numerics`), ``"exact"`` (both paths; the seeds' per-32 scales, ``megamoe.reference``'s
            default) or ``"hopper"`` (fused path only: per-32 scales folded into the 8-bit operands, no scale
            multiply inside the K loops; ``megamoe.reference`` with ``numerics="hopper"`` models it) or
            ``"hopper_l2_per_block"`` (the same, but the L2 input's per-128 scales applied per K block instead of
            folded).

    Interruption: a call either completes or leaves the buffer marked (``SymmBuffer.fault`` host side, and
    ``call_state`` in the workspace). With the ``local`` backend every rank is in this process, so the workspace of
    every rank is repaired before the exception (KeyboardInterrupt included) propagates, and the next call is
    correct. With one process per rank the next call raises :class:`WorkspaceStateError` until
    ``sym_buffer.reset()`` has been called on every rank.
    """
    check_numerics(numerics)
    calls = bind_calls(y, l1_weights, l2_weights, sym_buffer, cumulative_local_expert_recv_stats, activation,
                       activation_clamp, dispatch, check)
    chosen = resolve_impl(impl, [c.sb for c in calls], dispatch, calls[0].n, numerics)
    numerics = resolve_numerics(numerics, chosen, calls[0].sb.buffer.device)
    if chosen == "staged":
        run_steps(calls, pipeline_steps(dispatch), check)
        return
    from megamoe.fused import run_fused

    with guarded_call(calls, kernel_marks_calls=True):  # the kernel beats its heartbeat and counts call_state
        run_fused(calls, numerics=numerics)
        if check:
            for call in calls:
                check_barrier_state(call.sb)


def run_steps(calls: list["_RankCall"], steps: list[tuple[str, Callable[["_RankCall"], None]]],
              check: bool, mark: Callable[[], None] | None = None) -> None:
    """Run ``steps`` (from :func:`pipeline_steps`) for the bound ``calls`` in lock-step inside
    :func:`guarded_call`: before every step that is not a barrier wait each rank beats its heartbeat (so that peers
    waiting on it see progress; a no-op for one rank and the local backend); with ``check`` every rank's barrier
    state is checked at the end. ``mark``, if given, is called before the first step and after each one (every
    rank): the hook of the per-step timer (``megamoe.stepping.time_steps``), which so times the steps exactly as a
    call runs them, heartbeats included."""
    with guarded_call(calls) as beacon:
        if mark is not None:
            mark()
        for name, step in steps:
            waiting = name.endswith(WAIT_STEP_SUFFIX)
            beacon.active = not waiting
            for call in calls:
                if not waiting:
                    heartbeat(call.sb)
                step(call)
            if mark is not None:
                mark()
        beacon.active = False
        if check:
            for call in calls:
                check_barrier_state(call.sb)


@contextlib.contextmanager
def guarded_call(calls: list["_RankCall"], kernel_marks_calls: bool = False) -> Iterator[ProgressBeacon]:
    """Bracket one call's kernels (any implementation) on the bound ``calls``; yields a
    :class:`~megamoe.kernels.symm.ProgressBeacon` (set ``active`` while computing, clear it while waiting).

    Marks every buffer before the first kernel (``SymmBuffer.fault``, and ``call_state[0] += 1`` in the workspace)
    and clears the marks after the body completes (``call_state[1] += 1``); with ``kernel_marks_calls`` (the fused
    kernel, ``megamoe.kernels.fused``) the kernel counts ``call_state`` itself, in its first and last launch, and
    only ``fault`` is set here (two small torch launches fewer a call). If anything escapes the body -- an
    exception, a ``KeyboardInterrupt``, a ``BarrierTimeout`` -- the ``fault`` names it and the exception propagates;
    with the ``local`` backend (every rank in this process, nothing running concurrently) every rank's workspace is
    first zeroed (counters, barrier epochs/signals/state, call state) and the fault cleared, so the next call is
    correct. A second interrupt during that repair leaves the fault set: the next call then asks for ``reset()``.
    """
    sbs = [c.sb for c in calls]
    for sb in sbs:
        sb.fault = "a call was started and never completed"
    try:
        if not kernel_marks_calls:
            for sb in sbs:
                sb.view("call_state")[0] += 1
        with ProgressBeacon(sbs, min(sb.barrier_timeout_s for sb in sbs)) as beacon:
            yield beacon
        if not kernel_marks_calls:
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
    return max(1, min(max_tiles, programs_per_sm * sm_count(device)))


def gemm_steps(l1_kernel, l2_kernel, config: dict, dot_meta: Callable[[dict], dict] = lambda cfg: {}):
    """The pipeline's ``l1`` and ``l2`` steps for one format's two persistent GEMM kernels (same arguments in both
    formats: ``megamoe.kernels.gemm`` here, ``megamoe.kernels.gemm_fp8`` in ``megamoe.ops_fp8``), launched per
    ``config[step]`` (``BLOCK_N``, ``num_warps``, ``num_stages``, ``programs_per_sm``; read at each call, so a
    sweep may change it) plus ``dot_meta(config[step])`` (the format's own constexprs)."""
    def launch(c: _RankCall, step: str, n_total: int) -> tuple[tuple[int], dict]:
        L, cfg = c.sb.layout, config[step]
        grid = (_num_programs(L.num_max_pool_blocks * (n_total // cfg["BLOCK_N"]), c.sb.buffer.device,
                              cfg["programs_per_sm"]),)
        meta = dict(H=L.hidden, I=L.intermediate_hidden, BLOCK_N=cfg["BLOCK_N"], num_warps=cfg["num_warps"],
                    num_stages=cfg["num_stages"], **dot_meta(cfg), **_schedule_meta(L))
        return grid, meta

    def l1(c: _RankCall) -> None:
        grid, meta = launch(c, "l1", c.sb.layout.intermediate_hidden)
        l1_kernel[grid](
            c.sb.buffer, *c.l1, float(c.clamp) if c.clamp is not None else 0.0,
            **_offsets(c.sb, OFF_RECV="expert_recv_count", OFF_L1="l1_acts", OFF_L1_SF="l1_acts_sf",
                       OFF_L1_W="l1_topk_weights", OFF_L2="l2_acts", OFF_L2_SF="l2_acts_sf"),
            HAS_CLAMP=c.clamp is not None, F64_EXP=interpreting(), **meta)

    def l2(c: _RankCall) -> None:
        grid, meta = launch(c, "l2", c.sb.layout.hidden)
        l2_kernel[grid](
            c.sb.buffer, c.sb.buffer_ptrs, c.sb.rank, *c.l2,
            **_offsets(c.sb, OFF_RECV="expert_recv_count", OFF_L2="l2_acts", OFF_L2_SF="l2_acts_sf",
                       OFF_META="token_src_metadata", OFF_COMBINE="combine"),
            T=c.sb.layout.num_max_tokens_per_rank, **meta)

    return l1, l2


_l1, _l2 = gemm_steps(kg.l1_swiglu_kernel, kg.l2_combine_kernel, GEMM_CONFIG, _dot_meta)


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
def bind_calls(y, l1_weights, l2_weights, sym_buffer, stats, activation, clamp, dispatch, check,
               fmt: WeightFormat = FP8_FP4, gemm_config: dict | None = None, config_name: str = "GEMM_CONFIG",
               block_n_multiple: int = 1) -> list[_RankCall]:
    """Validate the arguments of :func:`fp8_fp4_mega_moe` (same meaning, positional) and return one bound call per
    rank: the single entry point that checks everything (for every implementation) before any kernel runs.
    Stepping through a call by hand is :func:`run_steps` (the per-step timer's way: heartbeats, progress beacon,
    interruption guard) or, for ``local`` ranks only, ``for name, step in pipeline_steps(dispatch): for c in calls:
    step(c)`` (``megamoe.stepping.StagedRun``: one process, so no rank can wait on another's heartbeat). ``fmt``
    and the GEMM config are the other format's (``megamoe.ops_fp8``); the checks are :mod:`megamoe.validation`'s."""
    buffers, is_list = check_buffers(sym_buffer, fmt)
    check_options(activation, dispatch, check)
    check_clamp(clamp)
    n = len(buffers)
    calls = [_RankCall(sb, yy, a, b, s, clamp, f"[{i}]" if is_list else "") for i, (sb, yy, a, b, s) in enumerate(zip(
        buffers, as_list(y, "y", n, is_list), as_list(l1_weights, "l1_weights", n, is_list),
        as_list(l2_weights, "l2_weights", n, is_list),
        as_list(stats, "cumulative_local_expert_recv_stats", n, is_list) if stats is not None else [None] * n))]
    for c in calls:
        check_call(c, fmt, GEMM_CONFIG if gemm_config is None else gemm_config, config_name, block_n_multiple)
    check_no_aliasing(calls)
    if check:
        for c in calls:
            check_inputs(c, fmt)
    return calls


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
        impl, numerics, check: as :func:`fp8_fp4_mega_moe`'s, for every call of this layer (on an H200 the default
            ``numerics="auto"`` runs the fast ``"hopper_l2_per_block"``; ``check=False`` skips the call's one host
            sync reading the inputs).
            Checked here: a Hopper ``numerics`` where ``impl`` does not resolve to the fused kernel is refused now,
            not at the first call.
    """

    def __init__(self, sym_buffer: SymmBuffer, l1_weights: WeightPair, l2_weights: WeightPair, *,
                 activation_clamp: float | None = None, dispatch: str = "pull", impl: str = "auto",
                 numerics: str = "auto", check: bool = True):
        check_buffers(sym_buffer, FP8_FP4)
        if isinstance(sym_buffer, (list, tuple)):
            raise TypeError("MegaMoE takes one rank's SymmBuffer (one process per rank); for the local backend call "
                            "fp8_fp4_mega_moe with lists")
        check_options("swiglu", dispatch, check)
        check_numerics(numerics)
        chosen = resolve_impl(impl, [sym_buffer], dispatch, numerics=numerics)
        self.impl, self.numerics, self.check = impl, numerics, check
        self.sym_buffer = sym_buffer
        dev = sym_buffer.buffer.device
        #: the numerics each call runs (``numerics`` resolved, :func:`resolve_numerics`): what to compare with
        #: ``megamoe.reference(..., numerics=...)``
        self.resolved_numerics = resolve_numerics(numerics, chosen, dev)
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
        check_clamp(activation_clamp)
        self.activation_clamp = activation_clamp
        self.dispatch = dispatch

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                cumulative_local_expert_recv_stats: torch.Tensor | None = None) -> torch.Tensor:
        """x bf16/float32 [n, H], topk_idx int64 [n, k] (-1 = masked), topk_weights float32 [n, k] -> y bf16 [n, H].

        Every argument is validated before anything is copied or launched (TypeError / ValueError naming it: None,
        meta tensors, wrong shapes or dtypes), then as in :func:`fp8_fp4_mega_moe` with this layer's ``check``."""
        check_buffers(self.sym_buffer, FP8_FP4)
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
        check_tensor("topk_idx", topk_idx, torch.int64, (n, L.num_topk), None)
        check_tensor("topk_weights", topk_weights, torch.float32, (n, L.num_topk), None)
        load_inputs(sb, *per_token_cast_to_fp8(x.to(sb.buffer.device)), topk_idx, topk_weights)
        y = torch.empty(n, L.hidden, dtype=torch.bfloat16, device=sb.buffer.device)
        fp8_fp4_mega_moe(y, self.l1_weights, self.l2_weights, sb, activation_clamp=self.activation_clamp,
                         cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats,
                         dispatch=self.dispatch, impl=self.impl, numerics=self.numerics, check=self.check)
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
                          "guarded_call", "resolve_impl", "resolve_numerics", "IMPLS", "NUMERICS", "NUMERICS_ARGS",
                          "WorkspaceStateError",
                          "TAG_AFTER_DISPATCH_PUSH", "GEMM_CONFIG"]
