"""What ``transform_weights_for_mega_moe`` does to the weights, shown on tiny tensors: the gate/up row interleave,
the nibble order inside a K chunk, the MN-major scales, and that the untransform restores the input bit for bit."""
from __future__ import annotations

import torch

from megamoe.quant import pack_nibbles, transform_weights_for_mega_moe, untransform_weights_for_mega_moe


def _tiny_weights(hidden: int = 128, intermediate: int = 128):
    """Zero FP4 weights for one expert (the transform only permutes, so zeros + labelled entries suffice)."""
    l1 = (torch.zeros(1, 2 * intermediate, hidden // 2, dtype=torch.int8),
          torch.zeros(1, 2 * intermediate, hidden // 128, dtype=torch.int32))
    l2 = (torch.zeros(1, hidden, intermediate // 2, dtype=torch.int8),
          torch.zeros(1, hidden, intermediate // 128, dtype=torch.int32))
    return l1, l2


def interleave_demo(intermediate: int = 128, hidden: int = 128, show: int = 32) -> list[int]:
    """Original L1 row of each of the first ``show`` transformed rows (rows ``[0, I)`` gate, ``[I, 2I)`` up): the
    scale of row ``r`` is set to ``r`` so the transform's row permutation can be read off."""
    l1, l2 = _tiny_weights(hidden, intermediate)
    l1[1][0, :, 0] = torch.arange(2 * intermediate, dtype=torch.int32)
    (_, sf), _ = transform_weights_for_mega_moe(l1, l2)
    return sf[0, :show, 0].tolist()


def _transformed_bit(k: int, nibble: int, hidden: int = 128, intermediate: int = 128) -> int:
    """The one set bit (index in the transformed row's bits, little-endian bytes) of a row whose element ``k`` is the
    e2m1 bit pattern ``nibble`` (a single bit) and every other element 0."""
    nib = torch.zeros(1, hidden, intermediate, dtype=torch.uint8)
    nib[0, 0, k] = nibble
    l1, _ = _tiny_weights(hidden, intermediate)
    l2 = (pack_nibbles(nib), torch.zeros(1, hidden, intermediate // 128, dtype=torch.int32))
    _, t2 = transform_weights_for_mega_moe(l1, l2)
    bits = (t2.rows()[0, 0].view(torch.uint8).long().unsqueeze(-1) >> torch.arange(8)) & 1  # (row order: unblocked)
    (bit,) = bits.flatten().nonzero().flatten().tolist()
    return bit


def nibble_split_demo(chunk: int = 64) -> list[dict]:
    """Where element ``k`` (0..63) of a weight row lives before (K-major, ``pack_nibbles``: byte ``k // 2``, low or
    high nibble) and after the transform: its byte lane (the byte of its sign bit), and where its 3-bit magnitude
    and its sign bit sit in the little-endian 32-bit word of byte lanes ``4q .. 4q + 3`` that holds it. Found by
    transforming one-hot rows: element ``k`` = e2m1 ``0b0001`` (magnitude code 1: the magnitude's lowest bit) and
    ``0b1000`` (the sign alone)."""
    out = []
    for k in range(chunk):
        mag, sign = _transformed_bit(k, 0b0001), _transformed_bit(k, 0b1000)
        out.append({"element": k, "before: byte": k // 2, "before: nibble": "lo" if k % 2 == 0 else "hi",
                    "after: byte lane": sign // 8, "after: magnitude bits": f"{mag % 32}..{mag % 32 + 2}",
                    "after: sign bit": sign % 32})
    return out


def mn_major_demo(hidden: int = 512, intermediate: int = 256) -> list[dict]:
    """Shapes and strides of the scale tensors before and after the transform (same shape, MN-major strides), and
    whether :func:`~megamoe.quant.untransform_weights_for_mega_moe` restores the input bit for bit."""
    g = torch.Generator().manual_seed(0)
    l1 = (torch.randint(-128, 128, (2, 2 * intermediate, hidden // 2), generator=g, dtype=torch.int8),
          torch.randint(0, 2**31 - 1, (2, 2 * intermediate, hidden // 128), generator=g, dtype=torch.int32))
    l2 = (torch.randint(-128, 128, (2, hidden, intermediate // 2), generator=g, dtype=torch.int8),
          torch.randint(0, 2**31 - 1, (2, hidden, intermediate // 128), generator=g, dtype=torch.int32))
    t1, t2 = transform_weights_for_mega_moe(l1, l2)
    u1, u2 = untransform_weights_for_mega_moe(t1, t2)
    rows = []
    for name, before, after, back in (("l1 scales", l1[1], t1[1], u1[1]), ("l2 scales", l2[1], t2[1], u2[1]),
                                      ("l1 weights", l1[0], t1[0], u1[0]), ("l2 weights", l2[0], t2[0], u2[0])):
        rows.append({"tensor": name, "shape": tuple(before.shape), "strides before": before.stride(),
                     "strides after": after.stride(), "round trip exact": bool(torch.equal(before, back))})
    return rows

