"""The reference MoE (megamoe.reference) and the shared test helpers (megamoe.testing)."""
from __future__ import annotations

import pytest
import torch

from megamoe.quant import dequant_fp4, dequant_fp8, per_token_cast_to_fp8
from megamoe.reference import combine, reference_mega_moe, reference_mega_moe_ep, swiglu
from megamoe.testing import Problem, assert_moe_close, make_problem, moe_error_stats

H, I, E, K = 256, 128, 8, 4


def _single_rank_inputs(p: Problem) -> tuple[torch.Tensor, ...]:
    """Every rank's tokens concatenated, as one rank would see them."""
    return tuple(torch.cat(parts) for parts in (p.x, p.x_sf, p.topk_idx, p.topk_weights))


def _naive_reference(p: Problem, activation_clamp: float | None = None) -> torch.Tensor:
    """The layer token by token, slot by slot, with float64 GEMMs: a second formulation of the semantics
    whose only difference from the reference is the GEMMs' summation order and precision."""
    x, x_sf, topk_idx, topk_weights = _single_rank_inputs(p)
    a = dequant_fp8(x, x_sf).double()
    w1, w2 = dequant_fp4(*p.l1_weights).double(), dequant_fp4(*p.l2_weights).double()
    y = torch.zeros(x.shape, dtype=torch.bfloat16)
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1], dtype=torch.float32)
        for j in range(topk_idx.shape[1]):
            e = int(topk_idx[t, j])
            if e < 0:
                continue
            h = (w1[e] @ a[t]).to(torch.bfloat16)
            act = swiglu(h.unsqueeze(0), activation_clamp) * topk_weights[t, j]
            act_q, act_sf = per_token_cast_to_fp8(act)
            acc += (w2[e] @ dequant_fp8(act_q, act_sf)[0].double()).to(torch.bfloat16).float()
        y[t] = acc.to(torch.bfloat16)
    return y


# ---------------------------------------------------------------------------------------------------------
# Reference semantics
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "num_ranks, num_tokens", [(1, [13]), (2, [9, 0]), (4, [5, 0, 11, 3])]
)
def test_single_rank_and_ep_forms_are_bitwise_equal(num_ranks, num_tokens):
    p = make_problem(num_ranks, num_tokens, H, I, E, K, masked_ratio=0.25, seed=num_ranks)
    assert any(bool((idx < 0).any()) for idx in p.topk_idx)  # masked slots present
    ys = p.reference()
    assert [tuple(y.shape) for y in ys] == [(n, H) for n in num_tokens]
    assert all(y.dtype == torch.bfloat16 for y in ys)
    y_single = reference_mega_moe(*_single_rank_inputs(p), p.l1_weights, p.l2_weights)
    assert torch.equal(torch.cat(ys), y_single)


@pytest.mark.parametrize("routing", ["uniform", "one_expert", "skewed"])
def test_ep_equality_with_clamp_and_routings(routing):
    p = make_problem(2, [12, 7], H, I, E, K, masked_ratio=0.1, routing=routing, seed=3)
    y_single = reference_mega_moe(*_single_rank_inputs(p), p.l1_weights, p.l2_weights, activation_clamp=0.5)
    assert torch.equal(torch.cat(p.reference(activation_clamp=0.5)), y_single)


@pytest.mark.parametrize("activation_clamp", [None, 0.5])
def test_reference_matches_token_by_token_float64_form(activation_clamp):
    p = make_problem(1, 24, H, I, E, K, masked_ratio=0.2, seed=5)
    y = reference_mega_moe(*_single_rank_inputs(p), p.l1_weights, p.l2_weights, activation_clamp=activation_clamp)
    stats = assert_moe_close(y, _naive_reference(p, activation_clamp))
    assert stats["rel_fro"] < 2e-3


