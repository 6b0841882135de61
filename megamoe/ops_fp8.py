"""``fp8_mega_moe``: DeepGEMM SM90's FP8 x FP8 Mega MoE op (same name, arguments and meaning), megamoe's second format.

The format (:mod:`megamoe.quant_fp8`): FP8 e4m3 activations with one float32 scale per token and 128 columns, FP8
e4m3 weights with one float32 scale per 128x128 block, recipe ``(128, 128, 128)``; L1 gate/up rows interleaved by 8
(:func:`~megamoe.quant_fp8.transform_weights_for_mega_moe_sm90`); the L1 output requantised to FP8 per 128 columns
with float32 scales before L2. :func:`megamoe.reference.reference_fp8_mega_moe` is its model.

It runs the staged pipeline of :mod:`megamoe.ops` (same steps, barriers, dispatch, combine, cleanup and interruption
guard) with the two GEMM steps swapped for :mod:`megamoe.kernels.gemm_fp8`. The dispatch copies a token's ``H/128``
scale words bit for bit, so the same kernel moves float32 scales. ``impl="fused"`` (the default ``"auto"`` on a
Hopper GPU) runs the same two tiles inside the fused persistent kernel (``megamoe.kernels.fused``, constexpr
``FP8W``) -- or, for at most ``megamoe.fused.FP8_SWAP_MAX_EXPECTED`` expected tokens per expert, their swap-AB
variants (constexpr ``FP8_SWAP``: weight rows on the MMA's M, 16 / 32 tokens on N): one launch, the pull overlapped
with the GEMMs through the arrival counts and masks; on CPU ranks under the interpreter both tile kinds are bit-exact
with the staged path (``tests/test_fp8_mega_moe.py``); on an H200 both paths passed ``tests/gpu/test_fp8_gpu.py``
before the swap-AB tiles were added (not yet run on a GPU), and ``python -m megamoe.bench --suite layer_fp8`` times
them beside DeepGEMM's kernel.

The buffer must have been made for this format: ``SymmBuffer(..., format="fp8")`` (or ``mma_type="fp8xfp8"``), whose
``x_sf`` view is float32 ``[T, H/128]``.
"""
from __future__ import annotations

import numbers
from typing import Callable

import torch

from megamoe import ops
from megamoe.env import interpreting
from megamoe.kernels import gemm_fp8 as kg8
from megamoe.quant_fp8 import FORMAT, FP8_BLOCK, SM90_RECIPE, TransformedWeightsSM90
from megamoe.symm import SymmBuffer

#: Launch configuration of the two FP8 GEMM steps. ``BLOCK_N`` (L1: intermediate columns, so 2x weight rows; L2:
#: hidden columns) must be a multiple of 128: an L1 tile owns whole 128-column requant groups. Not tuned on a GPU.
GEMM_CONFIG_FP8 = {
    "l1": {"BLOCK_N": 128, "num_warps": 8, "num_stages": 3, "programs_per_sm": 2},
    "l2": {"BLOCK_N": 128, "num_warps": 8, "num_stages": 3, "programs_per_sm": 2},
}


