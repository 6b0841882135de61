"""The fused kernel on a GPU: against its numerics model (``numerics="hopper"``) at small and real sizes, on one rank
and on 4 local ranks in one launch, skew and masks, repeated calls, CUDA-graph capture and replay, the timeline,
and a rank that never arrives (named by the timeout) or arrives late but alive (waited for)."""
import pytest
import torch

from megamoe.cases import MoECase, assert_reports, prepare_rank, run_case_local
from megamoe.fused import TIMELINE_KINDS, run_fused
from megamoe.kernels.symm import BarrierTimeout, check_barrier_state
from megamoe.ops import bind_calls, fp8_fp4_mega_moe
from megamoe.symm import SymmBuffer
from megamoe.testing import assert_cuda_graph_replays, assert_moe_close

REAL = dict(hidden=7168, intermediate=3072, num_experts=384, num_topk=6, block_m=128)

pytestmark = pytest.mark.skipif(torch.cuda.get_device_capability() < (9, 0), reason="the fused kernel needs sm_90")




@pytest.mark.parametrize("case", [
    MoECase(num_ranks=1, num_topk=1, num_experts=4, num_tokens=37),
    MoECase(num_ranks=2, num_topk=6, num_experts=8, num_tokens=[45, 0], masked_ratio=0.3),
    MoECase(num_ranks=4, num_topk=2, num_experts=8, num_tokens=[33, 7, 0, 12], block_m=16, activation_clamp=0.25),
    MoECase(num_ranks=2, num_topk=2, num_tokens=48, routing="one_expert", num_calls=3),
    MoECase(num_ranks=2, num_topk=3, num_tokens=[29, 13], hidden=384, intermediate=640, routing="skewed"),
], ids=["r1k1", "r2k6-mask-zero", "r4-bm16-clamp", "worst-pool-3calls", "r2-h384-i640-skew"])
@pytest.mark.parametrize("numerics", ["exact", "hopper"])
def test_fused_small_cases(case, numerics):
    case.impl, case.numerics = "fused", numerics
    assert_reports(run_case_local(case, device="cuda"), f"fused {numerics} small")


@pytest.mark.parametrize("numerics", ["exact", "hopper"])
def test_fused_real_size_one_rank(numerics):
    case = MoECase(num_ranks=1, num_tokens=1024, masked_ratio=0.1, num_calls=2, seed=1, impl="fused",
                   numerics=numerics, **REAL)
    assert_reports(run_case_local(case, device="cuda"), f"fused {numerics} real r1")


@pytest.mark.parametrize("numerics", ["exact", "hopper"])
def test_fused_real_size_four_local_ranks_skewed(numerics):
    case = MoECase(num_ranks=4, num_tokens=[512, 0, 256, 77], masked_ratio=0.1, num_calls=2, seed=2,
                   routing="skewed", impl="fused", numerics=numerics, **REAL)
    assert_reports(run_case_local(case, device="cuda"), f"fused {numerics} real local4 skew")


def _one_rank(n=64, **kw):
    case = MoECase(num_ranks=1, num_tokens=n, hidden=1024, intermediate=512, num_experts=16, num_topk=4, **kw)
    sb = SymmBuffer.local(1, case.num_experts, n, case.num_topk, case.hidden, case.intermediate, block_m=64,
                          device="cuda")[0]
    problem = case.problem(device="cuda")
    return case, sb, problem, prepare_rank(sb, problem, 0)


@pytest.mark.parametrize("numerics", ["exact", "hopper"])
def test_fused_cuda_graph_capture_and_replay(numerics):
    case, sb, problem, (y, l1, l2, stats) = _one_rank()
    ref = problem.reference(numerics=numerics)[0]
    assert_cuda_graph_replays(lambda: fp8_fp4_mega_moe(y, l1, l2, sb, impl="fused", numerics=numerics, check=False),
                              y, ref)
    check_barrier_state(sb)
    sb.destroy()


def test_fused_timeline_has_every_phase():
    case, sb, problem, (y, l1, l2, stats) = _one_rank()
    calls = bind_calls(y, l1, l2, sb, None, "swiglu", None, "pull", True)
    (events,) = run_fused(calls, numerics="hopper", timeline=True)
    torch.cuda.synchronize()
    kinds = set(events[..., 0][events[..., 0] >= 0].tolist())
    assert {TIMELINE_KINDS.index(k) for k in ("count", "barrier1", "pull", "l1", "l2", "combine")} <= kinds, kinds
    valid = events[events[..., 0] >= 0]
    assert bool((valid[:, 2] >= valid[:, 1]).all())
    assert_moe_close(y, problem.reference(numerics="hopper")[0], accumulation="fp8_mma")
    sb.destroy()


def test_fused_rank_that_never_arrives_is_named():
    """Two local ranks, but only rank 0's programs are launched: barrier 1 must time out naming rank 1."""
    case = MoECase(num_ranks=2, num_tokens=16)
    sbs = SymmBuffer.local(2, case.num_experts, 16, case.num_topk, case.hidden, case.intermediate, block_m=32,
                           device="cuda", barrier_timeout_s=1.0)
    problem = case.problem(device="cuda")
    prepared = [prepare_rank(sb, problem, r) for r, sb in enumerate(sbs)]
    ys, l1s, l2s, _ = (list(t) for t in zip(*prepared))
    calls = bind_calls(ys, l1s, l2s, sbs, None, "swiglu", None, "pull", True)
    run_fused(calls[:1])
    with pytest.raises(BarrierTimeout) as info:
        check_barrier_state(sbs[0])
    assert info.value.tag == 1 and info.value.missing_rank == 1
    for sb in sbs:
        sb.destroy()


def test_fused_slow_but_live_rank_is_not_named():
    """Two local ranks; every pair goes to rank 0's experts ("one_expert" routing), so rank 1 has no task and waits
    in barrier 2 for rank 0 many times ``barrier_timeout_s`` while rank 0's heartbeat moves. The call must succeed:
    a live rank is waited for however slow, and the programs of rank 1 parked in the grid sync behind that barrier
    hold their clock meanwhile (without the hold they would time out there: TAG_INTERNAL_WAIT)."""
    timeout_s = 0.002
    case = MoECase(num_ranks=2, num_tokens=4096, routing="one_expert", hidden=7168, intermediate=3072,
                   num_experts=16, num_topk=6)
    sbs = SymmBuffer.local(2, case.num_experts, 4096, case.num_topk, case.hidden, case.intermediate, block_m=128,
                           device="cuda", barrier_timeout_s=timeout_s)
    problem = case.problem(device="cuda")
    prepared = [prepare_rank(sb, problem, r) for r, sb in enumerate(sbs)]
    ys, l1s, l2s, _ = (list(t) for t in zip(*prepared))
    # "exact" (the staged tiles in the one launch): long enough for rank 1 to outlast the timeout many times
    fp8_fp4_mega_moe(ys, l1s, l2s, sbs, impl="fused", numerics="exact")  # warm-up; BarrierTimeout on a failure
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fp8_fp4_mega_moe(ys, l1s, l2s, sbs, impl="fused", numerics="exact")
    end.record()
    torch.cuda.synchronize()
    # The test means something only if rank 1 really waited longer than the timeout.
    assert start.elapsed_time(end) / 1e3 > 5 * timeout_s, "the case is too small to outlast the barrier timeout"
    for y, ref in zip(ys, problem.reference()):
        assert_moe_close(y, ref, accumulation="fp8_mma")
    for sb in sbs:
        sb.destroy()
