"""``megamoe.fp8_mega_moe`` (DeepGEMM SM90's FP8 x FP8 format) end to end on CPU ranks (Triton interpreter) against
``megamoe.reference.reference_fp8_mega_moe_ep``, and its argument validation.

The staged FP8 kernels reproduce the reference bit for bit here (same per-128 promotion order, IEEE float32 requant
on the interpreter); the tests require it, and also the ``fp32`` tolerance profile (``megamoe.testing``). So do the
fused kernel's swap-AB tiles (``"fp8_swap"``, few tokens per expert): on the interpreter a 128-wide dot of two e4m3
tiles is summed exactly and rounded once whichever operand is transposed (``megamoe.env.
exact_fp8_dots_under_interpreter``), as the reference's block dot (``test_block_dot_orientations_sum_alike`` checks
the premise, with data whose float32 sums round)."""
import pytest
import torch

import megamoe
import megamoe.kernels  # noqa: F401  (switches the interpreter on where there is no CUDA, before triton)

# isort: split
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import megamoe.fused
from megamoe.cases import MoECase, prepare_rank, run_case_local, run_case_rank
from megamoe.launch import launch
from megamoe.layout import Layout
from megamoe.symm import SymmBuffer


def _check(reports, bitwise=True):
    for r in reports:
        assert not r["failures"], r
        assert r["recv_stats_ok"], r
        if bitwise:
            assert r["bitwise_equal"], r


@pytest.mark.parametrize("num_ranks,num_topk,num_experts,tokens", [(1, 2, 4, 21), (2, 2, 4, [17, 9]),
                                                                   (2, 3, 8, [12, 12])])
def test_ranks_match_the_reference_bitwise(num_ranks, num_topk, num_experts, tokens):
    _check(run_case_local(MoECase(format="fp8", num_ranks=num_ranks, num_topk=num_topk, num_experts=num_experts,
                                      num_tokens=tokens, block_m=16, seed=num_ranks)))


def test_four_ranks_and_several_scale_blocks_along_n_and_k():
    """H = 384 (three K blocks in L1, three N tiles in L2) and I = 256: two L1 tiles of 128 intermediate columns,
    tile t reading gate scale block t and up block I/128 + t (a kernel that read block 0 for both tiles, or
    interleaved the scale rows, fails here; with I = 128 it would not)."""
    _check(run_case_local(MoECase(format="fp8", num_ranks=4, num_tokens=[6, 0, 9, 4], hidden=384, intermediate=256,
                                      num_topk=3, num_experts=8, masked_ratio=0.2, block_m=16, seed=11)))


def test_masks_an_empty_rank_and_clamp():
    reports = run_case_local(MoECase(format="fp8", num_ranks=2, num_tokens=[23, 0], num_topk=2, num_experts=4,
                                         masked_ratio=0.3, activation_clamp=0.25, block_m=16, seed=3))
    _check(reports)
    assert reports[1]["num_tokens"] == 0 and sum(reports[1]["recv_stats"]) > 0


def test_skewed_one_expert_routing_and_repeated_calls_with_push():
    reports = run_case_local(MoECase(format="fp8", num_ranks=2, num_tokens=[18, 7], num_topk=2, num_experts=4,
                                         routing="one_expert", num_calls=2, dispatch="push", block_m=16, seed=5))
    _check(reports)  # recv stats doubled: the workspace was cleaned between the calls
    assert reports[0]["recv_stats"][0] == 2 * 25 and sum(reports[1]["recv_stats"]) == 0


@pytest.mark.slow
def test_process_ranks_over_shared_memory():
    case = MoECase(format="fp8", num_ranks=2, num_tokens=[15, 6], num_topk=2, num_experts=4, block_m=16, seed=9)
    _check(launch(run_case_rank, 2, case, backend="cpu", timeout_s=300))


