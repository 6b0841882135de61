"""The SM90 FP8 x FP8 format (megamoe.quant_fp8): 1x128 / 128x128 quantisers, dequantisers, the weight transform."""
from __future__ import annotations

import pytest
import torch

from megamoe.quant import L1_INTERLEAVE_ROWS, TransformedWeights
from megamoe.quant_fp8 import (
    FP8_BLOCK,
    TransformedWeightsSM90,
    cast_grouped_weights_to_fp8,
    check_moe_weights_fp8,
    dequant_fp8_block,
    dequant_fp8_per_token_128,
    l1_original_rows,
    per_block_cast_to_fp8,
    per_token_cast_to_fp8_128,
    transform_weights_for_mega_moe_sm90,
    untransform_weights_for_mega_moe_sm90,
    weight_offset,
)

E4M3_GRID = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
E4M3_GRID = E4M3_GRID[torch.isfinite(E4M3_GRID)].unique()


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed=0, dtype=torch.float32):
    spread = torch.exp(torch.randn(*shape, generator=_gen(seed + 1)))
    return (torch.randn(*shape, generator=_gen(seed)) * spread).to(dtype)


def _nearest_e4m3_error_bound(v: torch.Tensor) -> torch.Tensor:
    """Half the gap between the e4m3 neighbours of |v| (|v| <= 448): the largest RNE rounding error at v."""
    a = v.abs().double()
    grid = E4M3_GRID.double().abs().unique()
    idx = torch.searchsorted(grid, a).clamp(1, len(grid) - 1)
    return (grid[idx] - grid[idx - 1]) / 2


