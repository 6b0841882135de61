"""The FP8 x FP4 format's Gluon GEMM phase (tile kind ``"fp4_ws"``, ``megamoe.kernels.gemm_fp4_ws``, "hopper" numerics)
on a GPU: front launch, the warp-specialised phase, back launch, against ``problem.reference(numerics="hopper")``
within the FP8-MMA tolerance profile. Small cases on 1, 2 and 4 local ranks with the kind and block forced, spread
scales so that the folds round, the real size, and a CUDA-graph capture -- each at pool block 128 (two math
warpgroups, one decode partition) and 64 (one math warpgroup, two decode partitions; forced through
``FP4_BLOCK64_MAX_EXPECTED`` where the size would pick 128)."""
import pytest
import torch

from megamoe.cases import MoECase, assert_cuda_graph_replays, assert_reports, fp4_gluon_phase_cases, run_case_local

pytestmark = pytest.mark.skipif(torch.cuda.get_device_capability() != (9, 0), reason="the Gluon phase is sm_90 only")

REAL = dict(hidden=7168, intermediate=3072, num_experts=384, num_topk=6, block_m=128)
WS = dict(block_m=128, impl="fused", numerics="hopper")


CASES = fp4_gluon_phase_cases(**WS)



def _force_fp4_ws(monkeypatch, block_m=None):
    """Take the Gluon phase for every "hopper" call whatever the expected tokens per expert; ``block_m`` 64 / 128:
    that pool block whatever the expected tokens (None: the host's choice)."""
    import megamoe.fused as mf

    monkeypatch.setattr(mf, "FP4_WS_ENABLED", True)
    monkeypatch.setattr(mf, "FP4_WS_MIN_EXPECTED", -1)
    monkeypatch.setattr(mf, "FP4_RS_ENABLED", False)  # the decode-partition tile (test_fp4_rs_gpu.py: the other)
    if block_m is not None:
        monkeypatch.setattr(mf, "FP4_BLOCK64_MAX_EXPECTED", float("inf") if block_m == 64 else -1)


@pytest.mark.parametrize("block_m", [128, 64])
@pytest.mark.parametrize("case", CASES, ids=["r1-300", "r2k6-mask-zero", "r4-clamp-i640", "r2-skew-3calls",
                                             "r2-spread-scales"])
def test_fp4_ws_small_cases(case, block_m, monkeypatch):
    """Several pool blocks per expert, partial blocks, masks, an empty rank, clamp, I / 128 odd (5 L1 tiles a
    block), skew, repeated calls (the workspace cleaned between them), scales whose folds round; at pool block 128
    and 64."""
    import megamoe.fused as mf

    _force_fp4_ws(monkeypatch, block_m)
    cfg = mf.fused_config(case.layout(), 300, case.num_ranks, torch.device("cuda"), "hopper")
    assert (cfg.kind, cfg.block_m) == ("fp4_ws", block_m)
    assert_reports(run_case_local(case, device="cuda"), f"hopper fused (FP4 Gluon GEMM phase) small, block {block_m}")


@pytest.mark.parametrize("num_ranks,num_tokens", [(1, [8192]), (4, [4096, 0, 2048, 77])], ids=["r1-t8192", "r4-skew"])
def test_fp4_ws_real_size(num_ranks, num_tokens, monkeypatch):
    """Real size (V4-Pro, 384 experts, top-6): 128 / 64 expected tokens per expert on rank 0."""
    import megamoe.fused as mf

    monkeypatch.setattr(mf, "FP4_WS_ENABLED", True)
    case = MoECase(num_ranks=num_ranks, num_tokens=num_tokens, masked_ratio=0.1, num_calls=2, seed=3,
                   routing="skewed" if num_ranks > 1 else "uniform", impl="fused", numerics="hopper", **REAL)
    assert mf.fused_config(case.layout(), num_tokens[0], num_ranks, torch.device("cuda"), "hopper").kind == "fp4_ws"
    assert_reports(run_case_local(case, device="cuda"), f"hopper fused (FP4 Gluon GEMM phase) real r{num_ranks}")


