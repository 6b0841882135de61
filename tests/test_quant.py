"""Number formats (megamoe.quant): UE8M0 scales, FP8 and FP4 casts, nibble packing, the kernel weight layout."""
from __future__ import annotations

import pytest
import torch

from megamoe import quant
from megamoe.quant import (
    FP4_E2M1_VALUES,
    FP8_E4M3_MAX,
    cast_grouped_weights_to_fp4,
    ceil_to_ue8m0,
    dequant_fp4,
    dequant_fp8,
    e2m1_decode,
    e2m1_encode,
    pack_nibbles,
    pack_ue8m0,
    per_token_cast_to_fp4,
    per_token_cast_to_fp8,
    transform_weights_for_mega_moe,
    unpack_nibbles,
    unpack_ue8m0,
    untransform_weights_for_mega_moe,
)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _scales_per_element(sf: torch.Tensor) -> torch.Tensor:
    return unpack_ue8m0(sf).repeat_interleave(32, dim=-1)


# ---------------------------------------------------------------------------------------------------------
# UE8M0
# ---------------------------------------------------------------------------------------------------------


def test_fp4_values():
    assert FP4_E2M1_VALUES.dtype == torch.float32
    assert FP4_E2M1_VALUES.tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def test_ceil_to_ue8m0_powers_and_neighbours():
    powers = torch.tensor([2.0**e for e in range(-126, 127)], dtype=torch.float32)
    assert torch.equal(ceil_to_ue8m0(powers), powers)
    above = torch.nextafter(powers[:-1], torch.tensor(float("inf")))
    assert torch.equal(ceil_to_ue8m0(above), powers[1:])
    below = torch.nextafter(powers[1:], torch.tensor(0.0))
    assert torch.equal(ceil_to_ue8m0(below), powers[1:])


def test_ceil_to_ue8m0_random_and_subnormal():
    x = torch.exp(torch.empty(10_000).uniform_(-80, 80, generator=_gen()))
    r = ceil_to_ue8m0(x)
    assert torch.equal(torch.frexp(r).mantissa, torch.full_like(r, 0.5))  # a power of two
    assert bool((r >= x).all()) and bool((r / 2 < x).all())
    assert ceil_to_ue8m0(torch.tensor([1e-45, 2.0**-127])).tolist() == [2.0**-126] * 2
    with pytest.raises(TypeError, match="x"):
        ceil_to_ue8m0(torch.tensor([1.0], dtype=torch.float64))


def test_pack_ue8m0_byte_order():
    scales = torch.tensor([[1.0, 2.0, 0.5, 8.0, 2.0**-127 * 2, 2.0**127, 1.0, 1.0]])
    bytes_ = [127, 128, 126, 130, 1, 254, 127, 127]
    expected = []
    for i in range(2):
        word = sum(b << (8 * j) for j, b in enumerate(bytes_[4 * i : 4 * i + 4]))
        expected.append(word - 2**32 if word >= 2**31 else word)
    packed = pack_ue8m0(scales)
    assert packed.dtype == torch.int32 and packed.tolist() == [expected]
    assert torch.equal(unpack_ue8m0(packed), scales)


def test_unpack_ue8m0_extremes_and_round_trip():
    sf = torch.tensor([[0x00FF7F00]], dtype=torch.int32)  # bytes 0, 127, 255, 0
    values = unpack_ue8m0(sf)
    assert values[0, 0].item() == 2.0**-127 and values[0, 3].item() == 2.0**-127
    assert values[0, 1].item() == 1.0 and torch.isnan(values[0, 2])
    words = torch.randint(-(2**31), 2**31, (5, 7), dtype=torch.int64, generator=_gen()).to(torch.int32)
    words = words & 0x7E7E7E7E | 0x01010101  # bytes in [1, 254]: normal powers of two
    assert torch.equal(pack_ue8m0(unpack_ue8m0(words)), words)