# ------------------------------------------------------------------ the fused kernel (FP8W tiles), CPU ranks
@pytest.fixture
def fused_configs(monkeypatch):
    """The ``FusedConfig`` of every fused launch in this process (``megamoe.fused.fused_config`` spied on)."""
    seen = []
    real = megamoe.fused.fused_config

    def spy(*args, **kwargs):
        seen.append(real(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(megamoe.fused, "fused_config", spy)
    return seen


@pytest.mark.parametrize("tokens,block_m,kind,bm", [(19, 16, "fp8_swap", 16),
                                                    pytest.param(50, 32, "fp8_swap", 32, marks=pytest.mark.slow),
                                                    (70, 16, "fp8", 16)])
def test_fused_one_rank_bitwise(fused_configs, tokens, block_m, kind, bm, monkeypatch):
    """The fused persistent kernel with this format's tiles (one program under the interpreter): H = 384 and I = 256
    (several K blocks, two L1 tiles and their L2 arrival-mask bits), masks, clamp, two calls. 19 / 50 tokens x top-3
    over 6 experts expect 9.5 / 25 tokens per expert: the swap-AB tiles (at the pool's block 16 / 32, below their
    own 32; taken up to 32 expected here, ``FP8_SWAP_MAX_EXPECTED`` -- on an H200 the Gluon phase takes over above 2,
    which the interpreter cannot run); 70 (35 expected) the staged tile. The spy checks which tile ran."""
    monkeypatch.setattr(megamoe.fused, "FP8_SWAP_MAX_EXPECTED", 32)
    case = MoECase(format="fp8",
                   num_ranks=1, num_tokens=tokens, hidden=384, intermediate=256, num_topk=3, num_experts=6,
                   masked_ratio=0.2, activation_clamp=0.5, num_calls=2, block_m=block_m, impl="fused", seed=13)
    _check(run_case_local(case))
    assert [(c.kind, c.block_m) for c in fused_configs] == [(kind, bm)] * 2


@triton.jit
def _block_dot_kernel(a_ptr, w_ptr, out_ptr, BM: tl.constexpr, SWAP: tl.constexpr):
    """One 128-wide block dot of e4m3 tiles ``a [BM, 128]`` and ``w [128, 128]`` into float32 ``out [BM, 128]``:
    ``dot(a, w^T)``, or with ``SWAP`` ``dot(w, a^T)^T`` (the swap-AB tiles' orientation)."""
    m, k = tl.arange(0, BM), tl.arange(0, 128)
    a = tl.load(a_ptr + m[:, None] * 128 + k[None, :])
    w = tl.load(w_ptr + k[:, None] * 128 + k[None, :])
    if SWAP:
        out = tl.trans(tl.dot(w, tl.trans(a)))
    else:
        out = tl.dot(a, tl.trans(w))
    tl.store(out_ptr + m[:, None] * 128 + k[None, :], out)


def test_block_dot_orientations_sum_alike():
    """The premise of the swap-AB tiles' bitwise tests: an interpreted ``tl.dot`` of two e4m3 tiles gives the same
    float32 bits as ``dot(a, w^T)``, as ``dot(w, a^T)^T`` and as the reference's block dot
    (``megamoe.reference.block_scaled_matmul`` at unit scales), on e4m3 data spread over 2^20 whose float32 block
    sums do round -- on any CPU: both sum exactly and round once (``megamoe.env.exact_fp8_dots_under_interpreter``;
    Triton's own float16 sgemm gave three different results on an AMD EPYC with OpenBLAS's Haswell kernels)."""
    from megamoe.env import exact_fp8_dots_under_interpreter
    from megamoe.reference import block_scaled_matmul

    assert exact_fp8_dots_under_interpreter()  # installed (megamoe.kernels did it on import)
    g = torch.Generator().manual_seed(0)
    rounded = 0
    for bm in (16, 32):
        a, w = ((torch.randn(n, 128, generator=g) * torch.pow(2.0, torch.randint(-12, 8, (n, 128), generator=g)))
                .clamp(-448, 448).to(torch.float8_e4m3fn) for n in (bm, 128))
        outs = []
        for swap in (False, True):
            out = torch.full((bm, 128), float("nan"))
            _block_dot_kernel[(1,)](a, w, out, BM=bm, SWAP=swap)
            outs.append(out)
        ref = block_scaled_matmul(a.float(), torch.ones(bm, 1), w.float(), torch.ones(128, 1))
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], ref), bm
        rounded += int((ref.double() != a.double() @ w.double().T).sum())
    assert rounded > 0  # the sums round: a different summation order could change bits