@pytest.mark.parametrize("num_tokens", [256, 128, 8])
def test_fp4_ws_block64_one_ep8_rank(num_tokens, monkeypatch):
    """One EP8 rank's share of V4-Pro (48 experts, H 7168, I 3072, top-6) at T = 256 / 128 / 8: 32 / 16 / 1 expected
    tokens per expert, where the host picks pool block 64 itself (one math warpgroup, two decode partitions); at
    T = 256 some experts take two blocks, at T = 8 most experts get no token. Masked rows, two calls."""
    import megamoe.fused as mf

    monkeypatch.setattr(mf, "FP4_WS_ENABLED", True)
    monkeypatch.setattr(mf, "FP4_RS_ENABLED", False)  # the decode-partition tile at block 64
    case = MoECase(num_ranks=1, num_tokens=num_tokens, hidden=7168, intermediate=3072, num_experts=48, num_topk=6,
                   block_m=128, masked_ratio=0.1, num_calls=2, seed=7, impl="fused", numerics="hopper")
    cfg = mf.fused_config(case.layout(), num_tokens, 1, torch.device("cuda"), "hopper")
    assert (cfg.kind, cfg.block_m) == ("fp4_ws", 64)
    assert_reports(run_case_local(case, device="cuda"), f"hopper fused (FP4 Gluon GEMM phase) block 64 T={num_tokens}")


@pytest.mark.parametrize("num_ranks,num_tokens", [(4, [4096, 0, 2048, 77])], ids=["r4-skew"])
def test_fp4_ws_real_size_block64_forced(num_ranks, num_tokens, monkeypatch):
    """The real size on 4 local ranks (384 experts, skewed routing: many blocks per expert, an empty rank) with pool
    block 64 forced where the host would pick 128."""
    import megamoe.fused as mf

    _force_fp4_ws(monkeypatch, 64)
    case = MoECase(num_ranks=num_ranks, num_tokens=num_tokens, masked_ratio=0.1, num_calls=2, seed=3,
                   routing="skewed", impl="fused", numerics="hopper", **REAL)
    cfg = mf.fused_config(case.layout(), num_tokens[0], num_ranks, torch.device("cuda"), "hopper")
    assert (cfg.kind, cfg.block_m) == ("fp4_ws", 64)
    assert_reports(run_case_local(case, device="cuda"), f"hopper fused (FP4 Gluon GEMM phase) real r{num_ranks} b64")


@pytest.mark.parametrize("block_m", [128, 64])
@pytest.mark.parametrize("num_ranks,num_tokens", [(1, [8192]), (4, [4096, 0, 2048, 77])], ids=["r1-t8192", "r4-skew"])
def test_fp4_ws_predecoded(num_ranks, num_tokens, block_m, monkeypatch):
    """The predecoded path forced (``FP4_PREDECODE_MIN_EXPECTED`` = -1: both weights decoded once per call by
    ``megamoe.fold_decode``, the Gluon phase streaming e4m3) at the real size, both pool blocks, two calls."""
    import megamoe.fused as mf

    _force_fp4_ws(monkeypatch, block_m)
    monkeypatch.setattr(mf, "FP4_PREDECODE_MIN_EXPECTED", -1)
    case = MoECase(num_ranks=num_ranks, num_tokens=num_tokens, masked_ratio=0.1, num_calls=2, seed=3,
                   routing="skewed" if num_ranks > 1 else "uniform", impl="fused", numerics="hopper", **REAL)
    cfg = mf.fused_config(case.layout(), num_tokens[0], num_ranks, torch.device("cuda"), "hopper")
    assert (cfg.kind, cfg.block_m, cfg.predecode) == ("fp4_ws", block_m, True)
    assert_reports(run_case_local(case, device="cuda"), f"hopper fused (FP4 predecoded) r{num_ranks} b{block_m}")


def test_fold_decode_on_the_gpu_equals_the_cpu_pass():
    """``megamoe.fold_decode`` on the GPU (byte-permute lookups) gives the interpreter's bits (tested against the
    decode partitions' model on CPU): one expert of V4-Pro's L1 and L2 shapes, scales spread over 2^10."""
    from megamoe.fold_decode import fold_decode
    from megamoe.gemm_phase import _folded_fp4_rows
    from megamoe.quant import cast_grouped_weights_to_fp4, transform_weights_for_mega_moe

    g = torch.Generator().manual_seed(5)
    l1 = cast_grouped_weights_to_fp4(torch.randn(2, 2 * 3072, 7168, generator=g))
    l2 = cast_grouped_weights_to_fp4(torch.randn(2, 7168, 3072, generator=g))
    low = lambda sf: torch.where(torch.rand(sf.shape, generator=g) < 0.3, sf - 0x0A0A0A0A, sf)  # noqa: E731
    for w, sf in transform_weights_for_mega_moe((l1[0], low(l1[1])), (l2[0], low(l2[1]))):
        folded, row_exp = fold_decode((w.cuda(), sf.cuda()))
        rows = torch.arange(0, w.shape[1], 97)
        for e in range(w.shape[0]):
            want, want_exp = _folded_fp4_rows(w, sf, e, rows)
            assert torch.equal(row_exp[e, rows.cuda()].cpu(), want_exp.to(torch.int32))
            assert torch.equal(folded[e, rows.cuda()].float().cpu(), want)


