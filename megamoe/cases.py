"""Mega MoE cases: one configuration (:class:`MoECase`) run end to end on ranks and checked against the reference.

:func:`run_case` runs a case on a backend (:func:`run_case_local` with every rank in this process, or
:func:`run_case_rank` on one process per rank through ``megamoe.launch``) and returns one report per rank:
error statistics against the reference, the tolerance verdict, bitwise equality and the recv stats.
Used by the tests (CPU ranks, local ranks), by ``tests/gpu`` at real sizes, by the benchmarks and the notebooks.
Functions that run inside launched rank processes live here, in an importable module, because spawned processes
cannot import functions defined in a notebook or a test file.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

import torch

from megamoe.harness import on_ranks
from megamoe.ops import fp8_fp4_mega_moe, load_inputs
from megamoe.ops_fp8 import fp8_mega_moe
from megamoe.quant import transform_weights_for_mega_moe
from megamoe.quant_fp8 import transform_weights_for_mega_moe_sm90
from megamoe.symm import SymmBuffer
from megamoe.testing import Problem, check_stats, default_accumulation, make_problem, moe_error_stats
from megamoe.testing_fp8 import Fp8Problem, make_fp8_problem


@dataclass
class MoECase:
    """One configuration to run. ``num_tokens`` is per rank (an int, or a list with one entry per rank)."""

    num_ranks: int = 2
    num_tokens: int | list[int] = 40
    hidden: int = 256
    intermediate: int = 128
    num_experts: int = 8
    num_topk: int = 2
    masked_ratio: float = 0.0
    routing: str = "uniform"
    seed: int = 0
    block_m: int = 32
    activation_clamp: float | None = None
    dispatch: str = "pull"
    impl: str = "auto"
    numerics: str = "exact"
    num_calls: int = 1
    num_max_tokens_per_rank: int | None = None
    extra: dict = field(default_factory=dict)
    #: The op: ``"fp8_fp4"`` (``fp8_fp4_mega_moe``, FP4 weights) or ``"fp8"`` (``fp8_mega_moe``, DeepGEMM's SM90 FP8
    #: format; ``numerics`` must stay ``"exact"``).
    format: str = "fp8_fp4"

    def tokens(self) -> list[int]:
        n = self.num_tokens
        return list(n) if isinstance(n, (list, tuple)) else [n] * self.num_ranks

    def max_tokens(self) -> int:
        return self.num_max_tokens_per_rank or max(1, max(self.tokens()))

    def layout(self):
        """The :class:`~megamoe.layout.Layout` of the case's buffers (what ``fused_config`` is asked about)."""
        from megamoe.layout import Layout

        return Layout(self.num_ranks, self.num_experts, self.max_tokens(), self.num_topk, self.hidden,
                      self.intermediate, self.block_m, format=self.format)

    def problem(self, device="cpu") -> Problem:
        """The case's inputs and weights in its format (a :class:`~megamoe.testing_fp8.Fp8Problem` for ``"fp8"``)."""
        make = make_fp8_problem if self.format == "fp8" else make_problem
        return make(self.num_ranks, self.tokens(), self.hidden, self.intermediate, self.num_experts, self.num_topk,
                    masked_ratio=self.masked_ratio, routing=self.routing, seed=self.seed, device=device)

    def run(self, y, l1, l2, sym_buffer, stats) -> None:
        """One call of the case's op on bound arguments (lists of them for the local backend)."""
        if self.format == "fp8":
            fp8_mega_moe(y, l1, l2, sym_buffer, stats, activation_clamp=self.activation_clamp, dispatch=self.dispatch,
                         impl=self.impl)
        else:
            fp8_fp4_mega_moe(y, l1, l2, sym_buffer, activation_clamp=self.activation_clamp,
                             cumulative_local_expert_recv_stats=stats, dispatch=self.dispatch, impl=self.impl,
                             numerics=self.numerics)

    def label(self) -> str:
        """What the reports call the numerics: ``"fp8"`` for that format, else ``numerics``."""
        return "fp8" if self.format == "fp8" else self.numerics


