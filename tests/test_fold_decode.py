"""``megamoe.fold_decode``: transformed FP4 weights decoded once into folded e4m3 + row exponents, bit for bit what
the FP8 x FP4 Gluon phase's decode partitions compute (its torch model ``megamoe.gemm_phase._folded_fp4_rows``)."""
import pytest
import torch
import triton
import triton.language as tl

import megamoe.kernels.fold_decode as kfd
from megamoe.fold_decode import fold_decode
from megamoe.gemm_phase import _folded_fp4_rows
from megamoe.quant import cast_grouped_weights_to_fp4, transform_weights_for_mega_moe


def _weights(El=2, H=512, I=256, spread=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    l1 = cast_grouped_weights_to_fp4(torch.randn(El, 2 * I, H, generator=g))
    l2 = cast_grouped_weights_to_fp4(torch.randn(El, H, I, generator=g))
    if spread:  # 30 % of the scale words 2^10 lower (and one group 2^14 lower): folds that round into subnormals / 0
        def low(sf):
            lower = torch.rand(sf.shape, generator=g) < 0.3
            sf = torch.where(lower, sf - 0x0A0A0A0A, sf)
            sf[0, 0, 0] -= 0x0E
            return sf
        l1, l2 = (l1[0], low(l1[1])), (l2[0], low(l2[1]))
    return transform_weights_for_mega_moe(l1, l2)


@pytest.mark.parametrize("spread", [False, True])
def test_fold_decode_equals_the_decode_partitions_model(spread):
    for w, sf in _weights(spread=spread):
        folded, row_exp = fold_decode((w, sf))
        for e in range(w.shape[0]):
            rows = torch.arange(w.shape[1])
            want, want_exp = _folded_fp4_rows(w, sf, e, rows)
            assert torch.equal(row_exp[e], want_exp.to(torch.int32))
            assert torch.equal(folded[e].float(), want)  # every value, including the subnormal roundings


def test_fold_decode_fails_on_a_wrong_table(monkeypatch):
    """The comparison above can fail: a table shifted by one binade changes the result."""
    import megamoe.fused as mf

    (w, sf), _ = _weights(spread=True)
    good, _ = fold_decode((w, sf))
    lut = mf._fold_lut(w.device)
    monkeypatch.setitem(mf._FOLD_LUTS, str(w.device), torch.roll(lut, 2))
    bad, _ = fold_decode((w, sf))
    assert not torch.equal(bad.float(), good.float())


def test_fold_decode_names_bad_arguments():
    (w, sf), _ = _weights()
    with pytest.raises(TypeError, match="weights"):
        fold_decode(w)
    with pytest.raises(ValueError, match=r"weights\[1\]"):
        fold_decode((w, sf.contiguous()))  # K-major scales: not transformed
    with pytest.raises(ValueError, match=r"weights\[0\]"):
        fold_decode((w.float(), sf))
    with pytest.raises(ValueError, match="out"):
        fold_decode((w, sf), out=torch.empty(1, dtype=torch.float8_e4m3fn))


_DECODE_WIDE = kfd._decode_wide  # (the real one, for the wrong one below to call while it is patched in)

# The access-pattern variants of ``fold_decode_kernel`` (``megamoe.fold_decode.FOLD_DECODE_*``; the GPU probe's list
# is ``results/probes/ws_variants_probe.py``'s ``FOLD_DECODE_VARIANTS``), at the test shapes' divisors (K = 512:
# four 128-wide steps, so ``K_SPLIT`` 2 / 4 and ``RMAX_CHUNK`` 2 / 4 instead of the probe's 8).
VARIANTS = {
    "as_before": dict(FOLD_DECODE_WIDE=False, FOLD_DECODE_ROWS=64, FOLD_DECODE_STEP_K=128),
    "wide": dict(FOLD_DECODE_WIDE=True, FOLD_DECODE_ROWS=64, FOLD_DECODE_STEP_K=128),
    "wide_32x256": dict(FOLD_DECODE_WIDE=True, FOLD_DECODE_ROWS=32, FOLD_DECODE_STEP_K=256),
    "wide_16x512_stream": dict(FOLD_DECODE_WIDE=True, FOLD_DECODE_ROWS=16, FOLD_DECODE_STEP_K=512,
                               FOLD_DECODE_STREAM=True),
    "split2": dict(FOLD_DECODE_K_SPLIT=2),
    "wide_split4": dict(FOLD_DECODE_WIDE=True, FOLD_DECODE_K_SPLIT=4),
    "rmax_chunk2_stream": dict(FOLD_DECODE_RMAX_CHUNK=2, FOLD_DECODE_STREAM=True),
    "wide_rmax_chunk4": dict(FOLD_DECODE_WIDE=True, FOLD_DECODE_RMAX_CHUNK=4),
}


@triton.jit
def _decode_wide_unpermuted(w_e, sf_e, rmax, rows, k0, N: tl.constexpr, K: tl.constexpr, lut,
                            PRMT_DECODE: tl.constexpr, STEP_K: tl.constexpr, STREAM: tl.constexpr):
    """A wrong ``_decode_wide``: its tile with each 64-value chunk's two 32-value halves byte-interleaved (what the
    join without its permute would give)."""
    v = _DECODE_WIDE(w_e, sf_e, rmax, rows, k0, N, K, lut, PRMT_DECODE, STEP_K, STREAM)
    v = tl.permute(tl.reshape(v, [rows.shape[0], STEP_K // 128, 2, 2, 32]), (0, 1, 2, 4, 3))
    return tl.reshape(v, [rows.shape[0], STEP_K])


def _decode_prefilled(weights):
    """``fold_decode`` of each ``(w, sf)`` into outputs prefilled with 0xFF bytes / -1 (so that a variant which skips
    a byte or a row exponent cannot pass on what an earlier call left in reused memory); ``(uint8 view, row_exp)``."""
    res = []
    for w, sf in weights:
        out = torch.full((w.shape[0], w.shape[1], 2 * w.shape[2]), 0xFF, dtype=torch.uint8)
        row_exp = torch.full(w.shape[:2], -1, dtype=torch.int32)
        fold_decode((w, sf), out=out.view(torch.float8_e4m3fn), row_exp=row_exp)
        res.append((out, row_exp))
    return res


@pytest.fixture(scope="module")
def variant_case():
    """Two experts of both weights at H = I = 512 (L1 N = 1024, K = 512; L2 N = 512, K = 512: every variant's step
    divides K) with spread scales, and the default kernel's bytes."""
    weights = _weights(El=2, H=512, I=512, spread=True, seed=1)
    return weights, _decode_prefilled(weights)


@pytest.mark.slow  # ~7 s each on 2 cores (and ~8 s for the shared case)
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_fold_decode_variants_write_the_default_bytes(name, variant_case, monkeypatch):
    """Each access-pattern variant writes exactly the default kernel's bytes and row exponents, which are the decode
    partitions' model's (the spread scales put subnormal folds and zeros among the values; the values of a row are
    random, so a K-order slip in the interleave, a skipped piece or a K range written twice would show)."""
    import megamoe.fold_decode as fd

    weights, default = variant_case
    for key, value in VARIANTS[name].items():
        assert hasattr(fd, key), key
        monkeypatch.setattr(fd, key, value)
    got = _decode_prefilled(weights)
    for (w, sf), (out, row_exp), (want_out, want_exp) in zip(weights, got, default):
        assert torch.equal(row_exp, want_exp)
        assert torch.equal(out, want_out)
        for e in range(w.shape[0]):
            want, model_exp = _folded_fp4_rows(w, sf, e, torch.arange(w.shape[1]))
            assert torch.equal(row_exp[e], model_exp.to(torch.int32))
            assert torch.equal(out[e].view(torch.float8_e4m3fn).float(), want)


@pytest.mark.slow
def test_fold_decode_variant_check_can_fail(variant_case, monkeypatch):
    """The comparison above catches the likeliest slip of the wide decode: the nibble halves joined without the
    permute back into K order (bytes interleaved lo, hi, lo, hi instead of 32 lo then 32 hi)."""
    import megamoe.fold_decode as fd

    weights, default = variant_case
    monkeypatch.setattr(fd, "FOLD_DECODE_WIDE", True)
    monkeypatch.setattr(kfd, "_decode_wide", _decode_wide_unpermuted)
    (out, row_exp), _ = _decode_prefilled(weights)
    assert torch.equal(row_exp, default[0][1])
    assert not torch.equal(out, default[0][0])


@pytest.mark.parametrize("knobs", [dict(FOLD_DECODE_WIDE=False, FOLD_DECODE_STEP_K=256),
                                   dict(FOLD_DECODE_WIDE=True, FOLD_DECODE_STEP_K=192),
                                   dict(FOLD_DECODE_K_SPLIT=3), dict(FOLD_DECODE_RMAX_CHUNK=3)])
def test_fold_decode_rejects_knobs_that_do_not_divide_k(knobs, monkeypatch):
    import megamoe.fold_decode as fd

    for key, value in knobs.items():
        monkeypatch.setattr(fd, key, value)
    (w, sf), _ = _weights()
    with pytest.raises(ValueError, match="weights"):
        fold_decode((w, sf))


def test_row_maxima_equals_each_rows_largest_scale_byte():
    """``megamoe.fold_decode.row_maxima`` (the register-operand tile's fold reference) against the bytes' maximum in
    torch, at an L1-like and an odd shape (K / 128 = 3: one word a step), and its errors name the argument."""
    from megamoe.fold_decode import row_maxima

    g = torch.Generator().manual_seed(3)
    for El, N, KW in ((2, 256, 8), (3, 96, 3)):
        words = torch.randint(-2**31, 2**31 - 1, (El, KW, N), generator=g, dtype=torch.int64).to(torch.int32)
        sf = words.transpose(1, 2)  # MN-major [El, N, KW]
        want = torch.stack([(sf.long() >> (8 * j)) & 0xFF for j in range(4)], -1).amax(dim=(2, 3))
        assert torch.equal(row_maxima(sf).long(), want)
    with pytest.raises(ValueError, match="sf: expected MN-major int32"):
        row_maxima(words.contiguous())
