"""End-to-end Mega MoE forward on CPU ranks (Triton interpreter) against megamoe.reference.

Tolerance: `megamoe.testing.assert_moe_close` (derivation in its docstring). In practice the kernels reproduce the
reference bit for bit on these sizes, which the `bitwise` fraction reported in failures makes visible.
"""
import pytest
import torch

from megamoe.cases import MoECase, expected_recv_counts, run_case, run_case_local
from megamoe.stepping import StagedRun


def _check(reports):
    for r in reports:
        assert not r["failures"], r
        assert r["recv_stats_ok"], r


# ------------------------------------------------------------------ local backend: N ranks in one process
@pytest.mark.parametrize("num_ranks,num_topk,num_experts", [(1, 1, 4), (1, 6, 8), (2, 2, 8), (2, 6, 8), (4, 6, 8),
                                                            (4, 1, 8)])
def test_local_ranks_topk(num_ranks, num_topk, num_experts):
    _check(run_case_local(MoECase(num_ranks=num_ranks, num_topk=num_topk, num_experts=num_experts, num_tokens=37)))


def test_masked_slots_and_a_rank_with_zero_tokens():
    reports = run_case_local(MoECase(num_ranks=2, num_tokens=[45, 0], num_topk=2, masked_ratio=0.3, seed=3))
    _check(reports)
    assert reports[1]["num_tokens"] == 0 and sum(reports[1]["recv_stats"]) > 0  # rank 1 still serves its experts


def test_every_token_on_one_expert_fills_the_worst_case_pool():
    # every token of both ranks sends min(k, El) pairs to rank 0; expert 0 receives them all
    reports = run_case_local(MoECase(num_ranks=2, num_tokens=48, num_topk=2, routing="one_expert"))
    _check(reports)
    assert reports[0]["recv_stats"][0] == 2 * 48 and sum(reports[1]["recv_stats"]) == 0


def test_tokens_not_a_multiple_of_block_m_and_clamp():
    _check(run_case_local(MoECase(num_ranks=2, num_tokens=[33, 7], num_topk=2, block_m=16, activation_clamp=0.25,
                                  seed=5)))


def test_two_consecutive_calls_reuse_the_buffer():
    # the stats double only if the workspace counters were cleaned in between (else recv counts would accumulate)
    _check(run_case_local(MoECase(num_ranks=2, num_tokens=[30, 19], num_topk=2, num_calls=2, masked_ratio=0.1)))


def test_pull_and_push_give_the_same_y():
    ys = {}
    for dispatch in ("pull", "push"):
        case = MoECase(num_ranks=2, num_tokens=[29, 13], num_topk=2, masked_ratio=0.2, dispatch=dispatch, seed=7)
        with StagedRun(case) as run:   # the same launches as fp8_fp4_mega_moe, keeping each rank's y
            run.run()
            assert not any(r["failures"] for r in run.compare_y())
            for rank, stats in enumerate(run.stats):
                assert torch.equal(stats.cpu(), expected_recv_counts(run.problem, rank))
            ys[dispatch] = [y.cpu().clone() for y in run.ys]
    for a, b in zip(ys["pull"], ys["push"], strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))   # bit for bit, NaN-poisoned rows included


# ------------------------------------------------------------------ cpu backend: one process per rank, /dev/shm
@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_process_ranks_over_shared_memory(world_size):
    case = MoECase(num_ranks=world_size, num_tokens=[21, 0, 17, 9][:world_size], num_topk=2, masked_ratio=0.2,
                   num_calls=2, seed=11)
    _check(run_case(case, backend="cpu"))   # one process per rank through megamoe.launch