@pytest.mark.slow
@pytest.mark.parametrize("tokens,kinds", [([2, 0], ("fp8_swap", "fp8_swap")), ([40, 0], ("fp8", "fp8_swap"))])
def test_fused_two_processes_bitwise(tokens, kinds):
    """Two CPU processes: the fused kernel's in-kernel barriers, remote pulls of float32 scale words and the
    write-back into the source rank's combine buffer, with an empty rank and skew. Each rank picks its tiles from
    its own token count: with 40 tokens (40 expected per expert) rank 0 runs the staged tile while the empty rank 1
    runs the swap-AB tiles on what it receives (each process takes ``FP8_SWAP_MAX_EXPECTED`` as it is: swap-AB up
    to 2 expected tokens)."""
    case = MoECase(format="fp8",
                   num_ranks=2, num_tokens=tokens, num_topk=2, num_experts=4, routing="skewed", block_m=16,
                   impl="fused", seed=17)
    layout = Layout(2, 4, max(tokens), 2, case.hidden, case.intermediate, 16, "fp8")  # each rank's SymmBuffer's
    assert tuple(megamoe.fused.fused_config(layout, n, 1, torch.device("cpu")).kind for n in tokens) == kinds
    _check(launch(run_case_rank, 2, case, backend="cpu", timeout_s=300))


def test_fused_is_chosen_where_it_runs_and_refused_where_not():
    """impl="fused" on the interpreter with local ranks > 1 is refused by name (its programs run one after
    another); "auto" on CPU stays staged."""
    from megamoe.ops import resolve_impl

    sbs = SymmBuffer.local(2, 4, 8, 2, 128, 128, block_m=16, format="fp8")
    try:
        assert resolve_impl("auto", sbs, "pull") == "staged"
        with pytest.raises(ValueError, match="impl='fused'"):
            run_case_local(MoECase(format="fp8", num_ranks=2, num_tokens=4, num_topk=2, num_experts=4, block_m=16,
                                       impl="fused"))
    finally:
        for sb in sbs:
            sb.destroy()


# ------------------------------------------------------------------ validation (no kernel runs)
@pytest.fixture
def bound():
    case = MoECase(format="fp8", num_ranks=1, num_tokens=5, num_topk=2, num_experts=4, block_m=16)
    sb = SymmBuffer.local(1, 4, 8, 2, 256, 128, block_m=16, device="cpu", format="fp8")[0]
    problem = case.problem()
    y, l1, l2, stats = prepare_rank(sb, problem, 0)
    yield sb, y, l1, l2, stats
    sb.destroy()


def test_rejects_bad_arguments_by_name(bound):
    sb, y, l1, l2, stats = bound
    f = megamoe.fp8_mega_moe
    with pytest.raises(ValueError, match=r"recipe=\(1, 1, 32\) is not supported"):
        f(y, l1, l2, sb, recipe=(1, 1, 32))
    with pytest.raises(TypeError, match="recipe must be a tuple of three ints"):
        f(y, l1, l2, sb, recipe=128)
    with pytest.raises(TypeError, match="fast_math must be a bool"):
        f(y, l1, l2, sb, fast_math=1)
    with pytest.raises(ValueError, match="activation='gelu'"):
        f(y, l1, l2, sb, activation="gelu")
    with pytest.raises(ValueError, match="activation_clamp"):
        f(y, l1, l2, sb, activation_clamp=-1.0)
    with pytest.raises(TypeError, match="l1_weights is a plain tuple"):
        f(y, tuple(l1), l2, sb)
    with pytest.raises(ValueError, match="l2_weights holds l1 weights"):
        f(y, l1, l1, sb)
    with pytest.raises(TypeError, match="cumulative_local_expert_recv_stats must have dtype torch.int32"):
        f(y, l1, l2, sb, stats.long())
    with pytest.raises(ValueError, match="y must have shape"):
        f(y[:, :128], l1, l2, sb)


