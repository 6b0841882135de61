"""Problems in the SM90 FP8 x FP8 format (:mod:`megamoe.quant_fp8`), for tests: same tokens and routing as
:func:`megamoe.testing.make_problem` for a given seed, FP8 weights with 128x128 fp32 block scales."""
from __future__ import annotations

import torch

from megamoe.quant_fp8 import FP8_BLOCK, cast_grouped_weights_to_fp8, per_token_cast_to_fp8_128
from megamoe.testing import Problem, _generator, make_problem


class Fp8Problem(Problem):
    """A :class:`megamoe.testing.Problem` in the SM90 format: ``x_sf`` float32 ``[n_r, H/128]``, ``l1_weights =
    (float8_e4m3fn [E, 2I, H], float32 [E, 2I/128, H/128])`` (gate rows then up), ``l2_weights = (float8_e4m3fn
    [E, H, I], float32 [E, H/128, I/128])``, untransformed; its reference is
    :func:`megamoe.reference.reference_fp8_mega_moe_ep`."""

    def reference(self, activation_clamp: float | None = None, numerics: str = "exact") -> list[torch.Tensor]:
        from megamoe.reference import reference_fp8_mega_moe_ep

        if numerics != "exact":
            raise ValueError(f"numerics={numerics!r}: the fp8 format has one numerics, 'exact'")
        return reference_fp8_mega_moe_ep(self.x, self.x_sf, self.topk_idx, self.topk_weights, self.l1_weights,
                                         self.l2_weights, self.num_ranks, activation_clamp=activation_clamp)


def make_fp8_problem(num_ranks: int, num_tokens, hidden: int, intermediate: int, num_experts: int, num_topk: int,
                     *, masked_ratio: float = 0.0, routing: str = "uniform", seed: int = 0,
                     device="cpu") -> Fp8Problem:
    """Tokens and routing of ``make_problem(...)`` (same arguments), quantised per 1x128 with fp32 scales; weights
    ``randn / sqrt(fan_in)`` in bf16 (their own generator stream), quantised per 128x128 block."""
    # intermediate=128: the FP4 weights it also builds are not used, keep them small (tokens do not depend on it)
    base = make_problem(num_ranks, num_tokens, hidden, 128, num_experts, num_topk, masked_ratio=masked_ratio,
                        routing=routing, seed=seed, device=device)
    device = torch.device(device)
    gen = _generator(seed, 10_007, device)

    def weights(rows: int, cols: int):  # one expert at a time: fp32 of all 384 real-size experts would be 100 GB
        w = torch.empty(num_experts, rows, cols, dtype=torch.float8_e4m3fn, device=device)
        sf = torch.empty(num_experts, rows // FP8_BLOCK, cols // FP8_BLOCK, dtype=torch.float32, device=device)
        for e in range(num_experts):
            one = torch.randn(1, rows, cols, generator=gen, device=device) / cols ** 0.5
            w[e], sf[e] = (t[0] for t in cast_grouped_weights_to_fp8(one.to(torch.bfloat16)))
        return w, sf

    l1 = weights(2 * intermediate, hidden)
    l2 = weights(hidden, intermediate)
    xs, sfs = zip(*(per_token_cast_to_fp8_128(x) for x in base.x_bf16)) if base.x_bf16 else ((), ())
    return Fp8Problem(**{**vars(base), "intermediate": intermediate, "x": list(xs), "x_sf": list(sfs),
                         "l1_weights": l1, "l2_weights": l2})
