"""Problem generation and the output tolerance, shared by tests, notebooks and benchmarks.

:func:`make_problem` builds a deterministic expert-parallel problem (per-rank quantised tokens and routing,
global FP4 expert weights); :func:`assert_moe_close` / :func:`moe_error_stats` compare a kernel's ``y`` with
the reference's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megamoe.quant import QuantWeights, cast_grouped_weights_to_fp4, per_token_cast_to_fp8
from megamoe.reference import reference_mega_moe_ep

ROUTINGS = ("uniform", "one_expert", "skewed")
ZIPF_EXPONENT = 1.0
"""Expert popularity of the ``"skewed"`` routing: the i-th most popular expert has weight ``1 / i**ZIPF_EXPONENT``."""
_WEIGHT_CHUNK_ELEMENTS = 1 << 24


@dataclass
class Problem:
    """One expert-parallel MoE problem. Per-rank lists are indexed by rank; weights are global and untransformed.

    Attributes:
        x: per rank, float8_e4m3fn ``[n_r, H]`` quantised tokens.
        x_sf: per rank, int32 ``[n_r, H/128]`` packed UE8M0 scales (K-major).
        topk_idx: per rank, int64 ``[n_r, k]`` global expert ids, -1 for masked slots.
        topk_weights: per rank, float32 ``[n_r, k]``; 0 for masked slots.
        x_bf16: per rank, bf16 ``[n_r, H]`` activations before quantisation.
        l1_weights: ``(int8 [E, 2I, H/2], int32 [E, 2I, H/128])``, rows gate then up.
        l2_weights: ``(int8 [E, H, I/2], int32 [E, H, I/128])``.
    """

    num_ranks: int
    num_tokens: list[int]
    hidden: int
    intermediate: int
    num_experts: int
    num_topk: int
    masked_ratio: float
    routing: str
    seed: int
    x: list[torch.Tensor]
    x_sf: list[torch.Tensor]
    topk_idx: list[torch.Tensor]
    topk_weights: list[torch.Tensor]
    x_bf16: list[torch.Tensor]
    l1_weights: QuantWeights
    l2_weights: QuantWeights

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.num_ranks

    def weights_for_rank(self, rank: int) -> tuple[QuantWeights, QuantWeights]:
        """The untransformed ``(l1, l2)`` weights of experts ``[rank*El, (rank+1)*El)`` (views, not copies)."""
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank: must lie in [0, {self.num_ranks}), got {rank}")
        experts = slice(rank * self.num_local_experts, (rank + 1) * self.num_local_experts)
        l1 = (self.l1_weights[0][experts], self.l1_weights[1][experts])
        l2 = (self.l2_weights[0][experts], self.l2_weights[1][experts])
        return l1, l2

    def reference(self, activation_clamp: float | None = None, numerics: str = "exact") -> list[torch.Tensor]:
        """Reference ``y`` per rank (bf16 ``[n_r, H]``), from :func:`megamoe.reference.reference_mega_moe_ep`
        (``numerics``: ``"exact"`` for the staged kernels, ``"hopper"`` for the fused one)."""
        return reference_mega_moe_ep(
            self.x, self.x_sf, self.topk_idx, self.topk_weights, self.l1_weights, self.l2_weights,
            self.num_ranks, activation_clamp=activation_clamp, numerics=numerics,
        )


def _generator(seed: int, stream: int, device: torch.device) -> torch.Generator:
    """An independent generator per (seed, stream): weights do not depend on the token counts, nor rank r's
    tokens on other ranks'."""
    return torch.Generator(device=device).manual_seed(seed * 1_000_003 + stream)