def test_intermediates_are_consistent():
    p = make_problem(1, 20, H, I, E, K, masked_ratio=0.3, seed=6)
    x, x_sf, topk_idx, topk_weights = _single_rank_inputs(p)
    y, inter = reference_mega_moe(
        x, x_sf, topk_idx, topk_weights, p.l1_weights, p.l2_weights, return_intermediates=True
    )
    valid = topk_idx[topk_idx >= 0]
    assert torch.equal(inter["expert_recv_count"], torch.bincount(valid, minlength=E))
    for e in range(E):
        rows = inter["expert_rows"][e]
        assert bool((topk_idx[rows[:, 0], rows[:, 1]] == e).all())
        assert inter["l1_out"][e].shape == (len(rows), 2 * I) and inter["l1_out"][e].dtype == torch.bfloat16
        act = swiglu(inter["l1_out"][e], None) * topk_weights[rows[:, 0], rows[:, 1]].unsqueeze(1)
        (q, sf), (want_q, want_sf) = inter["l2_in"][e], per_token_cast_to_fp8(act)
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(sf, want_sf)
    assert inter["combine"].shape == (K, x.shape[0], H)
    assert not bool(inter["combine"][topk_idx.T < 0].any())  # masked slots never written
    assert torch.equal(combine(inter["combine"], topk_idx), y)


def test_combine_sums_in_float32_then_rounds_once():
    buffer = torch.tensor([[[1.0]], [[2.0**-8]], [[2.0**-8]], [[100.0]]], dtype=torch.bfloat16)
    # bf16(1 + 2^-8) = 1 (tie to even), yet two of them in float32 give 1 + 2^-7, representable in bf16
    assert combine(buffer[:3], torch.tensor([[0, 1, 2]])).item() == 1.0 + 2.0**-7
    assert combine(buffer, torch.tensor([[0, -1, 2, -1]])).item() == 1.0  # masked slots are skipped


def test_all_masked_token_gives_zero():
    p = make_problem(2, [6, 4], H, I, E, K, seed=7)
    p.topk_idx[1][2] = -1
    p.topk_weights[1][2] = 0.0
    ys = p.reference()
    assert torch.equal(ys[1][2], torch.zeros(H, dtype=torch.bfloat16))
    assert bool((ys[1][[0, 1, 3]].abs().sum(dim=1) > 0).all()) and bool((ys[0].abs().sum(dim=1) > 0).all())
    x, x_sf, _, _ = _single_rank_inputs(p)
    y = reference_mega_moe(x, x_sf, torch.full((10, K), -1), torch.zeros(10, K), p.l1_weights, p.l2_weights)
    assert torch.equal(y, torch.zeros(10, H, dtype=torch.bfloat16))


def test_swiglu_clamp():
    h = torch.tensor([[10.0, -10.0, 0.5, 10.0, -10.0, -0.5]])  # gate | up
    c = 1.0
    gate, up = torch.tensor([1.0, -10.0, 0.5]), torch.tensor([1.0, -1.0, -0.5])
    exp = lambda v: torch.exp(v.double()).float()  # noqa: E731  (float64 exp, rounded once: exp_f32)
    assert torch.equal(swiglu(h, c)[0], gate / (1 + exp(-gate)) * up)
    gate, up = h[0, :3], h[0, 3:]
    assert torch.equal(swiglu(h, None)[0], gate / (1 + exp(-gate)) * up)


def test_clamp_changes_output_only_when_active():
    p = make_problem(1, 16, H, I, E, K, seed=8)
    args = (*_single_rank_inputs(p), p.l1_weights, p.l2_weights)
    y, inter = reference_mega_moe(*args, return_intermediates=True)
    assert max(h.float().abs().max().item() for h in inter["l1_out"] if len(h)) < 1e4
    assert torch.equal(reference_mega_moe(*args, activation_clamp=1e4), y)
    y_clamped = reference_mega_moe(*args, activation_clamp=0.25)
    assert not torch.equal(y_clamped, y)
    assert y_clamped.float().abs().max() < y.float().abs().max()


# ---------------------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------------------


def test_reference_validation():
    p = make_problem(2, [4, 4], H, I, E, K, seed=9)
    x, x_sf, idx, w = _single_rank_inputs(p)
    l1, l2 = p.l1_weights, p.l2_weights
    with pytest.raises(ValueError, match="topk_idx.*expert ids"):
        reference_mega_moe(x, x_sf, idx.clone().fill_(E), w, l1, l2)
    with pytest.raises(ValueError, match="topk_idx.*expert ids"):
        reference_mega_moe(x, x_sf, idx.clone().fill_(-2), w, l1, l2)
    with pytest.raises(TypeError, match=r"\bx\b"):
        reference_mega_moe(x.float(), x_sf, idx, w, l1, l2)
    with pytest.raises(TypeError, match="topk_idx"):
        reference_mega_moe(x, x_sf, idx.int(), w, l1, l2)
    with pytest.raises(ValueError, match="x_sf"):
        reference_mega_moe(x, x_sf[:, :1], idx, w, l1, l2)
    with pytest.raises(ValueError, match="topk_weights"):
        reference_mega_moe(x, x_sf, idx, w[:, :2], l1, l2)
    with pytest.raises(ValueError, match=r"\bx\b.*hidden"):
        reference_mega_moe(x[:, :128], x_sf[:, :1], idx, w, l1, l2)
    with pytest.raises(ValueError, match="l2_weights"):
        reference_mega_moe(x, x_sf, idx, w, l1, (l2[0][:, :, :32], l2[1][:, :, :1]))
    with pytest.raises(ValueError, match="activation_clamp"):
        reference_mega_moe(x, x_sf, idx, w, l1, l2, activation_clamp=0.0)


