"""The register-operand FP8 x FP4 GEMM phase (``megamoe.kernels.gemm_fp4_rs``: the FP4 decode in the math warps,
``FusedConfig(kind="fp4_ws", block_m=64, rs_block_n=8 / 16 / 32 / 64)``) on a GPU, against
``problem.reference(numerics="hopper")`` within the FP8-MMA tolerance profile: the small cases of both Gluon phases
(1, 2 and 4 local ranks, masks, an empty rank, clamp, I / 128 odd, skew, repeated calls) and spread scales at every
token chunk, one EP8 rank's share of V4-Pro where the host picks the tile itself, 4 local ranks at the real size,
and a CUDA-graph capture."""
import pytest
import torch

from megamoe.cases import MoECase, assert_cuda_graph_replays, assert_reports, fp4_gluon_phase_cases, run_case_local
from megamoe.fused import FP4_RS_CANDIDATES

pytestmark = pytest.mark.skipif(torch.cuda.get_device_capability() != (9, 0), reason="the Gluon phase is sm_90 only")

WS = dict(block_m=128, impl="fused", numerics="hopper")
CASES = fp4_gluon_phase_cases(**WS)



def _force_rs(monkeypatch, block_n=None):
    """Every "hopper" call takes the register-operand tile (its pool block ``fp4_rs_block_m``: 64, or 128 on 128-row
    chains), with token chunk ``block_n`` (None: the host's choice)."""
    import megamoe.fused as mf

    monkeypatch.setattr(mf, "FP4_WS_ENABLED", True)
    monkeypatch.setattr(mf, "FP4_WS_MIN_EXPECTED", -1)
    monkeypatch.setattr(mf, "FP4_BLOCK64_MAX_EXPECTED", float("inf"))
    monkeypatch.setattr(mf, "FP4_RS_ENABLED", True)
    monkeypatch.setattr(mf, "FP4_RS_MAX_EXPECTED", float("inf"))
    monkeypatch.setattr(mf, "FP4_PREDECODE_MIN_EXPECTED", float("inf"))
    if block_n is not None:
        monkeypatch.setattr(mf, "fp4_rs_block_n", lambda expected: block_n)


@pytest.mark.parametrize("block_n", [8, 16, 32, 64])
@pytest.mark.parametrize("case", CASES, ids=["r1-300", "r2k6-mask-zero", "r4-clamp-i640", "r2-skew-3calls",
                                             "r2-spread-scales"])
def test_fp4_rs_small_cases(case, block_n, monkeypatch):
    """Many token chunks per pool block (up to 64 / ``block_n``), partial chunks, and the cases' masks, empty rank,
    clamp, odd I / 128, skew, repeated calls and rounding folds, at every token chunk."""
    import megamoe.fused as mf

    _force_rs(monkeypatch, block_n)
    cfg = mf.fused_config(case.layout(), 300, case.num_ranks, torch.device("cuda"), "hopper")
    assert (cfg.kind, cfg.block_m, cfg.rs_block_n) == ("fp4_ws", mf.fp4_rs_block_m(block_n), block_n)
    assert_reports(run_case_local(case, device="cuda"), f"hopper fused (FP4 register-operand tile) BN {block_n}")


@pytest.mark.parametrize("num_tokens", [8, 32, 128, 256, 512, 1024])
def test_fp4_rs_one_ep8_rank(num_tokens, monkeypatch):
    """One EP8 rank's share of V4-Pro (48 experts, H 7168, I 3072, top-6) at 1 / 4 / 16 / 32 / 64 / 128 expected
    tokens per expert with the token chunk the host picks (8 / 16 / 32 / 64 / 64 / 64); the host itself takes the
    register-operand tile up to FP4_RS_MAX_EXPECTED, above it the tile is forced; masked rows, two calls."""
    import megamoe.fused as mf

    monkeypatch.setattr(mf, "FP4_WS_ENABLED", True)
    if num_tokens * 6 / 48 > mf.FP4_RS_MAX_EXPECTED:
        monkeypatch.setattr(mf, "FP4_RS_MAX_EXPECTED", float("inf"))
        monkeypatch.setattr(mf, "FP4_BLOCK64_MAX_EXPECTED", float("inf"))
        monkeypatch.setattr(mf, "FP4_PREDECODE_MIN_EXPECTED", float("inf"))
    case = MoECase(num_ranks=1, num_tokens=num_tokens, hidden=7168, intermediate=3072, num_experts=48, num_topk=6,
                   block_m=128, masked_ratio=0.1, num_calls=2, seed=7, impl="fused", numerics="hopper")
    cfg = mf.fused_config(case.layout(), num_tokens, 1, torch.device("cuda"), "hopper")
    chunk = mf.fp4_rs_block_n(num_tokens * 6 / 48)
    assert (cfg.kind, cfg.block_m, cfg.rs_block_n) == ("fp4_ws", mf.fp4_rs_block_m(chunk), chunk)
    assert_reports(run_case_local(case, device="cuda"), f"hopper fused (FP4 register-operand tile) T={num_tokens}")