def test_formats_do_not_mix(bound):
    sb, y, l1, l2, _ = bound
    fp4_sb = SymmBuffer.local(1, 4, 8, 2, 256, 128, block_m=16, device="cpu")[0]
    with pytest.raises(ValueError, match="sym_buffer was made for format 'fp8_fp4'.*format='fp8'"):
        megamoe.fp8_mega_moe(y, l1, l2, fp4_sb)
    with pytest.raises(ValueError, match=r"made for format 'fp8' \(fp8_mega_moe\); fp8_fp4_mega_moe needs"):
        megamoe.fp8_fp4_mega_moe(y, l1, l2, sb)
    from megamoe.quant import cast_grouped_weights_to_fp4, transform_weights_for_mega_moe

    t1, t2 = transform_weights_for_mega_moe(cast_grouped_weights_to_fp4(torch.zeros(4, 256, 256)),
                                            cast_grouped_weights_to_fp4(torch.zeros(4, 256, 128)))
    with pytest.raises(TypeError, match="l1_weights holds FP4 weights of the fp8_fp4 format"):
        megamoe.fp8_mega_moe(y, t1, l2, sb)
    fp4_sb.destroy()


def test_check_rejects_bad_scales_and_a_repeated_expert(bound):
    sb, y, l1, l2, _ = bound
    sb.x_sf[2, 1] = 0.0
    with pytest.raises(ValueError, match=r"x_sf \(sym_buffer.x_sf\[:5\]\) holds the scale 0.0 at token 2"):
        megamoe.fp8_mega_moe(y, l1, l2, sb)
    sb.x_sf[2, 1] = 1.0
    sb.topk_idx[1] = torch.tensor([3, 3])
    with pytest.raises(ValueError, match="selects the same expert twice"):
        megamoe.fp8_mega_moe(y, l1, l2, sb)


def test_symm_buffer_factory_for_sm90():
    from megamoe.ops_fp8 import get_symm_buffer_for_mega_moe_sm90

    sb = get_symm_buffer_for_mega_moe_sm90(None, 4, 8, 2, 256, 128, block_m=16, backend="cpu")
    assert sb.layout.format == "fp8" and sb.x_sf.dtype == torch.float32
    sb.destroy()


