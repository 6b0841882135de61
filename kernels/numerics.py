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


# Per byte lane: the 3 magnitude bits of a nibble -> e4m3 magnitude byte through a PRMT lookup table (LUT bytes 0..7
# = 0x00, 0x30, 0x38, 0x3C, 0x40, 0x44, 0x48, 0x4C), then the nibble's sign bit -> bit 7. ``{src}`` holds the four
# lanes' nibbles in bits [0, 4) of each byte (the high nibbles: the packed word shifted right by 4); ``{sign}`` is
# the packed word shifted so that those nibbles' sign bits sit at bit 7 of each byte. The four magnitudes become the
# low 16 bits of the selector in two steps: ``x = v | v >> 4`` puts lanes (0, 1) in byte 0 and lanes (2, 3) in byte
# 2, and a byte PRMT moves byte 2 next to byte 0. 8 instructions per 4 values (``megamoe.inline_asm`` checks it on
# CPU against the model, ``tests/test_inline_asm.py``; the first form, 11, built the selector with five masks and
# shifts).
_PRMT_DECODE = """
    and.b32 v, {src}, 0x07070707;
    shr.b32 x, v, 4;
    or.b32 x, x, v;
    prmt.b32 sel, x, x, 0x0020;
    prmt.b32 {dst}, lut0, lut1, sel;
    and.b32 t, {sign}, 0x80808080;
    or.b32 {dst}, {dst}, t;
"""


_PRMT_ASM = tl.constexpr(
    "{\n.reg .b32 v, x, sel, t, lut0, lut1, src, sgn;\nmov.b32 lut0, 0x3C383000;\nmov.b32 lut1, 0x4C484440;\n"
    + "shl.b32 sgn, $2, 4;\n" + _PRMT_DECODE.format(src="$2", dst="$0", sign="sgn") + "shr.b32 src, $2, 4;\n"
    + _PRMT_DECODE.format(src="src", dst="$1", sign="$2") + "}")


@triton.jit
def e2m1x2_to_e4m3_prmt(packed):
    """GPU-only fast path of :func:`e2m1_to_e4m3` for both nibbles of uint8 ``packed``: 4 bytes per 32-bit register,
    8 instructions per 4 values instead of ~10 per value. Returns (low nibbles, high nibbles) as FP8 e4m3."""
    lo, hi = tl.inline_asm_elementwise(asm=_PRMT_ASM, constraints="=r,=r,r", args=[packed],
                                       dtype=(tl.uint8, tl.uint8), is_pure=True, pack=4)
    return lo.to(tl.float8e4nv, bitcast=True), hi.to(tl.float8e4nv, bitcast=True)


# The same decode with the byte table as operands: per byte lane, e2m1 magnitude code -> byte ``code`` of the pair
# (lut0 = codes 0..3, lut1 = codes 4..7), then the sign. Operands: $0/$1 outputs (low/high nibbles, 4 lanes each),
# $2 the packed bytes, then 4 registers per int32 table operand (pack=4; the lanes of a word share one table, so
# only the first of each is read): $3 low-nibble lut0, $7 low-nibble lut1, $11 high-nibble lut0, $15 high lut1.
_PRMT_LUT_ASM = tl.constexpr(
    "{\n.reg .b32 v, x, sel, t, src, sgn;\n" + "shl.b32 sgn, $2, 4;\n"
    + _PRMT_DECODE.format(src="$2", dst="$0", sign="sgn").replace("lut0, lut1", "$3, $7")
    + "shr.b32 src, $2, 4;\n" + _PRMT_DECODE.format(src="src", dst="$1", sign="$2").replace("lut0, lut1", "$11, $15")
    + "}")


@triton.jit
def e2m1x2_lut_prmt(packed, la0, la1, lb0, lb1):
    """GPU: both nibbles of uint8 ``packed`` through per-lane byte tables (low nibbles: ``la0``/``la1``, high:
    ``lb0``/``lb1``, int32 broadcast to ``packed``'s shape; see ``megamoe.quant.fold_lut``). Returns FP8 e4m3
    (low nibbles, high nibbles)."""
    lo, hi = tl.inline_asm_elementwise(asm=_PRMT_LUT_ASM, constraints="=r,=r," + "r," * 16 + "r",
                                       args=[packed, la0, la1, lb0, lb1], dtype=(tl.uint8, tl.uint8),
                                       is_pure=True, pack=4)
    return lo.to(tl.float8e4nv, bitcast=True), hi.to(tl.float8e4nv, bitcast=True)


@triton.jit
def e2m1_lut(nibble, lut0, lut1):
    """Interpreter twin of :func:`e2m1x2_lut_prmt` for one nibble (int32, low 4 bits): the table byte of its
    magnitude code, then its sign, as FP8 e4m3."""
    code = nibble & 7
    word = tl.where(code < 4, lut0, lut1)
    bits = ((word >> (8 * (code & 3))) & 0xFF) | ((nibble & 8) << 4)
    return bits.to(tl.uint8).to(tl.float8e4nv, bitcast=True)
