"""The cross-rank barrier, step by step: its signal and state words after every barrier, and a timeout.

:func:`barrier_demo` runs barriers tag 1 and 2 on every rank, then tag 3 which one rank skips: the others wait,
time out and name the missing rank (:class:`~megamoe.kernels.symm.BarrierTimeout`).
"""
from __future__ import annotations

import functools
import time

import torch.distributed as dist

from megamoe.harness import on_ranks, sync
from megamoe.kernels import symm as ks
from megamoe.symm import SymmBuffer


def _barrier_snapshot(sb: SymmBuffer, step: str) -> dict:
    sync(sb)
    state = sb.view("barrier_state").tolist()
    return {"rank": sb.rank, "step": step, "epoch": state[0], "failed_tag": state[1], "missing_rank": state[2],
            "barrier_signal": sb.view("barrier_signal").tolist()}


def _wait_for_tag3(sb: SymmBuffer, wait, timeout_s: float) -> dict | None:
    """``wait(sb, tag 3)`` (a whole barrier, or the wait half after a lock-step arrive) with ``timeout_s``: the
    :class:`~megamoe.kernels.symm.BarrierTimeout` it raised, as a dict, or None when every rank arrived."""
    sb.barrier_timeout_s = timeout_s
    start = time.monotonic()
    try:
        wait(sb, ks.TAG_AFTER_WORKSPACE_CLEAN)
        ks.check_barrier_state(sb)
    except ks.BarrierTimeout as e:
        return {"rank": e.rank, "tag": e.tag, "missing_rank": e.missing_rank, "message": str(e),
                "waited_s": round(time.monotonic() - start, 2)}
    return None


def barrier_demo_rank(rank: int, world_size: int, shape: dict, absent_rank: int, timeout_s: float) -> dict:
    """Barriers tag 1 and 2 on every rank, then tag 3 which ``absent_rank`` skips; the others wait ``timeout_s``
    and catch the :class:`~megamoe.kernels.symm.BarrierTimeout`. Returns the barrier words after every step."""
    sb = SymmBuffer(None, **shape)
    try:
        trace = [_barrier_snapshot(sb, "allocated")]
        for tag in (ks.TAG_BEFORE_DISPATCH_PULL, ks.TAG_BEFORE_COMBINE_REDUCE):
            ks.barrier(sb, tag)
            trace.append(_barrier_snapshot(sb, f"after barrier tag {tag}"))
        error = None
        if rank != absent_rank:
            error = _wait_for_tag3(sb, ks.barrier, timeout_s)
            trace.append(_barrier_snapshot(sb, "barrier tag 3 (timed out)" if error else "barrier tag 3"))
        sync(sb)
        dist.barrier()  # a host-side rendezvous: nobody unmaps its buffer while a peer may still touch it
        if rank == absent_rank:
            trace.append(_barrier_snapshot(sb, "skipped barrier tag 3 (seen after the others gave up)"))
        return {"rank": rank, "trace": trace, "error": error}
    finally:
        sb.destroy()


def barrier_demo(world_size: int, shape: dict, backend: str = "auto", absent_rank: int | None = None,
                 timeout_s: float = 1.0) -> list[dict]:
    """:func:`barrier_demo_rank` on every rank (``local``: the same protocol driven in lock-step in this process)."""
    absent_rank = world_size - 1 if absent_rank is None else absent_rank
    return on_ranks(barrier_demo_rank, functools.partial(_barrier_demo_local, world_size), world_size, shape,
                    absent_rank, timeout_s, backend=backend, timeout_s=300)


def _barrier_demo_local(world_size: int, shape: dict, absent_rank: int, timeout_s: float) -> list[dict]:
    """:func:`barrier_demo` with every rank in this process: the same protocol, driven in lock-step."""
    sbs = SymmBuffer.local(world_size, **shape)
    try:
        traces = [[_barrier_snapshot(sb, "allocated")] for sb in sbs]
        for tag in (ks.TAG_BEFORE_DISPATCH_PULL, ks.TAG_BEFORE_COMBINE_REDUCE):
            ks.barrier_lockstep(sbs, tag)
            for sb, tr in zip(sbs, traces):
                tr.append(_barrier_snapshot(sb, f"after barrier tag {tag}"))
        for sb in sbs:
            if sb.rank != absent_rank:
                ks.barrier_arrive(sb)
        errors = [None] * world_size
        for sb, tr in zip(sbs, traces):
            if sb.rank == absent_rank:
                continue
            errors[sb.rank] = _wait_for_tag3(sb, ks.barrier_wait, timeout_s)
            tr.append(_barrier_snapshot(sb, "barrier tag 3 (timed out)" if errors[sb.rank] else "barrier tag 3"))
        traces[absent_rank].append(_barrier_snapshot(sbs[absent_rank],
                                                     "skipped barrier tag 3 (seen after the others gave up)"))
        return [{"rank": r, "trace": traces[r], "error": errors[r]} for r in range(world_size)]
    finally:
        for sb in sbs:
            sb.destroy()

