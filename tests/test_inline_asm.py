"""The kernels' inline PTX, run on CPU by ``megamoe.inline_asm``: the FP4 -> e4m3 decode strings of
``megamoe.kernels.numerics`` against the torch model on every nibble pair in every lane (plain decode) and on
random words with every fold shift (the table decode of the "hopper" tiles and the FP8 x FP4 Gluon phase). The
interpreter runs the strings' ``tl`` twins, so without this a wrong string would only show on a GPU, as a wrong
tile."""
import numpy as np
import pytest
import torch

from megamoe.inline_asm import pack_bytes, run, unpack_bytes
from megamoe.kernels import numerics as kn
from megamoe.quant import E2M1_MAGNITUDES, FOLD_LUT_MAX_SHIFT, fold_lut


def _e4m3_bits(values) -> np.ndarray:
    return torch.tensor(values, dtype=torch.float32).to(torch.float8_e4m3fn).view(torch.uint8).numpy()


def _decode_model(nibbles: np.ndarray, table: np.ndarray) -> np.ndarray:
    """e4m3 bits of e2m1 ``nibbles`` (uint8, low 4 bits) through the per-element 8-byte magnitude ``table``
    ``[..., 8]``, then the nibble's sign bit -> bit 7."""
    mag = np.take_along_axis(table, (nibbles & 7)[..., None].astype(np.int64), axis=-1)[..., 0]
    return (mag | ((nibbles & 8) << 4)).astype(np.uint8)


def test_prmt_semantics():
    a, b = np.array([0x33221100], np.uint32), np.array([0x77665544], np.uint32)
    prmt = "{\nprmt.b32 $0, $1, $2, $3;\n}"
    for sel, want in ((0x3210, 0x33221100), (0x7654, 0x77665544), (0x0123, 0x00112233), (0x4444, 0x44444444)):
        assert run(prmt, {1: a, 2: b, 3: np.array([sel], np.uint32)})[0][0] == want
    neg = np.array([0x00000080], np.uint32)  # byte 0 has its sign bit: selector nibble 8 replicates it
    assert run(prmt, {1: neg, 2: b, 3: np.array([0x9898], np.uint32)})[0][0] == 0x00FF00FF


def test_unknown_instruction_raises():
    with pytest.raises(ValueError, match="not emulated"):
        run("{\nmul.lo.u32 $0, $1, $1;\n}", {1: np.array([3], np.uint32)})


