"""The staged pipeline, one step at a time: :class:`StagedRun` drives every rank of a case through the steps of
``megamoe.ops.pipeline_steps`` and reads the workspace, the pools and the combine buffers between steps.

* :class:`StagedRun` -- ``run(until="l1")`` executes steps (each for all ``local`` ranks, in lock-step, exactly as
  ``fp8_fp4_mega_moe`` does); then counters, source indices, the pool map, and per-step comparisons with the
  reference's intermediates (L2 inputs, combine rows, ``y``).
* :class:`PoolMap` -- which (source rank, token, slot) sits in each pool row of a rank, from the kernels' schedule.
* :func:`time_steps` -- per-step times of a call (the one per-step timer; used by the pull/push demo and the
  benchmarks).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch

from megamoe import ops
from megamoe.cases import MoECase, prepare_rank
from megamoe.kernels import symm as ks
from megamoe.kernels.pool import pool_schedule
from megamoe.quant import dequant_fp8
from megamoe.reference import reference_mega_moe
from megamoe.symm import SymmBuffer
from megamoe.testing import TOLERANCES, check_stats, default_accumulation, moe_error_stats


def stage_names(dispatch: str = "pull") -> list[str]:
    """The names of the steps of one call (``megamoe.ops.pipeline_steps``), in order."""
    return [name for name, _ in ops.pipeline_steps(dispatch)]


@dataclass
class PoolMap:
    """Which pair sits in each pool row of one rank (rows ``[0, used_rows)``; the rest of the buffer is unused).

    ``expert``: local expert of the row's block; ``valid``: False for padding rows; ``src_rank``, ``token``,
    ``slot``: the (source rank, token, top-k slot) the row came from, -1 for padding. ``counts[r][e]``: pairs
    source rank ``r`` sent to local expert ``e``; ``n``/``blocks``/``first_row`` per local expert.
    """

    rank: int
    block_m: int
    capacity: int
    counts: list[list[int]]
    n: list[int]
    blocks: list[int]
    first_row: list[int]
    expert: np.ndarray
    valid: np.ndarray
    src_rank: np.ndarray
    token: np.ndarray
    slot: np.ndarray

    @property
    def used_rows(self) -> int:
        return int(self.expert.shape[0])

    def source_order(self, local_expert: int) -> list[int]:
        """Source rank of each valid row of ``local_expert``, in pool order (shows the round-robin interleave)."""
        lo = self.first_row[local_expert]
        return self.src_rank[lo:lo + self.n[local_expert]].tolist()

    def summary(self) -> dict:
        pad = int((~self.valid).sum())
        return {"rank": self.rank, "pairs received": int(self.valid.sum()), "pool blocks used": sum(self.blocks),
                "rows used": self.used_rows, "padding rows": pad, "capacity (rows)": self.capacity,
                "occupancy": self.used_rows / self.capacity}


class StagedRun:
    """Every rank of ``case`` on the ``local`` backend, advanced one pipeline step at a time.

    ``run(until)`` executes steps (each for all ranks, in lock-step, exactly as ``fp8_fp4_mega_moe`` does) up to
    and including the step named ``until`` (default: to the end of the call); between steps the workspace, the
    pools and the combine buffers can be read. ``new_call()`` starts another call on the same buffers and inputs.

    Attributes: ``case``, ``sbs`` (one SymmBuffer per rank), ``problem`` (:class:`megamoe.testing.Problem`),
    ``ys``, ``stats`` (per-rank outputs and cumulative recv stats), ``steps`` (names), ``position`` (next step).
    """

    def __init__(self, case: MoECase, device=None):
        self.case = case
        self.sbs = SymmBuffer.local(case.num_ranks, case.num_experts, case.max_tokens(), case.num_topk, case.hidden,
                                    case.intermediate, block_m=case.block_m, device=device)
        self.device = self.sbs[0].buffer.device
        self.problem = case.problem(device=self.device)
        prepared = [prepare_rank(sb, self.problem, r) for r, sb in enumerate(self.sbs)]
        self.ys, self.l1s, self.l2s, self.stats = (list(t) for t in zip(*prepared))
        self._steps = ops.pipeline_steps(case.dispatch)
        self.steps = [name for name, _ in self._steps]
        self.num_calls = 0
        self._ref = None
        self.new_call()

    # ------------------------------------------------------------------ driving
    def new_call(self) -> None:
        """Start a new call: outputs set to NaN, next step = the first one."""
        for y in self.ys:
            y.fill_(float("nan"))
        self._calls = ops.bind_calls(self.ys, self.l1s, self.l2s, self.sbs, self.stats, "swiglu",
                                self.case.activation_clamp, self.case.dispatch, True)
        self.position = 0
        self.num_calls += 1

    def run(self, until: str | None = None) -> list[str]:
        """Run steps up to and including ``until`` (default: the last); return the names of the steps run."""
        stop = len(self.steps) - 1 if until is None else self.steps.index(until)
        if stop < self.position:
            raise ValueError(f"step {until!r} already ran (next step: {self.next_step!r})")
        done = []
        while self.position <= stop:
            name, step = self._steps[self.position]
            for call in self._calls:
                step(call)
            done.append(name)
            self.position += 1
        if self.position == len(self.steps):
            for sb in self.sbs:
                ks.check_barrier_state(sb)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return done

    @property
    def accumulation(self) -> str:
        """The tolerance profile of this device (``megamoe.testing.default_accumulation``): ``fp32`` under the
        interpreter (results usually bit-exact), ``fp8_mma`` on Hopper tensor cores."""
        return default_accumulation(self.device)

    @property
    def tolerance(self) -> dict:
        return TOLERANCES[self.accumulation]

    @property
    def next_step(self) -> str | None:
        return self.steps[self.position] if self.position < len(self.steps) else None

    def close(self) -> None:
        for sb in self.sbs:
            sb.destroy()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ workspace
    @property
    def layout(self):
        return self.sbs[0].layout

    def counters(self) -> list[dict]:
        """Per rank: the workspace counters (``expert_send_count`` [E], ``expert_recv_count`` [R][El],
        ``expert_recv_count_sum`` [El]) as lists."""
        return [{"rank": sb.rank, "expert_send_count": sb.view("expert_send_count").tolist(),
                 "expert_recv_count": sb.view("expert_recv_count").tolist(),
                 "expert_recv_count_sum": sb.view("expert_recv_count_sum").tolist()} for sb in self.sbs]

    def counters_are_zero(self) -> list[bool]:
        """Per rank: True when the three accumulating workspace counters are all zero (the state between calls)."""
        return [all(int(sb.view(n).count_nonzero()) == 0
                    for n in ("expert_send_count", "expert_recv_count", "expert_recv_count_sum")) for sb in self.sbs]

    def src_indices(self, rank: int, local_expert: int) -> list[list[int]]:
        """``src_token_topk_idx[e][r][:count]`` on ``rank`` for every source rank ``r``: the ``token*k + slot``
        values the source ranks wrote (after step ``count``; valid once the counts are published)."""
        sb = self.sbs[rank]
        recv = sb.view("expert_recv_count").cpu()
        idx = sb.view("src_token_topk_idx").cpu()
        return [idx[local_expert, r, :int(recv[r, local_expert])].tolist() for r in range(sb.num_ranks)]

    def expected_src_pairs(self, rank: int, local_expert: int) -> list[list[int]]:
        """Reference for :meth:`src_indices`: per source rank, the sorted ``token*k + slot`` routed to that expert."""
        El = self.layout.num_experts_per_rank
        e = rank * El + local_expert
        return [sorted((idx.cpu().flatten() == e).nonzero().flatten().tolist()) for idx in self.problem.topk_idx]

    def pool_map(self, rank: int) -> PoolMap:
        """The pool of ``rank`` after the dispatch: the schedule the kernels compute from ``expert_recv_count``
        (:func:`megamoe.kernels.pool.pool_schedule`) and the (source rank, token, slot) the dispatch recorded per row
        in ``token_src_metadata``. Needs the counts, i.e. call it before the ``cleanup`` step."""
        sb, L = self.sbs[rank], self.layout
        recv = sb.view("expert_recv_count")
        if int(recv.sum()) == 0 and self.position > self.steps.index("cleanup"):
            raise RuntimeError("the workspace was cleaned: take the pool map before the 'cleanup' step")
        n, blocks, first = (t.to(torch.int64) for t in pool_schedule(recv, L.block_m))
        bm = L.block_m
        used = int(blocks.sum()) * bm
        meta = sb.view("token_src_metadata")[:used].cpu().to(torch.int64)
        expert = torch.repeat_interleave(torch.arange(L.num_experts_per_rank), blocks * bm)
        valid = torch.arange(used) - first[expert] < n[expert]
        src, tok, slot = (torch.where(valid, meta[:, i], torch.full_like(meta[:, i], -1)) for i in range(3))
        return PoolMap(rank, bm, L.num_max_pool_tokens, recv.cpu().tolist(), n.tolist(), blocks.tolist(),
                       first.tolist(), expert.numpy(), valid.numpy(), src.numpy(), tok.numpy(), slot.numpy())

    def check_pool(self, rank: int) -> dict:
        """After the dispatch: every valid pool row of ``rank`` must hold exactly its source token's FP8 bytes, its
        per-32 scales and its top-k weight, and each local expert must hold exactly the pairs routed to it."""
        sb, L = self.sbs[rank], self.layout
        pm = self.pool_map(rank)
        acts = sb.l1_acts.view(torch.uint8).cpu()
        sf = sb.l1_acts_sf.cpu()
        w = sb.view("l1_topk_weights").cpu()
        rows = np.nonzero(pm.valid)[0]
        ok_x = ok_sf = ok_w = 0
        for p in rows:
            s, t, j = int(pm.src_rank[p]), int(pm.token[p]), int(pm.slot[p])
            ok_x += bool(torch.equal(acts[p], self.problem.x[s][t].cpu().view(torch.uint8)))
            sf_row = L.sf_row(p)
            ok_sf += bool(torch.equal(sf[sf_row], self.problem.x_sf[s][t].cpu()))
            ok_w += bool(w[p].item() == self.problem.topk_weights[s][t, j].item())
        El, k = L.num_experts_per_rank, self.case.num_topk
        sets_ok = True
        for e in range(El):
            lo = pm.first_row[e]
            got = sorted(zip(pm.src_rank[lo:lo + pm.n[e]].tolist(), (pm.token[lo:lo + pm.n[e]] * k
                                                                       + pm.slot[lo:lo + pm.n[e]]).tolist()))
            want = sorted((s, p) for s, lst in enumerate(self.expected_src_pairs(rank, e)) for p in lst)
            sets_ok &= got == want
        return {"rank": rank, "valid rows": len(rows), "x rows equal": ok_x, "scale rows equal": ok_sf,
                "weights equal": ok_w, "each expert holds exactly its pairs": bool(sets_ok)}

    # ------------------------------------------------------------------ against the reference
    def reference(self):
        """``(y_ref per rank, intermediates, token offsets)`` from :func:`megamoe.reference.reference_mega_moe` on
        all ranks' tokens concatenated (global token ``offsets[r] + t`` is token ``t`` of rank ``r``)."""
        if self._ref is None:
            p = self.problem
            cat = lambda ts: torch.cat([t.cpu() for t in ts])  # noqa: E731
            y, inter = reference_mega_moe(cat(p.x), cat(p.x_sf), cat(p.topk_idx), cat(p.topk_weights),
                                          tuple(t.cpu() for t in p.l1_weights), tuple(t.cpu() for t in p.l2_weights),
                                          activation_clamp=self.case.activation_clamp, return_intermediates=True)
            offsets = [0]
            for n in p.num_tokens:
                offsets.append(offsets[-1] + n)
            self._ref = (list(y.split(p.num_tokens)), inter, offsets)
        return self._ref

    def compare_l2_inputs(self) -> list[dict]:
        """After step ``l1``: each valid pool row's L2 input (FP8 bytes + UE8M0 scales written by the L1 epilogue)
        against the reference's ``l2_in`` of the same (token, slot); per rank: rows, bit-exact rows, max error."""
        _, inter, offsets = self.reference()
        L = self.layout
        El = L.num_experts_per_rank
        out = []
        for sb in self.sbs:
            pm = self.pool_map(sb.rank)
            acts, sf = sb.l2_acts.cpu(), sb.l2_acts_sf.cpu()
            exact_x = exact_sf = 0
            max_err = err_sq = ref_sq = 0.0
            index = {}
            for e in range(El):
                rows = inter["expert_rows"][sb.rank * El + e].tolist()
                index[e] = {(t, j): i for i, (t, j) in enumerate(rows)}
            valid = np.nonzero(pm.valid)[0]
            for p in valid:
                e = int(pm.expert[p])
                g = offsets[int(pm.src_rank[p])] + int(pm.token[p])
                i = index[e][(g, int(pm.slot[p]))]
                ref_x, ref_sf = inter["l2_in"][sb.rank * El + e]
                sf_row = L.sf_row(p)
                exact_x += bool(torch.equal(acts[p].view(torch.uint8), ref_x[i].view(torch.uint8)))
                exact_sf += bool(torch.equal(sf[sf_row], ref_sf[i]))
                got = dequant_fp8(acts[p:p + 1], sf[sf_row:sf_row + 1])
                want = dequant_fp8(ref_x[i:i + 1], ref_sf[i:i + 1])
                max_err = max(max_err, float((got - want).abs().max()))
                err_sq += float(((got - want) ** 2).sum())
                ref_sq += float((want ** 2).sum())
            rel = (err_sq / ref_sq) ** 0.5 if ref_sq else 0.0
            out.append({"rank": sb.rank, "pool rows": len(valid), "FP8 rows bit-exact": exact_x,
                        "scale rows bit-exact": exact_sf, "max |dequant diff|": max_err, "rel_fro": rel,
                        "within tolerance": rel <= self.tolerance["rel_fro"]})
        return out

    def compare_combine(self) -> list[dict]:
        """After step ``l2`` (rows written into the source ranks): ``combine[slot][token]`` of every valid
        (token, slot) of every rank against the reference's combine rows."""
        _, inter, offsets = self.reference()
        out = []
        for sb in self.sbs:
            n = self.problem.num_tokens[sb.rank]
            comb = sb.view("combine").cpu()
            idx = self.problem.topk_idx[sb.rank].cpu()
            rows = exact = 0
            err_sq = ref_sq = 0.0
            for t in range(n):
                for j in range(self.case.num_topk):
                    if idx[t, j] < 0:
                        continue
                    rows += 1
                    got, want = comb[j, t], inter["combine"][j, offsets[sb.rank] + t]
                    exact += bool(torch.equal(got.view(torch.int16), want.view(torch.int16)))
                    err_sq += float(((got.float() - want.float()) ** 2).sum())
                    ref_sq += float((want.float() ** 2).sum())
            rel = (err_sq / ref_sq) ** 0.5 if ref_sq else 0.0
            out.append({"rank": sb.rank, "valid (token, slot) rows": rows, "bit-exact rows": exact, "rel_fro": rel,
                        "within tolerance": rel <= self.tolerance["rel_fro"]})
        return out

    def combine_landing(self, rank: int, max_rows: int = 8) -> list[dict]:
        """The first ``max_rows`` valid ``combine[slot][token]`` rows of ``rank``: which expert and which owner rank
        wrote each one, and whether it equals the reference."""
        _, inter, offsets = self.reference()
        El = self.layout.num_experts_per_rank
        comb = self.sbs[rank].view("combine").cpu()
        idx = self.problem.topk_idx[rank].cpu()
        rows = []
        for t in range(self.problem.num_tokens[rank]):
            for j in range(self.case.num_topk):
                e = int(idx[t, j])
                if e < 0:
                    continue
                rows.append({"token": t, "slot": j, "expert": e, "written by rank": e // El,
                             "first values": [round(v, 4) for v in comb[j, t, :3].float().tolist()],
                             "equals reference": bool(torch.equal(
                                 comb[j, t].view(torch.int16),
                                 inter["combine"][j, offsets[rank] + t].view(torch.int16)))})
                if len(rows) == max_rows:
                    return rows
        return rows

    def compare_y(self) -> list[dict]:
        """After the call: ``y`` of every rank against the reference (error statistics and bitwise equality)."""
        y_ref, _, _ = self.reference()
        out = []
        for r, y in enumerate(self.ys):
            s = moe_error_stats(y.cpu(), y_ref[r])
            out.append({"rank": r, "tokens": y.shape[0], "rel_fro": s["rel_fro"], "max_abs_err": s["max_abs_err"],
                        "bitwise equal": bool(torch.equal(y.cpu().view(torch.int16), y_ref[r].view(torch.int16))),
                        "failures": check_stats(s, self.accumulation)})
        return out




