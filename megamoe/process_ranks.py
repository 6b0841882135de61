"""Process ranks for the notebooks' process stories.

Notebooks 01, 02 and 06 explain what happens *between processes*: each process maps the peers' buffers at its own
addresses (so ``buffer_ptrs`` and ``map`` deltas differ from process to process), the CPU backend's shared-memory
files are unlinked but stay mapped, a rank writes into memory another process owns. On one GPU the notebooks run
their other sections on ``local`` ranks (all ranks in the notebook's process), where none of that can be seen. So
those sections run on **one process per rank** whatever the notebook's backend: ``cuda`` processes when the notebook
has one GPU per rank, else ``cpu`` processes (gloo, POSIX shared memory, kernels under Triton's interpreter) -- and
print where they ran (:func:`provenance`), next to the notebook's own provenance line.
"""
from __future__ import annotations

import os

#: What each process backend is, for the provenance line.
BACKEND_WORDS = {
    "cpu": "gloo group, POSIX shared memory mapped into every process, kernels under Triton's interpreter",
    "cuda": "NCCL group, torch symmetric memory over NVLink, one GPU per process",
}


def process_backend(backend: str) -> str:
    """The backend of a process story for a notebook whose resolved backend is ``backend``: ``cuda`` stays (one
    process per GPU already), anything else (``local``, ``cpu``) becomes ``cpu``."""
    return "cuda" if backend == "cuda" else "cpu"


def rank_info() -> dict:
    """Where this rank process runs: pid, kernel device, interpreter on or off."""
    from megamoe.env import interpreting, kernel_device

    return {"pid": os.getpid(), "device": str(kernel_device()), "interpreter": interpreting()}


def case_rank(rank: int, world_size: int, case) -> dict:
    """:func:`megamoe.cases.run_case_rank` plus :func:`rank_info` (one process per rank, via ``launch``)."""
    from megamoe.cases import run_case_rank

    return {**run_case_rank(rank, world_size, case), **rank_info()}


def run_case(case, backend: str, timeout_s: float = 600.0) -> list[dict]:
    """``case`` on ``case.num_ranks`` processes of :func:`process_backend` ``(backend)``; one report per rank with
    its pid and device (see :func:`provenance`)."""
    from megamoe.launch import launch

    return launch(case_rank, case.num_ranks, case, backend=process_backend(backend), timeout_s=timeout_s)


def provenance(results: list[dict], backend: str, notebook_backend: str) -> str:
    """One line saying where a process story ran: how many processes, their pids, the backend and what it is,
    and how that differs from the rest of the notebook (``notebook_backend``). ``results``: per-rank dicts with a
    ``pid`` (and ``device`` where known)."""
    pids = [r.get("pid") for r in results]
    distinct = len(set(pids))
    devices = sorted({str(r["device"]) for r in results if r.get("device") is not None})
    line = (f"process ranks: {len(results)} ranks in {distinct} processes (pids {', '.join(map(str, pids))}), "
            f"backend {backend!r} ({BACKEND_WORDS.get(backend, backend)})")
    if devices:
        line += f", device {'/'.join(devices)}"
    if notebook_backend != backend:
        line += (f"; the rest of this notebook runs on {notebook_backend!r} ranks -- this section needs one process "
                 f"per rank to show what happens between processes")
    return line
