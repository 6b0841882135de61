"""``megamoe.fold_decode``: transformed FP4 weights decoded once into folded e4m3 + row exponents, bit for bit what
the FP8 x FP4 Gluon phase's decode partitions compute (its torch model ``megamoe.gemm_phase._folded_fp4_rows``)."""
import pytest
import torch

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
