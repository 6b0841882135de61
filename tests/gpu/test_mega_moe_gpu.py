"""The CPU suite's cases on a GPU, plus DeepGEMM's real sizes (hidden 7168, intermediate 3072, 384 experts).

Run: `make test-gpu` (or `pytest tests/gpu -q -s` to see the error report lines).
"""
import pytest
import torch

from megamoe.cases import MoECase, assert_reports, run_case_local, run_case_rank
from megamoe.launch import launch

REAL = dict(hidden=7168, intermediate=3072, num_experts=384, num_topk=6, block_m=128)




@pytest.mark.parametrize("case", [
    MoECase(num_ranks=1, num_topk=1, num_experts=4, num_tokens=37),
    MoECase(num_ranks=2, num_topk=6, num_experts=8, num_tokens=[45, 0], masked_ratio=0.3),
    MoECase(num_ranks=4, num_topk=2, num_experts=8, num_tokens=[33, 7, 0, 12], block_m=16, activation_clamp=0.25),
    MoECase(num_ranks=2, num_topk=2, num_tokens=48, routing="one_expert", num_calls=2),
    MoECase(num_ranks=2, num_topk=2, num_tokens=[29, 13], masked_ratio=0.2, dispatch="push"),
], ids=["r1k1", "r2k6-mask-zero", "r4-bm16-clamp", "worst-pool-2calls", "push"])
def test_small_cases_local(case):
    assert_reports(run_case_local(case, device="cuda"), "small")


def test_real_size_one_rank():
    case = MoECase(num_ranks=1, num_tokens=1024, masked_ratio=0.1, num_calls=2, seed=1, **REAL)
    assert_reports([run_case_rank(0, 1, case)], "real r1")


def test_real_size_four_local_ranks():
    case = MoECase(num_ranks=4, num_tokens=[512, 0, 256, 77], masked_ratio=0.1, num_calls=2, seed=2, **REAL)
    assert_reports(run_case_local(case, device="cuda"), "real local4")


def test_real_size_push_equals_pull():
    out = {}
    for dispatch in ("pull", "push"):
        case = MoECase(num_ranks=4, num_tokens=128, dispatch=dispatch, seed=3, **REAL)
        out[dispatch] = run_case_local(case, device="cuda")
        assert_reports(out[dispatch], f"real local4 {dispatch}")
    assert [r["rel_fro"] for r in out["pull"]] == [r["rel_fro"] for r in out["push"]]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs >= 2 GPUs for one process per GPU")
def test_real_size_one_process_per_gpu():
    n = torch.cuda.device_count()
    case = MoECase(num_ranks=n, num_tokens=512, masked_ratio=0.1, num_calls=2, **REAL)
    assert_reports(launch(run_case_rank, n, case, backend="cuda"), f"real cuda x{n}")


@pytest.mark.skipif(torch.cuda.get_device_capability() != (9, 0), reason="the Hopper numerics are sm_90 only")
@pytest.mark.parametrize("numerics", ["hopper", "hopper_l2_per_block", "auto"])
def test_layer_wrapper_with_hopper_numerics(numerics):
    """``MegaMoE(..., numerics=..., check=False)``: the wrapper's calls run the fused kernel in that numerics (one EP8
    rank's share of V4-Pro at T = 128, twice), within the FP8-MMA tolerance of its reference model; the default
    ``"auto"`` resolves to the Hopper numerics here."""
    from megamoe.ops import AUTO_GPU_NUMERICS, MegaMoE
    from megamoe.symm import SymmBuffer
    from megamoe.testing import assert_moe_close

    case = MoECase(num_ranks=1, num_tokens=128, hidden=7168, intermediate=3072, num_experts=48, num_topk=6,
                   block_m=128, masked_ratio=0.1, seed=9)
    problem = case.problem(device="cuda")
    sb = SymmBuffer.local(1, 48, 128, 6, 7168, 3072, block_m=128, device="cuda")[0]
    try:
        layer = MegaMoE(sb, *problem.weights_for_rank(0), numerics=numerics, check=False)
        assert layer.resolved_numerics == (AUTO_GPU_NUMERICS if numerics == "auto" else numerics)
        ref = problem.reference(numerics=layer.resolved_numerics)[0]
        for _ in range(2):
            y = layer(problem.x_bf16[0], problem.topk_idx[0], problem.topk_weights[0])
            torch.cuda.synchronize()
            assert_moe_close(y, ref, accumulation="fp8_mma")
    finally:
        sb.destroy()
