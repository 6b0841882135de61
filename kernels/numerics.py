"""Bit-exact number-format helpers shared by every Triton kernel (GPU and interpreter alike).

Triton's interpreter rounds fp32 -> fp8/bf16 casts wrongly (ties away from even, a mantissa-carry bug, truncated
subnormals, garbage on overflow) and does bf16 arithmetic on raw bits. So the kernels never cast *to* fp8 or bf16:
they round with integer operations written here, which give the same bits as torch (RTNE, FP8 saturating to
+-448 like ``cvt.rn.satfinite``) on both back ends. Decoding (fp8 -> fp32 inside ``tl.dot``) is exact everywhere.

Formats:
  * UE8M0 scale byte ``b`` means 2^(b-127); four bytes per int32, byte j of word i = group 4i+j (little-endian).
  * FP4 e2m1 nibble = sign<<3 | code, code -> {0, .5, 1, 1.5, 2, 3, 4, 6}.
  * FP8 e4m3fn: bias 7, max 448, no inf; 0x7f/0xff are NaN.
"""
import triton
import triton.language as tl


@triton.jit
def ue8m0_to_f32(byte):
    """int32 exponent byte -> float32 2^(byte-127) (byte 0, never produced by the quantizers, gives 0.0)."""
    return (byte << 23).to(tl.float32, bitcast=True)


@triton.jit
def sf_byte(word, group):
    """Exponent byte of per-32 group ``group`` (mod 4) from a packed int32 scale word."""
    return (word >> (8 * (group % 4))) & 0xFF


@triton.jit
def e2m1_to_e4m3(nibble):
    """FP4 e2m1 nibbles (int32, low 4 bits) -> the identical values as FP8 e4m3 (exact: every e2m1 value is an
    e4m3 value). code>=2: exponent e, mantissa m map to byte (e+6)<<3 | m<<2; code 1 (0.5) -> 0x30."""
    mag = nibble & 7
    bits = tl.where(mag >= 2, (mag << 2) + 0x30, tl.where(mag == 1, 0x30, 0))
    bits = bits | ((nibble & 8) << 4)
    return bits.to(tl.uint8).to(tl.float8e4nv, bitcast=True)


@triton.jit
def f32_to_e4m3_bits(x):
    """float32 -> FP8 e4m3 bit pattern (int32 0..255), round-to-nearest-even, saturating to +-448.

    Normal results keep 3 of the 23 mantissa bits; subnormal results (|x| < 2^-6) are k * 2^-9 with k rounded from
    the 24-bit significand. Inputs are finite (the quantizers reject NaN/inf before any kernel runs).
    """
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    e = (a >> 23) - 127
    # normal: drop 20 mantissa bits with RTNE; re-bias exponent 127 -> 7 (subtract 120 << 3)
    keep = a >> 20
    rem = a & 0xFFFFF
    up = (rem > 0x80000) | ((rem == 0x80000) & ((keep & 1) == 1))
    normal = keep + up.to(tl.int32) - (120 << 3)
    # subnormal: k = round(|x| * 2^9) = significand >> (14 - e)
    sig = (a & 0x7FFFFF) | 0x800000
    shift = tl.minimum(tl.maximum(14 - e, 1), 25)
    k = sig >> shift
    rem2 = sig & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    up2 = (rem2 > half) | ((rem2 == half) & ((k & 1) == 1))
    sub = k + up2.to(tl.int32)
    mag = tl.minimum(tl.where(e >= -6, normal, sub), 0x7E)
    return mag | sign


@triton.jit
def f32_to_bf16_bits(x):
    """float32 -> bf16 bit pattern (int32 0..65535), round-to-nearest-even (finite inputs)."""
    bits = x.to(tl.int32, bitcast=True)
    r = bits + 0x7FFF + ((bits >> 16) & 1)
    return (r >> 16) & 0xFFFF