def force_rs_variant(mf, monkeypatch, block_n: int, variant: str) -> None:
    """Token chunk ``block_n`` of the register-operand tile at candidate ``variant`` of
    ``megamoe.fused.FP4_RS_CANDIDATES`` (chain rows, CTAs an SM, chains a token stage, loader registers)."""
    for name, value in mf.fp4_rs_variant(block_n, *mf.FP4_RS_CANDIDATES[block_n][variant]).items():
        monkeypatch.setattr(mf, name, value)


#: Every candidate, as (token chunk, name); and the T of one EP8 rank whose host picks that chunk.
RS_VARIANTS = [(bn, name) for bn in sorted(FP4_RS_CANDIDATES) for name in sorted(FP4_RS_CANDIDATES[bn])]
RS_VARIANT_T = {8: 8, 16: 32, 32: 128, 64: 512}


@pytest.mark.parametrize("block_n, variant", RS_VARIANTS)
@pytest.mark.parametrize("case", CASES[2:4], ids=["r4-clamp-i640", "r2-skew-3calls"])
def test_fp4_rs_variant_small_cases(case, block_n, variant, monkeypatch):
    """A candidate of the register-operand tile (``megamoe.fused.FP4_RS_CANDIDATES``) on the clamp / odd I /
    empty-rank case and the skewed repeated one."""
    import megamoe.fused as mf

    _force_rs(monkeypatch, block_n)
    force_rs_variant(mf, monkeypatch, block_n, variant)
    cfg = mf.fused_config(case.layout(), 300, case.num_ranks, torch.device("cuda"), "hopper")
    assert (cfg.block_m, cfg.rs_block_n) == (mf.fp4_rs_block_m(block_n), block_n)
    assert_reports(run_case_local(case, device="cuda"),
                   f"hopper fused (FP4 register-operand tile) BN {block_n} {variant}")


@pytest.mark.parametrize("block_n, variant", RS_VARIANTS)
def test_fp4_rs_variant_one_ep8_rank(block_n, variant, monkeypatch):
    """A candidate at one EP8 rank's share of V4-Pro at the T whose expected tokens per expert take its chunk (T =
    8 / 32 / 128 / 512 for chunks 8 / 16 / 32 / 64), masked rows, two calls."""
    import megamoe.fused as mf

    force_rs_variant(mf, monkeypatch, block_n, variant)
    T = RS_VARIANT_T[block_n]
    case = MoECase(num_ranks=1, num_tokens=T, hidden=7168, intermediate=3072, num_experts=48, num_topk=6,
                   block_m=128, masked_ratio=0.1, num_calls=2, seed=7, impl="fused", numerics="hopper")
    cfg = mf.fused_config(case.layout(), T, 1, torch.device("cuda"), "hopper")
    assert (cfg.kind, cfg.block_m, cfg.rs_block_n) == ("fp4_ws", mf.fp4_rs_block_m(block_n), block_n)
    assert_reports(run_case_local(case, device="cuda"), f"hopper fused (FP4 register-operand tile) T={T} {variant}")


def test_fp4_rs_real_size_four_local_ranks(monkeypatch):
    """384 experts of V4-Pro on 4 local ranks, skewed routing (many chunks and blocks per expert), an empty rank."""
    _force_rs(monkeypatch, 16)
    case = MoECase(num_ranks=4, num_tokens=[1024, 0, 512, 77], masked_ratio=0.1, num_calls=2, seed=3,
                   routing="skewed", impl="fused", numerics="hopper", hidden=7168, intermediate=3072,
                   num_experts=384, num_topk=6, block_m=128)
    assert_reports(run_case_local(case, device="cuda"), "hopper fused (FP4 register-operand tile) real r4")