def fp8_mega_moe(y, l1_weights, l2_weights, sym_buffer, cumulative_local_expert_recv_stats=None,
                 recipe=SM90_RECIPE, activation: str = "swiglu", activation_clamp: float | None = None,
                 fast_math: bool = True, *, dispatch: str = "pull", check: bool = True, impl: str = "auto") -> None:
    """Run one Mega MoE layer forward in the SM90 FP8 x FP8 format (DeepGEMM ``fp8_mega_moe``).

    Before the call each rank copies its inputs into its buffer: ``sym_buffer.x[:n]`` (FP8 e4m3 ``[n, H]``),
    ``x_sf[:n]`` (float32 ``[n, H/128]``, e.g. from :func:`megamoe.quant_fp8.per_token_cast_to_fp8_128`),
    ``topk_idx[:n]`` (int64 ``[n, k]``, -1 = masked) and ``topk_weights[:n]`` (float32 ``[n, k]``).

    Args:
        y: bf16 ``[n, H]``, contiguous (``n <= num_max_tokens_per_rank``; 0 allowed).
        l1_weights: the L1 :class:`~megamoe.quant_fp8.TransformedWeightsSM90` ``(float8_e4m3fn [El, 2I, H], float32
            [El, 2I/128, H/128])`` from :func:`~megamoe.quant_fp8.transform_weights_for_mega_moe_sm90`; plain tuples
            are rejected (transformed and untransformed weights have the same shapes).
        l2_weights: the L2 ``TransformedWeightsSM90`` ``(float8_e4m3fn [El, H, I], float32 [El, H/128, I/128])``.
        sym_buffer: this rank's ``SymmBuffer`` of format ``"fp8"``; with the ``local`` backend the list of a group's
            buffers, and then ``y``, the weights and the stats are lists too (as :func:`megamoe.ops.fp8_fp4_mega_moe`).
        cumulative_local_expert_recv_stats: optional contiguous int32 ``[El]``; received pairs per local expert are
            added to it.
        recipe: the scale granularity (M, N, K); only ``(128, 128, 128)``.
        activation: only ``"swiglu"``.
        activation_clamp: None or a finite number > 0: ``gate <= c`` and ``-c <= up <= c`` before SwiGLU.
        fast_math: a bool, accepted for DeepGEMM compatibility. The staged kernels do not change with it: SwiGLU's
            exp is float64-rounded on the interpreter (bit-reproducible) and the fast float32 exp on a GPU.
        dispatch, check: as :func:`megamoe.ops.fp8_fp4_mega_moe` (``check`` also rejects non-finite or non-positive
            ``x_sf`` scales).
        impl: as :func:`megamoe.ops.fp8_fp4_mega_moe`: ``"staged"``, ``"fused"`` (one persistent launch on a Hopper
            GPU, running this format's staged GEMM tiles, or their swap-AB variants for few tokens per expert,
            inside ``megamoe.kernels.fused``'s task loop) or
            ``"auto"`` (fused wherever it can run; :func:`megamoe.ops.resolve_impl`).

    Interruption and repair are those of :func:`megamoe.ops.fp8_fp4_mega_moe`.
    """
    calls = bind_calls_fp8(y, l1_weights, l2_weights, sym_buffer, cumulative_local_expert_recv_stats, recipe,
                           activation, activation_clamp, fast_math, dispatch, check)
    chosen = ops.resolve_impl(impl, [c.sb for c in calls], dispatch, calls[0].n)
    if chosen == "staged":
        ops.run_steps(calls, pipeline_steps_fp8(dispatch), check)
        return
    from megamoe.fused import run_fused

    with ops.guarded_call(calls):
        run_fused(calls, numerics="exact")
        if check:
            for call in calls:
                ops.check_barrier_state(call.sb)


def pipeline_steps_fp8(dispatch: str) -> list[tuple[str, Callable]]:
    """:func:`megamoe.ops.pipeline_steps` with the L1 and L2 steps of this format."""
    swap = {"l1": _l1, "l2": _l2}
    return [(name, swap.get(name, step)) for name, step in ops.pipeline_steps(dispatch)]


