"""Reliability of the op and its workspace (issue #12): interrupted calls, progress-based barrier timeouts, weights
that did not come from the transform, inputs that must be rejected before any kernel runs.

CPU ranks under Triton's interpreter. Multi-process cases run the functions in ``rank_fns`` through
``megamoe.launch``; the local backend runs every rank in this process.
"""
import math
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rank_fns  # noqa: E402

from megamoe import ops  # noqa: E402
from megamoe.kernels import symm as ks  # noqa: E402
from megamoe.launch import launch  # noqa: E402
from megamoe.programs import MoECase, prepare_rank  # noqa: E402
from megamoe.quant import TransformedWeights, transform_weights_for_mega_moe  # noqa: E402
from megamoe.symm import SymmBuffer  # noqa: E402


class Ranks:
    """Every rank of ``case`` on the local backend (or one ``cpu`` rank with ``process=True``): buffers, inputs,
    transformed weights, the reference, and ``call()`` -> whether every ``y`` equals the reference bit for bit."""

    def __init__(self, case: MoECase, process: bool = False, timeout_s: float = 3.0):
        shape = (case.num_experts, case.max_tokens(), case.num_topk, case.hidden, case.intermediate)
        if process:
            self.sbs = [SymmBuffer(None, *shape, block_m=case.block_m, backend="cpu", barrier_timeout_s=timeout_s)]
        else:
            self.sbs = SymmBuffer.local(case.num_ranks, *shape, block_m=case.block_m, barrier_timeout_s=timeout_s)
        self.case, self.process = case, process
        self.problem = case.problem()
        prepared = [prepare_rank(sb, self.problem, r) for r, sb in enumerate(self.sbs)]
        self.ys, self.l1s, self.l2s, self.stats = (list(t) for t in zip(*prepared))
        self.refs = self.problem.reference(activation_clamp=case.activation_clamp)

    def args(self):
        if self.process:
            return self.ys[0], self.l1s[0], self.l2s[0], self.sbs[0]
        return self.ys, self.l1s, self.l2s, self.sbs

    def call(self, **kw) -> bool:
        for y in self.ys:
            y.fill_(float("nan"))
        ops.fp8_fp4_mega_moe(*self.args(), activation_clamp=self.case.activation_clamp,
                             dispatch=self.case.dispatch, **kw)
        return all(torch.equal(y.view(torch.int16), r.view(torch.int16)) for y, r in zip(self.ys, self.refs))

    def workspaces_zero(self) -> bool:
        return all(int(sb.buffer[:sb.layout.workspace_bytes].count_nonzero()) == 0 for sb in self.sbs)

    def destroy(self):
        for sb in self.sbs:
            sb.destroy()


#: The smallest two-rank case (one token, one expert per rank): ~0.5 s per call on the interpreter.
TINY = MoECase(num_ranks=2, num_tokens=[1, 1], hidden=128, intermediate=128, num_experts=2, num_topk=1, block_m=16,
               seed=4)


PIPELINE_STEPS = ops.pipeline_steps


def _interrupting(dispatch: str, after: int, trigger_rank: int, exc=KeyboardInterrupt):
    """``pipeline_steps(dispatch)`` (the original) with step ``after`` raising ``exc`` once rank ``trigger_rank`` has run it
    (``trigger_rank = R - 1``: every rank ran the step; ``0``: only rank 0 did, e.g. between two ranks' arrives)."""
    steps = PIPELINE_STEPS(dispatch)
    name, fn = steps[after]

    def step(c, fn=fn):
        fn(c)
        if c.sb.rank == trigger_rank:
            raise exc(f"injected after step {name!r} of rank {trigger_rank}")
    return steps[:after] + [(name, step)] + steps[after + 1:]


# ---------------------------------------------------------------------------------------------------- item 1
@pytest.mark.slow
@pytest.mark.parametrize("dispatch", ["pull", "push"])
def test_interrupt_at_every_step_boundary_local_backend_is_repaired(monkeypatch, dispatch):
    """KeyboardInterrupt after every step, once after all ranks ran it and once after only rank 0 did: the exception
    propagates, every rank's workspace is back to zero (a fresh buffer's), and the next call is bit-exact."""
    r = Ranks(MoECase(**{**TINY.__dict__, "dispatch": dispatch}))
    original = ops.pipeline_steps
    names = [n for n, _ in original(dispatch)]
    # push shares every step with pull but its own three (pull covers the rest)
    boundaries = range(len(names)) if dispatch == "pull" else [names.index(n) for n in
                                                               ("push", "barrier4_arrive", "barrier4_wait")]
    faults = 0
    try:
        for after in boundaries:
            for trigger in (1, 0):
                monkeypatch.setattr(ops, "pipeline_steps", lambda d, a=after, t=trigger: _interrupting(d, a, t))
                with pytest.raises(KeyboardInterrupt, match="injected"):
                    r.call()
                monkeypatch.setattr(ops, "pipeline_steps", original)
                faults += 1
                assert [sb.fault for sb in r.sbs] == [None, None], (names[after], trigger)
                assert r.workspaces_zero(), (names[after], trigger)
                # a full call after every rank-0-only interruption (the barrier-arrive splits) and after all-rank
                # ones that leave stale pools / combine rows behind
                if trigger == 0 or names[after] in ("push", "pull", "l2", "cleanup"):
                    assert r.call(), f"wrong y after an interrupt after {names[after]!r} (trigger rank {trigger})"
    finally:
        r.destroy()
    assert faults == 2 * len(boundaries)