def time_steps(calls, steps, repeats: int = 20) -> dict[str, float]:
    """Median time in microseconds of every step of one call: ``calls`` (``megamoe.ops.bind_calls``) advanced in
    lock-step through ``steps`` (``megamoe.ops.pipeline_steps``) ``repeats`` times by ``megamoe.ops.run_steps``, with
    CUDA events between the steps on a GPU (no host sync inside a call), ``time.perf_counter`` marks on CPU. The one
    per-step timer (notebooks and ``megamoe.bench``).

    Through ``run_steps``, so a step is timed as a call runs it (each rank's heartbeat before it) and, with one
    process per rank, a rank whose step outlasts the barrier timeout keeps its waiting peers' clocks moving (its
    progress beacon): stepping bare, a long interpreter step on one rank timed the other out (notebook 04's
    all-tokens-on-one-expert case, 30 s, on a loaded CI machine)."""
    cuda = calls[0].sb.buffer.device.type == "cuda"
    samples: dict[str, list[float]] = {name: [] for name, _ in steps}
    stamps: list = []  # CUDA events (GPU) or perf_counter seconds (CPU), one before the first step and after each

    def mark():
        if cuda:
            stamps.append(torch.cuda.Event(enable_timing=True))
            stamps[-1].record()
        else:
            stamps.append(time.perf_counter())
    for _ in range(repeats):
        stamps.clear()
        ops.run_steps(calls, steps, check=False, mark=mark)
        if cuda:
            torch.cuda.synchronize()
        times = [stamps[i].elapsed_time(stamps[i + 1]) * 1e3 if cuda else (stamps[i + 1] - stamps[i]) * 1e6
                 for i in range(len(steps))]
        for (name, _), t in zip(steps, times):
            samples[name].append(t)
    return {name: statistics.median(v) for name, v in samples.items()}
