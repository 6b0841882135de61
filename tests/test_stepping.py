"""megamoe.stepping on local CPU ranks: the staged pipeline driven one step at a time, the pool map read from the
kernels' schedule, per-step comparisons with the reference, and the per-step timer."""
import pytest
import torch

from megamoe.cases import MoECase, expected_recv_counts
from megamoe.kernels.pool import pool_schedule
from megamoe.stepping import StagedRun, stage_names, time_steps

CASE = dict(num_ranks=2, num_tokens=[13, 7], hidden=128, intermediate=128, num_experts=4, num_topk=2, block_m=16,
            masked_ratio=0.2, seed=3)


@pytest.mark.parametrize("recv,block_m", [([[3, 5, 0], [4, 0, 0], [0, 11, 1]], 4), ([[16, 1]], 16), ([[0, 0]], 8)])
def test_pool_schedule_pads_every_expert_to_whole_blocks_in_expert_order(recv, block_m):
    n, blocks, first = pool_schedule(torch.tensor(recv, dtype=torch.int64), block_m)
    assert n.tolist() == torch.tensor(recv).sum(0).tolist()
    for e in range(len(recv[0])):
        assert blocks[e] * block_m >= n[e] > (blocks[e] - 1) * block_m or n[e] == blocks[e] == 0
        assert first[e] == block_m * int(blocks[:e].sum())   # expert-major, no gaps


def test_pool_map_after_the_dispatch():
    with StagedRun(MoECase(**CASE)) as run:
        assert run.run("pull")[-1] == "pull" and run.next_step == "l1"
        for rank in range(run.case.num_ranks):
            pm = run.pool_map(rank)
            assert pm.n == expected_recv_counts(run.problem, rank).tolist()
            assert [sum(c[e] for c in pm.counts) for e in range(len(pm.n))] == pm.n
            assert int(pm.valid.sum()) == sum(pm.n) and pm.used_rows == run.layout.block_m * sum(pm.blocks)
            assert (pm.src_rank[~pm.valid] == -1).all() and (pm.src_rank[pm.valid] >= 0).all()
            for e in range(len(pm.n)):
                rows = pm.expert[pm.first_row[e]:pm.first_row[e] + pm.blocks[e] * pm.block_m]
                assert (rows == e).all()
                # round-robin over the source ranks: every prefix is balanced while both still have pairs
                order = pm.source_order(e)
                for j in range(len(order)):
                    seen = [order[:j].count(s) for s in range(run.case.num_ranks)]
                    left = [pm.counts[s][e] - seen[s] for s in range(run.case.num_ranks)]
                    busy = [seen[s] for s in range(run.case.num_ranks) if left[s] > 0]
                    assert not busy or max(busy) - min(busy) <= 1, (e, order)
            check = run.check_pool(rank)
            assert check["x rows equal"] == check["scale rows equal"] == check["weights equal"] == sum(pm.n)
            assert check["each expert holds exactly its pairs"]


def test_every_step_matches_the_reference_and_the_workspace_is_clean_after_the_call():
    with StagedRun(MoECase(**CASE)) as run:
        run.run("l1")
        for r in run.compare_l2_inputs():   # the interpreter accumulates in fp32 like the reference: bit-exact
            assert r["FP8 rows bit-exact"] == r["scale rows bit-exact"] == r["pool rows"] > 0, r
        run.run("l2")
        for r in run.compare_combine():
            assert r["bit-exact rows"] == r["valid (token, slot) rows"] > 0, r
        assert run.counters_are_zero() == [False, False]
        assert run.run()[-1] == run.steps[-1] and run.next_step is None
        assert all(r["bitwise equal"] and not r["failures"] for r in run.compare_y())
        assert run.counters_are_zero() == [True, True]
        with pytest.raises(RuntimeError, match="before the 'cleanup' step"):
            run.pool_map(0)


def test_a_step_runs_once_per_call_and_a_new_call_reuses_the_buffers():
    with StagedRun(MoECase(**CASE)) as run:
        run.run("publish")
        with pytest.raises(ValueError, match="already ran"):
            run.run("count")
        run.run()
        run.new_call()
        assert run.next_step == "count" and all(bool(y.isnan().all()) for y in run.ys)
        run.run()
        assert all(r["bitwise equal"] for r in run.compare_y())
        for rank, stats in enumerate(run.stats):   # cumulative over the two calls
            assert torch.equal(stats.cpu(), 2 * expected_recv_counts(run.problem, rank))


def test_time_steps_times_every_step_of_a_call():
    with StagedRun(MoECase(**CASE, dispatch="push")) as run:   # push: the other tests drive pull
        times = time_steps(run._calls, run._steps, repeats=2)
        assert list(times) == stage_names("push") == run.steps
        assert all(t > 0 for t in times.values())
        assert all(r["bitwise equal"] for r in run.compare_y())   # the timed calls computed the layer


def test_compare_steps_takes_the_widest_shared_step_and_sums_each_dispatch():
    """``megamoe.demos.pull_push.compare_steps``: the shared step whose pull and push times differ most, relative to the
    smaller, and each variant's own dispatch steps summed (push with its barrier 4)."""
    from megamoe.demos.pull_push import compare_steps

    pull = {"count": 100.0, "publish": 50.0, "pull": 30.0, "l1": 1000.0}
    push = {"count": 110.0, "publish": 60.0, "push": 20.0, "barrier4_arrive": 5.0, "barrier4_wait": 7.0, "l1": 1001.0}
    cmp = compare_steps(pull, push)
    assert cmp["worst"] == "publish" and abs(cmp["spread"] - 0.2) < 1e-12
    assert cmp["dispatch_us"] == {"pull": 30.0, "push": 32.0}