def test_reference_ep_validation():
    p = make_problem(2, [4, 3], H, I, E, K, seed=10)
    args = (p.x, p.x_sf, p.topk_idx, p.topk_weights, p.l1_weights, p.l2_weights)
    with pytest.raises(ValueError, match="num_ranks"):
        reference_mega_moe_ep(*args, 3)
    with pytest.raises(ValueError, match="xs"):
        reference_mega_moe_ep(p.x[:1], *args[1:], 2)
    bad_idx = [p.topk_idx[0], p.topk_idx[1].clone().fill_(E + 1)]
    with pytest.raises(ValueError, match=r"topk_idxs\[1\]"):
        reference_mega_moe_ep(p.x, p.x_sf, bad_idx, p.topk_weights, p.l1_weights, p.l2_weights, 2)


# ---------------------------------------------------------------------------------------------------------
# make_problem
# ---------------------------------------------------------------------------------------------------------


def _problem_tensors(p: Problem) -> list[torch.Tensor]:
    return [*p.x_bf16, *p.x_sf, *p.topk_idx, *p.topk_weights, *p.l1_weights, *p.l2_weights]


def test_make_problem_is_deterministic_and_shaped():
    p = make_problem(2, [5, 0], H, I, E, K, masked_ratio=0.3, seed=11)
    q = make_problem(2, [5, 0], H, I, E, K, masked_ratio=0.3, seed=11)
    r = make_problem(2, [5, 0], H, I, E, K, masked_ratio=0.3, seed=12)
    assert all(torch.equal(a, b) for a, b in zip(_problem_tensors(p), _problem_tensors(q)))
    assert not torch.equal(p.l1_weights[0], r.l1_weights[0])
    assert p.num_tokens == [5, 0] and p.num_local_experts == 4
    assert p.x[0].dtype == torch.float8_e4m3fn and p.x[1].shape == (0, H) and p.x_sf[0].shape == (5, H // 128)
    assert p.topk_idx[1].shape == (0, K) and p.topk_weights[0].dtype == torch.float32
    assert p.l1_weights[0].shape == (E, 2 * I, H // 2) and p.l2_weights[1].shape == (E, H, I // 128)
    assert torch.equal(p.x[0].float(), per_token_cast_to_fp8(p.x_bf16[0])[0].float())
    (l1_w, l1_sf), (l2_w, _) = p.weights_for_rank(1)
    assert torch.equal(l1_w, p.l1_weights[0][4:]) and torch.equal(l1_sf, p.l1_weights[1][4:]) and len(l2_w) == 4
    # the weights do not depend on the token counts
    assert torch.equal(make_problem(2, 3, H, I, E, K, seed=11).l2_weights[0], p.l2_weights[0])


@pytest.mark.parametrize("routing", ["uniform", "one_expert", "skewed"])
def test_make_problem_routing(routing):
    num_experts = 32
    p = make_problem(2, 64, H, I, num_experts, K, masked_ratio=0.25, routing=routing, seed=13)
    idx, w = torch.cat(p.topk_idx), torch.cat(p.topk_weights)
    masked = idx < 0
    assert 0.15 < masked.float().mean().item() < 0.35
    assert bool((w[masked] == 0).all()) and bool((w[~masked] > 0).all())
    assert bool((w.sum(dim=1) <= 1 + 1e-6).all())
    ordered = idx.sort(dim=1).values
    assert not bool(((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any())  # distinct experts
    counts = torch.bincount(idx[~masked], minlength=num_experts).float()
    if routing == "one_expert":
        assert bool((idx[:, 0][~masked[:, 0]] == 0).all())
        assert bool((idx[~masked] < p.num_local_experts).all())  # El >= K: everything lands on rank 0
    elif routing == "skewed":
        assert counts.max() > 3 * counts.mean()
    else:
        assert counts.max() < 2 * counts.mean()


def test_make_problem_output_scale():
    y = torch.cat(make_problem(2, 32, H, I, E, K, seed=14).reference()).float()
    rms = y.pow(2).mean().sqrt().item()
    assert bool(torch.isfinite(y).all()) and 0.05 < rms < 5


def test_make_problem_validation():
    with pytest.raises(ValueError, match="num_experts"):
        make_problem(3, 4, H, I, E, K)
    with pytest.raises(ValueError, match="num_tokens"):
        make_problem(2, [4], H, I, E, K)
    with pytest.raises(ValueError, match="hidden"):
        make_problem(1, 4, 200, I, E, K)
    with pytest.raises(ValueError, match="routing"):
        make_problem(1, 4, H, I, E, K, routing="zipf")
    with pytest.raises(ValueError, match="rank"):
        make_problem(2, 4, H, I, E, K).weights_for_rank(2)


# ---------------------------------------------------------------------------------------------------------
# assert_moe_close
# ---------------------------------------------------------------------------------------------------------


def _reference_y() -> torch.Tensor:
    return torch.cat(make_problem(2, 32, H, I, E, K, seed=15).reference())


def test_assert_moe_close_passes_on_identical_and_ulp_flips():
    y = _reference_y()
    stats = assert_moe_close(y, y.clone())
    assert stats["rel_fro"] == 0.0 and stats["num_outliers"] == 0 and stats["finite"]
    flipped = y.clone().view(torch.int16)
    chosen = torch.randperm(y.numel(), generator=torch.Generator().manual_seed(0))[: y.numel() // 200]
    flipped.view(-1)[chosen] += 1  # one bf16 ulp on 0.5% of elements
    assert_moe_close(flipped.view(torch.bfloat16), y)


def test_assert_moe_close_fails_on_perturbed():
    y = _reference_y()
    with pytest.raises(AssertionError, match="rel_fro"):
        assert_moe_close((y.float() * 1.01).to(torch.bfloat16), y)
    # 2% of elements off by ~1.1%: small in norm, too many outliers
    perturbed = y.float()
    chosen = torch.randperm(y.numel(), generator=torch.Generator().manual_seed(1))[: y.numel() // 50]
    perturbed.view(-1)[chosen] *= 1 + 2.0**-6.5
    stats = moe_error_stats(perturbed, y)
    assert stats["rel_fro"] < 2e-3 and stats["frac_outliers"] > 1e-2
    with pytest.raises(AssertionError, match="frac_outliers") as info:
        assert_moe_close(perturbed, y, name="y_kernel")
    assert "y_kernel" in str(info.value) and "worst element" in str(info.value)
    nan = y.clone()
    nan[3, 5] = float("nan")
    with pytest.raises(AssertionError, match=r"non-finite.*\[3, 5\]"):
        assert_moe_close(nan, y)
    with pytest.raises(AssertionError, match="shape"):
        assert_moe_close(y[:1], y)


def test_fp8_mma_profile_tolerates_rounding_flips_but_not_a_wrong_row():
    y = _reference_y()
    flipped = y.float() * (1 + 2.0**-6.5 * (torch.rand(y.shape, generator=torch.Generator().manual_seed(2)) < 0.05))
    assert_moe_close(flipped, y, accumulation="fp8_mma")
    wrong_row = y.clone()
    wrong_row[1] = wrong_row[2]
    with pytest.raises(AssertionError, match="max_row_rel"):
        assert_moe_close(wrong_row, y, accumulation="fp8_mma")


def test_exp_f32_does_not_depend_on_the_math_library():
    """float32 exp differs between torch and NumPy (the interpreter's) in the last bit for many inputs; exp_f32
    (float64, rounded once) agrees with NumPy's float64 exp rounded to float32 on every input tried."""
    import numpy as np

    from megamoe.reference import exp_f32
    x = torch.linspace(-30, 30, 1 << 16)
    assert int((torch.exp(x) != torch.from_numpy(np.exp(x.numpy()))).sum()) > 0  # why exp_f32 exists
    assert torch.equal(exp_f32(x), torch.from_numpy(np.exp(x.numpy().astype(np.float64)).astype(np.float32)))
