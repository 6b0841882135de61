"""Seeded random configurations of the whole layer, for the fuzz tests (``tests/test_fuzz.py``, ``make fuzz``).

:func:`fuzz_cases` draws :class:`~megamoe.cases.MoECase` objects over ranks 1/2/4, top-k 1-6, block_m, routing
(uniform / skewed / all-to-one), masked slots, clamp, pull/push, hidden and intermediate sizes that are multiples of
128 but mostly not powers of two (384, 640, 1536, 7168), ranks with no tokens and one or two calls per buffer. Sizes
are drawn so that one case costs about a second under Triton's interpreter: large H or I only with 1-2 tokens.
Every case must reproduce :mod:`megamoe.reference` bit for bit on CPU.
"""
from __future__ import annotations

import random

from megamoe.cases import MoECase
from megamoe.testing import ROUTINGS

#: Sizes drawn for H and I in ordinary cases (multiples of 128; 384 and 640 are not powers of two).
SMALL_SIZES = (128, 256, 384, 640)
#: (H, I) of the rare large cases, run with 1-2 tokens per rank.
LARGE_SHAPES = ((7168, 128), (128, 1536), (1536, 128), (384, 1536))
RANKS = (1, 2, 4)
BLOCK_MS = (16, 32, 64, 128)
CLAMPS = (None, None, 0.5, 4.0)
MASKED_RATIOS = (0.0, 0.0, 0.3, 0.7)
MAX_TOPK = 6
MAX_TOKENS_PER_RANK = 48
#: Default largest :func:`interpreter_cost` of a drawn case (~2 s on one core under the interpreter, ~0.015 s/unit);
#: the large shapes (:data:`LARGE_SHAPES`) only fit budgets above ~600 (``make fuzz`` raises it).
MAX_COST = 130.0
#: Cost units of one call's fixed work per rank (launches, barriers, the small steps).
COST_PER_RANK_CALL = 10.0


def interpreter_cost(case: MoECase) -> float:
    """Rough cost of ``case`` under Triton's interpreter, in units of one 64x64 GEMM K-step of a tile: per pool
    block, L1 runs I/64 N-tiles x H/64 K-steps x 2 (gate, up) and L2 H/128 x I/64; the number of pool blocks is at
    most ``min(E, pairs) + pairs / block_m`` (pairs = sum of tokens x k)."""
    pairs = sum(case.tokens()) * case.num_topk
    blocks = min(case.num_experts, pairs) + pairs / case.block_m
    per_block = 2.5 * case.hidden * case.intermediate / 4096
    return case.num_calls * (case.num_ranks * COST_PER_RANK_CALL + blocks * per_block)


def fuzz_case(rng: random.Random, seed: int, max_cost: float = MAX_COST) -> MoECase:
    """One random case of :func:`interpreter_cost` at most ``max_cost``: the structure (ranks, experts, k, sizes,
    block_m, calls) is drawn first (again if even one token per rank would not fit), then the token counts within
    what is left; a rank may get none. ``seed`` seeds the case's problem (tokens, weights, routing)."""
    while True:
        num_ranks = rng.choice(RANKS)
        num_experts = num_ranks * rng.choice((1, 2, 3))
        num_topk = rng.randint(1, min(MAX_TOPK, num_experts))
        if rng.random() < 0.15:
            hidden, intermediate = rng.choice(LARGE_SHAPES)
        else:
            hidden, intermediate = rng.choice(SMALL_SIZES), rng.choice(SMALL_SIZES)
        block_m, num_calls = rng.choice(BLOCK_MS), rng.choice((1, 1, 2))
        per_block = 2.5 * hidden * intermediate / 4096
        left = max_cost / num_calls - num_ranks * COST_PER_RANK_CALL
        blocks = left / per_block  # pool blocks that fit: min(E, P) + P / block_m <= blocks
        max_pairs = int(min(num_experts, blocks / (1 + 1 / block_m))) if blocks > 0 else 0
        if blocks > num_experts:
            max_pairs = max(max_pairs, int((blocks - num_experts) * block_m))
        if max_pairs >= num_topk:
            break
    total = rng.randint(1, min(max_pairs // num_topk, MAX_TOKENS_PER_RANK * num_ranks))
    cuts = sorted(rng.randint(0, total) for _ in range(num_ranks - 1))
    tokens = [b - a for a, b in zip([0] + cuts, cuts + [total])]
    case = MoECase(num_ranks=num_ranks, num_tokens=tokens, hidden=hidden, intermediate=intermediate,
                   num_experts=num_experts, num_topk=num_topk, masked_ratio=rng.choice(MASKED_RATIOS),
                   routing=rng.choice(ROUTINGS), seed=seed, block_m=block_m, activation_clamp=rng.choice(CLAMPS),
                   dispatch=rng.choice(("pull", "push")), num_calls=num_calls,
                   num_max_tokens_per_rank=max(tokens) + rng.randint(0, 2) or 1)
    assert interpreter_cost(case) <= max_cost
    return case


def fuzz_cases(seed: int, count: int, max_cost: float = MAX_COST) -> list[MoECase]:
    """``count`` cases from ``seed`` (the same list every time for the same arguments)."""
    rng = random.Random(seed)
    return [fuzz_case(rng, seed * 100_003 + i, max_cost) for i in range(count)]


def describe(case: MoECase) -> str:
    """A short test id: ranks, tokens, E, k, H, I, block_m, routing, mask, clamp, dispatch, calls."""
    return (f"R{case.num_ranks}-n{'.'.join(map(str, case.tokens()))}-E{case.num_experts}-k{case.num_topk}"
            f"-H{case.hidden}-I{case.intermediate}-bm{case.block_m}-{case.routing}-m{case.masked_ratio}"
            f"-c{case.activation_clamp}-{case.dispatch}-x{case.num_calls}")