def _pack_register_order(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """uint8 bytes of words in register order (``megamoe.quant.transform_weights_for_mega_moe`` (b), written out
    here from its definition) from the e2m1 nibbles ``lo`` / ``hi`` ``[n, 4]`` of each word's four lanes."""
    i = np.arange(4, dtype=np.uint32)
    lo, hi = lo.astype(np.uint32), hi.astype(np.uint32)
    w = (((lo & 7) << (4 * i)) | ((lo >> 3) << (8 * i + 7)) | ((hi & 7) << (16 + 4 * i))
         | ((hi >> 3) << (8 * i + 3)))
    return np.bitwise_or.reduce(w, axis=-1).astype("<u4").view(np.uint8)


def test_plain_prmt_decode_every_pair():
    """``_PRMT_ASM`` (constant table: e2m1 magnitudes in e4m3) on every (low, high) nibble pair in every lane."""
    pairs = np.arange(256, dtype=np.uint8)
    lanes = np.stack([np.roll(pairs, 64 * i) for i in range(4)], axis=-1)  # [256 words, 4 lanes]: each pair, each lane
    lo, hi = lanes & 0xF, lanes >> 4
    out = run(kn._PRMT_ASM.value, {2: pack_bytes(_pack_register_order(lo, hi))})
    table = np.broadcast_to(_e4m3_bits(E2M1_MAGNITUDES), (lanes.size, 8))
    np.testing.assert_array_equal(unpack_bytes(out[0]), _decode_model(lo.reshape(-1), table))
    np.testing.assert_array_equal(unpack_bytes(out[1]), _decode_model(hi.reshape(-1), table))


def test_table_prmt_decode_every_shift():
    """``_PRMT_LUT_ASM`` with ``fold_lut``'s tables at every fold shift, a different shift for the low and the
    high values of each word (as two 32-groups of one row), on random nibbles."""
    rng = np.random.default_rng(7)
    n = 4096
    lo, hi = rng.integers(0, 16, size=(2, n, 4), dtype=np.uint8)
    lut = fold_lut().numpy().astype(np.uint32)
    d_lo, d_hi = rng.integers(0, FOLD_LUT_MAX_SHIFT + 1, size=(2, n))
    ops = {2: pack_bytes(_pack_register_order(lo, hi)), 3: lut[2 * d_lo], 7: lut[2 * d_lo + 1], 11: lut[2 * d_hi],
           15: lut[2 * d_hi + 1]}
    out = run(kn._PRMT_LUT_ASM.value, ops)

    def table(d):  # [n, 8] magnitude bytes of each word, repeated for its four lanes
        t = np.stack([lut[2 * d], lut[2 * d + 1]], axis=-1).astype("<u4").view(np.uint8)
        return np.repeat(t, 4, axis=0)

    np.testing.assert_array_equal(unpack_bytes(out[0]), _decode_model(lo.reshape(-1), table(d_lo)))
    np.testing.assert_array_equal(unpack_bytes(out[1]), _decode_model(hi.reshape(-1), table(d_hi)))
    assert len({int(x) for x in d_lo}) == FOLD_LUT_MAX_SHIFT + 1  # every shift drawn


def test_register_order_matches_the_transform():
    """The words this file packs from the definition are the transform's bytes: ``megamoe.quant._repack_nibbles``
    of a K-major row whose chunk holds ``lo`` at elements ``j`` and ``hi`` at ``32 + j``."""
    from megamoe.quant import _repack_nibbles, pack_nibbles

    rng = np.random.default_rng(3)
    lo, hi = rng.integers(0, 16, size=(2, 8, 4), dtype=np.uint8)  # one 64-element chunk: 8 words of 4 lanes
    row = np.concatenate([lo.reshape(-1), hi.reshape(-1)])  # K order: elements 0..31 low, 32..63 high
    got = _repack_nibbles(pack_nibbles(torch.from_numpy(row)[None])).view(torch.uint8)[0].numpy()
    np.testing.assert_array_equal(got, _pack_register_order(lo, hi))


def test_bf16x2_round_string_is_round_to_bf16():
    """``BF16X2_ROUND_ASM`` (the Gluon epilogues' ``_round_bf16``, two values a ``cvt.rn.bf16x2.f32``): each output
    is its own input rounded to the nearest bf16, ties to even, as float32 bits -- on ties, values one ulp either
    side of a tie, signed zeros, subnormals, the largest finite values (rounding up to infinity) and infinities;
    swapping the two sources of the ``cvt`` (the PTX puts the first in the upper half) fails here."""
    rng = np.random.default_rng(7)
    hi = rng.integers(0, 1 << 16, 4096, dtype=np.uint32) << 16
    ties = np.concatenate([hi | 0x8000, hi | 0x7FFF, hi | 0x8001, hi, hi | 0xFFFF])
    special = np.array([0, 0x80000000, 1, 0x807FFFFF, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000, 0xFF800000, 0x3F808000,
                        0x3F818000], np.uint32)
    x = np.concatenate([ties, special, rng.integers(0, 1 << 32, 4096, dtype=np.uint64).astype(np.uint32)])
    x = x[(((x >> 23) & 0xFF) != 0xFF) | ((x & 0x7FFFFF) == 0)]  # finite and infinite values; NaN payloads aside
    assert len(x) > 24000
    if len(x) % 2:
        x = x[:-1]
    a, b = x[0::2], x[1::2]
    out = run(kn.BF16X2_ROUND_ASM.value, {2: a, 3: b})
    want = torch.from_numpy(x.view(np.float32).copy()).to(torch.bfloat16).to(torch.float32).numpy().view(np.uint32)
    assert np.array_equal(out[0], want[0::2]) and np.array_equal(out[1], want[1::2])
    swapped = run(kn.BF16X2_ROUND_ASM.value.replace("t, $3, $2", "t, $2, $3"), {2: a, 3: b})
    assert not np.array_equal(swapped[0], want[0::2])


def test_fold_table_string_is_the_fold_lut():
    """``FOLD_TABLE_ASM`` (the Gluon decode's fold table, computed in registers) gives ``fold_lut``'s two words at
    every shift it takes, and ``fold_lut``'s rows past ``FOLD_TABLE_MAX_SHIFT`` (where the kernel clamps) are that
    last row: all zero. The emulated ``cvt.rn.satfinite.e4m3x2.f16x2`` rounds to nearest even, subnormals included
    (shifts 6 .. 12 round); swapping the halves of a packed pair, or dropping the code-0 half's guard, fails here."""
    asm = kn.FOLD_TABLE_ASM.value
    top = kn.FOLD_TABLE_MAX_SHIFT.value
    d = np.arange(top + 1, dtype=np.uint32)
    lut = fold_lut().numpy().view(np.uint32).reshape(-1, 2)
    assert FOLD_LUT_MAX_SHIFT >= top and (lut[top:] == 0).all()
    out = run(asm, {2: d})
    assert np.array_equal(out[0], lut[:top + 1, 0]) and np.array_equal(out[1], lut[:top + 1, 1])
    assert len({int(w) for w in out[1]}) == top + 1  # every shift's row differs, the last all zero
    swapped = run(asm.replace("{e0, e1}", "{e1, e0}"), {2: d})
    assert not np.array_equal(swapped[0], lut[:top + 1, 0])
    unguarded = run(asm.replace("0xFC000000, 0x38000000", "0xFBFFFC00, 0x38000000"), {2: d})
    assert not np.array_equal(unguarded[0], lut[:top + 1, 0])


def test_e4m3x2_cvt_rounds_and_saturates():
    """The emulator's ``cvt.rn.satfinite.e4m3x2.f16x2``: float16 pairs (low half to the low byte) against torch's
    float32 -> e4m3 cast, which rounds to nearest even; finite values past 448 saturate, NaN stays NaN."""
    rng = np.random.default_rng(3)
    h = rng.integers(0, 1 << 16, 8192, dtype=np.uint32)
    f = h.astype(np.uint16).view(np.float16).astype(np.float32)
    h = h[np.isfinite(f)]
    f = f[np.isfinite(f)]
    if len(h) % 2:
        h, f = h[:-1], f[:-1]
    words = h[0::2] | (h[1::2] << 16)
    out = run("{ .reg .b16 e; cvt.rn.satfinite.e4m3x2.f16x2 e, $1; mov.b32 $0, {e, e}; }", {1: words})[0]
    want = torch.from_numpy(np.clip(f, -448, 448)).to(torch.float8_e4m3fn).view(torch.uint8).numpy().astype(np.uint32)
    assert np.array_equal(out & 0xFF, want[0::2]) and np.array_equal((out >> 8) & 0xFF, want[1::2])
    nan = run("{ .reg .b16 e; cvt.rn.satfinite.e4m3x2.f16x2 e, $1; mov.b32 $0, {e, e}; }",
              {1: np.array([0x7E00FE00], np.uint32)})[0]
    assert int(nan[0]) & 0xFFFF == 0x7FFF