@pytest.mark.parametrize("numerics", ["hopper", "hopper_l2_per_block"])
@pytest.mark.parametrize("num_tokens", [512, 384])
def test_fp4_ws_idle_decode_one_ep8_rank(num_tokens, numerics):
    """The host's tile at 64 / 48 expected tokens per expert of one EP8 rank of V4-Pro: the decode-partition tile at
    block 128 with ``IDLE_DECODE`` (math warpgroup 1 decodes where its rows of an expert's last block are empty:
    about half of the blocks here, and at T = 384 most), masked rows, two calls."""
    import megamoe.fused as mf
    from megamoe.layout import Layout

    cfg = mf.fused_config(Layout(1, 48, num_tokens, 6, 7168, 3072, 128), num_tokens, 1, torch.device("cuda"),
                          numerics)
    assert (cfg.kind, cfg.block_m, cfg.rs_block_n, cfg.predecode, cfg.idle_decode) == ("fp4_ws", 128, 0, False, True)
    case = MoECase(num_ranks=1, num_tokens=num_tokens, hidden=7168, intermediate=3072, num_experts=48, num_topk=6,
                   block_m=128, masked_ratio=0.1, num_calls=2, seed=11, impl="fused", numerics=numerics)
    assert_reports(run_case_local(case, device="cuda"), f"{numerics} fused, idle decode, T={num_tokens}")


@pytest.mark.parametrize("num_tokens,block_m", [(2048, 128), (512, 128), (256, 64)])
def test_fp4_ws_cuda_graph_capture_and_replay(num_tokens, block_m, monkeypatch):
    """The three launches captured in a CUDA graph (descriptors, tile tables, the fold table cached before the
    capture) and replayed three times, at one EP8 rank's share of V4-Pro (48 experts, T = 2048: pool block 128;
    T = 512: block 128 with ``IDLE_DECODE``; T = 256: block 64)."""
    import megamoe.fused as mf
    from megamoe.symm import SymmBuffer

    monkeypatch.setattr(mf, "FP4_WS_ENABLED", True)
    monkeypatch.setattr(mf, "FP4_RS_ENABLED", False)  # the decode-partition tile (test_fp4_rs_gpu captures the other)
    case = MoECase(num_ranks=1, num_tokens=num_tokens, hidden=7168, intermediate=3072, num_experts=48, num_topk=6,
                   block_m=128, masked_ratio=0.1, seed=5)
    sb = SymmBuffer.local(1, 48, num_tokens, 6, 7168, 3072, block_m=128, device="cuda")[0]
    cfg = mf.fused_config(sb.layout, num_tokens, 1, sb.buffer.device, "hopper")
    assert (cfg.kind, cfg.block_m) == ("fp4_ws", block_m)
    assert_cuda_graph_replays(sb, case.problem(device="cuda"))
    sb.destroy()


def test_fp4_ws_is_the_default_above_its_threshold():
    """On this GPU a "hopper" call takes the Gluon phase at any size (``FP4_WS_MIN_EXPECTED``): block 128 at the real
    size; at few tokens per expert the register-operand tile (its own block) or block 64."""
    import megamoe.fused as mf
    from megamoe.layout import Layout

    L = Layout(8, 384, 8192, 6, 7168, 3072, 128)
    assert mf.FP4_WS_ENABLED is True
    assert mf.fused_config(L, 8192, 1, torch.device("cuda"), "hopper").kind == "fp4_ws"
    assert mf.fused_config(L, 8192, 1, torch.device("cuda"), "hopper").block_m == 128
    L48 = Layout(1, 48, 8192, 6, 7168, 3072, 128)  # one EP8 rank's share: T / 8 expected tokens per expert
    for t in (8, 128, 256, 512, 1024):
        cfg, expected = mf.fused_config(L48, t, 1, torch.device("cuda"), "hopper"), t * 6 / 48
        assert cfg.kind == "fp4_ws" and bool(cfg.rs_block_n) == (expected <= mf.FP4_RS_MAX_EXPECTED), t
        # the register-operand tile's own pool block; else 64 rows where 128 would be mostly padding
        want = mf.fp4_rs_block_m(cfg.rs_block_n) if cfg.rs_block_n else (
            64 if expected <= mf.FP4_BLOCK64_MAX_EXPECTED else 128)
        assert cfg.block_m == want, t