# ---------------------------------------------------------------------------------------------------------
# 1 x 128 activations
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_token_scale_rule_matches_deepgemm_sm90(dtype):
    x = _randn(7, 384, dtype=dtype)
    x[2, 128:256] = 0  # an all-zero group: amax floored at 1e-4
    q, sf = per_token_cast_to_fp8_128(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (7, 384)
    assert sf.dtype == torch.float32 and sf.shape == (7, 3)
    amax = x.float().unflatten(1, (3, 128)).abs().amax(-1).clamp(min=1e-4)
    assert torch.equal(sf, amax / 448.0)  # fp32, not rounded to a power of two
    assert not torch.equal(sf, torch.exp2(torch.ceil(torch.log2(sf))))
    expected = (x.float().unflatten(1, (3, 128)) * (1.0 / sf).unsqueeze(-1)).to(torch.float8_e4m3fn).flatten(1)
    assert torch.equal(q.view(torch.uint8), expected.view(torch.uint8))
    assert sf[2, 1].item() == pytest.approx(1e-4 / 448, rel=1e-6) and q[2, 128:256].float().abs().max() == 0
    # every group's amax element lands on (or an ulp from) 448
    assert torch.allclose(q.float().unflatten(1, (3, 128)).abs().amax(-1)[amax > 1e-4], torch.tensor(448.0))


def test_per_token_roundtrip_error_within_half_an_e4m3_ulp():
    x = _randn(16, 256, seed=3)
    q, sf = per_token_cast_to_fp8_128(x)
    back = dequant_fp8_per_token_128(q, sf, dtype=torch.float64)
    scaled = x.double() / sf.double().repeat_interleave(128, dim=1)
    bound = _nearest_e4m3_error_bound(scaled.clamp(-448, 448)) * sf.double().repeat_interleave(128, dim=1)
    assert bool(((back - x.double()).abs() <= bound * (1 + 1e-6) + 1e-30).all())
    # float64 dequantisation is exact: q * sf
    assert torch.equal(back, q.double() * sf.double().repeat_interleave(128, 1))


def test_per_token_rejects_bad_inputs():
    with pytest.raises(ValueError, match="x: dimension 1 must be a positive multiple of 128"):
        per_token_cast_to_fp8_128(torch.zeros(2, 96))
    with pytest.raises(ValueError, match="x: contains NaN"):
        per_token_cast_to_fp8_128(torch.full((1, 128), float("nan")))
    with pytest.raises(TypeError, match="x: expected float32"):
        per_token_cast_to_fp8_128(torch.zeros(1, 128, dtype=torch.int32))
    with pytest.raises(ValueError, match="sf: expected shape"):
        dequant_fp8_per_token_128(torch.zeros(2, 128).to(torch.float8_e4m3fn), torch.ones(2, 2))
    with pytest.raises(TypeError, match="sf: expected a torch.float32"):
        dequant_fp8_per_token_128(torch.zeros(2, 128).to(torch.float8_e4m3fn), torch.ones(2, 1, dtype=torch.int32))


# ---------------------------------------------------------------------------------------------------------
# 128 x 128 weights
# ---------------------------------------------------------------------------------------------------------


def test_per_block_one_scale_per_128x128_block():
    w = _randn(256, 384, seed=5)
    w[128:, 256:] *= 1000  # one block far larger: only its own scale moves
    q, sf = per_block_cast_to_fp8(w)
    assert q.shape == (256, 384) and sf.shape == (2, 3) and sf.dtype == torch.float32
    amax = w.reshape(2, 128, 3, 128).abs().amax(dim=(1, 3)).clamp(min=1e-4)
    assert torch.equal(sf, amax / 448.0)
    assert sf[1, 2] > 100 * sf[1, 1]
    back = dequant_fp8_block(q, sf, dtype=torch.float64)
    per_elem = sf.double().repeat_interleave(128, 0).repeat_interleave(128, 1)
    bound = _nearest_e4m3_error_bound((w.double() / per_elem).clamp(-448, 448)) * per_elem
    assert bool(((back - w.double()).abs() <= bound * (1 + 1e-6)).all())


def test_grouped_cast_is_per_expert():
    w = _randn(3, 256, 128, seed=7)
    q, sf = cast_grouped_weights_to_fp8(w)
    assert sf.shape == (3, 2, 1)
    for e in range(3):
        qe, sfe = per_block_cast_to_fp8(w[e])
        assert torch.equal(q[e].view(torch.uint8), qe.view(torch.uint8)) and torch.equal(sf[e], sfe)


def test_per_block_rejects_unaligned_rows():
    with pytest.raises(ValueError, match="w: dimension 0 must be a positive multiple of 128"):
        per_block_cast_to_fp8(torch.zeros(100, 128))
    with pytest.raises(ValueError, match="w: expected a 3-D"):
        cast_grouped_weights_to_fp8(torch.zeros(128, 128))


# ---------------------------------------------------------------------------------------------------------
# Weight transform
# ---------------------------------------------------------------------------------------------------------


def _weights(E=2, H=256, I=256, seed=11):
    l1 = cast_grouped_weights_to_fp8(_randn(E, 2 * I, H, seed=seed))
    l2 = cast_grouped_weights_to_fp8(_randn(E, H, I, seed=seed + 2))
    return l1, l2


def test_transform_interleaves_l1_rows_by_8_blocks_the_bytes_and_keeps_every_scale():
    (w1, sf1), (w2, sf2) = l1, l2 = _weights()
    t1, t2 = transform_weights_for_mega_moe_sm90(l1, l2)
    assert isinstance(t1, TransformedWeightsSM90) and (t1.role, t2.role) == ("l1", "l2") and t1.format == "fp8"
    assert t1.w.shape == w1.shape and t2.w.shape == w2.shape and t1.w.is_contiguous() and t2.w.is_contiguous()
    I = w1.shape[1] // 2
    g = L1_INTERLEAVE_ROWS
    r1 = t1.rows()
    # rows [gate0..7, up0..7, gate8..15, up8..15, ...]
    assert torch.equal(r1[:, :g].view(torch.uint8), w1[:, :g].view(torch.uint8))
    assert torch.equal(r1[:, g:2 * g].view(torch.uint8), w1[:, I:I + g].view(torch.uint8))
    assert torch.equal(r1[:, 2 * g:3 * g].view(torch.uint8), w1[:, g:2 * g].view(torch.uint8))
    assert torch.equal(t1.sf, sf1) and torch.equal(t2.sf, sf2) and torch.equal(t2.rows().view(torch.uint8),
                                                                               w2.view(torch.uint8))
    # the bytes: blocked by 128 x 128, value (n, k) of an expert at weight_offset(n, k, K), each block one run
    H = w1.shape[2]
    n, k = torch.meshgrid(torch.arange(2 * I), torch.arange(H), indexing="ij")
    flat = t1.w.view(torch.uint8).reshape(t1.w.shape[0], -1)
    assert torch.equal(flat[:, weight_offset(n, k, H).reshape(-1)].view_as(r1.view(torch.uint8)),
                       r1.view(torch.uint8))
    assert torch.equal(flat[0, :128 * 128].view(128, 128), r1[0, :128, :128].view(torch.uint8))
    assert torch.equal(flat[0, 128 * 128:2 * 128 * 128].view(128, 128), r1[0, :128, 128:256].view(torch.uint8))
    # the original-row map: transformed row r is untransformed row orig[r], whose scale is sf1[orig[r] // 128]
    orig = l1_original_rows(2 * I)
    assert torch.equal(r1.view(torch.uint8), w1.view(torch.uint8)[:, orig])
    assert sorted(orig.tolist()) == list(range(2 * I))
    # DeepGEMM's rule: interleaved 128-row tile t reads gate block t // 2 and up block I/128 + t // 2
    for t in range(2 * I // 128):
        rows = orig[t * 128:(t + 1) * 128] // 128
        assert set(rows.tolist()) == {t // 2, I // 128 + t // 2}
    # dequantising through the map reproduces the untransformed weights
    dq_t = r1.double() * sf1.double()[:, orig // 128].repeat_interleave(128, dim=2)
    assert torch.equal(dq_t, dequant_fp8_block(w1, sf1, torch.float64)[:, orig])


def test_untransform_is_exact_and_transform_refuses_twice():
    l1, l2 = _weights(E=1, H=128, I=128)
    t1, t2 = transform_weights_for_mega_moe_sm90(l1, l2)
    (u1, usf1), (u2, usf2) = untransform_weights_for_mega_moe_sm90(t1, t2)
    assert torch.equal(u1.view(torch.uint8), l1[0].view(torch.uint8)) and torch.equal(usf1, l1[1])
    assert torch.equal(u2.view(torch.uint8), l2[0].view(torch.uint8)) and torch.equal(usf2, l2[1])
    with pytest.raises(TypeError, match="l1_weights: these weights are already transformed"):
        transform_weights_for_mega_moe_sm90(t1, l2)
    with pytest.raises(TypeError, match="l1_weights: expected the l1 TransformedWeightsSM90"):
        untransform_weights_for_mega_moe_sm90(l1, t2)
    with pytest.raises(TypeError, match="l2_weights: expected the l2"):
        untransform_weights_for_mega_moe_sm90(t1, t1)
    assert not isinstance(t1, TransformedWeights)  # the FP4 op's tag is a different type
    assert repr(t1).startswith("TransformedWeightsSM90(role='l1'")


def test_check_weights_names_the_argument():
    l1, l2 = _weights(E=1, H=128, I=128)
    with pytest.raises(TypeError, match=r"l1_weights: expected \(float8_e4m3fn, float32\)"):
        check_moe_weights_fp8((l1[0].view(torch.int8), l1[1]), l2)
    with pytest.raises(ValueError, match="l1_weights: scales"):
        check_moe_weights_fp8((l1[0], l1[1][:, :1]), l2)
    with pytest.raises(ValueError, match="l2_weights: shapes"):
        check_moe_weights_fp8(l1, (l2[0][:, :, :0], l2[1]))
    assert check_moe_weights_fp8(l1, l2) == (1, 128, 128)
    assert FP8_BLOCK == 128


# ---------------------------------------------------------------------------------------------------------
# Reference (megamoe.reference.reference_fp8_mega_moe) against float64
# ---------------------------------------------------------------------------------------------------------

BF16_REL = 2.0**-8  # RNE to bf16 (8 significant bits): |error| <= 2^-8 |value|
E4M3_REL = 2.0**-4  # RNE to e4m3 normals (4 significant bits): |error| <= 2^-4 |value|
E4M3_SUB_ABS = 2.0**-10  # e4m3 subnormal spacing 2^-9: |error| <= 2^-10 (times the scale)
FP32_EPS = 2.0**-24


def _fp8_problem(**kw):
    from megamoe.testing_fp8 import make_fp8_problem

    args = dict(num_ranks=1, num_tokens=24, hidden=256, intermediate=256, num_experts=4, num_topk=2, seed=1)
    args.update(kw)
    return make_fp8_problem(**args)


def _float64_layer(p, clamp=None):
    """The layer in float64 on the same quantised inputs, with no rounding at all between the GEMMs, plus a
    per-element bound on how far the reference's roundings may move y (derived from the formats, see below)."""
    x = torch.cat(p.x)
    a = dequant_fp8_per_token_128(x, torch.cat(p.x_sf), torch.float64)
    idx, tw = torch.cat(p.topk_idx), torch.cat(p.topk_weights).double()
    w1 = dequant_fp8_block(*p.l1_weights, dtype=torch.float64)
    w2 = dequant_fp8_block(*p.l2_weights, dtype=torch.float64)
    I = p.intermediate
    y = torch.zeros(x.shape[0], p.hidden, dtype=torch.float64)
    bound = torch.zeros_like(y)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            if e < 0:
                continue
            h = w1[e] @ a[t]
            s1 = w1[e].abs() @ a[t].abs()  # sum |w a|: scale of the float32 accumulation error
            # L1 output: fp32 block accumulation (<= (128 + K/128 + 3) eps * s1), then bf16 (<= 2^-8 relative)
            e1 = (128 + p.hidden / 128 + 3) * FP32_EPS * s1
            e1 = e1 + BF16_REL * (h.abs() + e1)
            g, u = h[:I], h[I:]
            if clamp is not None:
                g, u = g.clamp(max=clamp), u.clamp(-clamp, clamp)
            sig = torch.sigmoid(g)
            act = g * sig * u * tw[t, j]
            # first-order propagation of the L1 error through silu(g) * u (|d silu / dg| <= 1.1) plus float32 slack
            ea = (1.1 * e1[:I] * u.abs() + (g * sig).abs() * e1[I:]) * tw[t, j] + 8 * FP32_EPS * act.abs()
            # the FP8 requant of act (per 128 columns, scale amax/448): 2^-4 relative, or 2^-10 scale if subnormal
            amax = (act.abs() + ea).unflatten(0, (-1, 128)).amax(-1).clamp(min=1e-4).repeat_interleave(128)
            ea = ea + E4M3_REL * (act.abs() + ea) + E4M3_SUB_ABS * amax / 448
            o = w2[e] @ act
            eo = w2[e].abs() @ ea + (128 + I / 128 + 3) * FP32_EPS * (w2[e].abs() @ (act.abs() + ea))
            eo = eo + BF16_REL * (o.abs() + eo)
            y[t] += o
            bound[t] += eo + 2 * FP32_EPS * (y[t].abs() + eo)
    bound += BF16_REL * (y.abs() + bound)
    return y, bound


@pytest.mark.parametrize("clamp", [None, 0.5])
def test_reference_fp8_within_format_bounds_of_float64(clamp):
    from megamoe.reference import reference_fp8_mega_moe

    p = _fp8_problem(masked_ratio=0.2)
    y = reference_fp8_mega_moe(p.x[0], p.x_sf[0], p.topk_idx[0], p.topk_weights[0], p.l1_weights, p.l2_weights,
                               activation_clamp=clamp)
    y64, bound = _float64_layer(p, clamp)
    err = (y.double() - y64).abs()
    assert bool((err <= bound).all()), f"worst excess {(err - bound).max().item()}"
    # That bound is a worst case (errors of one sign on every term). Statistically the rounding errors of the I
    # terms of an L2 dot are independent and zero-mean, each at most 2^-4 of its term (the FP8 requant dominates):
    # the error's norm is then at most ~2^-4 of the output's.
    rel_fro = ((y.double() - y64).norm() / y64.norm()).item()
    assert 1e-4 < rel_fro < E4M3_REL, rel_fro
    # masked tokens (every slot -1) give exactly 0
    dead = (p.topk_idx[0] < 0).all(dim=1)
    assert bool((y[dead] == 0).all())


def test_reference_fp8_detects_a_wrong_scale_block():
    """The bound above is tight enough to catch a swapped gate/up scale block (the test can fail)."""
    from megamoe.reference import reference_fp8_mega_moe

    p = _fp8_problem(seed=4)
    w1, sf1 = p.l1_weights
    I = p.intermediate
    swapped = torch.cat([sf1[:, I // 128:], sf1[:, :I // 128]], dim=1) * 4  # gate <-> up blocks, and off by 4x
    y_bad = reference_fp8_mega_moe(p.x[0], p.x_sf[0], p.topk_idx[0], p.topk_weights[0], (w1, swapped),
                                   p.l2_weights)
    y64, bound = _float64_layer(p)
    assert not bool(((y_bad.double() - y64).abs() <= bound).all())
    assert ((y_bad.double() - y64).norm() / y64.norm()).item() > E4M3_REL


def test_reference_fp8_ep_equals_single_rank_and_intermediates():
    from megamoe.reference import reference_fp8_mega_moe, reference_fp8_mega_moe_ep

    p = _fp8_problem(num_ranks=2, num_tokens=[5, 0], num_experts=4, masked_ratio=0.3, seed=2)
    ys = reference_fp8_mega_moe_ep(p.x, p.x_sf, p.topk_idx, p.topk_weights, p.l1_weights, p.l2_weights, 2)
    y, inter = reference_fp8_mega_moe(torch.cat(p.x), torch.cat(p.x_sf), torch.cat(p.topk_idx),
                                      torch.cat(p.topk_weights), p.l1_weights, p.l2_weights,
                                      return_intermediates=True)
    assert [t.shape[0] for t in ys] == [5, 0]
    assert torch.equal(torch.cat(ys), y)
    assert int(inter["expert_recv_count"].sum()) == int((torch.cat(p.topk_idx) >= 0).sum())
    for l2_in, l2_sf in inter["l2_in"]:
        assert l2_in.dtype == torch.float8_e4m3fn and l2_sf.dtype == torch.float32
        assert l2_sf.shape == (l2_in.shape[0], p.intermediate // 128)


def test_reference_fp8_rejects_wrong_inputs_by_name():
    from megamoe.reference import reference_fp8_mega_moe

    p = _fp8_problem(num_tokens=3)
    args = (p.x[0], p.x_sf[0], p.topk_idx[0], p.topk_weights[0])
    with pytest.raises(TypeError, match="x_sf: expected torch.float32"):
        reference_fp8_mega_moe(p.x[0], p.x_sf[0].view(torch.int32), *args[2:], p.l1_weights, p.l2_weights)
    t1, t2 = transform_weights_for_mega_moe_sm90(p.l1_weights, p.l2_weights)
    with pytest.raises(TypeError, match="l1_weights: the reference takes untransformed weights"):
        reference_fp8_mega_moe(*args, t1, t2)
    with pytest.raises(TypeError, match="l1_weights: expected \\(float8_e4m3fn, float32\\)"):
        from megamoe.quant import cast_grouped_weights_to_fp4

        reference_fp8_mega_moe(*args, cast_grouped_weights_to_fp4(torch.zeros(4, 512, 256)), p.l2_weights)


# ---------------------------------------------------------------------------------------------------------
# SymmBuffer
# ---------------------------------------------------------------------------------------------------------


def test_symm_buffer_takes_the_format():
    from megamoe.symm import SymmBuffer, get_symm_buffer_for_mega_moe

    sbs = SymmBuffer.local(2, 4, 16, 2, 256, 128, block_m=16, device="cpu", format="fp8")
    assert sbs[0].layout.format == "fp8" and sbs[1].x_sf.dtype == torch.float32
    assert sbs[0].l2_acts_sf.dtype == torch.float32 and sbs[0].l2_acts_sf.shape[1] == 1
    assert SymmBuffer.local(1, 4, 16, 2, 256, 128, block_m=16, device="cpu")[0].x_sf.dtype == torch.int32
    sb = get_symm_buffer_for_mega_moe(None, 4, 16, 2, 256, 128, block_m=16, backend="cpu", mma_type="fp8xfp8")
    assert sb.layout.format == "fp8" and sb.x_sf.dtype == torch.float32
    with pytest.raises(ValueError, match="mma_type='fp8xfp4' does not match format='fp8'"):
        SymmBuffer.local(1, 4, 16, 2, 256, 128, device="cpu", format="fp8", mma_type="fp8xfp4")
    with pytest.raises(ValueError, match="format='int4' must be one of"):
        SymmBuffer.local(1, 4, 16, 2, 256, 128, device="cpu", format="int4")