def _make_weights(num_experts: int, rows: int, cols: int, gen: torch.Generator, device: torch.device) -> QuantWeights:
    """FP4 weights ``[E, rows, cols]`` from bf16 ``randn / sqrt(cols)``, generated and quantised a few experts
    at a time (about :data:`_WEIGHT_CHUNK_ELEMENTS` elements) to bound the float32 temporaries."""
    chunk = max(1, _WEIGHT_CHUNK_ELEMENTS // (rows * cols))
    packed, scales = [], []
    for start in range(0, num_experts, chunk):
        count = min(chunk, num_experts - start)
        w = torch.randn(count, rows, cols, generator=gen, device=device) / cols**0.5
        w_q, sf = cast_grouped_weights_to_fp4(w.to(torch.bfloat16))
        packed.append(w_q)
        scales.append(sf)
    return torch.cat(packed), torch.cat(scales)


def _route(
    routing: str, n: int, num_experts: int, num_local_experts: int, num_topk: int,
    gen: torch.Generator, device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct top-k experts per token (int64 ``[n, k]``) and their softmax weights (float32 ``[n, k]``)."""
    if routing == "skewed":
        # Gumbel-top-k: k experts without replacement, with probabilities from Zipf popularity (shuffled experts)
        popularity_rank = torch.randperm(num_experts, generator=gen, device=device) + 1
        log_popularity = -ZIPF_EXPONENT * popularity_rank.float().log()
        uniform = torch.rand(n, num_experts, generator=gen, device=device).clamp(min=1e-12)
        scores = log_popularity - (-uniform.log()).log()
    else:
        scores = torch.randn(n, num_experts, generator=gen, device=device)
    keys = scores
    if routing == "one_expert":
        # Slot 0 on expert 0, then rank 0's other experts, then the rest: every token sends min(k, El) pairs
        # to rank 0, the largest pool a rank can receive.
        bias = torch.zeros(num_experts, device=device)
        bias[:num_local_experts] = 1e4
        bias[0] = 2e4
        keys = scores + bias
    topk_idx = keys.topk(num_topk, dim=1).indices
    topk_weights = scores.gather(1, topk_idx).softmax(dim=1)
    return topk_idx, topk_weights


def make_problem(
    num_ranks: int,
    num_tokens: int | list[int],
    hidden: int,
    intermediate: int,
    num_experts: int,
    num_topk: int,
    *,
    masked_ratio: float = 0.0,
    routing: str = "uniform",
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> Problem:
    """A deterministic (for a given ``seed`` and device type) expert-parallel MoE problem.

    * Tokens: ``x_bf16 = randn`` bf16 ``[n_r, H]``, quantised with :func:`megamoe.quant.per_token_cast_to_fp8`.
      ``num_tokens`` is one count for every rank or a list per rank (0 allowed).
    * Weights: ``randn / sqrt(fan_in)`` in bf16 for ``W1 [E, 2I, H]`` and ``W2 [E, H, I]``, quantised with
      :func:`megamoe.quant.cast_grouped_weights_to_fp4`; ``y`` then has an RMS of order 0.1-1.
    * Routing (always ``k`` distinct experts per token; weights = softmax of the selected scores):
      ``"uniform"``: top-k of randn scores. ``"one_expert"``: slot 0 is expert 0 for every token and the other
      slots go to rank 0's other experts first (random order), so rank 0 receives every pair it can, the
      worst-case pool. ``"skewed"``: experts sampled without replacement from a Zipf popularity
      (exponent :data:`ZIPF_EXPONENT`) over a random permutation of experts.
    * Masking: each slot independently with probability ``masked_ratio`` gets id -1 and weight 0 (weights
      are not renormalised).
    """
    if not isinstance(num_ranks, int) or num_ranks < 1:
        raise ValueError(f"num_ranks: must be a positive int, got {num_ranks}")
    counts = [num_tokens] * num_ranks if isinstance(num_tokens, int) else list(num_tokens)
    if len(counts) != num_ranks or any(not isinstance(c, int) or c < 0 for c in counts):
        raise ValueError(f"num_tokens: expected an int >= 0 or a list of {num_ranks} of them, got {num_tokens}")
    if hidden % 128 != 0 or hidden <= 0:
        raise ValueError(f"hidden: must be a positive multiple of 128, got {hidden}")
    if intermediate % 128 != 0 or intermediate <= 0:
        raise ValueError(f"intermediate: must be a positive multiple of 128, got {intermediate}")
    if num_experts < 1 or num_experts % num_ranks != 0:
        raise ValueError(f"num_experts: must be a positive multiple of num_ranks={num_ranks}, got {num_experts}")
    if not 1 <= num_topk <= num_experts:
        raise ValueError(f"num_topk: must lie in [1, num_experts={num_experts}], got {num_topk}")
    if not 0.0 <= masked_ratio <= 1.0:
        raise ValueError(f"masked_ratio: must lie in [0, 1], got {masked_ratio}")
    if routing not in ROUTINGS:
        raise ValueError(f"routing: must be one of {ROUTINGS}, got {routing!r}")
    device = torch.device(device)

    gen = _generator(seed, 0, device)
    l1_weights = _make_weights(num_experts, 2 * intermediate, hidden, gen, device)
    l2_weights = _make_weights(num_experts, hidden, intermediate, gen, device)

    x, x_sf, topk_idx, topk_weights, x_bf16 = [], [], [], [], []
    for rank, n in enumerate(counts):
        gen = _generator(seed, rank + 1, device)
        tokens = torch.randn(n, hidden, generator=gen, device=device).to(torch.bfloat16)
        idx, weights = _route(routing, n, num_experts, num_experts // num_ranks, num_topk, gen, device)
        masked = torch.rand(n, num_topk, generator=gen, device=device) < masked_ratio
        x_q, sf = per_token_cast_to_fp8(tokens)
        x.append(x_q)
        x_sf.append(sf)
        topk_idx.append(idx.masked_fill(masked, -1))
        topk_weights.append(weights.masked_fill(masked, 0.0))
        x_bf16.append(tokens)

    return Problem(
        num_ranks=num_ranks, num_tokens=counts, hidden=hidden, intermediate=intermediate,
        num_experts=num_experts, num_topk=num_topk, masked_ratio=masked_ratio, routing=routing, seed=seed,
        x=x, x_sf=x_sf, topk_idx=topk_idx, topk_weights=topk_weights, x_bf16=x_bf16,
        l1_weights=l1_weights, l2_weights=l2_weights,
    )


# ----------------------------------------------------------------------------------------------------------
# Tolerance
# ----------------------------------------------------------------------------------------------------------

#: Tolerance profiles: what may differ between a kernel and the reference, by how the kernel accumulates.
#: ``"fp32"``: dot products accumulated in float32 (Triton's interpreter; also the reference) -- they differ only
#: in summation order. ``"fp8_mma"``: Hopper FP8 tensor cores, which add the products inside one MMA (K=32) with
#: ~14 significant bits (DeepSeek-V3 report, H800) before each fp32 promotion.
TOLERANCES = {
    "fp32": {"rel_fro": 2e-3, "frac_outliers": 1e-2, "max_row_rel": 2e-2},
    "fp8_mma": {"rel_fro": 1e-2, "frac_outliers": None, "max_row_rel": 5e-2},
}
ELEM_REL_TOL = 2.0**-7
ELEM_ABS_TOL_RMS = 2.0**-10
"""An element is an outlier when ``|y - ref| > ELEM_REL_TOL * |ref| + ELEM_ABS_TOL_RMS * rms(ref)``."""


def default_accumulation(device) -> str:
    """The tolerance profile for kernels that ran on ``device``: ``"fp8_mma"`` on CUDA, ``"fp32"`` otherwise."""
    return "fp8_mma" if torch.device(device).type == "cuda" else "fp32"


def moe_error_stats(y: torch.Tensor, y_ref: torch.Tensor) -> dict:
    """Error statistics of ``y`` against ``y_ref`` (same shape, else AssertionError; any float dtypes), in float32.

    Keys: ``numel``, ``finite`` (every element of both finite), ``rel_fro`` (``||y-ref||_F / ||ref||_F``; 0 when
    both norms are 0, inf when only ``ref``'s is), ``rms_ref``, ``max_abs_err``, ``num_outliers`` and
    ``frac_outliers`` (elements with ``|y-ref| > 2^-7 |ref| + 2^-10 rms(ref)``, non-finite ones included), and
    ``worst_index`` / ``worst_y`` / ``worst_ref``: the element furthest beyond that threshold (a non-finite
    one first), ``None`` for empty tensors.
    """
    if y.shape != y_ref.shape:
        raise AssertionError(f"shape mismatch: y {tuple(y.shape)} vs y_ref {tuple(y_ref.shape)}")
    y32, ref32 = y.detach().float(), y_ref.detach().float()
    stats: dict = {"numel": y.numel()}
    finite = torch.isfinite(y32) & torch.isfinite(ref32)
    stats["finite"] = bool(finite.all())
    diff = (y32 - ref32).abs()
    diff_norm, ref_norm = diff.norm().item(), ref32.norm().item()
    stats["rel_fro"] = diff_norm / ref_norm if ref_norm > 0 else (0.0 if diff_norm == 0 else float("inf"))
    rms = ref_norm / max(y.numel(), 1) ** 0.5
    stats["rms_ref"] = rms
    stats["max_abs_err"] = diff.max().item() if y.numel() else 0.0
    excess = diff - (ELEM_REL_TOL * ref32.abs() + ELEM_ABS_TOL_RMS * rms)
    excess = torch.where(finite, excess, torch.full_like(excess, float("inf")))
    num_outliers = int((excess > 0).sum())
    stats["num_outliers"] = num_outliers
    stats["frac_outliers"] = num_outliers / max(y.numel(), 1)
    if y.dim() == 2 and y.numel():
        row_ref = ref32.norm(dim=1)
        row_rel = (y32 - ref32).norm(dim=1) / row_ref.clamp_min(rms * y.shape[1] ** 0.5 * 1e-3)
        stats["max_row_rel"] = float(torch.where(finite.all(dim=1), row_rel, float("inf")).max())
    else:
        stats["max_row_rel"] = 0.0
    if y.numel():
        worst = tuple(int(i) for i in torch.unravel_index(excess.argmax(), excess.shape))
        stats.update(worst_index=worst, worst_y=y32[worst].item(), worst_ref=ref32[worst].item())
    else:
        stats.update(worst_index=None, worst_y=None, worst_ref=None)
    return stats


def check_stats(stats: dict, accumulation: str = "fp32") -> list[str]:
    """The bounds of profile ``accumulation`` (see :data:`TOLERANCES`) that ``stats`` violates (empty = pass)."""
    tol = TOLERANCES[accumulation]
    failures = [] if stats["finite"] else ["non-finite values"]
    for key in ("rel_fro", "frac_outliers", "max_row_rel"):
        if tol[key] is not None and stats[key] > tol[key]:
            failures.append(f"{key} {stats[key]:.3e} > {tol[key]:.0e} ({accumulation})")
    return failures


def assert_cuda_graph_replays(call, y: torch.Tensor, y_ref: torch.Tensor, replays: int = 3,
                              accumulation: str = "fp8_mma") -> None:
    """Warm ``call()`` up (one MoE call writing ``y``: compiles, fills the caches a capture must not allocate), capture
    it in a CUDA graph and replay it ``replays`` times, ``y`` filled with NaN before each; every replay must match
    ``y_ref`` (:func:`assert_moe_close`)."""
    call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for _ in range(replays):
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_moe_close(y, y_ref, accumulation=accumulation)


def assert_moe_close(y: torch.Tensor, y_ref: torch.Tensor, name: str = "y", accumulation: str = "fp32") -> dict:
    """Assert a kernel's MoE output matches the reference's; return :func:`moe_error_stats` on success.

    Why these bounds: kernel and reference consume identical quantised inputs, and every product of an FP8
    (4-bit significand) and an FP4 (2-bit significand) value times power-of-two scales is exact in float32.

    * ``"fp32"`` accumulation: the two differ only in float32 summation order (~1e-6 relative). That can flip the
      bf16 rounding of an L1 or L2 output (one bf16 ulp, 2^-8 relative) and, rarely, the FP8 requantisation of one
      SwiGLU output (one FP8 ulp, <= 2^-3 relative, on one of ``I`` terms of an L2 dot product). Hence
      ``||y - ref||_F / ||ref||_F <= 2e-3``, at most 1% of elements with ``|y - ref| > 2^-7 |ref| + 2^-10 rms``
      (two bf16 ulps plus a floor near zero), and no row off by more than 2%.
    * ``"fp8_mma"`` accumulation: each K=32 tensor-core dot carries ~2^-13 relative error, so an L1 output lands
      on the other side of a bf16 rounding boundary with probability ~2^-13 / 2^-8 = 3%, and of an FP8 requant
      boundary ~2^-13 / 2^-4 = 0.05% of the time. With I = 3072 that is ~1.5 flipped L2 inputs per row, each
      changing one of I terms by <= 1/16 of itself: relative row error ~ sqrt(1.5 / I) / 16 ~ 1.4e-3, plus bf16
      flips. Bound: ``rel_fro <= 1e-2`` and every row within 5% (a wrong expert or token gives ~100%); the
      outlier fraction is reported, not bounded (2-ulp differences are common at K = 7168).

    Raises AssertionError naming ``name`` with the statistics and the worst element's index.
    """
    stats = moe_error_stats(y, y_ref)
    failures = check_stats(stats, accumulation)
    if failures:
        raise AssertionError(
            f"{name} does not match the reference: {'; '.join(failures)}. worst element {name}"
            f"{list(stats['worst_index'] or ())} = {stats['worst_y']} vs reference {stats['worst_ref']}; stats: {stats}"
        )
    return stats
