"""Per-rank programs of the SM90 FP8 x FP8 format (``fp8_mega_moe``): :class:`megamoe.cases.MoECase` run end to
end in the ``"fp8"`` format and checked against :func:`megamoe.reference.reference_fp8_mega_moe_ep`."""
from __future__ import annotations

import torch

from megamoe.cases import MoECase, _report, _timed_calls
from megamoe.ops import load_inputs
from megamoe.ops_fp8 import fp8_mega_moe
from megamoe.quant_fp8 import transform_weights_for_mega_moe_sm90
from megamoe.symm import SymmBuffer
from megamoe.testing_fp8 import Fp8Problem, make_fp8_problem


def fp8_problem(case: MoECase, device="cpu") -> Fp8Problem:
    return make_fp8_problem(case.num_ranks, case.tokens(), case.hidden, case.intermediate, case.num_experts,
                            case.num_topk, masked_ratio=case.masked_ratio, routing=case.routing, seed=case.seed,
                            device=device)


def prepare_rank_fp8(sb: SymmBuffer, problem: Fp8Problem, rank: int):
    """Load ``rank``'s inputs into ``sb``; ``(y, l1, l2, stats)`` with NaN-poisoned ``y`` and transformed weights."""
    dev = sb.buffer.device
    load_inputs(sb, problem.x[rank], problem.x_sf[rank], problem.topk_idx[rank], problem.topk_weights[rank])
    l1, l2 = problem.weights_for_rank(rank)
    l1, l2 = transform_weights_for_mega_moe_sm90(tuple(t.to(dev) for t in l1), tuple(t.to(dev) for t in l2))
    y = torch.full((problem.num_tokens[rank], problem.hidden), float("nan"), dtype=torch.bfloat16, device=dev)
    stats = torch.zeros(problem.num_local_experts, dtype=torch.int32, device=dev)
    return y, l1, l2, stats


def run_fp8_case_local(case: MoECase, device=None) -> list[dict]:
    """All ranks in this process (``local`` backend) in the ``"fp8"`` format; one report per rank (as
    :func:`megamoe.cases.run_case_local`; ``case.impl`` picks the path, ``case.numerics`` is not used)."""
    sbs = SymmBuffer.local(case.num_ranks, case.num_experts, case.max_tokens(), case.num_topk, case.hidden,
                           case.intermediate, block_m=case.block_m, device=device, format="fp8")
    try:
        problem = fp8_problem(case, device=sbs[0].buffer.device)
        ys, l1s, l2s, stats = (list(t) for t in zip(*[prepare_rank_fp8(sb, problem, r) for r, sb in enumerate(sbs)]))
        seconds = _timed_calls(case, ys, lambda: fp8_mega_moe(
            ys, l1s, l2s, sbs, stats, activation_clamp=case.activation_clamp, dispatch=case.dispatch, impl=case.impl))
        refs = problem.reference(activation_clamp=case.activation_clamp)
        return [_report(case, problem, r, ys[r], refs[r], stats[r], seconds, "fp8") for r in range(case.num_ranks)]
    finally:
        for sb in sbs:
            sb.destroy()


def run_fp8_case_rank(rank: int, world_size: int, case: MoECase) -> dict:
    """This rank's part of ``case`` in the ``"fp8"`` format, one process per rank (through ``megamoe.launch``)."""
    if world_size != case.num_ranks:
        raise ValueError(f"world_size={world_size} does not match case.num_ranks={case.num_ranks}")
    sb = SymmBuffer(None, case.num_experts, case.max_tokens(), case.num_topk, case.hidden, case.intermediate,
                    block_m=case.block_m, format="fp8")
    try:
        problem = fp8_problem(case, device=sb.buffer.device)
        y, l1, l2, stats = prepare_rank_fp8(sb, problem, rank)
        seconds = _timed_calls(case, [y], lambda: fp8_mega_moe(
            y, l1, l2, sb, stats, activation_clamp=case.activation_clamp, dispatch=case.dispatch, impl=case.impl))
        ref = problem.reference(activation_clamp=case.activation_clamp)[rank]
        return _report(case, problem, rank, y, ref, stats, seconds, "fp8")
    finally:
        sb.destroy()
