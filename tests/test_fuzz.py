"""Seeded fuzz of the whole layer against ``megamoe.reference``, bit for bit, on CPU ranks.

``make test`` runs ``MEGAMOE_FUZZ_COUNT`` (default 20) random cases of seed ``MEGAMOE_FUZZ_SEED`` (default 0), each
of interpreter cost at most ``MEGAMOE_FUZZ_MAX_COST`` (default ``megamoe.fuzz.MAX_COST``, ~2 s), plus fixed anchors
(H = 384, 640, 7168 and I = 1536 at one token) and one cpu-process case; ``make fuzz`` runs hundreds with larger
cases (see the Makefile). A failing case's id lists its configuration (``megamoe.fuzz.describe``).
"""
import os

import pytest

from megamoe.cases import MoECase, run_case_local, run_case_rank
from megamoe.fuzz import MAX_COST, describe, fuzz_cases
from megamoe.launch import launch

COUNT = int(os.environ.get("MEGAMOE_FUZZ_COUNT", "20"))
SEED = int(os.environ.get("MEGAMOE_FUZZ_SEED", "0"))
#: Largest interpreter cost of a random case (``megamoe.fuzz.interpreter_cost``); ``make fuzz`` raises it so that the
#: large shapes (H 7168, I 1536) are drawn too.
MAX_CASE_COST = float(os.environ.get("MEGAMOE_FUZZ_MAX_COST", str(MAX_COST)))

#: Always run: every hidden size of the issue that is a multiple of 128 but not a power of two, and I = 1536.
ANCHORS = [
    MoECase(num_ranks=1, num_tokens=1, hidden=384, intermediate=128, num_experts=2, num_topk=1, block_m=16),
    MoECase(num_ranks=1, num_tokens=1, hidden=7168, intermediate=128, num_experts=2, num_topk=1, block_m=16, seed=1),
    MoECase(num_ranks=2, num_tokens=[1, 1], hidden=640, intermediate=128, num_experts=4, num_topk=1, block_m=16,
            seed=2, dispatch="push", activation_clamp=0.5),
    MoECase(num_ranks=1, num_tokens=1, hidden=128, intermediate=1536, num_experts=2, num_topk=1, block_m=16, seed=3),
]
CASES = ANCHORS + fuzz_cases(SEED, COUNT, MAX_CASE_COST)


def _check(reports, case):
    for r in reports:
        assert r["bitwise_equal"], (describe(case), r)
        assert r["recv_stats_ok"], (describe(case), r)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[describe(c) for c in CASES])
def test_fuzz_local_bit_exact(case):
    _check(run_case_local(case), case)


@pytest.mark.slow
def test_fuzz_cpu_processes_bit_exact():
    """One process per rank (cpu backend, /dev/shm): non-power-of-two H and I, masks, skewed routing, two calls."""
    case = MoECase(num_ranks=2, num_tokens=[3, 2], hidden=384, intermediate=128, num_experts=4, num_topk=3,
                   masked_ratio=0.3, routing="skewed", block_m=16, seed=17, num_calls=2)
    _check(launch(run_case_rank, 2, case, backend="cpu", timeout_s=300), case)
