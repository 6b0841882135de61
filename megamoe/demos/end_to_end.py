"""The whole layer, end to end: a grid of cases against the reference, and the ``MegaMoE`` module on ranks."""
from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from megamoe.cases import MoECase, expected_recv_counts, run_case_local
from megamoe.symm import SymmBuffer
from megamoe.testing import check_stats, default_accumulation, moe_error_stats


def correctness_grid(cases: Sequence[MoECase], device=None) -> list[dict]:
    """Run each case on ``local`` ranks (``megamoe.run_case_local``) and summarise it as one table row."""
    rows = []
    for case in cases:
        t0 = time.perf_counter()
        reports = run_case_local(case, device=device)
        rows.append({"ranks": case.num_ranks, "top-k": case.num_topk, "masked": case.masked_ratio,
                     "routing": case.routing, "tokens/rank": str(case.tokens()),
                     "pairs": sum(sum(r["recv_stats"]) for r in reports),
                     "max rel_fro": max(r["rel_fro"] for r in reports),
                     "within tolerance": all(not r["failures"] for r in reports),
                     "bitwise equal": all(r["bitwise_equal"] for r in reports),
                     "recv stats ok": all(r["recv_stats_ok"] for r in reports),
                     "seconds": round(time.perf_counter() - t0, 1)})
    return rows


def megamoe_layer_rank(rank: int, world_size: int, case: MoECase, num_calls: int = 2) -> dict:
    """One process per rank: build ``MegaMoE`` from untransformed FP4 weights, call it on bf16 activations
    ``num_calls`` times and compare every output with the reference in the numerics it runs (the module quantises x
    itself; on a GPU the default numerics is "hopper_l2_per_block", on CPU ranks "exact")."""
    from megamoe.ops import MegaMoE

    sb = SymmBuffer(None, case.num_experts, case.max_tokens(), case.num_topk, case.hidden, case.intermediate,
                    block_m=case.block_m)
    try:
        dev = sb.buffer.device
        problem = case.problem(device=dev)
        l1, l2 = problem.weights_for_rank(rank)
        layer = MegaMoE(sb, l1, l2, activation_clamp=case.activation_clamp)
        stats = torch.zeros(problem.num_local_experts, dtype=torch.int32, device=dev)
        # the default numerics="auto" runs a Hopper numerics on a GPU's fused path, "exact" on CPU ranks: compare
        # with the reference in the numerics the layer runs
        ref = problem.reference(activation_clamp=case.activation_clamp,
                                numerics=layer.resolved_numerics)[rank].cpu()
        bitwise, errors, failures = [], [], []
        for _ in range(num_calls):
            y = layer(problem.x_bf16[rank], problem.topk_idx[rank], problem.topk_weights[rank], stats)
            s = moe_error_stats(y.cpu(), ref)
            bitwise.append(bool(torch.equal(y.cpu().view(torch.int16), ref.view(torch.int16))))
            errors.append(s["rel_fro"])
            failures += check_stats(s, default_accumulation(dev))
        expected = expected_recv_counts(problem, rank) * num_calls
        return {"rank": rank, "tokens": problem.num_tokens[rank], "rel_fro per call": errors,
                "bitwise equal per call": bitwise, "failures": failures, "recv stats": stats.cpu().tolist(),
                "recv stats ok": bool(torch.equal(stats.cpu(), expected))}
    finally:
        sb.destroy()

