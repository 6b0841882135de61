"""What the fused FP8 x FP4 path keeps on a buffer from a call's weights (``megamoe.fused._weights_cache``: the Gluon
phases' TMA descriptors, over the packed weights and their scale words, and the register-operand tile's row maxima)
follows the weights on a GPU: the same packed FP4 weights called with another scale tensor give that scale
tensor's result. (Until session 22 the descriptors were keyed by the packed weights' addresses alone, so the second
call read the first call's scale words.) The host side -- keys, lifetime, ``destroy`` -- is tested on CPU in
``tests/test_fused.py``."""
import dataclasses

import pytest
import torch

from megamoe.cases import MoECase, prepare_rank

pytestmark = pytest.mark.skipif(torch.cuda.get_device_capability() != (9, 0), reason="the Gluon phases are sm_90 only")


@pytest.mark.parametrize("num_tokens,rs", [(32, True), (512, False)], ids=["register-operand", "decode-partition"])
def test_fp4_new_scales_beside_the_same_packed_weights(num_tokens, rs):
    import megamoe.fused as mf
    from megamoe.ops import fp8_fp4_mega_moe
    from megamoe.quant import TransformedWeights, transform_weights_for_mega_moe
    from megamoe.symm import SymmBuffer
    from megamoe.testing import assert_moe_close, default_accumulation

    case = MoECase(num_ranks=1, num_tokens=num_tokens, hidden=7168, intermediate=3072, num_experts=48, num_topk=6,
                   block_m=128, masked_ratio=0.1, seed=11)
    sb = SymmBuffer.local(1, 48, num_tokens, 6, 7168, 3072, block_m=128, device="cuda")[0]
    cfg = mf.fused_config(sb.layout, num_tokens, 1, sb.buffer.device, "hopper")
    assert cfg.kind == "fp4_ws" and bool(cfg.rs_block_n) == rs
    problem = case.problem(device="cuda")
    y, l1, l2, _ = prepare_rank(sb, problem, 0)
    w1, sf1 = problem.l1_weights
    assert max(int(((sf1 >> (8 * j)) & 0xFF).max()) for j in range(4)) < 0xFF  # no exponent byte carries
    doubled = dataclasses.replace(problem, l1_weights=(w1, sf1 + 0x01010101))  # every L1 block scale times 2
    l1_doubled, _ = transform_weights_for_mega_moe(*doubled.weights_for_rank(0))
    assert torch.equal(l1_doubled[0], l1[0])
    mixed = TransformedWeights(l1[0], l1_doubled[1], "l1")  # the first call's packed tensor, new scale words
    outs = []
    for weights, prob in ((l1, problem), (mixed, doubled), (l1, problem)):
        y.fill_(float("nan"))
        fp8_fp4_mega_moe(y, weights, l2, sb, impl="fused", numerics="hopper")
        torch.cuda.synchronize()
        name = f"y (scales {'doubled' if prob is doubled else 'as drawn'})"
        ref = prob.reference(numerics="hopper")[0]
        assert_moe_close(y, ref, name=name, accumulation=default_accumulation(y.device))
        outs.append(y.clone())
    assert not torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    sb.destroy()