def test_pack_ue8m0_rejects_non_powers_of_two():
    with pytest.raises(ValueError, match="scales"):
        pack_ue8m0(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    with pytest.raises(ValueError, match="scales"):
        pack_ue8m0(torch.tensor([1.0, 2.0, -4.0, 4.0]))
    with pytest.raises(ValueError, match="scales"):
        pack_ue8m0(torch.tensor([1.0, 2.0, 4.0]))


# ---------------------------------------------------------------------------------------------------------
# FP8
# ---------------------------------------------------------------------------------------------------------


def _random_fp8_groups(m: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random finite FP8 values [m, k] whose groups of 32 each start with +-448, and power-of-two scales [m, k/32]."""
    bits = torch.randint(0, 256, (m, k), dtype=torch.int64, generator=gen).to(torch.uint8)
    bits = torch.where((bits & 0x7F) == 0x7F, bits & 0xF0, bits)  # drop NaN encodings
    q = bits.view(torch.float8_e4m3fn).float()
    q[:, ::32] = torch.where(torch.rand(m, k // 32, generator=gen) < 0.5, -FP8_E4M3_MAX, FP8_E4M3_MAX)
    scales = 2.0 ** torch.randint(-20, 30, (m, k // 32), generator=gen).float()  # amax = 448 * scale >= 1e-4
    return q, scales


def test_fp8_round_trip_of_representable_values():
    q, scales = _random_fp8_groups(8, 256, _gen(1))
    x = q * scales.repeat_interleave(32, dim=1)
    x_fp8, sf = per_token_cast_to_fp8(x)
    assert x_fp8.dtype == torch.float8_e4m3fn and x_fp8.shape == (8, 256)
    assert sf.dtype == torch.int32 and sf.shape == (8, 2)
    assert torch.equal(x_fp8.float(), q)
    assert torch.equal(unpack_ue8m0(sf), scales)
    assert torch.equal(dequant_fp8(x_fp8, sf), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_error_bound(dtype):
    gen = _gen(2)
    magnitude = 10.0 ** torch.empty(64, 16).uniform_(-3, 3, generator=gen)  # one per group of 32
    x = torch.randn(64, 512, generator=gen) * magnitude.repeat_interleave(32, dim=1)
    x = x.to(dtype)
    x_fp8, sf = per_token_cast_to_fp8(x)
    scale = _scales_per_element(sf)
    err = (x.float() - dequant_fp8(x_fp8, sf)).abs()
    # half an ulp: 2^-4 relative for normals, 2^-10 * scale in the subnormal range (step 2^-9)
    assert bool((err <= 2.0**-4 * x.float().abs() + 2.0**-10 * scale).all())
    amax = x.float().abs().unflatten(1, (-1, 32)).amax(-1).repeat_interleave(32, dim=1)
    assert bool((amax / scale <= FP8_E4M3_MAX).all()) and bool((amax / scale > FP8_E4M3_MAX / 2).all())


def test_fp8_zeros_use_amax_floor():
    x_fp8, sf = per_token_cast_to_fp8(torch.zeros(2, 128))
    assert torch.equal(x_fp8.float(), torch.zeros(2, 128))
    assert torch.equal(unpack_ue8m0(sf), torch.full((2, 4), 2.0**-22))  # ceil_pow2(1e-4 / 448)
    assert torch.equal(dequant_fp8(x_fp8, sf), torch.zeros(2, 128))


def test_fp8_subnormal_outputs():
    x = torch.zeros(1, 128)
    x[0, 0] = 448.0
    x[0, 1:4] = torch.tensor([2.0**-9, 3 * 2.0**-9, 7 * 2.0**-9])  # FP8 subnormals
    x[0, 4] = 2.0**-10  # a tie between 0 and 2^-9: to even (0)
    x[0, 5] = 3 * 2.0**-11  # between 2^-10 and 2^-9 nearest: 2^-9
    x_fp8, sf = per_token_cast_to_fp8(x)
    assert unpack_ue8m0(sf)[0, 0].item() == 1.0
    assert x_fp8.float()[0, :6].tolist() == [448.0, 2.0**-9, 3 * 2.0**-9, 7 * 2.0**-9, 0.0, 2.0**-9]
    assert bool(((x_fp8.view(torch.uint8)[0, 1:4] & 0x78) == 0).all())  # exponent field 0


def test_fp8_saturation_at_exactly_amax():
    x = torch.zeros(2, 128)
    x[0, :32] = torch.linspace(-448.0, 448.0, 32) * 2.0**5
    x[1, 0] = 449.0  # just above 448: the scale doubles, 449/2 rounds to 224
    x_fp8, sf = per_token_cast_to_fp8(x)
    assert x_fp8.float()[0, 0].item() == -448.0 and x_fp8.float()[0, 31].item() == 448.0
    assert unpack_ue8m0(sf)[0, 0].item() == 2.0**5
    assert unpack_ue8m0(sf)[1, 0].item() == 2.0 and x_fp8.float()[1, 0].item() == 224.0
    assert not bool(torch.isnan(x_fp8.float()).any())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_casts_reject_non_finite(bad):
    x = torch.zeros(2, 128)
    x[1, 7] = bad
    with pytest.raises(ValueError, match=r"\bx\b.*NaN or inf"):
        per_token_cast_to_fp8(x)
    with pytest.raises(ValueError, match=r"\bw\b.*NaN or inf"):
        per_token_cast_to_fp4(x)
    with pytest.raises(ValueError, match=r"\bw\b.*NaN or inf"):
        cast_grouped_weights_to_fp4(x.unsqueeze(0))


def test_casts_reject_bad_shapes_and_dtypes():
    with pytest.raises(ValueError, match=r"\bx\b.*multiple of 128"):
        per_token_cast_to_fp8(torch.zeros(2, 96))
    with pytest.raises(ValueError, match=r"\bw\b.*multiple of 128"):
        per_token_cast_to_fp4(torch.zeros(2, 160))
    with pytest.raises(ValueError, match=r"\bx\b.*2-D"):
        per_token_cast_to_fp8(torch.zeros(2, 2, 128))
    with pytest.raises(TypeError, match=r"\bx\b"):
        per_token_cast_to_fp8(torch.zeros(2, 128, dtype=torch.int32))
    with pytest.raises(TypeError, match=r"\bw\b"):
        per_token_cast_to_fp4(torch.zeros(2, 128, dtype=torch.float64))
    with pytest.raises(ValueError, match="gran_k"):
        per_token_cast_to_fp8(torch.zeros(2, 128), gran_k=128)


# ---------------------------------------------------------------------------------------------------------
# FP4
# ---------------------------------------------------------------------------------------------------------


def test_e2m1_ties_round_to_even_mantissa():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert e2m1_decode(e2m1_encode(ties)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert e2m1_decode(e2m1_encode(-ties)).tolist() == [-0.0, -1.0, -1.0, -2.0, -2.0, -4.0, -4.0]
    near = torch.tensor([0.2501, 0.7499, 1.2501, 1.7499, 2.5001, 3.4999, 5.0001, 6.0, 7.0, 1e30])
    assert e2m1_decode(e2m1_encode(near)).tolist() == [0.5, 0.5, 1.5, 1.5, 3.0, 3.0, 6.0, 6.0, 6.0, 6.0]
    assert e2m1_encode(torch.tensor([-0.1, 0.1, -6.0])).tolist() == [8, 0, 15]


def test_fp4_tie_rounding_through_cast():
    w = torch.zeros(1, 128)
    w[0, :8] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    w_packed, sf = per_token_cast_to_fp4(w)
    assert unpack_ue8m0(sf)[0, 0].item() == 1.0
    assert dequant_fp4(w_packed, sf)[0, :8].tolist() == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]


def test_fp4_packing_low_nibble_first():
    w = torch.zeros(1, 128)
    w[0, :4] = torch.tensor([6.0, 0.5, -1.0, 3.0])  # codes 7, 1, 8|2, 5
    w_packed, sf = per_token_cast_to_fp4(w)
    assert w_packed.dtype == torch.int8 and w_packed.shape == (1, 64) and sf.shape == (1, 1)
    assert w_packed.view(torch.uint8)[0, :3].tolist() == [0x17, 0x5A, 0x00]
    nibbles = torch.randint(0, 16, (3, 64), dtype=torch.int64, generator=_gen()).to(torch.uint8)
    packed = pack_nibbles(nibbles)
    assert torch.equal(packed.view(torch.uint8), nibbles[:, 0::2] + 16 * nibbles[:, 1::2])
    assert torch.equal(unpack_nibbles(packed), nibbles)


def test_fp4_round_trip_of_representable_values():
    gen = _gen(3)
    nibbles = torch.randint(0, 16, (16, 256), dtype=torch.int64, generator=gen).to(torch.uint8)
    nibbles[:, ::32] = 7 | (8 * torch.randint(0, 2, (16, 8), generator=gen)).to(torch.uint8)  # +-6 per group
    scales = 2.0 ** torch.randint(-12, 20, (16, 8), generator=gen).float()  # amax = 6 * scale >= 1e-4
    w = e2m1_decode(nibbles) * scales.repeat_interleave(32, dim=1)
    w_packed, sf = per_token_cast_to_fp4(w)
    assert torch.equal(w_packed, pack_nibbles(nibbles))  # -0 keeps its sign bit
    assert torch.equal(unpack_ue8m0(sf), scales)
    assert torch.equal(dequant_fp4(w_packed, sf), w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp4_error_bound(dtype):
    gen = _gen(4)
    w = (torch.randn(64, 512, generator=gen) * 10.0 ** torch.empty(64, 512).uniform_(-2, 2, generator=gen)).to(dtype)
    w_packed, sf = per_token_cast_to_fp4(w)
    scale = _scales_per_element(sf)
    v = w.float().abs() / scale
    half_gap = torch.where(v < 2, 0.25, torch.where(v < 4, 0.5, 1.0))
    assert bool(((w.float() - dequant_fp4(w_packed, sf)).abs() <= half_gap * scale).all())
    assert bool((v <= 6.0).all())


def test_fp4_zeros_use_amax_floor():
    w_packed, sf = per_token_cast_to_fp4(torch.zeros(3, 256))
    assert torch.equal(w_packed, torch.zeros(3, 128, dtype=torch.int8))
    assert torch.equal(unpack_ue8m0(sf), torch.full((3, 8), 2.0**-15))  # ceil_pow2(1e-4 / 6)


def test_grouped_cast_matches_per_expert_and_dequant_accepts_expert_dim():
    w = torch.randn(3, 32, 256, generator=_gen(5))
    w_packed, sf = cast_grouped_weights_to_fp4(w)
    assert w_packed.shape == (3, 32, 128) and sf.shape == (3, 32, 2)
    for e in range(3):
        p, s = per_token_cast_to_fp4(w[e])
        assert torch.equal(w_packed[e], p) and torch.equal(sf[e], s)
    assert torch.equal(dequant_fp4(w_packed, sf)[1], dequant_fp4(w_packed[1], sf[1]))
    x_fp8, x_sf = per_token_cast_to_fp8(w[0])
    assert torch.equal(dequant_fp8(x_fp8.unsqueeze(0), x_sf.unsqueeze(0))[0], dequant_fp8(x_fp8, x_sf))
    with pytest.raises(ValueError, match=r"\bw\b.*3-D"):
        cast_grouped_weights_to_fp4(w[0])


# ---------------------------------------------------------------------------------------------------------
# Weight transform
# ---------------------------------------------------------------------------------------------------------

E, H, I = 2, 256, 256


def _weights(seed: int = 6):
    gen = _gen(seed)
    l1 = cast_grouped_weights_to_fp4(torch.randn(E, 2 * I, H, generator=gen))
    l2 = cast_grouped_weights_to_fp4(torch.randn(E, H, I, generator=gen))
    return l1, l2


def _decode_transformed(w: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    """Dequantise kernel-layout weights [E, N, K/2] straight from the layout's definition (loops, no reshapes
    shared with the implementation)."""
    e, n, half_k = w.shape
    b = w.view(torch.uint8).long()
    values = torch.empty(e, n, 2 * half_k)
    for c in range(half_k // 32):
        for q in range(8):  # the little-endian word of byte lanes 4q .. 4q + 3 of chunk c, in register order
            word = sum(b[:, :, 32 * c + 4 * q + i] << (8 * i) for i in range(4))
            for i in range(4):
                lo = ((word >> (4 * i)) & 7) | (((word >> (8 * i + 7)) & 1) << 3)
                hi = ((word >> (16 + 4 * i)) & 7) | (((word >> (8 * i + 3)) & 1) << 3)
                values[:, :, 64 * c + 4 * q + i] = e2m1_decode(lo.to(torch.uint8))
                values[:, :, 64 * c + 32 + 4 * q + i] = e2m1_decode(hi.to(torch.uint8))
    scales = torch.empty_like(values)
    sf_bytes = sf.long()
    for g in range(2 * half_k // 32):
        byte = (sf_bytes[:, :, g // 4] >> (8 * (g % 4))) & 0xFF
        scales[:, :, 32 * g : 32 * g + 32] = (2.0 ** (byte - 127).double()).float().unsqueeze(-1)
    return values * scales


@pytest.mark.parametrize("piece_bytes", [None, 1, 1000], ids=["whole", "row-by-row", "ragged-pieces"])
def test_transform_layout_and_semantics(piece_bytes, monkeypatch):
    if piece_bytes:  # the repack works in pieces of rows (bounded memory at V4-Pro size): the bits must not change
        monkeypatch.setattr(quant, "_REPACK_PIECE_BYTES", piece_bytes)
    l1, l2 = _weights()
    (t1_w, t1_sf), (t2_w, t2_sf) = transform_weights_for_mega_moe(l1, l2)
    assert t1_w.shape == (E, 2 * I, H // 2) and t1_w.dtype == torch.int8 and t1_w.is_contiguous()
    assert t1_sf.shape == (E, 2 * I, H // 128) and t1_sf.stride() == (2 * I * H // 128, 1, 2 * I)
    assert t2_w.shape == (E, H, I // 2) and t2_sf.shape == (E, H, I // 128)
    assert t2_sf.stride() == (H * I // 128, 1, H)
    # row r of the transformed L1 is gate row 8*(r//16) + r%8 when r%16 < 8, else that up row
    rows = torch.arange(2 * I)
    source = 8 * (rows // 16) + rows % 8 + I * ((rows % 16) >= 8).long()
    # the bytes are blocked by 256 rows x 128 K (block_fp4_weights): read them back row-major by the definition
    assert torch.equal(_decode_transformed(_unblock_by_definition(t1_w), t1_sf), dequant_fp4(*l1)[:, source])
    assert torch.equal(_decode_transformed(_unblock_by_definition(t2_w), t2_sf), dequant_fp4(*l2))
    t1, t2 = transform_weights_for_mega_moe(l1, l2)
    assert torch.equal(t1.rows(), _unblock_by_definition(t1_w)) and torch.equal(t2.rows(), _unblock_by_definition(t2_w))


def test_transform_inverse_round_trip():
    l1, l2 = _weights(7)
    back1, back2 = untransform_weights_for_mega_moe(*transform_weights_for_mega_moe(l1, l2))
    for got, want in zip(back1 + back2, l1 + l2):
        assert got.is_contiguous() and torch.equal(got, want)


def test_transform_validation():
    l1, l2 = _weights()
    with pytest.raises(ValueError, match="activation"):
        transform_weights_for_mega_moe(l1, l2, activation="gelu")
    with pytest.raises(TypeError, match="l1_weights"):
        transform_weights_for_mega_moe((l1[0].view(torch.uint8), l1[1]), l2)
    with pytest.raises(TypeError, match="l2_weights"):
        transform_weights_for_mega_moe(l1, l2[0])
    with pytest.raises(ValueError, match="l1_weights.*multiples of 128"):
        transform_weights_for_mega_moe((l1[0][:, :192], l1[1][:, :192]), l2)
    with pytest.raises(ValueError, match="l1_weights.*scales"):
        transform_weights_for_mega_moe((l1[0], l1[1][:, :, :1]), l2)
    with pytest.raises(ValueError, match="l2_weights"):
        transform_weights_for_mega_moe(l1, (l2[0][:1], l2[1][:1]))
    with pytest.raises(ValueError, match="l2_weights"):
        transform_weights_for_mega_moe(l1, (l2[0][:, :128], l2[1][:, :128]))


def _unblock_by_definition(w: torch.Tensor) -> torch.Tensor:
    """Row-major bytes of blocked FP4 weights ``w`` [E, N, K/2] from the layout's definition (loops): rows in blocks
    of 256 (the last ``N % 256`` rows a shorter one), each block's 128-wide K block ``kb`` one run of ``rows x 64``
    bytes at ``256 rb * K/2 + kb * rows * 64``."""
    E, N, KH = w.shape
    flat, out = w.view(torch.uint8).reshape(E, -1), torch.empty(E, N, KH, dtype=torch.uint8)
    for lo in range(0, N, 256):
        R = min(256, N - lo)
        for kb in range(KH // 64):
            base = lo * KH + kb * R * 64
            out[:, lo:lo + R, 64 * kb:64 * kb + 64] = flat[:, base:base + R * 64].reshape(E, R, 64)
    return out.view(w.dtype)


@pytest.mark.parametrize("N", [512, 640, 128])
def test_block_fp4_weights_lays_each_stage_out_as_one_run(N):
    """``block_fp4_weights``: run ``(e, row block, K block)`` of an expert's bytes is rows ``[256 rb, +256)`` (the
    last 128 rows their own block where ``N % 256`` is 128) x bytes ``[64 kb, +64)``, each row's bytes unchanged;
    ``fp4_weight_offset`` / ``fp4_weight_rows`` address the same bytes, ``unblock_fp4_weights`` inverts it; shapes
    the blocking cannot take are refused naming the argument."""
    g = torch.Generator().manual_seed(1)
    w = torch.randint(-128, 128, (2, N, 192), dtype=torch.int8, generator=g)  # El 2, K 384
    b = quant.block_fp4_weights(w)
    assert b.dtype == w.dtype and b.shape == w.shape and b.is_contiguous()
    assert torch.equal(_unblock_by_definition(b), w) and torch.equal(quant.unblock_fp4_weights(b), w)
    if N >= 512:  # a full block's K block 2 of expert 1 is one contiguous run of 256 x 64 bytes
        assert torch.equal(b[1].view(torch.uint8).reshape(-1)[256 * 192 + 2 * 256 * 64:][:256 * 64].view(256, 64),
                           w[1, 256:512, 128:192].view(torch.uint8))
    n, k = torch.arange(N)[:, None], torch.arange(192)[None, :]
    assert torch.equal(b[1].reshape(-1)[quant.fp4_weight_offset(n, k, N, 192)], w[1])
    rows = torch.tensor([N - 1, 0, N // 2 + 3])
    assert torch.equal(quant.fp4_weight_rows(b, 0, rows), w[0, rows])
    with pytest.raises(ValueError, match="w: rows"):
        quant.block_fp4_weights(w[:, :100])
    with pytest.raises(ValueError, match="w: rows"):
        quant.block_fp4_weights(w[:, :, :100])
