"""Pull vs push dispatch: the same layer with ``dispatch="pull"`` (the expert's rank reads) and ``"push"`` (the
source rank writes), per-step times (:func:`megamoe.stepping.time_steps`) and each one's ``y`` (bit for bit)."""
from __future__ import annotations

import torch

from megamoe import ops
from megamoe.cases import MoECase, prepare_rank
from megamoe.harness import on_ranks
from megamoe.stepping import time_steps
from megamoe.symm import SymmBuffer


def _pull_push(calls_for, repeats: int) -> dict:
    """Per-step medians for pull and for push, and the outputs of one call each (``calls_for(dispatch)`` binds)."""
    out = {}
    for dispatch in ("pull", "push"):
        calls = calls_for(dispatch)
        steps = ops.pipeline_steps(dispatch)
        ops.run_steps(calls, steps, check=True)  # warm-up (compiles on GPU) and the output to compare
        out[f"y_{dispatch}"] = [c.y.cpu().clone() for c in calls]
        out[dispatch] = time_steps(calls, steps, repeats)
    return out


def pull_push_rank(rank: int, world_size: int, case: MoECase, repeats: int = 20) -> dict:
    """One process per rank: the layer with ``dispatch="pull"`` and ``"push"``; per-step times (us) and y of each."""
    sb = SymmBuffer(None, case.num_experts, case.max_tokens(), case.num_topk, case.hidden, case.intermediate,
                    block_m=case.block_m)
    try:
        problem = case.problem(device=sb.buffer.device)
        y, l1, l2, _ = prepare_rank(sb, problem, rank)
        out = _pull_push(lambda d: ops.bind_calls(y, l1, l2, sb, None, "swiglu", case.activation_clamp, d, False),
                        repeats)
        out["y_equal"] = bool(torch.equal(out["y_pull"][0].view(torch.int16), out["y_push"][0].view(torch.int16)))
        ref = problem.reference(activation_clamp=case.activation_clamp)[rank].cpu()
        out["y_matches_reference"] = bool(torch.equal(out["y_pull"][0].view(torch.int16), ref.view(torch.int16)))
        del out["y_pull"], out["y_push"]
        out["rank"] = rank
        return out
    finally:
        sb.destroy()


def pull_push_local(case: MoECase, repeats: int = 20) -> dict:
    """All ranks in this process (``local``): per-step times of pull and push and whether every rank's y agrees."""
    sbs = SymmBuffer.local(case.num_ranks, case.num_experts, case.max_tokens(), case.num_topk, case.hidden,
                           case.intermediate, block_m=case.block_m)
    try:
        problem = case.problem(device=sbs[0].buffer.device)
        ys, l1s, l2s, _ = (list(t) for t in zip(*[prepare_rank(sb, problem, r) for r, sb in enumerate(sbs)]))
        out = _pull_push(lambda d: ops.bind_calls(ys, l1s, l2s, sbs, None, "swiglu", case.activation_clamp, d, False),
                        repeats)
        out["y_equal"] = all(torch.equal(a.view(torch.int16), b.view(torch.int16))
                             for a, b in zip(out["y_pull"], out["y_push"]))
        refs = problem.reference(activation_clamp=case.activation_clamp)
        out["y_matches_reference"] = all(torch.equal(a.view(torch.int16), r.cpu().view(torch.int16))
                                         for a, r in zip(out["y_pull"], refs))
        del out["y_pull"], out["y_push"]
        return out
    finally:
        for sb in sbs:
            sb.destroy()


def pull_push_timing(case: MoECase, backend: str = "auto", repeats: int = 20) -> list[dict]:
    """:func:`pull_push_rank` on every rank (``cuda``/``cpu``), or :func:`pull_push_local` as one entry (``local``)."""
    return on_ranks(pull_push_rank, pull_push_local, case.num_ranks, case, repeats, backend=backend)