@pytest.mark.parametrize("block_m", [128, 64])
def test_fused_three_launch_split_bitwise(monkeypatch, block_m):
    """The "fp8_ws" call on a CPU rank: the fused kernel's front launch (PHASE=1: count, barrier 1, pull, tile
    table), the GEMM phase's torch model (``megamoe.gemm_phase``, what the Gluon kernel computes per tile) and the
    back launch (PHASE=2: barrier 2, combine, cleanup) -- bit-exact against the reference, twice (the workspace is
    clean between calls). 300 tokens x top-3 over 6 experts: ~150 rows an expert, so experts span two pool blocks of
    128 (a full and a partial one); I = 384: three L1 tiles a block; H = 512: two L2 tiles. The tile table is
    checked against the pool schedule."""
    from megamoe.fused import FusedConfig
    from megamoe.gemm_phase import tile_groups, tile_pairs, tile_table

    cfg = FusedConfig(block_m=block_m, programs_per_rank=1, num_warps=8, num_stages=2, kind="fp8_ws")
    monkeypatch.setattr(megamoe.fused, "fused_config", lambda *a, **k: cfg)
    monkeypatch.setattr(megamoe.fused, "FP8_WS_MULTICAST", True)  # (off by default: its pair table checked below)
    tables = []
    real = megamoe.fused._tile_table
    monkeypatch.setattr(megamoe.fused, "_tile_table", lambda sb: tables.append(real(sb)) or tables[-1])
    case = MoECase(format="fp8", num_ranks=1, num_tokens=300, hidden=512, intermediate=384, num_topk=3,
                   num_experts=6, masked_ratio=0.1, activation_clamp=0.5, num_calls=2, block_m=128, impl="fused",
                   seed=21)
    descs = []
    real_descs = megamoe.fused._ws_descriptors
    monkeypatch.setattr(megamoe.fused, "_ws_descriptors", lambda *a: descs.append(real_descs(*a)) or descs[-1])
    _check(run_case_local(case))
    a1, a2, w1, w2, s1, s2, a1m, a2m, w1u, w2u = descs[-1]  # the Gluon launch's TMA descriptors, built on CPU
    assert [list(d.block_shape) for d in descs[-1]] == ([[block_m, 128]] * 2 + [[128, 128]] * 2 + [[block_m]] * 2
                                                        + [[block_m // 2, 128]] * 2 + [[128, 128]] * 2)
    assert a1m.base is a1.base and w1u.base is w1.base and w2u.base is w2.base  # the same tensors again
    assert list(w1.shape) == [6 * 2 * 384 * 4, 128] and list(w2.shape) == [6 * 512 * 3, 128]  # blocked weights
    entries, num_l1, block_rows = tile_table(tables[-1])
    l1, l2 = entries[:num_l1], entries[num_l1:]
    blocks = sorted({b for b, *_ in l1})
    assert blocks == list(range(len(blocks))) and len(blocks) > 6  # every block once, some expert with two
    assert len(l1) == 3 * len(blocks) and len(l2) == 2 * len(blocks)
    for part, n_tiles in ((l1, 3), (l2, 2)):
        assert sorted((b, nt) for b, nt, *_ in part) == [(b, nt) for b in blocks for nt in range(n_tiles)]
        assert [e for _, _, e, _ in part] == sorted(e for _, _, e, _ in part)  # expert-major
        assert all(0 < v <= block_m for *_, v in part)
    rows = {b: v for b, _, _, v in l1}  # valid rows per block: every routed (token, slot) pair exactly once
    assert sum(rows.values()) == int((case.problem().topk_idx[0] >= 0).sum())
    assert block_rows == [rows[b] for b in blocks]  # the block list the GEMM phase's pull walks
    # the group words (WS_GROUP_SYNC): each entry's run of entries on the same weight tile -- same GEMM, expert
    # and n-tile, consecutive -- and no longer; the counters zeroed (the call ran twice: the front re-zeroes them)
    groups, counters = tile_groups(tables[-1])
    assert len(groups) == len(entries) and counters == [0] * len(entries)
    for i, (first, size) in enumerate(groups):
        assert first <= i < first + size <= (num_l1 if i < num_l1 else len(entries)), (i, first, size)
        key = lambda j: (j < num_l1, entries[j][1], entries[j][2])  # noqa: E731
        assert all(key(j) == key(i) for j in range(first, first + size)), (i, first, size)
        assert first == 0 or first == num_l1 or key(first - 1) != key(i)
        assert first + size in (num_l1, len(entries)) or key(first + size) != key(i)
    assert max(s for _, s in groups) > 1  # some weight tile read by two pool blocks
    # the pair table of the 2-CTA clusters (FP8_WS_MULTICAST, block 128 only): every entry in exactly one pair,
    # a weight pair two consecutive blocks on one weight tile, a token pair two n-tiles of an expert's last block
    # where its count is odd; L1 pairs first; the weight pairs' group words as the entries'
    if block_m != 128:
        return
    pairs, l1_pairs, pair_groups, pair_counters = tile_pairs(tables[-1])
    covered = [t for t0, kind, t1 in pairs for t in ((t0, t1) if kind else (t0,))]
    assert sorted(covered) == list(range(len(entries)))
    assert all(t0 < num_l1 for t0, _, _ in pairs[:l1_pairs]) and all(t0 >= num_l1 for t0, _, _ in pairs[l1_pairs:])
    for i, (t0, kind, t1) in enumerate(pairs):
        first, size = groups[t0]
        (b0, nt0, e0, _), (b1, nt1, e1, _) = entries[t0], entries[t1]
        p_first, p_size = pair_groups[i]
        if kind == 1:  # a weight pair: blocks 2j, 2j + 1 of one expert's weight tile (one GEMM)
            assert t1 == t0 + 1 and (t0 - first) % 2 == 0 and groups[t1] == (first, size)
            assert (e1, nt1, b1) == (e0, nt0, b0 + 1) and (t0 < num_l1) == (t1 < num_l1)
            assert p_size == size // 2 and pairs[p_first][0] == first
        else:  # a token pair (n-tiles 2q, 2q + 1) or a single: the last block of an expert with an odd count
            assert t0 == first + size - 1 and size % 2 == 1 and p_size == 1 and p_first == i
            if kind == 2:
                assert (e1, b1, nt1) == (e0, b0, nt0 + 1) and nt0 % 2 == 0 and (t0 < num_l1) == (t1 < num_l1)
            else:
                assert t1 == t0
    kinds = {kind for _, kind, _ in pairs}
    assert kinds == {0, 1, 2}, kinds  # (I = 384: three L1 n-tiles, so an odd expert's last L1 tile is a single)
    assert pair_counters == [0] * len(pairs)


def test_gluon_phase_weight_boxes_are_blocks_of_the_transformed_weights(monkeypatch):
    """The "fp8_ws" phase's weight descriptors on a CPU rank (host code only; the GEMM phase's torch model reads the
    weights through ``unblock_weights``): over the transformed weights as ``[El * N * K/128, 128]``, box [128, 128],
    and the box the loader asks for -- row ``((w_row // 128) * KB + kb) * 128`` for the left half of ring stage
    ``kb`` of a tile of 256 weight rows from ``w_row``, ``KB`` rows of blocks further for the right half -- is the
    transformed weights' rows ``[w_row, +128)`` / ``[w_row + 128, +128)`` x K block ``kb`` (``.rows()``)."""
    import megamoe.fused as mf
    from megamoe.fused import FusedConfig

    cfg = FusedConfig(block_m=128, programs_per_rank=1, num_warps=8, num_stages=2, kind="fp8_ws")
    monkeypatch.setattr(mf, "fused_config", lambda *a, **k: cfg)
    calls, descs = [], []
    real_descs = mf._ws_descriptors
    monkeypatch.setattr(mf, "_ws_descriptors", lambda c, *a: calls.append(c) or descs.append(real_descs(c, *a))
                        or descs[-1])
    case = MoECase(format="fp8", num_ranks=1, num_tokens=40, hidden=512, intermediate=384, num_topk=3,
                   num_experts=6, num_calls=1, block_m=128, impl="fused", seed=5)
    _check(run_case_local(case))
    c, (_, _, w1d, w2d, *_) = calls[-1], descs[-1]
    assert [list(w1d.block_shape), list(w2d.block_shape)] == [[128, 128]] * 2
    assert list(w1d.shape) == [6 * 2 * 384 * 512 // 128, 128] and list(w2d.shape) == [6 * 512 * 384 // 128, 128]
    for pair, desc in ((c.l1, w1d), (c.l2, w2d)):
        boxes = desc.base.view(torch.uint8)
        rows = pair.rows().view(torch.uint8).reshape(-1, pair.w.shape[-1])
        KB = pair.w.shape[-1] // 128
        for w_row in range(0, rows.shape[0], 256):
            for kb in range(KB):
                w0 = ((w_row // 128) * KB + kb) * 128
                for half, at in ((0, w0), (1, w0 + KB * 128)):
                    r = w_row + 128 * half
                    assert torch.equal(boxes[at:at + 128], rows[r:r + 128, kb * 128:(kb + 1) * 128]), (w_row, kb)


def test_gluon_phase_is_chosen_only_where_it_can_run(monkeypatch):
    """``tile_kind`` / ``ws_unsupported_reason`` on an sm_90 device (faked: this test runs on CPU): the Gluon GEMM
    phase above FP8_WS_MIN_EXPECTED expected tokens per expert with a pool of block 128 and I <= 4096; otherwise the
    one-launch tiles, with the reason naming what is missing; never for the FP8 x FP4 format or another GPU."""
    import megamoe.fused as mf

    monkeypatch.setattr(mf, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = torch.device("cuda")
    big = mf.FP8_WS_MIN_EXPECTED + 1
    ok = Layout(1, 48, 8192, 6, 7168, 3072, 128, "fp8")
    assert mf.ws_unsupported_reason(ok, cuda) is None
    assert mf.tile_kind(ok, "exact", big, cuda) == "fp8_ws"
    assert mf.tile_kind(ok, "exact", mf.FP8_SWAP_MAX_EXPECTED, cuda) == "fp8_swap"
    assert mf.tile_kind(ok, "exact", big, torch.device("cpu")) == "fp8"
    for layout, word in ((Layout(1, 48, 8192, 6, 7168, 3072, 64, "fp8"), "block_m=64"),
                         (Layout(1, 48, 8192, 6, 7168, 5120, 128, "fp8"), "I=5120"),
                         (Layout(1, 48, 8192, 6, 7296, 3072, 128, "fp8"), "H=7296")):
        assert word in mf.ws_unsupported_reason(layout, cuda)
        assert mf.tile_kind(layout, "exact", big, cuda) == "fp8"
    assert mf.tile_kind(Layout(1, 48, 8192, 6, 7168, 3072, 128), "exact", big, cuda) == "exact"
    with pytest.raises(ValueError, match="fp8_ws.*block_m=32"):
        mf.kernel_meta(ok, mf.FusedConfig(block_m=32, programs_per_rank=1, kind="fp8_ws"), has_clamp=False,
                       has_stats=False, timeline=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert "sm_90" in mf.ws_unsupported_reason(ok, cuda)



@pytest.mark.parametrize("block_m", [128, 64])
def test_gluon_phase_keywords_match_its_constexprs(block_m):
    """The keywords ``_run_ws`` launches the Gluon GEMM phase with (built on the host, so checked here without a
    GPU) are exactly the kernel's constexpr parameters plus the launch options, with the buffer's offsets."""
    import megamoe.fused as mf
    from megamoe.kernels import gemm_fp8_ws as kws

    sb = SymmBuffer.local(1, 6, 300, 3, 512, 384, block_m=128, format="fp8")[0]
    try:
        kw = mf._ws_constexprs(sb, block_m, True)
        assert set(kw) - {"num_warps", "maxnreg", "launch_pdl"} == {p.name for p in kws.fp8_gemm_phase_kernel.params
                                                      if p.is_constexpr}
        assert kw["OFF_L1"] == sb.layout.offset("l1_acts") and kw["STAGES"] == mf.fp8_ws_stages(block_m)
        assert kw["BULK"] == (mf.FP8_WS_BULK and block_m == 128) and kw["COPIER"] == mf.FP8_WS_COPIER
        assert mf.fp8_ws_stages(block_m) == mf.FP8_WS_STAGES[block_m] - kw["BULK"]  # the staging takes a stage
        assert kw["HAS_CLAMP"] and mf._ws_constexprs(sb, block_m, True) is kw  # cached
    finally:
        sb.destroy()

@pytest.mark.slow
@pytest.mark.parametrize("block_m", [128, 64])
def test_fused_three_launch_split_two_processes_bitwise(block_m):
    """The three-launch split across two CPU processes: front launches meeting in barrier 1, the GEMM phase's model
    pulling rows from the peer's input and writing L2 rows into the peer's combine buffer, back launches meeting in
    barrier 2; skewed routing, masks, two calls. Bit-exact."""
    import rank_fns

    case = MoECase(format="fp8", num_ranks=2, num_tokens=[150, 60], num_topk=2, num_experts=4, hidden=512,
                   intermediate=256, routing="skewed", masked_ratio=0.1, num_calls=2, block_m=128, impl="fused",
                   seed=23)
    _check(launch(rank_fns.run_case_rank_fp8_ws, 2, case, block_m, backend="cpu", timeout_s=300))
