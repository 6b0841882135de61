"""``fp8_mega_moe`` (the SM90 FP8 x FP8 format) on a GPU, staged and fused, against
``megamoe.reference.reference_fp8_mega_moe_ep`` within the FP8-MMA tolerance profile: small cases on 1, 2 and 4
local ranks (masks, an empty rank, clamp, skew, repeated calls) and the real size on one rank (384 experts)."""
import pytest
import torch

from megamoe.cases import MoECase, assert_reports, gluon_phase_cases, run_case_local

pytestmark = pytest.mark.skipif(torch.cuda.get_device_capability() < (9, 0), reason="the fused kernel needs sm_90")

REAL = dict(hidden=7168, intermediate=3072, num_experts=384, num_topk=6, block_m=128)


@pytest.mark.parametrize("case", [
    MoECase(format="fp8", num_ranks=1, num_topk=2, num_experts=4, num_tokens=37),
    MoECase(format="fp8", num_ranks=2, num_topk=6, num_experts=8, num_tokens=[45, 0], masked_ratio=0.3),
    MoECase(format="fp8",
            num_ranks=4, num_topk=2, num_experts=8, num_tokens=[33, 7, 0, 12], block_m=16, activation_clamp=0.25),
    MoECase(format="fp8", num_ranks=2, num_topk=3, num_tokens=[29, 13], hidden=384, intermediate=256, routing="skewed",
            num_calls=3),
], ids=["r1", "r2k6-mask-zero", "r4-bm16-clamp", "r2-h384-i256-skew-3calls"])
@pytest.mark.parametrize("impl", ["staged", "fused"])
def test_fp8_small_cases(case, impl):
    case.impl = impl
    assert_reports(run_case_local(case, device="cuda"), f"fp8 {impl} small")


@pytest.mark.parametrize("num_tokens", [128, 1024, 4096], ids=["t128-swap", "t1024-ws64", "t4096-ws128"])
@pytest.mark.parametrize("impl", ["staged", "fused"])
def test_fp8_real_size_one_rank(impl, num_tokens):
    """One rank of 384 experts, top-6: 2 / 16 / 64 expected tokens per expert, so the fused path runs its swap-AB
    tiles / the Gluon GEMM phase's 64-row / 128-row tiles (``megamoe.fused.fused_config``; the kind is asserted);
    the small cases above cover the swap-AB tiles
    at block 32 (r1, r2-h384) and the one-launch staged-tile kernel at block 16 / 32 (r4, r2k6: pools of block_m
    < 128, where the Gluon phase cannot run)."""
    import megamoe.fused as mf

    case = MoECase(format="fp8",
                   num_ranks=1, num_tokens=num_tokens, masked_ratio=0.1, num_calls=2, seed=1, impl=impl, **REAL)
    cfg = mf.fused_config(case.layout(), num_tokens, 1, torch.device("cuda"))
    assert (cfg.kind, cfg.block_m) == {128: ("fp8_swap", 32), 1024: ("fp8_ws", 64), 4096: ("fp8_ws", 128)}[num_tokens]
    assert_reports(run_case_local(case, device="cuda"), f"fp8 {impl} real r1")


# ------------------------------------------------------------------ the Gluon GEMM phase ("fp8_ws")
WS = dict(format="fp8", block_m=128)
WS_CASES = gluon_phase_cases(**WS) + [
    MoECase(num_ranks=2, num_topk=2, num_experts=8, num_tokens=[100, 40], masked_ratio=0.2, activation_clamp=0.3,
            hidden=512, intermediate=384, num_calls=2, **WS),  # 50 expected tokens per expert (block 64: below)
]



def _force_ws(monkeypatch):
    """Take the Gluon GEMM phase whatever the expected tokens per expert (it needs the pool's block_m of 128)."""
    import megamoe.fused as mf

    monkeypatch.setattr(mf, "FP8_WS_MIN_EXPECTED", -1)


@pytest.mark.parametrize("case", WS_CASES, ids=["r1-300", "r2k6-mask-zero", "r4-clamp-i640", "r2-skew-3calls",
                                                "r2-bm64-clamp"])
