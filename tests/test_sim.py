"""megamoe.sim: numba routing counts against torch, the pool bound, uniform statistics, traffic bookkeeping."""
import math

import numpy as np
import pytest
import torch

from megamoe.layout import get_num_max_pool_tokens
from megamoe.sim import reference_counts, sample_topk, simulate_routing, simulate_topk

H, I = 512, 256


@pytest.mark.parametrize("routing,alpha", [("uniform", 1.0), ("zipf", 1.0), ("zipf", 3.0)])
def test_numba_counts_match_torch_bincount(routing, alpha):
    topk = sample_topk(4, 100, 16, 3, routing=routing, zipf_alpha=alpha, seed=1)
    topk[0, :10, 1] = -1                       # masked slots are skipped
    res = simulate_topk(topk, 16, hidden=H)
    recv, pairs = reference_counts(topk, 16)
    assert np.array_equal(res.recv_pairs[0], recv.numpy())
    assert np.array_equal(res.pair_matrix[0], pairs.numpy())
    assert res.pair_matrix.sum() == 4 * 100 * 3 - 10


@pytest.mark.parametrize("routing,alpha,num_experts,num_topk", [
    ("uniform", 1.0, 8, 8),       # k == E: every token picks every expert
    ("zipf", 1.2, 64, 6),
    ("zipf", 200.0, 32, 8),       # weights underflow to 0 past the first few: exact fallback path
])
def test_sampled_experts_are_distinct_and_in_range(routing, alpha, num_experts, num_topk):
    topk = sample_topk(2, 500, num_experts, num_topk, routing=routing, zipf_alpha=alpha, seed=3)
    assert topk.min() >= 0 and topk.max() < num_experts
    flat = topk.reshape(-1, num_topk)
    assert all(len(set(row)) == num_topk for row in flat.tolist())


def test_seed_reproducible_and_sample_topk_matches_first_trial():
    kw = dict(routing="zipf", zipf_alpha=1.0, seed=11)
    a = simulate_routing(4, 256, 32, 4, hidden=H, num_trials=2, **kw)
    b = simulate_routing(4, 256, 32, 4, hidden=H, num_trials=2, **kw)
    assert np.array_equal(a.recv_pairs, b.recv_pairs) and np.array_equal(a.pair_matrix, b.pair_matrix)
    assert not np.array_equal(a.recv_pairs[0], a.recv_pairs[1])       # trials are independent draws
    one = simulate_topk(sample_topk(4, 256, 32, 4, **kw), 32, hidden=H)
    assert np.array_equal(one.recv_pairs[0], a.recv_pairs[0])


