"""Pull vs push dispatch: the same layer with ``dispatch="pull"`` (the expert's rank reads) and ``"push"`` (the
source rank writes), per-step times (:func:`megamoe.stepping.time_steps`) and each one's ``y`` (bit for bit)."""
from __future__ import annotations

import torch

from megamoe import ops
from megamoe.cases import MoECase, prepare_rank
from megamoe.harness import on_ranks
from megamoe.stepping import time_steps
from megamoe.symm import SymmBuffer

#: Steps that pull and push run alike: how far their two times differ is the per-step timing's noise floor.
SHARED_STEPS = ("count", "publish", "l1", "l2", "combine", "cleanup")
#: Each variant's own dispatch steps (push also needs barrier 4 before the owner's GEMM reads its pool).
DISPATCH_STEPS = {"pull": ("pull",), "push": ("push", "barrier4_arrive", "barrier4_wait")}


def compare_steps(pull: dict, push: dict) -> dict:
    """Per-step medians in us of one pull and one push call (``time_steps``' dicts): the shared step whose two times
    differ most (``worst``) and by how much, relative to the smaller (``spread``), and each variant's dispatch steps
    summed (``dispatch_us``: {"pull": .., "push": ..})."""
    shared = [s for s in SHARED_STEPS if s in pull and s in push]
    rel = {s: abs(pull[s] - push[s]) / min(pull[s], push[s]) for s in shared}
    worst = max(rel, key=rel.get)
    steps = {"pull": pull, "push": push}
    return {"worst": worst, "spread": rel[worst],
            "dispatch_us": {d: sum(steps[d].get(s, 0.0) for s in names) for d, names in DISPATCH_STEPS.items()}}


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