@triton.jit
def bf16_bits_to_f32(b):
    """bf16 bit pattern (any int type) -> float32, exact (subnormals kept)."""
    return ((b.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)


@triton.jit
def round_to_bf16(x):
    """float32 -> nearest bf16 value, returned as float32 (DeepGEMM rounds the L1 accumulator this way)."""
    return bf16_bits_to_f32(f32_to_bf16_bits(x))


@triton.jit
def ceil_ue8m0(x):
    """Smallest power of two >= x for positive normal float32 x, as (value float32, exponent byte int32)."""
    bits = (x.to(tl.int32, bitcast=True) + 0x7FFFFF) & 0x7F800000
    return bits.to(tl.float32, bitcast=True), bits >> 23


@triton.jit
def e2m1_scaled_f32(nibble, scale_byte):
    """FP4 e2m1 nibbles times their UE8M0 scale 2^(scale_byte-127), as float32, exactly (integer ops only).

    code >= 2 is 2^((code>>1)-1) * (1 + (code&1)/2): exponent field (code>>1)+126, mantissa bit 22 = code&1;
    code 1 is 0.5 (exponent field 126); the scale adds scale_byte-127 to the exponent field. Valid for scale bytes
    2..252 (results stay normal and finite); the quantizer produces 2^ceil(log2(amax/6)) with amax >= 1e-4."""
    code = nibble & 7
    efield = tl.where(code >= 2, (code >> 1) + 126, 126) + scale_byte - 127
    bits = (efield << 23) | ((code & tl.where(code >= 2, 1, 0)) << 22) | ((nibble & 8) << 28)
    return tl.where(code == 0, 0, bits).to(tl.float32, bitcast=True)


# The FP4 -> e4m3 decode of one 32-bit word of transformed weights (``megamoe.quant.transform_weights_for_mega_moe``
# (b): byte lanes 4q .. 4q + 3 of a 64-element chunk in register order -- lane i's low value: magnitude at bit 4i,
# sign at bit 8i + 7; its high value: magnitude at bit 16 + 4i, sign at bit 8i + 3). ``prmt`` reads its selector's
# low 16 bits, four 4-bit byte indices, so the masked word is the selector of the four low values' magnitudes and
# the masked word shifted by 16 that of the four high ones; each lookup takes a table of the eight e2m1 magnitudes
# as e4m3 bytes (``{lo0}, {lo1}``: codes 0..3, 4..7), then each value's sign goes to bit 7 of its byte by one mask
# (the word itself for the low values, the word shifted by 4 for the high ones). 7 SASS instructions per 8 values
# (ptxas fuses each and + or into one LOP3); the previous byte-per-pair packing needed ~12 (two masks, a shift-add
# and a compacting ``prmt`` a selector). ``megamoe.inline_asm`` checks it on CPU against the model
# (``tests/test_inline_asm.py``). Outputs ``$0`` / ``$1``: the low / high values, four e4m3 bytes each; ``$2`` the
# packed word (``pack=4`` of uint8 lanes: the four bytes of one aligned word, lane 0 in bits 0-7).
_PRMT_DECODE = """
    and.b32 m, $2, 0x77777777;
    prmt.b32 $0, {lo0}, {lo1}, m;
    and.b32 t, $2, 0x80808080;
    or.b32 $0, $0, t;
    shr.b32 m, m, 16;
    prmt.b32 $1, {hi0}, {hi1}, m;
    shl.b32 t, $2, 4;
    and.b32 t, t, 0x80808080;
    or.b32 $1, $1, t;
"""


_PRMT_ASM = tl.constexpr(
    "{\n.reg .b32 m, t, lut0, lut1;\nmov.b32 lut0, 0x3C383000;\nmov.b32 lut1, 0x4C484440;\n"
    + _PRMT_DECODE.format(lo0="lut0", lo1="lut1", hi0="lut0", hi1="lut1") + "}")


@triton.jit
def e2m1x2_to_e4m3_prmt(packed):
    """GPU-only fast path of :func:`e2m1_to_e4m3` over uint8 ``packed`` (transformed weights, the last dimension a
    whole number of aligned 4-byte words in each thread's registers): 7 instructions per 8 values. Returns (low
    values, high values) as FP8 e4m3, each of ``packed``'s shape (see :func:`e2m1x2_nibbles` for which is which)."""
    lo, hi = tl.inline_asm_elementwise(asm=_PRMT_ASM, constraints="=r,=r,r", args=[packed],
                                       dtype=(tl.uint8, tl.uint8), is_pure=True, pack=4)
    return lo.to(tl.float8e4nv, bitcast=True), hi.to(tl.float8e4nv, bitcast=True)


# The same decode with the byte tables as operands: $3 / $7 the low values' table pair, $11 / $15 the high values'
# (``megamoe.quant.fold_lut``'s rows; 4 registers per int32 table operand at pack=4, the lanes of a word share
# one table, so only the first of each is read).
_PRMT_LUT_ASM = tl.constexpr(
    "{\n.reg .b32 m, t;\n" + _PRMT_DECODE.format(lo0="$3", lo1="$7", hi0="$11", hi1="$15") + "}")


#: float32 -> nearest bf16 value as float32, two values an instruction (the Gluon epilogues' ``_round_bf16``,
#: ``pack=2``: $2 / $3 the two inputs, $0 / $1 their results): ``cvt.rn.bf16x2.f32`` packs its first source's bf16
#: into the upper half, its second's into the lower; each half then goes back to the top of a float32. The bits of
#: :func:`round_to_bf16` (``tests/test_inline_asm.py`` runs it on CPU by ``megamoe.inline_asm``).
BF16X2_ROUND_ASM = tl.constexpr(
    "{ .reg .b32 t; cvt.rn.bf16x2.f32 t, $3, $2; shl.b32 $0, t, 16; and.b32 $1, t, 0xffff0000; }")


#: Largest fold shift :data:`FOLD_TABLE_ASM` takes: every e2m1 magnitude times ``2^-13`` or less rounds to 0 in e4m3
#: (``6 * 2^-13 = 0.375 * 2^-9``, under half the smallest subnormal), so ``megamoe.quant.fold_lut``'s entries from
#: here on are all zero, and ``0.5 * 2^-13 = 2^-14`` is still a normal float16 (the asm's exponent subtraction exact).
FOLD_TABLE_MAX_SHIFT = tl.constexpr(13)
#: One row of ``megamoe.quant.fold_lut`` computed, not loaded: ``$2`` the fold shift ``d`` (0 ..
#: ``FOLD_TABLE_MAX_SHIFT``) -> ``$0`` / ``$1`` the e4m3 bytes of the e2m1 magnitudes (codes 0-3 / 4-7, code ``j``
#: in byte ``j % 4``) times ``2^-d``. The magnitudes as float16 pairs (0 / 0.5, 1 / 1.5, 2 / 3, 4 / 6: every
#: nonzero one normal down to ``2^-14``), ``d`` subtracted from each nonzero half's exponent field by one ``mad``
#: (code 0's half stays 0), then ``cvt.rn.satfinite.e4m3x2.f16x2`` (round to nearest even, subnormals included:
#: the rounding torch's float32 -> e4m3 cast does on the same values, so the bits of ``fold_lut``) and the four
#: byte pairs packed into two words. 10 SASS instructions (4 IMAD, 4 F2FP, 2 PRMT) where the table's gather takes
#: an address (2) and a load whose latency the decode warp waits for. ``megamoe.inline_asm`` runs it on CPU
#: (``tests/test_inline_asm.py``).
FOLD_TABLE_ASM = tl.constexpr(
    "{ .reg .b32 w0, w1, w2, w3; .reg .b16 e0, e1, e2, e3;"
    " mad.lo.u32 w0, $2, 0xFC000000, 0x38000000; mad.lo.u32 w1, $2, 0xFBFFFC00, 0x3E003C00;"
    " mad.lo.u32 w2, $2, 0xFBFFFC00, 0x42004000; mad.lo.u32 w3, $2, 0xFBFFFC00, 0x46004400;"
    " cvt.rn.satfinite.e4m3x2.f16x2 e0, w0; cvt.rn.satfinite.e4m3x2.f16x2 e1, w1;"
    " cvt.rn.satfinite.e4m3x2.f16x2 e2, w2; cvt.rn.satfinite.e4m3x2.f16x2 e3, w3;"
    " mov.b32 $0, {e0, e1}; mov.b32 $1, {e2, e3}; }")

@triton.jit
def e2m1x2_lut_prmt(packed, la0, la1, lb0, lb1):
    """GPU: uint8 ``packed`` (as :func:`e2m1x2_to_e4m3_prmt`) through per-lane byte tables (low values: ``la0`` /
    ``la1``, high: ``lb0`` / ``lb1``, int32 broadcast to ``packed``'s shape; see ``megamoe.quant.fold_lut``).
    Returns FP8 e4m3 (low values, high values)."""
    lo, hi = tl.inline_asm_elementwise(asm=_PRMT_LUT_ASM, constraints="=r,=r," + "r," * 16 + "r",
                                       args=[packed, la0, la1, lb0, lb1], dtype=(tl.uint8, tl.uint8),
                                       is_pure=True, pack=4)
    return lo.to(tl.float8e4nv, bitcast=True), hi.to(tl.float8e4nv, bitcast=True)


@triton.jit
def e2m1x2_nibbles(packed):
    """Interpreter twin of the register-order unpacking (and the arithmetic decodes' input): int8 or uint8 ``packed`` of
    transformed weights (any shape, the last dimension a whole number of aligned 4-byte words) -> (low, high)
    e2m1 nibbles, int32 of ``packed``'s shape (sign << 3 | magnitude code): byte lane ``j`` of a 64-element chunk
    carries elements ``j`` (low) and ``32 + j`` (high) of the chunk."""
    b = tl.reshape(packed.to(tl.int32) & 0xFF, [packed.numel // 4, 4])  # int8 sign-extends: keep the byte
    lane = tl.arange(0, 4)[None, :]
    # The four bytes hold disjoint bits, so their sum is their OR; tl.sum because the interpreter runs a reduce
    # with a Python combine function element by element (tl.reduce(.., _or) made the CPU suite ~3x slower).
    word = tl.sum(b << (8 * lane), 1)[:, None]
    lo = ((word >> (4 * lane)) & 7) | (((word >> (8 * lane + 7)) & 1) << 3)
    hi = ((word >> (16 + 4 * lane)) & 7) | (((word >> (8 * lane + 3)) & 1) << 3)
    return tl.reshape(lo, packed.shape), tl.reshape(hi, packed.shape)


@triton.jit
def e2m1_lut(nibble, lut0, lut1):
    """Interpreter twin of :func:`e2m1x2_lut_prmt` for one nibble (int32, low 4 bits, from
    :func:`e2m1x2_nibbles`): the table byte of its magnitude code, then its sign, as FP8 e4m3."""
    code = nibble & 7
    word = tl.where(code < 4, lut0, lut1)
    bits = ((word >> (8 * (code & 3))) & 0xFF) | ((nibble & 8) << 4)
    return bits.to(tl.uint8).to(tl.float8e4nv, bitcast=True)