@pytest.mark.parametrize("num_ranks,tokens,experts,topk,block_m,routing,alpha,hot", [
    (8, 512, 64, 6, 128, "uniform", 1.0, None),
    (8, 512, 64, 6, 64, "zipf", 1.5, None),
    (16, 300, 32, 8, 128, "zipf", 60.0, list(range(8))),   # the 8 hottest experts on ranks 0..3
    (72, 8192, 576, 8, 128, "zipf", 1.0, None),                                # NVL72 scale
])
def test_realized_pool_rows_never_exceed_the_bound(num_ranks, tokens, experts, topk, block_m, routing, alpha, hot):
    res = simulate_routing(num_ranks, tokens, experts, topk, hidden=H, block_m=block_m, routing=routing,
                           zipf_alpha=alpha, hot_experts=hot, seed=5)
    assert res.pool_rows.max() <= res.pool_bound
    assert res.pool_bound == get_num_max_pool_tokens(num_ranks, tokens, topk, experts // num_ranks, block_m)
    assert (res.pool_rows % block_m == 0).all()


@pytest.mark.parametrize("num_topk", [2, 4, 6])
def test_adversarial_all_to_one_rank(num_topk):
    """Every token of every rank routes to rank 0's experts (as many as it can): the worst case the bound sizes."""
    R, T, E, bm = 4, 333, 16, 128                   # El = 4
    El = E // R
    first = np.arange(num_topk) % E                 # experts 0..k-1: rank 0's first, then rank 1's
    topk = np.broadcast_to(first, (R, T, num_topk)).copy()
    res = simulate_topk(topk, E, hidden=H, block_m=bm)
    on_rank0 = min(num_topk, El)
    assert res.pairs_per_rank[0, 0] == R * T * on_rank0
    assert res.pool_rows[0, 0] == on_rank0 * math.ceil(R * T / bm) * bm
    assert res.pool_rows.max() <= res.pool_bound


def test_bound_is_tight_when_every_expert_wastes_block_m_minus_one_rows():
    """R=1, T=257, E=k=4: each expert receives 257 = 2*128 + 1 pairs, padded to 384 rows = the bound exactly."""
    topk = np.broadcast_to(np.arange(4), (1, 257, 4)).copy()
    res = simulate_topk(topk, 4, hidden=H, block_m=128)
    assert res.pool_rows[0, 0] == res.pool_bound == 4 * 384
    assert res.occupancy[0, 0] == 1.0


def _expected_padded_rows(n: int, p: float, block_m: int) -> float:
    """E[ceil(X / block_m) * block_m] for X ~ Binomial(n, p)."""
    k = np.arange(n + 1)
    log_pmf = (math.lgamma(n + 1) - np.array([math.lgamma(x + 1) + math.lgamma(n - x + 1) for x in k])
               + k * math.log(p) + (n - k) * math.log1p(-p))
    return float((np.exp(log_pmf) * (np.ceil(k / block_m) * block_m)).sum())


def test_uniform_matches_binomial_expectation():
    R, T, E, k, bm = 8, 2048, 64, 6, 128
    res = simulate_routing(R, T, E, k, hidden=H, block_m=bm, seed=2, num_trials=4)
    n, p = R * T, k / E                             # each token picks a given expert with probability k/E
    mean, sigma = n * p, math.sqrt(n * p * (1 - p))
    assert res.recv_pairs.mean() == mean            # every pair lands somewhere: the mean is exact
    assert np.abs(res.recv_pairs - mean).max() < 5 * sigma
    expected_rows = (E // R) * _expected_padded_rows(n, p, bm)
    assert abs(res.pool_rows.mean() - expected_rows) / expected_rows < 0.02
    assert res.load_imbalance.max() < 1.05


def test_zipf_is_more_imbalanced_than_uniform_and_hot_experts_pin_the_hot_rank():
    kw = dict(hidden=H, seed=4, num_trials=2)
    uniform = simulate_routing(8, 1024, 64, 4, **kw)
    zipf = simulate_routing(8, 1024, 64, 4, routing="zipf", zipf_alpha=1.2, **kw)
    assert zipf.load_imbalance.mean() > uniform.load_imbalance.mean() + 0.2
    pinned = simulate_routing(8, 1024, 64, 4, routing="zipf", zipf_alpha=2.0, hot_experts=[40, 41, 42], **kw)
    assert (pinned.pairs_per_rank.argmax(axis=1) == 5).all()      # experts 40..47 live on rank 5


def test_traffic_totals_are_consistent():
    R, T, E, k = 8, 700, 32, 5
    res = simulate_routing(R, T, E, k, hidden=H, intermediate_hidden=I, routing="zipf", seed=9, num_trials=3)
    pairs = R * T * k
    assert res.dispatch_bytes_per_pair == H + H // 32 + 4 and res.combine_bytes_per_pair == 2 * H
    assert (res.dispatch_bytes.sum(axis=(1, 2)) == pairs * res.dispatch_bytes_per_pair).all()
    assert (res.combine_bytes.sum(axis=(1, 2)) == pairs * 2 * H).all()
    # row = sender, column = receiver in both: combine reverses the dispatch pair by pair
    assert np.array_equal(res.combine_bytes // (2 * H),
                          res.dispatch_bytes.transpose(0, 2, 1) // res.dispatch_bytes_per_pair)
    assert (res.pair_matrix.sum(axis=2) == T * k).all()            # each rank sends T*k pairs
    assert np.array_equal(res.pair_matrix.sum(axis=1), res.pairs_per_rank)
    local = np.trace(res.pair_matrix, axis1=1, axis2=2)
    assert np.allclose(res.local_fraction, local / pairs)
    off = res.dispatch_bytes * (1 - np.eye(R, dtype=np.int64))
    assert (res.max_link_dispatch_bytes == off.max(axis=(1, 2))).all()
    assert (res.max_ingress_dispatch_bytes == off.sum(axis=1).max(axis=1)).all()
    assert res.max_egress_combine_bytes.max() <= (res.combine_bytes.sum(axis=2)).max()
    assert res.pool_bytes_per_row == (H + H // 32 + 4) + (I + I // 32)
    s = res.summary()
    assert s["num_trials"] == 3 and s["pool_rows_max"] <= s["pool_bound_rows"]


def test_reference_counts_accepts_torch():
    topk = torch.tensor([[[0, 3], [1, -1]], [[2, 3], [3, 0]]])
    recv, pairs = reference_counts(topk, 4)
    assert recv.tolist() == [[2, 1], [1, 3]]
    assert pairs.tolist() == [[2, 1], [1, 3]]


@pytest.mark.parametrize("bad", [dict(num_experts=10), dict(num_topk=0), dict(routing="pareto"),
                                 dict(routing="zipf", hot_experts=[1, 1])])
def test_argument_checks(bad):
    kw = dict(num_ranks=4, num_tokens_per_rank=8, num_experts=16, num_topk=2, hidden=H) | bad
    with pytest.raises(ValueError):
        simulate_routing(**kw)
