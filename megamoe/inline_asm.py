"""The kernels' inline PTX run on CPU: a bit-level emulator of the few 32-bit instructions their
``inline_asm_elementwise`` strings use (``mov``, ``and``, ``or``, ``xor``, ``not``, ``shl``, ``shr``, ``prmt``;
``mad.lo``; ``.b32`` / ``.u32``; ``cvt.rn.bf16x2.f32``, two float32 rounded to bf16 and packed;
``cvt.rn.satfinite.e4m3x2.f16x2`` and ``mov.b32 d, {lo, hi}`` on ``.b16`` registers), so that a CPU test can
check an asm string's *semantics* against the torch model. (The ``.approx`` instructions of the Gluon epilogue's
SwiGLU, ``ex2`` / ``rcp``, are the hardware's own approximations and are not emulated.)

The interpreter never runs these strings (it takes each kernel's pure-``tl`` twin), and a GPU only shows that a
whole tile is wrong. With this emulator the FP4 decode strings of :mod:`megamoe.kernels.numerics` are checked on
every word a CPU test draws, and a leaner string can be written and proven equal before it meets a GPU.

``run(asm, operands)``: ``asm`` as passed to ``inline_asm_elementwise`` (``$0 .. $n`` operands, a ``{ .reg ... }``
block); ``operands`` maps operand numbers to uint32 numpy arrays (inputs; with Triton's ``pack=4`` an operand
register holds four uint8 elements, element ``i`` in byte ``i``). Returns every ``$n`` written (uint32 arrays).
Unknown instructions raise: the emulator covers what the strings use, nothing silently.
"""
from __future__ import annotations

import re

import numpy as np

_MASK = np.uint64(0xFFFFFFFF)