@pytest.mark.slow
def test_keyboard_interrupt_from_a_timer_then_correct_calls():
    """The issue's reproduction: local backend, 2 ranks, H 256, I 128, 4 experts, top-2, 16 tokens each,
    barrier_timeout_s=3; SIGALRM raises KeyboardInterrupt 0.3 s (and 0.05 s) into a call; the next call matches."""
    r = Ranks(MoECase(num_ranks=2, num_tokens=16, hidden=256, intermediate=128, num_experts=4, num_topk=2,
                      block_m=16), timeout_s=3)

    def interrupt(signum, frame):
        raise KeyboardInterrupt("timer")

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        for delay in (0.3, 0.05):
            signal.setitimer(signal.ITIMER_REAL, delay)
            with pytest.raises(KeyboardInterrupt):
                r.call()
                time.sleep(5)  # only if the call finished first: the timer must still fire inside the test
            signal.setitimer(signal.ITIMER_REAL, 0)
            assert r.call()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        r.destroy()


def test_process_backend_refuses_after_an_interrupt_until_reset():
    """One ``cpu`` rank (process backend, no peers): an exception inside a call marks the buffer; the next call
    raises WorkspaceStateError naming reset() (with check=False too); after ``sb.reset()`` calls are bit-exact."""
    r = Ranks(MoECase(num_ranks=1, num_tokens=3, hidden=128, intermediate=128, num_experts=2, num_topk=2,
                      block_m=16, seed=8), process=True)
    try:
        names = [n for n, _ in ops.pipeline_steps("pull")]
        for after in (names.index("publish"), names.index("barrier2_arrive"), len(names) - 1):
            original = ops.pipeline_steps
            ops.pipeline_steps = lambda d, a=after: _interrupting(d, a, 0, RuntimeError)
            try:
                with pytest.raises(RuntimeError, match="injected"):
                    r.call()
            finally:
                ops.pipeline_steps = original
            assert "RuntimeError" in r.sbs[0].fault
            for check in (True, False):
                with pytest.raises(ops.WorkspaceStateError, match=r"sym_buffer \(rank 0\).*RuntimeError.*"
                                   r"sym_buffer.reset\(\) on every rank"):
                    r.call(check=check)
            r.sbs[0].reset()
            assert r.sbs[0].fault is None and r.workspaces_zero()
            assert r.call()
    finally:
        r.destroy()


def test_unfinished_call_recorded_in_the_workspace_is_detected():
    """A call that never finished while its host object was not told (a crashed process; simulated by clearing
    ``fault``) is caught by ``call_state`` in the workspace on the next checked call; a failed barrier likewise."""
    r = Ranks(MoECase(num_ranks=1, num_tokens=2, hidden=128, intermediate=128, num_experts=2, num_topk=1,
                      block_m=16, seed=9), process=True)
    sb = r.sbs[0]
    try:
        original = ops.pipeline_steps
        ops.pipeline_steps = lambda d: _interrupting(d, 3, 0, RuntimeError)
        try:
            with pytest.raises(RuntimeError):
                r.call()
        finally:
            ops.pipeline_steps = original
        sb.fault = None
        assert sb.view("call_state").tolist() == [1, 0]
        with pytest.raises(ops.WorkspaceStateError, match=r"1 calls begun but 0 completed.*reset\(\)"):
            r.call()
        sb.reset()
        assert r.call() and sb.view("call_state").tolist() == [1, 1]
        sb.view("barrier_state")[1:3] = torch.tensor([2, 0], dtype=torch.int32)  # as a timed-out GPU wait leaves it
        with pytest.raises(ops.WorkspaceStateError, match=r"barrier tag 2 timed out.*reset\(\)"):
            r.call()
        sb.reset()
        assert r.call()
    finally:
        r.destroy()


# ---------------------------------------------------------------------------------------------------- item 2
@pytest.mark.slow
def test_slow_but_alive_rank_does_not_time_out():
    """Rank 0 spends 3 x the barrier timeout in its L1 step while rank 1 waits at barrier 2: sleeping but beating
    its heartbeat, busy in Python (the interpreter's progress beacon beats), and its genuine GEMM work on every
    token of both ranks (checked to take longer than the timeout). No call may time out; every y is bit-exact."""
    timeout = 0.4
    out = launch(rank_fns.slow_rank_calls, 2, timeout, ["sleep_beating", "busy", "real"], backend="cpu",
                 timeout_s=120)
    for rank, calls in enumerate(out):
        for c in calls:
            assert c["error"] is None and c["bitwise_equal"], (rank, c)
    assert out[0][2]["l1_seconds"][0] > timeout, out[0][2]  # the genuine step really outlasts the timeout
    assert all(c["seconds"] > 3 * timeout for c in out[1][:2])  # rank 1 really waited that long


@pytest.mark.slow
def test_stuck_rank_is_named_within_the_timeout_and_reset_recovers():
    timeout = 1.5
    out = launch(rank_fns.stuck_rank_then_reset, 2, timeout, backend="cpu", timeout_s=120)
    r0, r1 = out
    assert (r1["timeout"]["tag"], r1["timeout"]["missing_rank"]) == (ks.TAG_BEFORE_COMBINE_REDUCE, 0), r1
    assert timeout <= r1["timeout"]["seconds"] < 2 * timeout + 1.0, r1
    assert (r0["timeout"]["tag"], r0["timeout"]["missing_rank"]) == (ks.TAG_AFTER_WORKSPACE_CLEAN, 1), r0
    for r in out:
        assert "BarrierTimeout" in r["fault"]
        assert "reset() on every rank" in r["refused"] and "BarrierTimeout" in r["refused"]
        assert r["fault_after_reset"] is None and r["bitwise_after_reset"] == [True, True], r
