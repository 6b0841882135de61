"""Running per-rank code on a backend: the one place that picks ``local`` (ranks in this process) or ``launch``.

* :func:`on_ranks` -- ``local_fn(*args)`` for the ``local`` backend, else ``launch(rank_fn, world_size, *args)`` on
  one process per rank (``cpu``/``cuda``); the backend is resolved by :func:`megamoe.env.resolve_backend`.
* :func:`run_phased` -- a per-rank program written as a list of *phases* separated by barriers, run on either: every
  rank allocates a :class:`~megamoe.symm.SymmBuffer` of :func:`buffer_shape` and calls each phase, then a barrier.
* :func:`sync` and :func:`base_info`, shared by per-rank demo code.
"""
from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence

import torch

from megamoe.env import resolve_backend
from megamoe.kernels import symm as ks
from megamoe.launch import launch
from megamoe.symm import SymmBuffer


def on_ranks(rank_fn: Callable, local_fn: Callable, world_size: int, *args, backend: str = "auto",
             timeout_s: float = 600.0) -> list:
    """Run one program on ``world_size`` ranks on ``backend`` (see :func:`megamoe.env.resolve_backend`).

    ``local``: ``local_fn(*args)``, which drives every rank in this process and returns its list of per-rank results
    (or one result for all ranks, wrapped in a list). ``cpu``/``cuda``: ``rank_fn(rank, world_size, *args)`` on one
    process per rank through :func:`megamoe.launch.launch`, results in rank order.
    """
    backend = resolve_backend(backend, world_size)
    if backend == "local":
        out = local_fn(*args)
        return out if isinstance(out, list) else [out]
    return launch(rank_fn, world_size, *args, backend=backend, timeout_s=timeout_s)


def buffer_shape(num_experts: int, num_tokens: int, num_topk: int, hidden: int, intermediate: int,
                 block_m: int) -> dict:
    """Keyword arguments of :class:`~megamoe.symm.SymmBuffer` (and ``SymmBuffer.local``) from notebook parameters."""
    return dict(num_experts=num_experts, num_max_tokens_per_rank=num_tokens, num_topk=num_topk, hidden=hidden,
                intermediate_hidden=intermediate, block_m=block_m)


def sync(sb: SymmBuffer) -> None:
    """Wait for the work queued on ``sb``'s device (a no-op on CPU, where kernels run synchronously)."""
    if sb.device.type == "cuda":
        torch.cuda.synchronize(sb.device)


def _phase_tag(i: int) -> int:
    """Barrier tags 1, 2, 3, 1, ... for consecutive phases (the tag only labels a timeout)."""
    return 1 + i % 3


def base_info(sb: SymmBuffer) -> dict:
    """What every demo rank reports first: rank, backend, device, pid, buffer size and the mapped peer pointers."""
    return {"rank": sb.rank, "num_ranks": sb.num_ranks, "backend": sb.backend, "device": str(sb.device),
            "pid": os.getpid(), "num_bytes": sb.layout.num_bytes, "buffer_ptrs": sb.buffer_ptrs.tolist(),
            "own_ptr": sb.buffer.data_ptr()}


Phase = Callable[[SymmBuffer, dict], None]


def run_phased(phases: Sequence[Phase], world_size: int, shape: dict, backend: str = "auto",
               timeout_s: float = 300.0) -> list[dict]:
    """Run a per-rank program made of ``phases`` on ``world_size`` ranks; return each rank's result dict.

    Every rank allocates a SymmBuffer of ``shape`` (see :func:`buffer_shape`), then for each phase calls
    ``phase(sb, out)`` and enters a barrier, so whatever a phase wrote (locally or into a peer) is visible to every
    rank in the next phase. ``out`` starts with :func:`base_info` (rank, backend, ``buffer_ptrs`` ...).
    Phases must be module-level functions (they are pickled into the rank processes).

    ``backend``: see :func:`on_ranks`; ``local`` runs each phase for every rank, then a lock-step barrier.
    """
    return on_ranks(phased_rank, functools.partial(_phased_local, world_size), world_size, tuple(phases), shape,
                    backend=backend, timeout_s=timeout_s)


def _phased_local(world_size: int, phases: Sequence[Phase], shape: dict) -> list[dict]:
    """:func:`run_phased` with every rank in this process (the ``local`` backend)."""
    sbs = SymmBuffer.local(world_size, **shape)
    try:
        outs = [base_info(sb) for sb in sbs]
        for i, phase in enumerate(phases):
            for sb, out in zip(sbs, outs):
                phase(sb, out)
            ks.barrier_lockstep(sbs, _phase_tag(i))
        for sb in sbs:
            ks.check_barrier_state(sb)
        return outs
    finally:
        for sb in sbs:
            sb.destroy()


def phased_rank(rank: int, world_size: int, phases: Sequence[Phase], shape: dict) -> dict:
    """One rank of :func:`run_phased` (one process per rank; run through :func:`megamoe.launch.launch`)."""
    sb = SymmBuffer(None, **shape)
    try:
        out = base_info(sb)
        for i, phase in enumerate(phases):
            phase(sb, out)
            sync(sb)
            ks.barrier(sb, _phase_tag(i))
        ks.check_barrier_state(sb)
        sync(sb)
        return out
    finally:
        sb.destroy()