def _prmt(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """``prmt.b32 d, a, b, c`` (default mode): byte ``i`` of ``d`` is byte ``c[4i+2:4i]`` of the 8-byte value
    ``{b, a}`` (a = bytes 0-3), or with ``c[4i+3]`` set that byte's sign bit replicated (0x00 / 0xFF)."""
    src = a.astype(np.uint64) | (b.astype(np.uint64) << np.uint64(32))
    out = np.zeros_like(a, dtype=np.uint64)
    for i in range(4):
        sel = (c.astype(np.uint64) >> np.uint64(4 * i)) & np.uint64(0xF)
        byte = (src >> ((sel & np.uint64(7)) * np.uint64(8))) & np.uint64(0xFF)
        byte = np.where(sel & np.uint64(8), np.where(byte & np.uint64(0x80), np.uint64(0xFF), np.uint64(0)), byte)
        out |= byte << np.uint64(8 * i)
    return out.astype(np.uint32)


_OPS = {
    "and": lambda x, y: x & y,
    "or": lambda x, y: x | y,
    "xor": lambda x, y: x ^ y,
    "shl": lambda x, y: ((x.astype(np.uint64) << np.minimum(y, 32).astype(np.uint64)) & _MASK).astype(np.uint32),
    "shr": lambda x, y: np.where(y >= 32, np.uint32(0), x >> np.minimum(y, 31)).astype(np.uint32),
}
_INSTR = re.compile(r"^(\w+)((?:\.\w+)*)\s+(.*)$")


def _bf16_rn(x: np.ndarray) -> np.ndarray:
    """float32 bits -> bf16 bits (uint32, low 16 bits), round to nearest even; NaN -> 0x7FFF (the canonical NaN
    the hardware's conversions write)."""
    x = x.astype(np.uint64)
    nan = ((x >> np.uint64(23)) & np.uint64(0xFF)) == np.uint64(0xFF)
    nan &= (x & np.uint64(0x7FFFFF)) != np.uint64(0)
    r = (x + np.uint64(0x7FFF) + ((x >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16)
    return np.where(nan, np.uint64(0x7FFF), r & np.uint64(0xFFFF)).astype(np.uint32)


def _e4m3_rn(h: np.ndarray) -> np.ndarray:
    """float16 bits (uint32, low 16 bits) -> e4m3 bits (uint32, low 8 bits) as ``cvt.rn.satfinite``: round to nearest
    even (subnormals included), finite values beyond 448 to +-448, NaN to NaN (0x7F with its sign)."""
    import torch

    x = torch.from_numpy(np.asarray(h, dtype=np.uint16).view(np.float16).astype(np.float32))
    e = x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8).numpy().astype(np.uint32)
    return np.where(np.isnan(x.numpy()), np.where(np.signbit(x.numpy()), 0xFF, 0x7F), e).astype(np.uint32)


def run(asm: str, operands: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    """Execute ``asm`` over the lanes of ``operands`` (see the module docstring)."""
    regs: dict[str, np.ndarray] = {f"${k}": np.asarray(v, dtype=np.uint32) for k, v in operands.items()}
    shape = next(iter(regs.values())).shape
    written: set[str] = set()

    def value(tok: str) -> np.ndarray:
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        if re.fullmatch(r"-?(0[xX][0-9a-fA-F]+|\d+)", tok):
            return np.full(shape, int(tok, 0) & 0xFFFFFFFF, dtype=np.uint32)
        raise KeyError(f"inline asm: operand {tok!r} read before it is written")

    body = asm.strip()
    if body.startswith("{") and body.endswith("}"):  # the block's braces (a vector operand keeps its own)
        body = body[1:-1]
    for stmt in (s.strip() for s in body.split(";")):
        if not stmt or stmt.startswith(".reg"):
            continue
        m = _INSTR.match(stmt)
        if m is None:
            raise ValueError(f"inline asm: cannot parse {stmt!r}")
        op, mods = m.group(1), m.group(2)
        vec = re.fullmatch(r"(\S+),\s*\{(.*)\}", m.group(3).strip())  # mov.b32 d, {lo, hi}
        args = [vec.group(1), "{" + vec.group(2) + "}"] if vec else [a.strip() for a in m.group(3).split(",")]
        dst, src = args[0], args[1:]
        if op == "cvt":
            if mods == ".rn.bf16x2.f32":  # PTX: a's value into the upper half of d, b's into the lower
                res = (_bf16_rn(value(src[0])) << np.uint32(16)) | _bf16_rn(value(src[1]))
            elif mods == ".rn.satfinite.e4m3x2.f16x2":  # each float16 half into the byte of its place
                res = _e4m3_rn(value(src[0]) & np.uint32(0xFFFF)) | (_e4m3_rn(value(src[0]) >> np.uint32(16))
                                                                      << np.uint32(8))
            else:
                raise ValueError(f"inline asm: only cvt.rn.bf16x2.f32 and cvt.rn.satfinite.e4m3x2.f16x2 are "
                                 f"emulated ({stmt!r})")
        elif op == "mov" and vec:  # two 16-bit registers into one 32-bit one, the first in the low half
            lo, hi = (value(t) & np.uint32(0xFFFF) for t in vec.group(2).split(","))
            res = lo | (hi << np.uint32(16))
        elif op == "mov":
            res = value(src[0]).copy()
        elif op == "mad":
            if mods != ".lo.u32":
                raise ValueError(f"inline asm: only mad.lo.u32 is emulated ({stmt!r})")
            a, b, c = (value(t).astype(np.uint64) for t in src)
            res = ((a * b + c) & _MASK).astype(np.uint32)
        elif op == "not":
            res = ~value(src[0])
        elif op == "prmt":
            res = _prmt(value(src[0]), value(src[1]), value(src[2]))
        elif op in _OPS:
            res = _OPS[op](value(src[0]), value(src[1]))
        else:
            raise ValueError(f"inline asm: instruction {op!r} is not emulated ({stmt!r})")
        regs[dst] = res.astype(np.uint32)
        written.add(dst)
    return {int(k[1:]): regs[k] for k in sorted(written) if k.startswith("$")}


def pack_bytes(b: np.ndarray) -> np.ndarray:
    """uint8 ``[..., 4n]`` -> uint32 ``[..., n]``, element ``4i + j`` in byte ``j`` (Triton's ``pack=4``)."""
    return np.ascontiguousarray(b, dtype=np.uint8).view("<u4")


def unpack_bytes(w: np.ndarray) -> np.ndarray:
    """The inverse of :func:`pack_bytes`."""
    return np.ascontiguousarray(w, dtype="<u4").view(np.uint8)
