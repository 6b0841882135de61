"""Routing simulation at scales no machine here has: pool occupancy and NVLink traffic of one Mega MoE call.

Up to 72 ranks x 8192 tokens/rank x top-8 (4.7 M (token, expert) pairs per trial) in well under a second: the
routing is sampled and counted in numba (``@njit``), everything else is numpy.

Model (DeepGEMM's first-release Mega MoE, no ring buffer; see :mod:`megamoe.layout`):

* ``R`` ranks, ``E`` experts, expert ``e`` lives on rank ``e // El`` (``El = E / R``); every rank routes ``T``
  tokens, each to ``k`` *distinct* experts (one (token, expert) *pair* per choice).
* A rank's L1/L2 pool holds, per local expert, its received pairs padded to ``block_m`` rows:
  ``pool_rows = sum_e ceil(n_e / block_m) * block_m``. The buffer is sized for the worst case
  :func:`~megamoe.layout.get_num_max_pool_tokens`; ``occupancy = pool_rows / bound``.
* Dispatch: the expert's rank pulls every pair separately: ``H`` FP8 bytes + ``H/32`` UE8M0 scale bytes + 4 bytes of
  router weight. Combine: the expert's rank writes ``2H`` bytes (BF16) per pair back to the token's rank.
  Pairs whose expert is on the token's own rank stay local (the diagonal of the traffic matrices).

Routing: ``"uniform"`` (every expert equally likely) or ``"zipf"`` (the expert of popularity rank ``i`` has weight
``(i+1)^-zipf_alpha``). Each token draws its ``k`` experts without replacement from that distribution (successive
draws renormalised over the experts not yet chosen). Which expert gets which popularity rank is a fresh random
permutation per trial, so hot experts land on random ranks -- unless ``hot_experts`` pins the hottest ones.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numba
import numpy as np

from megamoe.layout import get_num_max_pool_tokens

ROUTINGS = ("uniform", "zipf")
#: Rejection draws before the exact (linear-scan) fallback when sampling an expert not yet chosen.
_MAX_REJECTIONS = 64


# ---------------------------------------------------------------------------------------------------- numba kernels
@numba.njit(cache=False)
def _is_chosen(e: int, chosen: np.ndarray, num_chosen: int) -> bool:
    for i in range(num_chosen):
        if chosen[i] == e:
            return True
    return False


@numba.njit(cache=False)
def _draw_distinct(weights: np.ndarray, cdf: np.ndarray, chosen: np.ndarray, num_chosen: int) -> int:
    """One expert drawn with probability proportional to ``weights`` (float64[E], running sum ``cdf``), excluding
    ``chosen[:num_chosen]``.

    Rejection sampling first (cheap while the chosen mass is small); after ``_MAX_REJECTIONS`` misses, an exact draw
    over the remaining weights (summed directly, not from ``cdf`` differences, which lose the small weights to
    rounding). Both give the same distribution: the weights renormalised over the unchosen experts.
    """
    num_experts = weights.shape[0]
    total = cdf[num_experts - 1]
    for _ in range(_MAX_REJECTIONS):
        e = min(np.searchsorted(cdf, np.random.random() * total, side="right"), num_experts - 1)
        if not _is_chosen(e, chosen, num_chosen):
            return e
    remaining = 0.0
    for e in range(num_experts):
        if not _is_chosen(e, chosen, num_chosen):
            remaining += weights[e]
    u = np.random.random() * remaining
    last_free = -1
    for e in range(num_experts):
        if _is_chosen(e, chosen, num_chosen):
            continue
        last_free = e
        u -= weights[e]
        if u < 0.0:
            return e
    return last_free  # rounding, or no weight left: any unchosen expert


@numba.njit(cache=False)
def _sample_topk(num_tokens: int, num_topk: int, weights: np.ndarray, seed: int) -> np.ndarray:
    """int32[num_tokens, num_topk]: ``num_topk`` distinct experts per token, drawn in proportion to ``weights``."""
    np.random.seed(seed)
    cdf = np.cumsum(weights)
    out = np.empty((num_tokens, num_topk), np.int32)
    for t in range(num_tokens):
        for j in range(num_topk):
            out[t, j] = _draw_distinct(weights, cdf, out[t], j)
    return out


@numba.njit(cache=False)
def _count_pairs(topk_idx: np.ndarray, num_tokens_per_rank: int, num_experts: int, num_ranks: int):
    """Count the pairs of ``topk_idx`` (int32[R*T, k], token-major by source rank; negative = masked).

    Returns (int64[E] pairs per global expert, int64[R, R] pairs from source rank to expert rank).
    """
    experts_per_rank = num_experts // num_ranks
    recv = np.zeros(num_experts, np.int64)
    pairs = np.zeros((num_ranks, num_ranks), np.int64)
    for t in range(topk_idx.shape[0]):
        src = t // num_tokens_per_rank
        for j in range(topk_idx.shape[1]):
            e = topk_idx[t, j]
            if e < 0:
                continue
            recv[e] += 1
            pairs[src, e // experts_per_rank] += 1
    return recv, pairs


# ---------------------------------------------------------------------------------------------------- results
@dataclass(eq=False)
class SimResult:
    """Counts and traffic of ``num_trials`` simulated Mega MoE calls (leading axis of every array = trial).

    Arrays:
        recv_pairs: int64[trials, R, El] pairs received by each rank's local experts.
        pair_matrix: int64[trials, R, R] pairs from token rank (row) to expert rank (column).
    Byte quantities are derived from these (properties below); all sizes in bytes, rows in pool rows.
    """

    num_ranks: int
    num_tokens_per_rank: int
    num_experts: int
    num_topk: int
    hidden: int
    intermediate_hidden: int | None
    block_m: int
    routing: str
    zipf_alpha: float
    recv_pairs: np.ndarray
    pair_matrix: np.ndarray

    # ---- sizes
    @property
    def num_trials(self) -> int:
        return self.recv_pairs.shape[0]

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.num_ranks

    @property
    def dispatch_bytes_per_pair(self) -> int:
        """FP8 row + per-32 UE8M0 scales + FP32 router weight."""
        return self.hidden + self.hidden // 32 + 4

    @property
    def combine_bytes_per_pair(self) -> int:
        """One BF16 row written back to the token's rank."""
        return 2 * self.hidden

    @property
    def pool_bytes_per_row(self) -> int:
        """Bytes of one pool row: L1 (FP8 + scales + weight), plus L2 (FP8 + scales) when ``intermediate_hidden``
        is known."""
        l2 = 0 if self.intermediate_hidden is None else self.intermediate_hidden + self.intermediate_hidden // 32
        return self.dispatch_bytes_per_pair + l2

    # ---- pool occupancy
    @property
    def pool_bound(self) -> int:
        """Worst-case pool rows per rank (the buffer is sized for it): ``get_num_max_pool_tokens``."""
        return get_num_max_pool_tokens(self.num_ranks, self.num_tokens_per_rank, self.num_topk,
                                       self.experts_per_rank, self.block_m)

    @property
    def pool_rows(self) -> np.ndarray:
        """int64[trials, R]: rows each rank's pool really uses (each local expert padded to ``block_m``)."""
        bm = self.block_m
        return ((self.recv_pairs + bm - 1) // bm * bm).sum(axis=2)

    @property
    def occupancy(self) -> np.ndarray:
        """float64[trials, R]: ``pool_rows / pool_bound``."""
        return self.pool_rows / self.pool_bound

    @property
    def pairs_per_rank(self) -> np.ndarray:
        """int64[trials, R]: pairs each rank's experts receive."""
        return self.recv_pairs.sum(axis=2)

    @property
    def load_imbalance(self) -> np.ndarray:
        """float64[trials]: max / mean over ranks of received pairs (1.0 = perfectly balanced)."""
        p = self.pairs_per_rank
        return p.max(axis=1) / p.mean(axis=1)

    # ---- traffic
    @property
    def dispatch_bytes(self) -> np.ndarray:
        """int64[trials, src, dst]: bytes the expert rank ``dst`` pulls from token rank ``src`` (diagonal = local)."""
        return self.pair_matrix * self.dispatch_bytes_per_pair

    @property
    def combine_bytes(self) -> np.ndarray:
        """int64[trials, dst, src]: bytes expert rank ``dst`` writes back to token rank ``src`` (diagonal = local).

        Indexed like the dispatch's (dst, src) roles, so that row = sender, column = receiver in both matrices.
        """
        return self.pair_matrix.transpose(0, 2, 1) * self.combine_bytes_per_pair

    @staticmethod
    def _off_diagonal(m: np.ndarray) -> np.ndarray:
        return m * (1 - np.eye(m.shape[-1], dtype=m.dtype))

    @property
    def local_fraction(self) -> np.ndarray:
        """float64[trials]: share of pairs whose expert is on the token's own rank (no NVLink traffic)."""
        diag = np.trace(self.pair_matrix, axis1=1, axis2=2)
        return diag / self.pair_matrix.sum(axis=(1, 2))

    @property
    def max_link_dispatch_bytes(self) -> np.ndarray:
        """int64[trials]: the busiest rank-to-rank link of the dispatch (remote pairs only)."""
        return self._off_diagonal(self.dispatch_bytes).max(axis=(1, 2))

    @property
    def max_link_combine_bytes(self) -> np.ndarray:
        """int64[trials]: the busiest rank-to-rank link of the combine (remote pairs only)."""
        return self._off_diagonal(self.combine_bytes).max(axis=(1, 2))

    @property
    def max_ingress_dispatch_bytes(self) -> np.ndarray:
        """int64[trials]: the most remote bytes one rank pulls (its NVLink ingress bounds dispatch time)."""
        return self._off_diagonal(self.dispatch_bytes).sum(axis=1).max(axis=1)

    @property
    def max_egress_combine_bytes(self) -> np.ndarray:
        """int64[trials]: the most remote bytes one rank writes back (its NVLink egress bounds combine time)."""
        return self._off_diagonal(self.combine_bytes).sum(axis=2).max(axis=1)

    def summary(self) -> dict:
        """Scalars averaged over trials (maxima over ranks/links taken per trial first): for tables and JSON."""
        rows = self.pool_rows
        return {
            "num_ranks": self.num_ranks, "num_tokens_per_rank": self.num_tokens_per_rank,
            "num_experts": self.num_experts, "num_topk": self.num_topk, "block_m": self.block_m,
            "routing": self.routing, "zipf_alpha": self.zipf_alpha, "num_trials": self.num_trials,
            "pool_bound_rows": self.pool_bound,
            "pool_rows_mean": float(rows.mean()),
            "pool_rows_max": float(rows.max(axis=1).mean()),
            "occupancy_max": float(self.occupancy.max(axis=1).mean()),
            "load_imbalance": float(self.load_imbalance.mean()),
            "local_fraction": float(self.local_fraction.mean()),
            "max_link_dispatch_bytes": float(self.max_link_dispatch_bytes.mean()),
            "max_link_combine_bytes": float(self.max_link_combine_bytes.mean()),
            "max_ingress_dispatch_bytes": float(self.max_ingress_dispatch_bytes.mean()),
            "max_egress_combine_bytes": float(self.max_egress_combine_bytes.mean()),
        }


# ---------------------------------------------------------------------------------------------------- public API
def _check_shape(num_ranks: int, num_experts: int, num_topk: int, block_m: int) -> None:
    if num_ranks < 1 or num_experts % num_ranks:
        raise ValueError(f"num_experts={num_experts} must be a positive multiple of num_ranks={num_ranks}")
    if not 1 <= num_topk <= num_experts:
        raise ValueError(f"num_topk={num_topk} must be in [1, num_experts={num_experts}]")
    if block_m < 1:
        raise ValueError(f"block_m={block_m} must be >= 1")


def _counts(topk_idx: np.ndarray, num_ranks: int, num_tokens_per_rank: int, num_experts: int):
    """(int64[R, El], int64[R, R]) from int32[R*T, k] routing (numba)."""
    recv, pairs = _count_pairs(topk_idx, num_tokens_per_rank, num_experts, num_ranks)
    return recv.reshape(num_ranks, num_experts // num_ranks), pairs


def simulate_topk(topk_idx, num_experts: int, *, hidden: int, intermediate_hidden: int | None = None,
                  block_m: int = 128, routing: str = "given") -> SimResult:
    """One trial from an explicit routing.

    Args:
        topk_idx: int array [R, T, k] (numpy or torch): expert of each (source rank, token, slot); -1 = masked.
            Experts of one token should be distinct (as the router guarantees); duplicates are counted as given.
        num_experts: E, divisible by R.
    """
    topk = np.asarray(topk_idx.cpu() if hasattr(topk_idx, "cpu") else topk_idx)
    if topk.ndim != 3:
        raise ValueError(f"topk_idx must be [R, T, k], got shape {topk.shape}")
    num_ranks, num_tokens, num_topk = topk.shape
    _check_shape(num_ranks, num_experts, num_topk, block_m)
    if topk.size and topk.max() >= num_experts:
        raise ValueError(f"topk_idx has experts >= num_experts={num_experts}")
    flat = np.ascontiguousarray(topk.reshape(num_ranks * num_tokens, num_topk), dtype=np.int32)
    recv, pairs = _counts(flat, num_ranks, num_tokens, num_experts)
    return SimResult(num_ranks, num_tokens, num_experts, num_topk, hidden, intermediate_hidden, block_m, routing,
                     0.0, recv[None], pairs[None])


def expert_weights(num_experts: int, routing: str, zipf_alpha: float, rng: np.random.Generator,
                   hot_experts: Sequence[int] | None = None) -> np.ndarray:
    """float64[E] unnormalised popularity of each expert for one trial.

    ``"uniform"``: all ones. ``"zipf"``: ``(i+1)^-zipf_alpha`` for popularity rank ``i``; ranks go to
    ``hot_experts`` first (in order), then to the other experts in a random order drawn from ``rng``.
    """
    if routing == "uniform":
        return np.ones(num_experts)
    if routing != "zipf":
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    hot = [] if hot_experts is None else [int(e) for e in hot_experts]
    if len(set(hot)) != len(hot) or any(not 0 <= e < num_experts for e in hot):
        raise ValueError(f"hot_experts must be distinct experts in [0, {num_experts}), got {hot}")
    rest = np.setdiff1d(np.arange(num_experts), np.asarray(hot, dtype=np.int64))
    order = np.concatenate([np.asarray(hot, dtype=np.int64), rng.permutation(rest)])
    weights = np.empty(num_experts)
    weights[order] = (np.arange(num_experts) + 1.0) ** -zipf_alpha
    return weights


def simulate_routing(num_ranks: int, num_tokens_per_rank: int, num_experts: int, num_topk: int, *, hidden: int,
                     intermediate_hidden: int | None = None, block_m: int = 128, routing: str = "uniform",
                     zipf_alpha: float = 1.0, hot_experts: Sequence[int] | None = None, seed: int = 0,
                     num_trials: int = 1) -> SimResult:
    """Sample ``num_trials`` routings of ``num_ranks * num_tokens_per_rank`` tokens and count pairs and traffic.

    Args:
        num_ranks: R (any size; 72 = NVL72). num_tokens_per_rank: T. num_experts: E (divisible by R).
        num_topk: k distinct experts per token. hidden / intermediate_hidden: H / I, for byte counts.
        block_m: pool padding granularity per expert.
        routing: ``"uniform"`` or ``"zipf"`` (popularity ``(i+1)^-zipf_alpha``, see :func:`expert_weights`).
        hot_experts: zipf only: expert ids given the top popularity ranks, in order (default: random each trial).
        seed: makes the whole result reproducible. num_trials: independent routings (leading axis of the arrays).
    """
    _check_shape(num_ranks, num_experts, num_topk, block_m)
    if num_trials < 1 or num_tokens_per_rank < 1:
        raise ValueError("num_trials and num_tokens_per_rank must be >= 1")
    rng = np.random.default_rng(seed)
    recvs, pair_mats = [], []
    for _ in range(num_trials):
        weights = expert_weights(num_experts, routing, zipf_alpha, rng, hot_experts)
        topk = _sample_topk(num_ranks * num_tokens_per_rank, num_topk, weights, int(rng.integers(2**31)))
        recv, pairs = _counts(topk, num_ranks, num_tokens_per_rank, num_experts)
        recvs.append(recv)
        pair_mats.append(pairs)
    return SimResult(num_ranks, num_tokens_per_rank, num_experts, num_topk, hidden, intermediate_hidden, block_m,
                     routing, zipf_alpha if routing == "zipf" else 0.0, np.stack(recvs), np.stack(pair_mats))


def sample_topk(num_ranks: int, num_tokens_per_rank: int, num_experts: int, num_topk: int, *,
                routing: str = "uniform", zipf_alpha: float = 1.0, hot_experts: Sequence[int] | None = None,
                seed: int = 0) -> np.ndarray:
    """int32[R, T, k]: one routing, sampled exactly as one trial of :func:`simulate_routing` with the same seed."""
    _check_shape(num_ranks, num_experts, num_topk, 1)
    rng = np.random.default_rng(seed)
    weights = expert_weights(num_experts, routing, zipf_alpha, rng, hot_experts)
    topk = _sample_topk(num_ranks * num_tokens_per_rank, num_topk, weights, int(rng.integers(2**31)))
    return topk.reshape(num_ranks, num_tokens_per_rank, num_topk)


def reference_counts(topk_idx, num_experts: int):
    """Torch reference of the counting: ``torch.bincount`` instead of numba.

    Args:
        topk_idx: int tensor/array [R, T, k]; negative entries are masked.
    Returns:
        (int64 tensor [R, El] pairs per local expert, int64 tensor [R, R] pairs from token rank to expert rank).
    """
    import torch

    idx = torch.as_tensor(np.asarray(topk_idx) if not isinstance(topk_idx, torch.Tensor) else topk_idx).long()
    num_ranks = idx.shape[0]
    experts_per_rank = num_experts // num_ranks
    src = torch.arange(num_ranks).view(-1, 1, 1).expand_as(idx)
    valid = idx >= 0
    recv = torch.bincount(idx[valid], minlength=num_experts).view(num_ranks, experts_per_rank)
    link = src[valid] * num_ranks + idx[valid] // experts_per_rank
    pairs = torch.bincount(link, minlength=num_ranks * num_ranks).view(num_ranks, num_ranks)
    return recv, pairs


def route_to_one_rank(counts: Sequence[int], num_ranks: int, num_tokens_per_rank: int, num_topk: int) -> np.ndarray:
    """int32 ``[R, T, k]`` routing in which **every** (token, slot) pair of every rank goes to rank 0's experts,
    local expert ``e`` receiving ``counts[e]`` pairs (``sum(counts) == R*T*k``): the situation the worst-case pool
    bound is sized for, with a chosen spread over the experts.

    Pairs are laid out expert by expert and dealt to tokens column-wise (pair ``p`` -> token ``p % (R*T)``, slot
    ``p // (R*T)``), so a token's ``k`` experts are ``R*T`` pairs apart in that list: distinct whenever every count
    is at most ``R*T`` (checked).
    """
    counts = np.asarray(counts, dtype=np.int64)
    n_tok = num_ranks * num_tokens_per_rank
    if counts.sum() != n_tok * num_topk:
        raise ValueError(f"counts sum to {counts.sum()}, expected R*T*k = {n_tok * num_topk}")
    if counts.max() > n_tok:
        raise ValueError(f"an expert can receive at most R*T = {n_tok} pairs (one per token), got {counts.max()}")
    experts = np.repeat(np.arange(len(counts), dtype=np.int32), counts)
    p = np.arange(n_tok * num_topk)
    topk = np.empty((n_tok, num_topk), dtype=np.int32)
    topk[p % n_tok, p // n_tok] = experts
    assert (np.diff(np.sort(topk, axis=1), axis=1) > 0).all(), "a token got the same expert twice"
    return topk.reshape(num_ranks, num_tokens_per_rank, num_topk)