def _gemm_launch(c, step: str, n_total: int):
    L, cfg = c.sb.layout, GEMM_CONFIG_FP8[step]
    grid = (ops._num_programs(L.num_max_pool_blocks * (n_total // cfg["BLOCK_N"]), c.sb.buffer.device,
                              cfg["programs_per_sm"]),)
    meta = dict(H=L.hidden, I=L.intermediate_hidden, BLOCK_N=cfg["BLOCK_N"], num_warps=cfg["num_warps"],
                num_stages=cfg["num_stages"], **ops._schedule_meta(L))
    return grid, meta


def _l1(c) -> None:
    grid, meta = _gemm_launch(c, "l1", c.sb.layout.intermediate_hidden)
    kg8.l1_swiglu_fp8_kernel[grid](
        c.sb.buffer, *c.l1, float(c.clamp) if c.clamp is not None else 0.0,
        **ops._offsets(c.sb, OFF_RECV="expert_recv_count", OFF_L1="l1_acts", OFF_L1_SF="l1_acts_sf",
                       OFF_L1_W="l1_topk_weights", OFF_L2="l2_acts", OFF_L2_SF="l2_acts_sf"),
        HAS_CLAMP=c.clamp is not None, F64_EXP=interpreting(), **meta)


def _l2(c) -> None:
    grid, meta = _gemm_launch(c, "l2", c.sb.layout.hidden)
    kg8.l2_combine_fp8_kernel[grid](
        c.sb.buffer, c.sb.buffer_ptrs, c.sb.rank, *c.l2,
        **ops._offsets(c.sb, OFF_RECV="expert_recv_count", OFF_L2="l2_acts", OFF_L2_SF="l2_acts_sf",
                       OFF_META="token_src_metadata", OFF_COMBINE="combine"),
        T=c.sb.layout.num_max_tokens_per_rank, **meta)


# ---------------------------------------------------------------------------------------------------- validation
def _check_recipe(recipe) -> None:
    if (not isinstance(recipe, (tuple, list)) or len(recipe) != 3
            or any(isinstance(v, bool) or not isinstance(v, numbers.Integral) for v in recipe)):
        raise TypeError(f"recipe must be a tuple of three ints (M, N, K scale granularity), got {recipe!r}")
    if tuple(recipe) != SM90_RECIPE:
        raise ValueError(f"recipe={tuple(recipe)} is not supported: fp8_mega_moe takes {SM90_RECIPE} (one fp32 scale "
                         "per token x 128 activation columns and per 128x128 weight block)")


def bind_calls_fp8(y, l1_weights, l2_weights, sym_buffer, stats, recipe, activation, clamp, fast_math, dispatch,
                   check) -> list[ops._RankCall]:
    """Validate the arguments of :func:`fp8_mega_moe` (positional, same meaning) before any kernel runs; one bound
    call per rank (see :func:`megamoe.ops.bind_calls`). Errors name the argument."""
    buffers, is_list = ops._check_buffers(sym_buffer)
    for i, sb in enumerate(buffers):
        if sb.layout.format != FORMAT:
            where = f"sym_buffer[{i}]" if is_list else "sym_buffer"
            raise ValueError(f"{where} was made for format {sb.layout.format!r} (fp8_fp4_mega_moe: packed UE8M0 "
                             f"scales); fp8_mega_moe needs SymmBuffer(..., format={FORMAT!r}) (float32 scales)")
    _check_recipe(recipe)
    if activation != "swiglu":
        raise ValueError(f"activation={activation!r}: only 'swiglu' is supported")
    if not isinstance(fast_math, bool):
        raise TypeError(f"fast_math must be a bool, got {type(fast_math).__name__}")
    if dispatch not in ("pull", "push"):
        raise ValueError(f"dispatch={dispatch!r} must be 'pull' or 'push'")
    if not isinstance(check, bool):
        raise TypeError(f"check must be a bool, got {type(check).__name__}")
    ops._check_clamp(clamp)
    n = len(buffers)
    calls = [ops._RankCall(sb, yy, a, b, s, clamp, f"[{i}]" if is_list else "")
             for i, (sb, yy, a, b, s) in enumerate(zip(
                 buffers, ops._as_list(y, "y", n, is_list), ops._as_list(l1_weights, "l1_weights", n, is_list),
                 ops._as_list(l2_weights, "l2_weights", n, is_list),
                 ops._as_list(stats, "cumulative_local_expert_recv_stats", n, is_list) if stats is not None
                 else [None] * n))]
    for c in calls:
        _validate(c)
    ops._check_no_aliasing(calls)
    if check:
        for c in calls:
            _check_inputs(c)
    return calls


def _check_weights(name: str, pair, role: str, El: int, n_rows: int, k: int, dev, L) -> None:
    if not isinstance(pair, TransformedWeightsSM90):
        from megamoe.quant import TransformedWeights

        if isinstance(pair, TransformedWeights):
            raise TypeError(f"{name} holds FP4 weights of the fp8_fp4 format (transform_weights_for_mega_moe); "
                            "fp8_mega_moe takes FP8 weights with 128x128 float32 block scales from "
                            "transform_weights_for_mega_moe_sm90")
        if isinstance(pair, (tuple, list)):
            raise TypeError(f"{name} is a plain {type(pair).__name__}, not the output of "
                            "megamoe.quant_fp8.transform_weights_for_mega_moe_sm90: its L1 rows must be interleaved "
                            f"and untransformed weights look the same. Pass {name[:2]} of "
                            "`l1, l2 = transform_weights_for_mega_moe_sm90(l1_fp8, l2_fp8)`")
        raise TypeError(f"{name} must be the TransformedWeightsSM90 (w, sf) returned by "
                        f"transform_weights_for_mega_moe_sm90, got {type(pair).__name__}")
    if pair.role != role:
        raise ValueError(f"{name} holds {pair.role} weights (role {pair.role!r}); l1_weights and l2_weights swapped?")
    w, sf = pair
    if isinstance(w, torch.Tensor) and w.dim() == 3 and w.shape[0] != El:
        raise ValueError(f"{name} holds {w.shape[0]} experts but the buffer has {El} experts per rank "
                         f"(num_experts={L.num_experts} over {L.num_ranks} ranks): mismatched world size?")
    ops._check_tensor(f"{name}[0]", w, torch.float8_e4m3fn, (El, n_rows, k), dev)
    ops._check_tensor(f"{name}[1]", sf, torch.float32, (El, n_rows // FP8_BLOCK, k // FP8_BLOCK), dev)
    if not (w.is_contiguous() and sf.is_contiguous()):
        raise ValueError(f"{name} must be contiguous (weights and block scales), as "
                         "transform_weights_for_mega_moe_sm90 returns them")


def _validate(c) -> None:
    L, dev = c.sb.layout, c.sb.buffer.device
    El, H, I, T = L.num_experts_per_rank, L.hidden, L.intermediate_hidden, L.num_max_tokens_per_rank
    y = f"y{c.index}"
    if not isinstance(c.y, torch.Tensor):
        raise TypeError(f"{y} must be a bf16 torch.Tensor [num_tokens, {H}], got {type(c.y).__name__}")
    if c.y.dim() != 2:
        raise ValueError(f"{y} must be a 2-D bf16 tensor [num_tokens, {H}], got shape {tuple(c.y.shape)}")
    if c.y.shape[0] > T:
        raise ValueError(f"{y} has {c.y.shape[0]} tokens, more than num_max_tokens_per_rank={T} of the buffer")
    ops._check_tensor(y, c.y, torch.bfloat16, (c.y.shape[0], H), dev)
    if not c.y.is_contiguous():
        raise ValueError(f"{y} must be contiguous, got strides {c.y.stride()}")
    _check_weights(f"l1_weights{c.index}", c.l1, "l1", El, 2 * I, H, dev, L)
    _check_weights(f"l2_weights{c.index}", c.l2, "l2", El, H, I, dev, L)
    if c.stats is not None:
        name = f"cumulative_local_expert_recv_stats{c.index}"
        ops._check_tensor(name, c.stats, torch.int32, (El,), dev)
        if not c.stats.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got stride {c.stats.stride()}")
    for step, extent in (("l1", I), ("l2", H)):
        block_n = GEMM_CONFIG_FP8[step]["BLOCK_N"]
        if extent % block_n or block_n % FP8_BLOCK:
            raise ValueError(f"GEMM_CONFIG_FP8[{step!r}]['BLOCK_N']={block_n} must be a multiple of {FP8_BLOCK} "
                             f"dividing the {step} N extent {extent}")


def _check_inputs(c) -> None:
    """``check=True``: the inputs in ``sym_buffer`` (first n rows) and the workspace marks, in one host sync."""
    L, sb, n = c.sb.layout, c.sb, c.n
    E = L.num_experts
    name = f"sym_buffer{c.index}"
    idx, w, sf = sb.topk_idx[:n], sb.topk_weights[:n], sb.x_sf[:n]
    x_bytes = sb.x[:n].view(torch.uint8)
    call_state, barrier_state = sb.view("call_state"), sb.view("barrier_state")
    s = idx.sort(dim=1).values
    dup_rows = ((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)).any(dim=1)
    bad_sf = ~(torch.isfinite(sf) & (sf > 0))
    nan_x = (x_bytes & ops.FP8_E4M3FN_NAN_BITS) == ops.FP8_E4M3FN_NAN_BITS
    flags = torch.stack([((idx < -1) | (idx >= E)).any(), dup_rows.any(), (~torch.isfinite(w) & (idx >= 0)).any(),
                         bad_sf.any(), nan_x.any(), call_state[0] != call_state[1], barrier_state[1] != 0]).tolist()
    if not any(flags):
        return
    bad_range, dup, bad_w, bad_scale, bad_x, unfinished, failed = flags
    if unfinished:
        begun, done = call_state.tolist()
        raise ops._state_error(sb, name, f"its workspace records {begun} calls begun but {done} completed: a call "
                               "never finished")
    if failed:
        _, tag, missing, _ = barrier_state.tolist()
        raise ops._state_error(sb, name, f"barrier tag {tag} timed out in an earlier call (rank {missing} never "
                               "arrived)")
    if bad_range:
        raise ValueError(f"topk_idx ({name}.topk_idx[:{n}]) holds expert ids in [{int(idx.min())}, "
                         f"{int(idx.max())}]; valid are -1 (masked) and 0..{E - 1}")
    if dup:
        t = int(dup_rows.nonzero()[0])
        raise ValueError(f"topk_idx ({name}.topk_idx[:{n}]) has a token ({t}: {idx[t].tolist()}) that selects the "
                         "same expert twice; a token's top-k experts must be distinct")
    if bad_w:
        t, j = (int(v) for v in (~torch.isfinite(w) & (idx >= 0)).nonzero()[0])
        raise ValueError(f"topk_weights ({name}.topk_weights[:{n}]) holds a non-finite weight at token {t}, slot {j}")
    if bad_scale:
        t, b = (int(v) for v in bad_sf.nonzero()[0])
        raise ValueError(f"x_sf ({name}.x_sf[:{n}]) holds the scale {float(sf[t, b])} at token {t}, column block "
                         f"{b}; float32 scales must be finite and > 0 (per_token_cast_to_fp8_128 gives amax/448 >= "
                         "1e-4/448)")
    if bad_x:
        t, h = (int(v) for v in nan_x.nonzero()[0])
        raise ValueError(f"x ({name}.x[:{n}]) holds an FP8 NaN (byte 0x{int(x_bytes[t, h]):02X}) at token {t}, "
                         f"column {h}; the activations must be finite")


def get_symm_buffer_for_mega_moe_sm90(group, num_experts: int, num_max_tokens_per_rank: int, num_topk: int,
                                      hidden: int, intermediate_hidden: int, **kwargs) -> SymmBuffer:
    """The ``fp8_mega_moe`` buffer: :func:`megamoe.symm.get_symm_buffer_for_mega_moe` with ``format="fp8"``
    (DeepGEMM's SM90 build picks the SM90 buffer from the architecture; here the format is explicit)."""
    from megamoe.symm import get_symm_buffer_for_mega_moe

    return get_symm_buffer_for_mega_moe(group, num_experts, num_max_tokens_per_rank, num_topk, hidden,
                                        intermediate_hidden, format=FORMAT, **kwargs)


__all__ = ["fp8_mega_moe", "bind_calls_fp8", "pipeline_steps_fp8", "GEMM_CONFIG_FP8",
           "get_symm_buffer_for_mega_moe_sm90"]