@dataclass
class SpreadScalesCase(MoECase):
    """A FP8 x FP4 case whose activation and weight scales are spread: 30 % of the packed scale words 2^10 lower in
    all four groups (seeded), so that folding relative to a row's largest exponent (``numerics="hopper"``) rounds
    values below e4m3's normal range (a plain case's data fold exactly: its per-32 weight scales differ by about
    one exponent)."""

    def problem(self, device="cpu") -> Problem:
        p = super().problem(device)
        g = torch.Generator().manual_seed(self.seed)

        def spread(sf):
            lower = torch.rand(sf.shape, generator=g) < 0.3
            return torch.where(lower.to(sf.device), sf - 0x0A0A0A0A, sf)

        p.x_sf = [spread(sf) for sf in p.x_sf]
        p.l1_weights = (p.l1_weights[0], spread(p.l1_weights[1]))
        p.l2_weights = (p.l2_weights[0], spread(p.l2_weights[1]))
        return p


@dataclass
class L2SpreadCase(MoECase):
    """A FP8 x FP4 case whose L2 inputs' per-128 scales differ within a token: the L1 weights' scales of the gate and
    up rows of every other 128-column intermediate block lowered by 2^-6 (all four groups), so those blocks' SwiGLU
    outputs are ~2^-12 of the others'. Folding the L2 input per token (``numerics="hopper"``) then shifts those
    blocks' values ~12 exponents down and rounds every one below e4m3's normal range, and ``"hopper_l2_per_block"``
    (each K block's own scale) does not: the two models' outputs differ in a few elements of most rows (measured: 34
    of 40 rows at H 384, I 640, top-3, no clamp; a plain case of that shape: 5 of 40). Needs an intermediate size of
    at least two 128-column blocks."""

    def problem(self, device="cpu") -> Problem:
        p = super().problem(device)
        w, sf = p.l1_weights
        I = self.intermediate
        lower = torch.zeros(2 * I, dtype=torch.bool)
        for b in range(1, I // 128, 2):
            lower[b * 128: b * 128 + 128] = True  # gate rows
            lower[I + b * 128: I + b * 128 + 128] = True  # up rows
        lower = lower.to(sf.device)[None, :, None]
        p.l1_weights = (w, torch.where(lower, sf - 0x06060606, sf))
        return p


def l2_fold_exact_tokens(problem: Problem, activation_clamp: float | None = None) -> torch.Tensor:
    """Which tokens of a one-rank FP8 x FP4 ``problem`` have an L2 input that ``numerics="hopper"`` folds exactly,
    bool ``[n]``: for every expert row of the token (every unmasked slot), folding the row's per-128 values relative
    to its largest scale (:func:`megamoe.quant.fold_to_row_scale_dequant`) rounds nothing. For those tokens the two
    Hopper numerics compute the same products and sums up to exact powers of two, so a kernel's outputs in the two
    modes must be bitwise equal there, whatever order its sums take."""
    from megamoe.quant import dequant_fp8, fold_to_row_scale_dequant
    from megamoe.reference import reference_mega_moe

    if problem.num_ranks != 1:
        raise ValueError(f"problem: one rank's problem wanted, got num_ranks={problem.num_ranks}")
    _, inter = reference_mega_moe(problem.x[0], problem.x_sf[0], problem.topk_idx[0], problem.topk_weights[0],
                                  problem.l1_weights, problem.l2_weights, activation_clamp=activation_clamp,
                                  return_intermediates=True, numerics="hopper")
    exact = torch.ones(problem.x[0].shape[0], dtype=torch.bool, device=problem.x[0].device)
    for rows, (q, sf) in zip(inter["expert_rows"], inter["l2_in"]):
        ok = (fold_to_row_scale_dequant(q.float(), sf) == dequant_fp8(q, sf)).all(dim=1)
        exact[rows[:, 0][~ok]] = False
    return exact


def gluon_phase_cases(**common) -> list[MoECase]:
    """The small cases both Gluon GEMM phases' GPU tests run (``common``: the format, block and impl keywords): one
    rank; two ranks with masks and an empty rank at top-6; four ranks with a clamp and an I of five 128-blocks; two
    skewed ranks over three calls."""
    return [
        MoECase(num_ranks=1, num_topk=2, num_experts=4, num_tokens=300, hidden=512, intermediate=256, **common),
        MoECase(num_ranks=2, num_topk=6, num_experts=8, num_tokens=[145, 0], masked_ratio=0.3, hidden=768,
                intermediate=384, **common),
        MoECase(num_ranks=4, num_topk=2, num_experts=8, num_tokens=[133, 7, 0, 212], activation_clamp=0.25,
                hidden=512, intermediate=640, **common),
        MoECase(num_ranks=2, num_topk=3, num_tokens=[229, 13], hidden=1024, intermediate=512, routing="skewed",
                num_calls=3, **common),
    ]


def fp4_gluon_phase_cases(**common) -> list[MoECase]:
    """``gluon_phase_cases`` and, for the FP8 x FP4 format's Gluon tiles, two skewed ranks with spread scales (the
    folds round), masks, a clamp and two calls."""
    return gluon_phase_cases(**common) + [
        SpreadScalesCase(num_ranks=2, num_topk=3, num_experts=6, num_tokens=[300, 90], hidden=512, intermediate=384,
                         masked_ratio=0.1, activation_clamp=0.5, num_calls=2, seed=21, **common),
    ]


def assert_cuda_graph_replays(sb: SymmBuffer, problem: Problem, numerics: str = "hopper", replays: int = 3) -> None:
    """Rank 0's FP8 x FP4 fused call on ``sb`` (one local rank, a GPU): warmed up (compiles, fills the host caches),
    captured in a CUDA graph, replayed ``replays`` times on a NaN-poisoned output, each replay within the FP8-MMA
    tolerance of ``problem.reference(numerics=...)``; then the workspace's barrier state checked clean."""
    from megamoe.kernels.symm import check_barrier_state
    from megamoe.testing import assert_moe_close

    y, l1, l2, _ = prepare_rank(sb, problem, 0)
    ref = problem.reference(numerics=numerics)[0]
    fp8_fp4_mega_moe(y, l1, l2, sb, impl="fused", numerics=numerics, check=False)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fp8_fp4_mega_moe(y, l1, l2, sb, impl="fused", numerics=numerics, check=False)
    for _ in range(replays):
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_moe_close(y, ref, accumulation="fp8_mma")
    check_barrier_state(sb)


def expected_recv_counts(problem: Problem, rank: int) -> torch.Tensor:
    """int32 [El]: (token, slot) pairs every rank routes to each of ``rank``'s local experts."""
    El = problem.num_local_experts
    idx = torch.cat([t.flatten() for t in problem.topk_idx]).cpu()
    idx = idx[(idx >= rank * El) & (idx < (rank + 1) * El)] - rank * El
    return torch.bincount(idx, minlength=El).to(torch.int32)


def prepare_rank(sb: SymmBuffer, problem: Problem, rank: int):
    """Load ``rank``'s inputs into ``sb`` and return ``(y, l1, l2, stats)``: a NaN-poisoned bf16 output [n, H], the
    rank's transformed weights and a zeroed int32 [El] stats tensor, all on the buffer's device."""
    dev = sb.buffer.device
    load_inputs(sb, problem.x[rank], problem.x_sf[rank], problem.topk_idx[rank], problem.topk_weights[rank])
    l1, l2 = problem.weights_for_rank(rank)
    transform = transform_weights_for_mega_moe_sm90 if isinstance(problem, Fp8Problem) else \
        transform_weights_for_mega_moe
    l1, l2 = transform(tuple(t.to(dev) for t in l1), tuple(t.to(dev) for t in l2))
    y = torch.full((problem.num_tokens[rank], problem.hidden), float("nan"), dtype=torch.bfloat16, device=dev)
    stats = torch.zeros(problem.num_local_experts, dtype=torch.int32, device=dev)
    return y, l1, l2, stats


def _report(case: MoECase, problem: Problem, rank: int, y: torch.Tensor, ref: torch.Tensor, stats: torch.Tensor,
            seconds: list[float], numerics: str = "exact") -> dict:
    out = moe_error_stats(y.cpu(), ref.cpu())
    out["numerics"] = numerics
    accumulation = default_accumulation(y.device)
    out.update(accumulation=accumulation, failures=check_stats(out, accumulation))
    expected = expected_recv_counts(problem, rank) * case.num_calls
    out.update(rank=rank, num_tokens=problem.num_tokens[rank], seconds_per_call=seconds,
               recv_stats=stats.cpu().tolist(), recv_stats_ok=bool(torch.equal(stats.cpu(), expected)),
               bitwise_equal=bool(torch.equal(y.cpu().view(torch.int16), ref.cpu().view(torch.int16))))
    return out


def _timed_calls(case: MoECase, ys: list[torch.Tensor], call) -> list[float]:
    """Run ``call`` ``case.num_calls`` times on NaN-poisoned outputs; wall seconds per call (device synchronized)."""
    seconds = []
    for _ in range(case.num_calls):
        for y in ys:
            y.fill_(float("nan"))
        t0 = time.perf_counter()
        call()
        if ys[0].device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
    return seconds


def assert_reports(reports: list[dict], label: str) -> None:
    """Print one line per rank report (from :func:`run_case_local` / :func:`run_case_rank`) and assert it passed its
    tolerance profile and its recv stats (the GPU tests' check)."""
    for r in reports:
        print(f"{label} rank {r['rank']}: n={r['num_tokens']} numerics={r.get('numerics')} rel_fro={r['rel_fro']:.3e} "
              f"max_row={r['max_row_rel']:.2e} outliers={r['frac_outliers']:.2e} bitwise={r['bitwise_equal']} "
              f"recv={sum(r['recv_stats'])} t={[round(s * 1e3, 2) for s in r['seconds_per_call']]} ms")
        assert not r["failures"], r
        assert r["recv_stats_ok"], r


def run_case_local(case: MoECase, device=None) -> list[dict]:
    """All ``case.num_ranks`` ranks in this process (``local`` backend, lock-step); one stats dict per rank."""
    sbs = SymmBuffer.local(case.num_ranks, case.num_experts, case.max_tokens(), case.num_topk, case.hidden,
                           case.intermediate, block_m=case.block_m, device=device, format=case.format)
    try:
        dev = sbs[0].buffer.device
        problem = case.problem(device=dev)
        prepared = [prepare_rank(sb, problem, r) for r, sb in enumerate(sbs)]
        ys, l1s, l2s, stats = (list(t) for t in zip(*prepared))
        seconds = _timed_calls(case, ys, lambda: case.run(ys, l1s, l2s, sbs, stats))
        refs = problem.reference(activation_clamp=case.activation_clamp, numerics=case.numerics)
        return [_report(case, problem, r, ys[r], refs[r], stats[r], seconds, case.label())
                for r in range(case.num_ranks)]
    finally:
        for sb in sbs:
            sb.destroy()


def run_case_rank(rank: int, world_size: int, case: MoECase) -> dict:
    """This rank's part of ``case`` with one process per rank (run it through :func:`megamoe.launch.launch`)."""
    if world_size != case.num_ranks:
        raise ValueError(f"world_size={world_size} does not match case.num_ranks={case.num_ranks}")
    sb = SymmBuffer(None, case.num_experts, case.max_tokens(), case.num_topk, case.hidden, case.intermediate,
                    block_m=case.block_m, format=case.format)
    try:
        dev = sb.buffer.device
        problem = case.problem(device=dev)
        y, l1, l2, stats = prepare_rank(sb, problem, rank)
        seconds = _timed_calls(case, [y], lambda: case.run(y, l1, l2, sb, stats))
        ref = problem.reference(activation_clamp=case.activation_clamp, numerics=case.numerics)[rank]
        return _report(case, problem, rank, y, ref, stats, seconds, case.label())
    finally:
        sb.destroy()


def run_case(case: MoECase, backend: str = "auto", device=None) -> list[dict]:
    """``case`` on ``backend`` (``megamoe.env.resolve_backend``): :func:`run_case_local` (on ``device``) for
    ``local``, else :func:`run_case_rank` on ``case.num_ranks`` processes. One report per rank, in rank order."""
    return on_ranks(run_case_rank, functools.partial(run_case_local, device=device), case.num_ranks, case,
                    backend=backend)
