"""What ``transform_weights_for_mega_moe`` does to the weights, shown on tiny tensors: the gate/up row interleave,
the nibble order inside a K chunk, the MN-major scales, and that the untransform restores the input bit for bit."""
from __future__ import annotations

import torch

from megamoe.quant import pack_nibbles, transform_weights_for_mega_moe, unpack_nibbles, untransform_weights_for_mega_moe


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


def nibble_split_demo(chunk: int = 64) -> list[dict]:
    """Where element ``k`` (0..63) of a weight row lives before (K-major, ``pack_nibbles``) and after the transform:
    (byte, low/high nibble). Found by transforming one-hot rows (only element ``k`` non-zero)."""
    hidden, intermediate = 128, 128
    out = []
    for k in range(chunk):
        nib = torch.zeros(1, hidden, intermediate, dtype=torch.uint8)
        nib[0, 0, k] = 1
        l1, _ = _tiny_weights(hidden, intermediate)
        l2 = (pack_nibbles(nib), torch.zeros(1, hidden, intermediate // 128, dtype=torch.int32))
        _, (w, _) = transform_weights_for_mega_moe(l1, l2)
        before = unpack_nibbles(l2[0][0, 0]).nonzero().flatten().item()
        after = unpack_nibbles(w[0, 0]).nonzero().flatten().item()
        out.append({"element": k, "before: byte": before // 2, "before: nibble": "lo" if before % 2 == 0 else "hi",
                    "after: byte": after // 2, "after: nibble": "lo" if after % 2 == 0 else "hi"})
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