def test_fp8_ws_small_cases(case, monkeypatch):
    """The front launch / Gluon GEMM phase / back launch ("fp8_ws") on 1, 2 and 4 local ranks: several pool blocks
    per expert, partial blocks, masks, an empty rank, clamp, I / 128 odd (5 L1 tiles a block), skew, repeated calls."""
    _force_ws(monkeypatch)
    import megamoe.fused as mf

    assert mf.fused_config(case.layout(), 300, case.num_ranks, torch.device("cuda")).kind == "fp8_ws"
    case.impl = "fused"
    assert_reports(run_case_local(case, device="cuda"), "fp8 fused (Gluon GEMM phase) small")


def test_fp8_ws_block64_forced(monkeypatch):
    """The 64-row tile (``_math_partition_m64``: both math warpgroups on one block, the row maxima exchanged through
    shared memory), which ``fused_config`` no longer picks by default (``FP8_WS_BLOCK64_MAX_EXPECTED``): forced, on the
    last small case (2 ranks, masks, clamp, 2 calls)."""
    _force_ws(monkeypatch)
    import megamoe.fused as mf

    monkeypatch.setattr(mf, "FP8_WS_BLOCK64_MAX_EXPECTED", float("inf"))
    case = WS_CASES[-1]
    cfg = mf.fused_config(case.layout(), 100, case.num_ranks, torch.device("cuda"))
    assert (cfg.kind, cfg.block_m) == ("fp8_ws", 64)
    case.impl = "fused"
    assert_reports(run_case_local(case, device="cuda"), "fp8 fused (Gluon GEMM phase, 64-row tile) small")


@pytest.mark.parametrize("num_ranks,num_tokens", [(1, [8192]), (4, [4096, 0, 2048, 77])], ids=["r1-t8192", "r4-skew"])
def test_fp8_ws_real_size(num_ranks, num_tokens):
    """Real size, chosen by ``fused_config`` (128 / 64 expected tokens per expert on rank 0 > FP8_WS_MIN_EXPECTED)."""
    import megamoe.fused as mf

    case = MoECase(format="fp8", num_ranks=num_ranks, num_tokens=num_tokens, masked_ratio=0.1, num_calls=2, seed=3,
                   routing="skewed" if num_ranks > 1 else "uniform", impl="fused", **REAL)
    assert mf.fused_config(case.layout(), num_tokens[0], num_ranks, torch.device("cuda")).kind == "fp8_ws"
    assert_reports(run_case_local(case, device="cuda"), f"fp8 fused (Gluon GEMM phase) real r{num_ranks}")


@pytest.mark.parametrize("num_tokens,kind", [(16, "fp8_swap"), (2048, "fp8_ws")], ids=["swap", "ws"])
def test_fp8_fused_cuda_graph_capture_and_replay(num_tokens, kind):
    """The fused FP8 call captured in a CUDA graph (no host sync inside; descriptors and tile tables cached on the
    buffer) and replayed three times, at one EP8 rank's share of V4-Pro: the one-launch swap-AB kernel (T = 16) and
    the three launches around the Gluon GEMM phase (T = 2048)."""
    import megamoe.fused as mf
    from megamoe.cases import prepare_rank
    from megamoe.kernels.symm import check_barrier_state
    from megamoe.ops_fp8 import fp8_mega_moe
    from megamoe.symm import SymmBuffer
    from megamoe.testing import assert_cuda_graph_replays

    case = MoECase(format="fp8", num_ranks=1, num_tokens=num_tokens, hidden=7168, intermediate=3072, num_experts=48,
                   num_topk=6, block_m=128, masked_ratio=0.1, seed=5)
    sb = SymmBuffer.local(1, 48, num_tokens, 6, 7168, 3072, block_m=128, device="cuda", format="fp8")[0]
    assert mf.fused_config(sb.layout, num_tokens, 1, sb.buffer.device).kind == kind
    problem = case.problem(device="cuda")
    y, l1, l2, _ = prepare_rank(sb, problem, 0)
    ref = problem.reference()[0]
    assert_cuda_graph_replays(lambda: fp8_mega_moe(y, l1, l2, sb, impl="fused", check=False), y, ref)
    check_barrier_state(sb)
    sb.destroy()