def test_fp4_rs_cuda_graph_capture_and_replay(monkeypatch):
    """The launches (front, row maxima, the register-operand phase, back) captured in a CUDA graph and replayed
    three times at one EP8 rank's share of V4-Pro, T = 32."""
    import megamoe.fused as mf
    from megamoe.symm import SymmBuffer

    monkeypatch.setattr(mf, "FP4_WS_ENABLED", True)
    case = MoECase(num_ranks=1, num_tokens=32, hidden=7168, intermediate=3072, num_experts=48, num_topk=6,
                   block_m=128, masked_ratio=0.1, seed=5)
    sb = SymmBuffer.local(1, 48, 32, 6, 7168, 3072, block_m=128, device="cuda")[0]
    cfg = mf.fused_config(sb.layout, 32, 1, sb.buffer.device, "hopper")
    assert cfg.rs_block_n > 0
    assert_cuda_graph_replays(sb, case.problem(device="cuda"))
    sb.destroy()


def _force_wide(monkeypatch, block_n=128):
    """Every "hopper" call takes the register-operand tile on 128-row chains (two math warpgroups, pool blocks of
    128, one CTA an SM) with token chunk ``block_n``: 128 as configured, or 64 patched onto 128-row chains as
    ``results/probes/fused_fp8_ws_profile.py``'s ``FP4_RS_WIDE`` does."""
    import megamoe.fused as mf

    monkeypatch.setattr(mf, "FP4_WS_ENABLED", True)
    monkeypatch.setattr(mf, "FP4_WS_MIN_EXPECTED", -1)
    monkeypatch.setattr(mf, "FP4_BLOCK64_MAX_EXPECTED", -1)
    monkeypatch.setattr(mf, "FP4_RS_ENABLED", True)
    monkeypatch.setattr(mf, "FP4_RS_MAX_EXPECTED", float("inf"))
    monkeypatch.setattr(mf, "FP4_PREDECODE_MIN_EXPECTED", float("inf"))
    monkeypatch.setattr(mf, "fp4_rs_block_n", lambda expected: block_n)
    for name, value in (("FP4_RS_ROWS", 128), ("FP4_RS_CTAS_PER_SM", 1), ("FP4_RS_PAIR", 1), ("FP4_RS_LOAD_REGS", 40)):
        monkeypatch.setattr(mf, name, {**getattr(mf, name), block_n: value})


@pytest.mark.parametrize("block_n", [128, 64])
@pytest.mark.parametrize("case", CASES, ids=["r1-300", "r2k6-mask-zero", "r4-clamp-i640", "r2-skew-3calls",
                                             "r2-spread-scales"])
def test_fp4_rs_wide_small_cases(case, block_n, monkeypatch):
    """128-row chains (the wide tile: two math warpgroups, the next K block decoded under the current block's
    wgmmas) at chunks 128 and 64 on the small cases."""
    import megamoe.fused as mf

    _force_wide(monkeypatch, block_n)
    cfg = mf.fused_config(case.layout(), 300, case.num_ranks, torch.device("cuda"), "hopper")
    assert (cfg.kind, cfg.block_m, cfg.rs_block_n) == ("fp4_ws", 128, block_n)
    assert_reports(run_case_local(case, device="cuda"), f"hopper fused (FP4 register-operand tile, wide {block_n})")


@pytest.mark.parametrize("num_tokens, block_n", [(512, 64), (512, 128), (2048, 128)])
def test_fp4_rs_wide_one_ep8_rank(num_tokens, block_n, monkeypatch):
    """The wide tile at one EP8 rank's share of V4-Pro, T = 512 / 2048 (64 / 256 expected tokens per expert)."""
    _force_wide(monkeypatch, block_n)
    case = MoECase(num_ranks=1, num_tokens=num_tokens, hidden=7168, intermediate=3072, num_experts=48, num_topk=6,
                   block_m=128, masked_ratio=0.1, num_calls=2, seed=7, impl="fused", numerics="hopper")
    assert_reports(run_case_local(case, device="cuda"),
                   f"hopper fused (FP4 register-operand tile, wide {block_n}) T={num_tokens}")
