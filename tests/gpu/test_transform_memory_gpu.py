"""The weight transforms of both formats on a GPU, one EP8 rank's 48 V4-Pro experts (H 7168, I 3072): the memory
they allocate beyond their outputs is one expert's temporaries (``megamoe.quant.per_expert``) plus the FP4 nibble
repack's bounded pieces, not copies of the whole tensor -- before session 39 the FP8 transform of 384 experts
(25 GB of weights) ran an 80 GB H100 out of memory in the real-size tests. The untransforms give the inputs back.
The second test runs the same transforms with whole-tensor steps and checks that the bound would have caught them."""
import pytest
import torch

import megamoe.quant as q
import megamoe.quant_fp8 as q8

H, I, E = 7168, 3072, 48


def _fp4_weights():
    g = torch.Generator(device="cuda").manual_seed(0)
    w1 = torch.randint(-128, 128, (E, 2 * I, H // 2), dtype=torch.int8, device="cuda", generator=g)
    w2 = torch.randint(-128, 128, (E, H, I // 2), dtype=torch.int8, device="cuda", generator=g)
    sf = 0x7F7E7F80  # four valid UE8M0 bytes (2^0, 2^-1, 2^0, 2^1)
    return (w1, torch.full((E, 2 * I, H // 128), sf, dtype=torch.int32, device="cuda")), \
           (w2, torch.full((E, H, I // 128), sf, dtype=torch.int32, device="cuda"))


def _fp8_weights():
    g = torch.Generator(device="cuda").manual_seed(0)

    def one(rows, cols):
        w = (torch.randn(E, rows, cols, device="cuda", generator=g, dtype=torch.bfloat16)).to(torch.float8_e4m3fn)
        return w, torch.rand(E, rows // 128, cols // 128, device="cuda", generator=g) + 0.5

    return one(2 * I, H), one(H, I)


FORMATS = {"fp8_fp4": (_fp4_weights, q.transform_weights_for_mega_moe, q.untransform_weights_for_mega_moe),
           "fp8": (_fp8_weights, q8.transform_weights_for_mega_moe_sm90, q8.untransform_weights_for_mega_moe_sm90)}


def _transform_peak(fmt):
    """(bytes allocated at the transform's peak beyond its inputs and its outputs, the bound: four of the largest
    expert's weight bytes + 32 pieces of the FP4 nibble repack (``_by_pieces``; its int64 intermediates), inputs,
    outputs). Measured on an H100 (session 39): 399 MiB beyond the outputs (FP8 x FP4; bound 600) and 43 (FP8;
    bound 168) per expert, 1418 and 3023 MiB with whole-tensor steps
    (``results/probes/gputests_h100_s39.json``)."""
    make, transform, _ = FORMATS[fmt]
    l1, l2 = make()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = transform(l1, l2)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - sum(t.nbytes for pair in out for t in pair)
    one_expert = l1[0][0].nbytes
    bound = 4 * one_expert + (32 * q._REPACK_PIECE_BYTES if fmt == "fp8_fp4" else 0)
    return extra, bound, (l1, l2), out


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_transform_temporaries_are_one_experts(fmt):
    extra, bound, (l1, l2), out = _transform_peak(fmt)
    print(f"{fmt}: {extra / 2**20:.0f} MiB beyond the outputs (bound {bound / 2**20:.0f} MiB; the L1 weights "
          f"{l1[0].nbytes / 2**20:.0f} MiB)")
    assert extra <= bound, (fmt, extra, bound)
    back = FORMATS[fmt][2](*out)
    for a, b in zip((l1, l2), back):
        assert torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_the_bound_catches_whole_tensor_steps(fmt, monkeypatch):
    """``per_expert`` replaced by one call on the whole tensor (the transforms before session 39): over the bound."""
    whole = lambda fn, w: fn(w)  # noqa: E731
    monkeypatch.setattr(q, "per_expert", whole)
    monkeypatch.setattr(q8, "per_expert", whole)
    extra, bound, _, _ = _transform_peak(fmt)
    print(f"{fmt} whole-tensor steps: {extra / 2**20:.0f} MiB beyond the outputs (bound {bound / 2**20:.0f} MiB)")
    assert extra > bound, (fmt, extra, bound)
