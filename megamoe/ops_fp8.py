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
with the staged path (``tests/test_fp8_mega_moe.py``); on an H200 both paths, both tile kinds included, pass
``tests/gpu/test_fp8_gpu.py``, and ``python -m megamoe.bench --suite layer_fp8`` times them beside DeepGEMM's kernel.

The buffer must have been made for this format: ``SymmBuffer(..., format="fp8")`` (or ``mma_type="fp8xfp8"``), whose
``x_sf`` view is float32 ``[T, H/128]``.
"""
from __future__ import annotations

import numbers
from typing import Callable

from megamoe import ops
from megamoe.kernels import gemm_fp8 as kg8
from megamoe.quant_fp8 import FORMAT, FP8_BLOCK, SM90_RECIPE
from megamoe.symm import SymmBuffer
from megamoe.validation import FP8

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
            [El, 2I/128, H/128])`` from :func:`~megamoe.quant_fp8.transform_weights_for_mega_moe_sm90` (rows
            interleaved, bytes blocked by 128 x 128); plain tuples are rejected (transformed and untransformed
            weights have the same shapes).
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
        impl: as :func:`megamoe.ops.fp8_fp4_mega_moe`: ``"staged"``, ``"fused"`` (on a Hopper GPU: one persistent
            launch running this format's swap-AB tiles inside ``megamoe.kernels.fused``'s task loop up to 32
            expected tokens per expert; above, a front launch, the GEMMs as one warp-specialised Gluon launch
            (``megamoe.kernels.gemm_fp8_ws``) and a back launch; see ``megamoe.fused.tile_kind``) or
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

    with ops.guarded_call(calls, kernel_marks_calls=True):
        run_fused(calls, numerics="exact")
        if check:
            for call in calls:
                ops.check_barrier_state(call.sb)


def pipeline_steps_fp8(dispatch: str) -> list[tuple[str, Callable]]:
    """:func:`megamoe.ops.pipeline_steps` with the L1 and L2 steps of this format."""
    swap = {"l1": _l1, "l2": _l2}
    return [(name, swap.get(name, step)) for name, step in ops.pipeline_steps(dispatch)]


_l1, _l2 = ops.gemm_steps(kg8.l1_swiglu_fp8_kernel, kg8.l2_combine_fp8_kernel, GEMM_CONFIG_FP8)


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
    call per rank (:func:`megamoe.ops.bind_calls` with this format, :data:`megamoe.validation.FP8`). Errors name
    the argument."""
    _check_recipe(recipe)
    if not isinstance(fast_math, bool):
        raise TypeError(f"fast_math must be a bool, got {type(fast_math).__name__}")
    return ops.bind_calls(y, l1_weights, l2_weights, sym_buffer, stats, activation, clamp, dispatch, check,
                          fmt=FP8, gemm_config=GEMM_CONFIG_FP8, config_name="GEMM_CONFIG_FP8",
                          block_n_multiple=FP8_BLOCK)


def get_symm_buffer_for_mega_moe_sm90(group, num_experts: int, num_max_tokens_per_rank: int, num_topk: int,
                                      hidden: int, intermediate_hidden: int, **kwargs) -> SymmBuffer:
    """The ``fp8_mega_moe`` buffer: :func:`megamoe.symm.get_symm_buffer_for_mega_moe` with ``format="fp8"``
    (DeepGEMM's SM90 build picks the SM90 buffer from the architecture; here the format is explicit)."""
    from megamoe.symm import get_symm_buffer_for_mega_moe

    return get_symm_buffer_for_mega_moe(group, num_experts, num_max_tokens_per_rank, num_topk, hidden,
                                        intermediate_hidden, format=FORMAT, **kwargs)


__all__ = ["fp8_mega_moe", "bind_calls_fp8", "pipeline_steps_fp8", "GEMM_CONFIG_FP8",
           "get_symm_buffer_for_mega_moe_sm90"]
