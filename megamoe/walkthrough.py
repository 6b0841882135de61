"""What the notebooks run: per-rank programs, a step-by-step pipeline driver, and small helpers for tables/figures.

The notebooks call only package code. Functions that run *inside rank processes* live here because spawned ranks
cannot import functions defined in a notebook cell (``megamoe.launch`` pickles the function by module and name).
Everything returns plain data (ints, lists, dicts, small tensors) that the notebook then prints or plots.

Sections:

* **Backends** -- :func:`resolve_backend` and :func:`run_phased`: a per-rank program written as a list of *phases*
  separated by barriers runs either on one process per rank (``cpu``: gloo + POSIX shm + Triton interpreter;
  ``cuda``: NCCL + ``torch.distributed._symmetric_memory``) or on ``local`` ranks in this process (lock-step).
* **01/02 symmetric memory** -- write on one rank and read on another, ``map(ptr, r)`` arithmetic, remote read/write
  through the Triton kernels' ``sym_map``, the barrier protocol and a timeout, the CuPy/CUDA ``SymBuffer``.
* **04-06 the staged pipeline** -- :class:`StagedRun` advances every rank of a ``local`` group one pipeline step
  at a time (``megamoe.ops.pipeline_steps``) and reads the workspace and pools between steps: counts, source indices,
  the pool map (expert, source rank, padding per row), per-step comparison with the reference's intermediates.
* **05 number formats** -- value tables of FP8 e4m3 / FP4 e2m1 / UE8M0, quantisation errors, the weight
  transform on tiny tensors, the per-32 block-scaled dot.
* **07 and benchmarks** -- a correctness grid, the ``MegaMoE`` module on ranks, ``results/*.json`` readers.
* **Figures** -- the data-flow and pipeline diagrams and the pool picture (drawn with ``megamoe.figures`` style).
"""
from __future__ import annotations

import importlib
import inspect
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from megamoe import ops, programs
from megamoe.env import REPO_ROOT, cuda_available
from megamoe.kernels import symm as ks
from megamoe.launch import launch
from megamoe.programs import MoECase
from megamoe.quant import (
    dequant_fp4,
    dequant_fp8,
    e2m1_decode,
    pack_nibbles,
    per_token_cast_to_fp4,
    per_token_cast_to_fp8,
    transform_weights_for_mega_moe,
    unpack_nibbles,
    unpack_ue8m0,
    untransform_weights_for_mega_moe,
)
from megamoe.reference import reference_mega_moe
from megamoe.symm import SymmBuffer
from megamoe.testing import TOLERANCES, check_stats, default_accumulation, moe_error_stats

BACKENDS = ("auto", "cpu", "cuda", "local")


# ==================================================================================================== presentation
def markdown_table(rows: Sequence[dict], columns: Sequence[str] | None = None, floatfmt: str = ".4g") -> str:
    """A GitHub-markdown table of ``rows`` (dicts); ``columns`` picks and orders the keys (default: the first row's)."""
    rows = list(rows)
    if not rows:
        return "_(no rows)_"
    columns = list(columns or rows[0].keys())

    def cell(v) -> str:
        if isinstance(v, bool) or v is None:
            return str(v)
        if isinstance(v, float):
            return format(v, floatfmt)
        if isinstance(v, int):
            return f"{v:,}"
        return str(v).replace("|", "\\|")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def show_table(rows: Sequence[dict], columns: Sequence[str] | None = None, floatfmt: str = ".4g") -> None:
    """Display :func:`markdown_table` as rendered markdown in a notebook (printed elsewhere)."""
    text = markdown_table(rows, columns, floatfmt)
    try:
        from IPython import get_ipython
        from IPython.display import Markdown, display

        if get_ipython() is not None:
            display(Markdown(text))
            return
    except ImportError:
        pass
    print(text)


def show_figure(fig, name: str) -> None:
    """Save ``fig`` with :func:`megamoe.figures.save_figure` (PNG + SVG) and display the PNG (notebooks)."""
    from megamoe.figures import save_figure

    paths = save_figure(fig, name)
    try:
        from IPython import get_ipython
        from IPython.display import Image, display

        if get_ipython() is not None:
            display(Image(filename=str(paths[0])))
    except ImportError:
        pass
    folder = paths[0].parent
    try:
        folder = folder.relative_to(REPO_ROOT)
    except ValueError:
        pass
    print(f"saved {', '.join(p.name for p in paths)} in {folder}/")


def hex_bytes(t: torch.Tensor, n: int = 8) -> str:
    """The first ``n`` bytes of a tensor as hex (``"21 21 21 ..."``)."""
    b = t.detach().reshape(-1).cpu().view(torch.uint8)[:n].tolist()
    return " ".join(f"{v:02x}" for v in b)


# ==================================================================================================== backends
def resolve_backend(backend: str, world_size: int) -> str:
    """The notebooks' ``backend`` parameter -> ``"cpu"``, ``"cuda"`` or ``"local"``.

    ``auto``: ``cuda`` (one process per GPU) when at least ``world_size`` GPUs exist, ``local`` (all ranks in this
    process on one GPU) when fewer GPUs exist, ``cpu`` (one process per rank, Triton interpreter) without a GPU.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} must be one of {BACKENDS}")
    if backend != "auto":
        return backend
    gpus = torch.cuda.device_count() if cuda_available() else 0
    if gpus >= world_size:
        return "cuda"
    return "local" if gpus else "cpu"


def buffer_shape(num_experts: int, num_tokens: int, num_topk: int, hidden: int, intermediate: int,
                 block_m: int) -> dict:
    """Keyword arguments of :class:`~megamoe.symm.SymmBuffer` (and ``SymmBuffer.local``) from notebook parameters."""
    return dict(num_experts=num_experts, num_max_tokens_per_rank=num_tokens, num_topk=num_topk, hidden=hidden,
                intermediate_hidden=intermediate, block_m=block_m)


def _sync(sb: SymmBuffer) -> None:
    if sb.device.type == "cuda":
        torch.cuda.synchronize(sb.device)


def _tag(i: int) -> int:
    """Barrier tags 1, 2, 3, 1, ... for consecutive phases (the tag only labels a timeout)."""
    return 1 + i % 3


def _base_info(sb: SymmBuffer) -> dict:
    return {"rank": sb.rank, "num_ranks": sb.num_ranks, "backend": sb.backend, "device": str(sb.device),
            "pid": os.getpid(), "num_bytes": sb.layout.num_bytes, "buffer_ptrs": sb.buffer_ptrs.tolist(),
            "own_ptr": sb.buffer.data_ptr()}


Phase = Callable[[SymmBuffer, dict], None]


def run_phased(phases: Sequence[Phase], world_size: int, shape: dict, backend: str = "auto",
               timeout_s: float = 300.0) -> list[dict]:
    """Run a per-rank program made of ``phases`` on ``world_size`` ranks; return each rank's result dict.

    Every rank allocates a SymmBuffer of ``shape`` (see :func:`buffer_shape`), then for each phase calls
    ``phase(sb, out)`` and enters a barrier, so whatever a phase wrote (locally or into a peer) is visible to every
    rank in the next phase. ``out`` starts with :func:`_base_info` (rank, backend, ``buffer_ptrs`` ...).
    Phases must be module-level functions (they are pickled into the rank processes).

    ``backend``: see :func:`resolve_backend`; ``local`` runs each phase for every rank, then a lock-step barrier.
    """
    backend = resolve_backend(backend, world_size)
    if backend == "local":
        sbs = SymmBuffer.local(world_size, **shape)
        try:
            outs = [_base_info(sb) for sb in sbs]
            for i, phase in enumerate(phases):
                for sb, out in zip(sbs, outs):
                    phase(sb, out)
                ks.barrier_lockstep(sbs, _tag(i))
            for sb in sbs:
                ks.check_barrier_state(sb)
            return outs
        finally:
            for sb in sbs:
                sb.destroy()
    return launch(phased_rank, world_size, tuple(phases), shape, backend=backend, timeout_s=timeout_s)


def phased_rank(rank: int, world_size: int, phases: Sequence[Phase], shape: dict) -> dict:
    """One rank of :func:`run_phased` (one process per rank; run through :func:`megamoe.launch.launch`)."""
    sb = SymmBuffer(None, **shape)
    try:
        out = _base_info(sb)
        for i, phase in enumerate(phases):
            phase(sb, out)
            _sync(sb)
            ks.barrier(sb, _tag(i))
        ks.check_barrier_state(sb)
        _sync(sb)
        return out
    finally:
        sb.destroy()


# ================================================================================================= 01: symmetric memory
def own_shm_files() -> list[str]:
    """``/dev/shm`` files this process created (``megamoe-<pid>-*``); empty once a SymmBuffer is set up."""
    from megamoe.symm import shm_files_of

    return sorted(shm_files_of(os.getpid()))


def shm_mappings() -> list[str]:
    """The megamoe shm segments mapped into this process, from ``/proc/self/maps`` (``path (deleted)`` when the file
    was unlinked; the mapping stays valid)."""
    from megamoe.symm import SHM_DIR, SHM_PREFIX

    shm_prefix = os.path.join(SHM_DIR, SHM_PREFIX)
    try:
        with open("/proc/self/maps") as f:
            lines = [ln.split(maxsplit=5) for ln in f if shm_prefix in ln]
    except OSError:
        return []
    seen = []
    for parts in lines:
        name = parts[5].strip() if len(parts) > 5 else ""
        if name not in seen:
            seen.append(name)
    return [os.path.basename(s) for s in seen]


def hello_write(sb: SymmBuffer, out: dict) -> None:
    """Phase 1: stamp ``topk_idx[0, 0] = 100 + rank`` in my own buffer; rank 0 also writes ``1000 + p`` straight
    into ``topk_idx[1, 0]`` of every rank ``p`` (a remote write through the peer's mapping)."""
    sb.topk_idx[0, 0] = 100 + sb.rank
    if sb.rank == 0:
        for p in range(sb.num_ranks):
            sb.peer_view(p, "topk_idx")[1, 0] = 1000 + p
    out["shm_files_still_linked"] = own_shm_files()


def hello_read(sb: SymmBuffer, out: dict) -> None:
    """Phase 2 (after a barrier): read every rank's stamp through its mapping, and what rank 0 wrote into mine;
    list the shm segments this process maps (every rank has unlinked its file by now)."""
    out["shm_mappings"] = shm_mappings()
    out["stamps_seen"] = [int(sb.peer_view(p, "topk_idx")[0, 0]) for p in range(sb.num_ranks)]
    out["written_by_rank0"] = int(sb.topk_idx[1, 0])


HELLO = (hello_write, hello_read)


# ============================================================================================ 02: map and remote access
#: Rows each rank reads from / writes to a peer in the remote-access demo.
DEMO_ROWS = 4


def row_pattern(rank: int, rows: int, cols: int) -> torch.Tensor:
    """u8 ``[rows, cols]``: byte ``0x<rank+1><row>`` in every column, so a row names its owner and index in hex."""
    r = torch.arange(rows, dtype=torch.int32)[:, None].expand(rows, cols)
    return ((rank + 1) * 16 + r % 16).to(torch.uint8)


def map_fill(sb: SymmBuffer, out: dict) -> None:
    """Phase 1: fill ``x`` with :func:`row_pattern`; compute ``map(&x[3], r)`` for every rank ``r`` by hand and
    compare with the address of ``x[3]`` in rank ``r``'s buffer as mapped into this process."""
    L = sb.layout
    sb.x.view(torch.uint8)[:DEMO_ROWS].copy_(row_pattern(sb.rank, DEMO_ROWS, L.hidden).to(sb.device))
    ptrs = sb.buffer_ptrs.tolist()
    seg, row = L["x"], 3
    row_bytes = seg.nbytes // seg.shape[0]
    local = ptrs[sb.rank] + seg.offset + row * row_bytes
    table = []
    for r in range(sb.num_ranks):
        delta = ptrs[r] - ptrs[sb.rank]
        table.append({"dst_rank": r, "base[dst]": hex(ptrs[r]), "delta = base[dst]-base[me]": delta,
                      "map(&x[3], dst)": hex(local + delta),
                      "&x[3] in dst's buffer": hex(sb.peer_view(r, "x")[row].data_ptr()),
                      "equal": local + delta == sb.peer_view(r, "x")[row].data_ptr()})
    out.update(x_offset=seg.offset, row_bytes=row_bytes, local_addr=hex(local), map_table=table)


def map_access(sb: SymmBuffer, out: dict) -> None:
    """Phase 2: with the Triton copy kernel (``sym_map`` inside), *pull* rows 0..3 of the next rank's ``x`` into my
    ``l1_acts[0:4]`` (remote read) and *push* my rows 0..3 into the next rank's ``l1_acts[4:8]`` (remote write)."""
    peer = (sb.rank + 1) % sb.num_ranks
    rows = list(range(DEMO_ROWS))
    ks.pull_rows(sb, peer, "x", rows, rows, dst_segment="l1_acts")
    ks.push_rows(sb, peer, "x", rows, [DEMO_ROWS + i for i in rows], dst_segment="l1_acts")
    out["pulled_from"], out["pushed_to"] = peer, peer


def map_check(sb: SymmBuffer, out: dict) -> None:
    """Phase 3: read my ``l1_acts[0:8]`` and check it against the patterns of the ranks that filled it."""
    R, H = sb.num_ranks, sb.layout.hidden
    acts = sb.l1_acts.view(torch.uint8)[:2 * DEMO_ROWS].cpu()
    nxt, prev = (sb.rank + 1) % R, (sb.rank - 1) % R
    out["pulled_rows"] = [hex_bytes(acts[i], 6) for i in range(DEMO_ROWS)]
    out["pushed_rows"] = [hex_bytes(acts[DEMO_ROWS + i], 6) for i in range(DEMO_ROWS)]
    out["pull_ok"] = bool(torch.equal(acts[:DEMO_ROWS], row_pattern(nxt, DEMO_ROWS, H)))
    out["push_ok"] = bool(torch.equal(acts[DEMO_ROWS:], row_pattern(prev, DEMO_ROWS, H)))


MAP_DEMO = (map_fill, map_access, map_check)


def sym_map_source() -> str:
    """Source of the Triton ``sym_map`` device function (``megamoe.kernels.symm``)."""
    fn = getattr(ks.sym_map, "fn", ks.sym_map)
    return inspect.getsource(fn)


def cuda_header(name: str = "sym_buffer.cuh") -> str:
    """Text of ``kernels/cuda/<name>``."""
    from megamoe.kernels.cupy_prims import CUDA_DIR

    return (CUDA_DIR / name).read_text()


# ---------------------------------------------------------------------------------------------------- barrier protocol
def _barrier_snapshot(sb: SymmBuffer, step: str) -> dict:
    _sync(sb)
    state = sb.view("barrier_state").tolist()
    return {"rank": sb.rank, "step": step, "epoch": state[0], "failed_tag": state[1], "missing_rank": state[2],
            "barrier_signal": sb.view("barrier_signal").tolist()}


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
            sb.barrier_timeout_s = timeout_s
            start = time.monotonic()
            try:
                ks.barrier(sb, ks.TAG_AFTER_WORKSPACE_CLEAN)
                ks.check_barrier_state(sb)
            except ks.BarrierTimeout as e:
                error = {"rank": e.rank, "tag": e.tag, "missing_rank": e.missing_rank, "message": str(e),
                         "waited_s": round(time.monotonic() - start, 2)}
            trace.append(_barrier_snapshot(sb, "barrier tag 3 (timed out)" if error else "barrier tag 3"))
        _sync(sb)
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
    backend = resolve_backend(backend, world_size)
    if backend != "local":
        return launch(barrier_demo_rank, world_size, shape, absent_rank, timeout_s, backend=backend, timeout_s=300)
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
            sb.barrier_timeout_s = timeout_s
            start = time.monotonic()
            try:
                ks.barrier_wait(sb, ks.TAG_AFTER_WORKSPACE_CLEAN)
                ks.check_barrier_state(sb)
            except ks.BarrierTimeout as e:
                errors[sb.rank] = {"rank": e.rank, "tag": e.tag, "missing_rank": e.missing_rank, "message": str(e),
                                   "waited_s": round(time.monotonic() - start, 2)}
            tr.append(_barrier_snapshot(sb, "barrier tag 3 (timed out)" if errors[sb.rank] else "barrier tag 3"))
        traces[absent_rank].append(_barrier_snapshot(sbs[absent_rank],
                                                     "skipped barrier tag 3 (seen after the others gave up)"))
        return [{"rank": r, "trace": traces[r], "error": errors[r]} for r in range(world_size)]
    finally:
        for sb in sbs:
            sb.destroy()


# ---------------------------------------------------------------------------------------------------- CuPy / CUDA
def cupy_available() -> bool:
    """True when CuPy imports and sees a GPU (the CUDA ``SymBuffer`` demo can run)."""
    if not cuda_available():
        return False
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def _cupy_copy_and_check(sb: SymmBuffer, buffer_ptrs, peer: int, out: dict) -> None:
    from megamoe.kernels import cupy_prims

    L, H = sb.layout, sb.layout.hidden
    cupy_prims.pull_rows(buffer_ptrs, sb.rank, peer, L.offset("x"), L.offset("l1_acts"), DEMO_ROWS, H)
    cupy_prims.push_rows(buffer_ptrs, sb.rank, peer, L.offset("x"), L.offset("l1_acts") + DEMO_ROWS * H,
                         DEMO_ROWS, H)
    out["pulled_from"] = out["pushed_to"] = peer


def cupy_rank_read_write(rank: int, world_size: int, shape: dict) -> dict:
    """One GPU per rank: fill ``x``, CUDA barrier (``barrier.cuh``), pull the next rank's rows and push mine into it
    with ``pull_rows``/``push_rows`` (``SymBuffer::map`` + 1-D bulk copies), barrier, check ``l1_acts[0:8]``."""
    from megamoe.kernels import cupy_prims

    sb = SymmBuffer(None, **shape)
    try:
        L = sb.layout
        out = _base_info(sb)
        sig, st = L.offset("barrier_signal"), L.offset("barrier_state")
        sb.x.view(torch.uint8)[:DEMO_ROWS].copy_(row_pattern(rank, DEMO_ROWS, L.hidden).to(sb.device))
        cupy_prims.barrier(sb.buffer_ptrs, rank, sig, st, tag=1)
        _cupy_copy_and_check(sb, sb.buffer_ptrs, (rank + 1) % world_size, out)
        cupy_prims.barrier(sb.buffer_ptrs, rank, sig, st, tag=2)
        _sync(sb)
        ks.check_barrier_state(sb)
        map_check(sb, out)
        cupy_prims.barrier(sb.buffer_ptrs, rank, sig, st, tag=3)
        _sync(sb)
        ks.check_barrier_state(sb)
        return out
    finally:
        sb.destroy()


def cupy_local_read_write(world_size: int, shape: dict) -> list[dict]:
    """``world_size`` ranks as separate allocations on the current GPU: every rank pulls from and pushes into the
    next one with the CuPy kernels (stream order replaces the barriers); returns :func:`map_check` per rank."""
    sbs = SymmBuffer.local(world_size, **shape, device="cuda")
    try:
        outs = [_base_info(sb) for sb in sbs]
        for sb in sbs:
            sb.x.view(torch.uint8)[:DEMO_ROWS].copy_(row_pattern(sb.rank, DEMO_ROWS, sb.layout.hidden).cuda())
        for sb, out in zip(sbs, outs):
            _cupy_copy_and_check(sb, sb.buffer_ptrs, (sb.rank + 1) % world_size, out)
        torch.cuda.synchronize()
        for sb, out in zip(sbs, outs):
            map_check(sb, out)
        return outs
    finally:
        for sb in sbs:
            sb.destroy()


# =============================================================================================== 04-06: staged pipeline
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
        prepared = [programs.prepare_rank(sb, self.problem, r) for r, sb in enumerate(self.sbs)]
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
        """The pool of ``rank`` after the dispatch: derived from ``expert_recv_count`` (the schedule every kernel
        recomputes) and ``token_src_metadata``. Needs the counts, i.e. call it before the ``cleanup`` step."""
        sb, L = self.sbs[rank], self.layout
        recv = sb.view("expert_recv_count").cpu().to(torch.int64)
        if int(recv.sum()) == 0 and self.position > self.steps.index("cleanup"):
            raise RuntimeError("the workspace was cleaned: take the pool map before the 'cleanup' step")
        bm = L.block_m
        n = recv.sum(0)
        blocks = (n + bm - 1) // bm
        first = (torch.cumsum(blocks, 0) - blocks) * bm
        used = int(blocks.sum()) * bm
        meta = sb.view("token_src_metadata")[:used].cpu().to(torch.int64)
        expert = torch.full((used,), -1, dtype=torch.int64)
        valid = torch.zeros(used, dtype=torch.bool)
        for e in range(L.num_experts_per_rank):
            lo = int(first[e])
            expert[lo:lo + int(blocks[e]) * bm] = e
            valid[lo:lo + int(n[e])] = True
        src, tok, slot = (torch.where(valid, meta[:, i], torch.full_like(meta[:, i], -1)) for i in range(3))
        return PoolMap(rank, bm, L.num_max_pool_tokens, recv.tolist(), n.tolist(), blocks.tolist(), first.tolist(),
                       expert.numpy(), valid.numpy(), src.numpy(), tok.numpy(), slot.numpy())

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
            sf_row = (p // L.block_m) * L.sf_block_m + p % L.block_m
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
                sf_row = (p // L.block_m) * L.sf_block_m + p % L.block_m
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


# ---------------------------------------------------------------------------------------------------- pull vs push
def _time_steps(calls, steps, repeats: int) -> dict[str, float]:
    """Median wall time (CUDA events when on GPU, else perf_counter) of every step of one call, in microseconds."""
    cuda = calls[0].sb.buffer.device.type == "cuda"
    samples: dict[str, list[float]] = {name: [] for name, _ in steps}
    for _ in range(repeats):
        if cuda:
            events = [torch.cuda.Event(enable_timing=True) for _ in range(len(steps) + 1)]
            events[0].record()
        else:
            marks = [time.perf_counter()]
        for i, (_, step) in enumerate(steps):
            for c in calls:
                step(c)
            if cuda:
                events[i + 1].record()
            else:
                marks.append(time.perf_counter())
        if cuda:
            torch.cuda.synchronize()
            times = [events[i].elapsed_time(events[i + 1]) * 1e3 for i in range(len(steps))]
        else:
            times = [(marks[i + 1] - marks[i]) * 1e6 for i in range(len(steps))]
        for (name, _), t in zip(steps, times):
            samples[name].append(t)
    return {name: statistics.median(v) for name, v in samples.items()}


def _pull_push(calls_for, repeats: int) -> dict:
    """Per-step medians for pull and for push, and the outputs of one call each (``calls_for(dispatch)`` binds)."""
    out = {}
    for dispatch in ("pull", "push"):
        calls = calls_for(dispatch)
        steps = ops.pipeline_steps(dispatch)
        for _, step in steps:  # warm-up (compiles on GPU) and the output to compare
            for c in calls:
                step(c)
        out[f"y_{dispatch}"] = [c.y.cpu().clone() for c in calls]
        out[dispatch] = _time_steps(calls, steps, repeats)
    return out


def pull_push_rank(rank: int, world_size: int, case: MoECase, repeats: int = 20) -> dict:
    """One process per rank: the layer with ``dispatch="pull"`` and ``"push"``; per-step times (us) and y of each."""
    sb = SymmBuffer(None, case.num_experts, case.max_tokens(), case.num_topk, case.hidden, case.intermediate,
                    block_m=case.block_m)
    try:
        problem = case.problem(device=sb.buffer.device)
        y, l1, l2, _ = programs.prepare_rank(sb, problem, rank)
        out = _pull_push(lambda d: ops.bind_calls(y, l1, l2, sb, None, "swiglu", case.activation_clamp, d, False),
                        repeats)
        out["y_equal"] = bool(torch.equal(out["y_pull"][0].view(torch.int16), out["y_push"][0].view(torch.int16)))
        ref = problem.reference(activation_clamp=case.activation_clamp)[rank].cpu()
        out["y_matches_reference"] = bool(torch.equal(out["y_pull"][0].view(torch.int16), ref.view(torch.int16)))
        del out["y_pull"], out["y_push"]
        out["rank"] = rank
        return out
    finally:
        sb.destroy()


def pull_push_local(case: MoECase, repeats: int = 20) -> dict:
    """All ranks in this process (``local``): per-step times of pull and push and whether every rank's y agrees."""
    sbs = SymmBuffer.local(case.num_ranks, case.num_experts, case.max_tokens(), case.num_topk, case.hidden,
                           case.intermediate, block_m=case.block_m)
    try:
        problem = case.problem(device=sbs[0].buffer.device)
        ys, l1s, l2s, _ = (list(t) for t in zip(*[programs.prepare_rank(sb, problem, r) for r, sb in enumerate(sbs)]))
        out = _pull_push(lambda d: ops.bind_calls(ys, l1s, l2s, sbs, None, "swiglu", case.activation_clamp, d, False),
                        repeats)
        out["y_equal"] = all(torch.equal(a.view(torch.int16), b.view(torch.int16))
                             for a, b in zip(out["y_pull"], out["y_push"]))
        refs = problem.reference(activation_clamp=case.activation_clamp)
        out["y_matches_reference"] = all(torch.equal(a.view(torch.int16), r.cpu().view(torch.int16))
                                         for a, r in zip(out["y_pull"], refs))
        del out["y_pull"], out["y_push"]
        return out
    finally:
        for sb in sbs:
            sb.destroy()


def pull_push_timing(case: MoECase, backend: str = "auto", repeats: int = 20) -> list[dict]:
    """:func:`pull_push_rank` on every rank (``cuda``/``cpu``), or :func:`pull_push_local` as one entry (``local``)."""
    backend = resolve_backend(backend, case.num_ranks)
    if backend == "local":
        return [pull_push_local(case, repeats)]
    return launch(pull_push_rank, case.num_ranks, case, repeats, backend=backend, timeout_s=600)


# ==================================================================================================== 05: formats
def fp8_e4m3_codes() -> list[dict]:
    """Characteristic FP8 e4m3 codes: the value each decodes to (torch's ``float8_e4m3fn``)."""
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    named = [(0x01, "smallest subnormal (2^-9)"), (0x07, "largest subnormal"), (0x08, "smallest normal (2^-6)"),
             (0x38, "one"), (0x39, "next after one (1 + 2^-3)"), (0x7E, "largest finite"), (0x7F, "NaN"),
             (0xB8, "minus one"), (0xFE, "most negative")]
    return [{"code": f"0x{c:02x}", "bits s.eeee.mmm": f"{c >> 7}.{(c >> 3) & 15:04b}.{c & 7:03b}",
             "value": float(values[c]), "meaning": m} for c, m in named]


def fp8_positive_values() -> torch.Tensor:
    """All positive finite FP8 e4m3 values (float32, ascending)."""
    v = torch.arange(1, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return v


def e2m1_codes() -> list[dict]:
    """The 16 FP4 e2m1 nibbles and their values."""
    nib = torch.arange(16, dtype=torch.uint8)
    vals = e2m1_decode(nib)
    return [{"nibble": f"0b{n:04b}", "sign": n >> 3, "code": n & 7, "value": float(v)} for n, v in
            zip(nib.tolist(), vals.tolist())]


def ue8m0_codes(codes: Sequence[int] = (0, 1, 117, 126, 127, 128, 135, 254, 255)) -> list[dict]:
    """UE8M0 scale bytes and the power of two each means (decoded by ``megamoe.quant.unpack_ue8m0``)."""
    out = []
    for c in codes:
        word = torch.tensor([c | (127 << 8) | (127 << 16) | (127 << 24)], dtype=torch.int64)
        word = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)
        v = float(unpack_ue8m0(word)[0])
        out.append({"byte": c, "value": v, "as 2^(byte-127)": f"2^{c - 127}" if c < 255 else "NaN"})
    return out


def quantization_errors(rows: int = 512, cols: int = 1024, seed: int = 0) -> dict:
    """Quantise Gaussian data per 32 to FP8 (activations) and FP4 (weights); return the data, the dequantised values,
    the per-group amax and the relative-error statistics."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    x8 = dequant_fp8(*per_token_cast_to_fp8(x))
    x4 = dequant_fp4(*per_token_cast_to_fp4(x))
    amax = x.unflatten(-1, (-1, 32)).abs().amax(-1).repeat_interleave(32, -1)
    stats = {}
    for name, q in (("FP8 e4m3", x8), ("FP4 e2m1", x4)):
        err = (q - x)
        stats[name] = {"format": name, "rel. RMS error": float(err.norm() / x.norm()),
                       "max |err| / group amax": float((err.abs() / amax).max()),
                       "exact zeros kept": bool(torch.equal(q[x == 0], x[x == 0]))}
    return {"x": x, "fp8": x8, "fp4": x4, "amax": amax, "stats": list(stats.values())}


def quantization_figure(q: dict):
    """Three panels: the FP8 grid (relative spacing per value), the FP4 staircase of one group, error histograms."""
    from megamoe.figures import log_axis, new_figure

    fig, axes = new_figure(1, 3, size=(14.0, 4.0))
    ax = axes[0, 0]
    v = fp8_positive_values()
    ax.plot(v[:-1].numpy(), ((v[1:] - v[:-1]) / v[:-1]).numpy(), ".", ms=3)
    ax.set_xscale("log", base=2)
    log_axis(ax)
    ax.set_xlabel("FP8 e4m3 value")
    ax.set_ylabel("gap to the next value / value")
    ax.set_title("FP8 e4m3: relative gap to the next value")
    ax = axes[0, 1]
    x, x4, amax = q["x"][0, :32], q["fp4"][0, :32], q["amax"][0, 0]
    order = torch.argsort(x)
    ax.plot(x[order].numpy(), x4[order].numpy(), "o-", drawstyle="steps-mid", label="FP4 e2m1 x scale")
    ax.plot(x[order].numpy(), x[order].numpy(), "k:", lw=1, label="exact")
    ax.set_xlabel("value (one group of 32)")
    ax.set_ylabel("dequantised")
    ax.set_title(f"FP4 e2m1: one group of 32 (amax {float(amax):.2f})")
    ax.legend()
    ax = axes[0, 2]
    for name, key in (("FP8 e4m3", "fp8"), ("FP4 e2m1", "fp4")):
        rel = ((q[key] - q["x"]).abs() / q["amax"]).flatten().numpy()
        ax.hist(rel, bins=80, histtype="step", label=name, density=True)
    ax.set_yscale("log")
    ax.set_xlabel("|error| / group amax")
    ax.set_ylabel("density")
    ax.set_title("per-32 quantisation error, N(0,1) data")
    ax.legend()
    return fig


def _tiny_weights(hidden: int = 128, intermediate: int = 128):
    """Zero FP4 weights for one expert (the transform only permutes, so zeros + labelled entries suffice)."""
    l1 = (torch.zeros(1, 2 * intermediate, hidden // 2, dtype=torch.int8),
          torch.zeros(1, 2 * intermediate, hidden // 128, dtype=torch.int32))
    l2 = (torch.zeros(1, hidden, intermediate // 2, dtype=torch.int8),
          torch.zeros(1, hidden, intermediate // 128, dtype=torch.int32))
    return l1, l2


def interleave_demo(intermediate: int = 128, hidden: int = 128, show: int = 32) -> list[int]:
    """Original L1 row of each of the first ``show`` transformed rows (rows ``[0, I)`` gate, ``[I, 2I)`` up): the
    scale of row ``r`` is set to ``r`` so the transform's row permutation can be read off."""
    l1, l2 = _tiny_weights(hidden, intermediate)
    l1[1][0, :, 0] = torch.arange(2 * intermediate, dtype=torch.int32)
    (_, sf), _ = transform_weights_for_mega_moe(l1, l2)
    return sf[0, :show, 0].tolist()


def nibble_split_demo(chunk: int = 64) -> list[dict]:
    """Where element ``k`` (0..63) of a weight row lives before (K-major, ``pack_nibbles``) and after the transform:
    (byte, low/high nibble). Found by transforming one-hot rows (only element ``k`` non-zero)."""
    hidden, intermediate = 128, 128
    out = []
    for k in range(chunk):
        nib = torch.zeros(1, hidden, intermediate, dtype=torch.uint8)
        nib[0, 0, k] = 1
        l1, _ = _tiny_weights(hidden, intermediate)
        l2 = (pack_nibbles(nib), torch.zeros(1, hidden, intermediate // 128, dtype=torch.int32))
        _, (w, _) = transform_weights_for_mega_moe(l1, l2)
        before = unpack_nibbles(l2[0][0, 0]).nonzero().flatten().item()
        after = unpack_nibbles(w[0, 0]).nonzero().flatten().item()
        out.append({"element": k, "before: byte": before // 2, "before: nibble": "lo" if before % 2 == 0 else "hi",
                    "after: byte": after // 2, "after: nibble": "lo" if after % 2 == 0 else "hi"})
    return out


def mn_major_demo(hidden: int = 512, intermediate: int = 256) -> list[dict]:
    """Shapes and strides of the scale tensors before and after the transform (same shape, MN-major strides), and
    whether :func:`~megamoe.quant.untransform_weights_for_mega_moe` restores the input bit for bit."""
    g = torch.Generator().manual_seed(0)
    l1 = (torch.randint(-128, 128, (2, 2 * intermediate, hidden // 2), generator=g, dtype=torch.int8),
          torch.randint(0, 2**31 - 1, (2, 2 * intermediate, hidden // 128), generator=g, dtype=torch.int32))
    l2 = (torch.randint(-128, 128, (2, hidden, intermediate // 2), generator=g, dtype=torch.int8),
          torch.randint(0, 2**31 - 1, (2, hidden, intermediate // 128), generator=g, dtype=torch.int32))
    t1, t2 = transform_weights_for_mega_moe(l1, l2)
    u1, u2 = untransform_weights_for_mega_moe(t1, t2)
    rows = []
    for name, before, after, back in (("l1 scales", l1[1], t1[1], u1[1]), ("l2 scales", l2[1], t2[1], u2[1]),
                                      ("l1 weights", l1[0], t1[0], u1[0]), ("l2 weights", l2[0], t2[0], u2[0])):
        rows.append({"tensor": name, "shape": tuple(before.shape), "strides before": before.stride(),
                     "strides after": after.stride(), "round trip exact": bool(torch.equal(before, back))})
    return rows


def block_scaled_dot_demo(k: int = 256, seed: int = 0) -> list[dict]:
    """Why the kernels issue one ``tl.dot`` per 32-wide K group: a row of FP8 activations times a row of FP4 weights,
    both with a scale per 32. Per-group dots scaled by ``sa*sb`` and summed in float32 equal the exact (float64)
    dot of the dequantised rows up to float32 summation order; one dot over a wider K with a single pair of scales
    (what an MMA over K=64/128 would do without per-32 "promotion") is wrong."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(1, k, generator=g) * torch.logspace(-2, 2, k // 32).repeat_interleave(32)
    b = torch.randn(1, k, generator=g)
    a8, asf = per_token_cast_to_fp8(a)
    b4, bsf = per_token_cast_to_fp4(b)
    exact = float((dequant_fp8(a8, asf).double() * dequant_fp4(b4, bsf).double()).sum())
    sa, sb = unpack_ue8m0(asf)[0], unpack_ue8m0(bsf)[0]
    av = a8.float()[0]
    bv = e2m1_decode(unpack_nibbles(b4))[0]
    rows = []
    for width in (32, 64, 128):
        acc = torch.zeros((), dtype=torch.float32)
        for g0 in range(0, k, width):
            dot = (av[g0:g0 + width] * bv[g0:g0 + width]).sum()  # an MMA over `width` K elements, unscaled
            acc += dot * sa[g0 // 32] * sb[g0 // 32]  # one scale pair per dot: the first group's
        rows.append({"K per dot": width, "scale pairs used": k // width, "result": float(acc), "exact": exact,
                     "relative error": abs(float(acc) - exact) / abs(exact)})
    return rows


# ==================================================================================================== 07 and results
def correctness_grid(cases: Sequence[MoECase], device=None) -> list[dict]:
    """Run each case on ``local`` ranks (``megamoe.programs.run_case_local``) and summarise it as one table row."""
    rows = []
    for case in cases:
        t0 = time.perf_counter()
        reports = programs.run_case_local(case, device=device)
        rows.append({"ranks": case.num_ranks, "top-k": case.num_topk, "masked": case.masked_ratio,
                     "routing": case.routing, "tokens/rank": str(case.tokens()),
                     "pairs": sum(sum(r["recv_stats"]) for r in reports),
                     "max rel_fro": max(r["rel_fro"] for r in reports),
                     "within tolerance": all(not r["failures"] for r in reports),
                     "bitwise equal": all(r["bitwise_equal"] for r in reports),
                     "recv stats ok": all(r["recv_stats_ok"] for r in reports),
                     "seconds": round(time.perf_counter() - t0, 1)})
    return rows


def megamoe_layer_rank(rank: int, world_size: int, case: MoECase, num_calls: int = 2) -> dict:
    """One process per rank: build ``MegaMoE`` from untransformed FP4 weights, call it on bf16 activations
    ``num_calls`` times and compare every output with the reference (the module quantises x itself)."""
    from megamoe.ops import MegaMoE

    sb = SymmBuffer(None, case.num_experts, case.max_tokens(), case.num_topk, case.hidden, case.intermediate,
                    block_m=case.block_m)
    try:
        dev = sb.buffer.device
        problem = case.problem(device=dev)
        l1, l2 = problem.weights_for_rank(rank)
        layer = MegaMoE(sb, l1, l2, activation_clamp=case.activation_clamp)
        stats = torch.zeros(problem.num_local_experts, dtype=torch.int32, device=dev)
        ref = problem.reference(activation_clamp=case.activation_clamp)[rank].cpu()
        bitwise, errors, failures = [], [], []
        for _ in range(num_calls):
            y = layer(problem.x_bf16[rank], problem.topk_idx[rank], problem.topk_weights[rank], stats)
            s = moe_error_stats(y.cpu(), ref)
            bitwise.append(bool(torch.equal(y.cpu().view(torch.int16), ref.view(torch.int16))))
            errors.append(s["rel_fro"])
            failures += check_stats(s, default_accumulation(dev))
        expected = programs.expected_recv_counts(problem, rank) * num_calls
        return {"rank": rank, "tokens": problem.num_tokens[rank], "rel_fro per call": errors,
                "bitwise equal per call": bitwise, "failures": failures, "recv stats": stats.cpu().tolist(),
                "recv stats ok": bool(torch.equal(stats.cpu(), expected))}
    finally:
        sb.destroy()


def results_files(prefix: str = "") -> list[Path]:
    """``results/<prefix>*.json`` (``$MEGAMOE_RESULTS_DIR`` overrides the folder), sorted, without the notebooks'
    own execution times (``notebook_times_*``: rewritten by every notebook run, so no notebook output made from
    them could stay fresh; the README cites them)."""
    from megamoe.figures import results_dir

    return sorted(p for p in results_dir().glob(f"{prefix}*.json") if not p.stem.startswith("notebook_times"))


def load_result(path: Path) -> dict:
    """``megamoe.figures.read_results`` (the one reader: it records the file's hash in the notebook's output)."""
    from megamoe.figures import read_results

    return read_results(path)


def results_overview() -> list[dict]:
    """One row per ``results/*.json``: file, kind, device, commit, number of rows."""
    rows = []
    for p in results_files():
        d = load_result(p)
        prov = d.get("provenance", {})
        rows.append({"file": p.name, "kind": d.get("kind"), "device": prov.get("device"),
                     "commit": str(prov.get("git_commit", ""))[:12], "rows": len(d.get("rows") or [])})
    return rows


def flatten_rows(data: dict, columns: Sequence[str] | None = None) -> list[dict]:
    """The ``rows`` of a results dict with nested dicts (e.g. ``steps_us``) flattened to ``key.sub`` columns."""
    out = []
    for r in data.get("rows") or []:
        flat = {}
        for k, v in r.items():
            if isinstance(v, dict):
                flat.update({f"{k}.{kk}": vv for kk, vv in v.items()})
            else:
                flat[k] = v
        out.append({c: flat.get(c) for c in columns} if columns else flat)
    return out


def roofline_rows(layer: dict, ceilings: dict | None, impl: str = "staged", routing: str = "uniform") -> list[dict]:
    """Per row of a ``layer`` result of implementation ``impl`` (rows without ``impl`` count as staged) and
    ``routing``: measured TFLOP/s against the roofline from a ``ceilings`` result (measured FP8 matmul TFLOP/s and
    device copy TB/s): ``time >= max(flops / peak, touched weight bytes / bandwidth)``."""
    peak = bw = None
    for r in (ceilings or {}).get("rows", []):
        if "tflops" in r:
            peak = r["tflops"]
        if "tb_per_s" in r:
            bw = r["tb_per_s"]
    rows = []
    for r in layer.get("rows", []):
        if r.get("impl", "staged") != impl or r.get("routing", "uniform") != routing:
            continue
        row = {"tokens/rank": r.get("num_tokens_per_rank"), "ranks": r.get("num_ranks"), "us": r.get("us"),
               "TFLOP/s": r.get("tflops")}
        if peak and bw and r.get("flops"):
            t_compute = r["flops"] / (peak * 1e12)
            t_memory = r.get("weight_bytes_touched", 0) / (bw * 1e12)
            bound = max(t_compute, t_memory)
            row.update({"roofline us": bound * 1e6, "roofline TFLOP/s": r["flops"] / bound / 1e12,
                        "bound by": "compute" if t_compute >= t_memory else "weights (HBM)",
                        "fraction of roofline": bound / (r["us"] * 1e-6)})
        rows.append(row)
    return rows


def roofline_figure(rows: Sequence[dict], title: str):
    """Measured TFLOP/s (and the roofline when known) against tokens per rank."""
    from megamoe.figures import log_axis, new_figure

    fig, axes = new_figure(size=(6.5, 4.0))
    ax = axes[0, 0]
    xs = [r["tokens/rank"] for r in rows]
    ax.plot(xs, [r["TFLOP/s"] for r in rows], "o-", label="measured")
    if all("roofline TFLOP/s" in r for r in rows):
        ax.plot(xs, [r["roofline TFLOP/s"] for r in rows], "s--", color="k", label="roofline (measured ceilings)")
    ax.set_xscale("log", base=2)
    log_axis(ax)
    ax.set_xlabel("tokens per rank")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(title)
    ax.legend()
    return fig


# ==================================================================================================== 00: package map
PACKAGE_MODULES = ("env", "layout", "quant", "reference", "testing", "symm", "launch", "ops", "programs", "sim",
                   "figures", "bench", "walkthrough", "notebooks")
KERNEL_MODULES = ("symm", "dispatch", "pool", "gemm", "combine", "numerics", "cupy_prims")


def _first_sentence(doc: str | None) -> str:
    doc = (doc or "").strip().split("\n\n")[0].replace("\n", " ")
    return doc.split(". ")[0].rstrip(".") + "." if doc else ""


def package_map() -> list[dict]:
    """One row per module of ``megamoe`` and ``megamoe.kernels`` (and per CUDA header): what it holds, read from its
    docstring (or the header's first comment line)."""
    from megamoe.kernels.cupy_prims import CUDA_DIR

    rows = []
    for name in PACKAGE_MODULES:
        try:
            mod = importlib.import_module(f"megamoe.{name}")
        except ImportError as e:  # a module that cannot load here (never expected): say so
            rows.append({"module": f"megamoe.{name}", "holds": f"(not importable: {e})"})
            continue
        rows.append({"module": f"megamoe.{name}", "holds": _first_sentence(mod.__doc__)})
    for name in KERNEL_MODULES:
        mod = importlib.import_module(f"megamoe.kernels.{name}")
        rows.append({"module": f"megamoe.kernels.{name}", "holds": _first_sentence(mod.__doc__)})
    for path in sorted(CUDA_DIR.glob("*.cuh")):
        first = path.read_text().splitlines()[0].lstrip("/ ")
        rows.append({"module": f"kernels/cuda/{path.name}", "holds": first.split(" -- ", 1)[-1]})
    return rows


# ==================================================================================================== figures
_EXPERT_COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c",
                  "#ccb974", "#64b5cd")
_RANK_HATCHES = ("", "////", "\\\\\\\\", "xxxx", "....", "oo", "++", "**")


def _box(ax, x, y, w, h, text, color, fontsize=8, alpha=0.9, **kw):
    from matplotlib.patches import FancyBboxPatch

    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08", fc=color, ec="k",
                                lw=0.8, alpha=alpha, **kw))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize)


def _arrow(ax, x0, y0, x1, y1, text="", color="k", style="-|>", ls="-", text_offset=(0.0, 0.12), fontsize=7):
    from matplotlib.patches import FancyArrowPatch

    ax.add_patch(FancyArrowPatch((x0, y0), (x1, y1), arrowstyle=style, mutation_scale=10, color=color, lw=1.2,
                                 ls=ls, shrinkA=0, shrinkB=0))
    if text:
        ax.text((x0 + x1) / 2 + text_offset[0], (y0 + y1) / 2 + text_offset[1], text, ha="center", va="bottom",
                fontsize=fontsize, color=color)


def dataflow_figure():
    """DeepEP's push pipeline (5 buffer levels between the router and the experts) above Mega MoE's pull on
    symmetric memory (input -> pool -> combine), with the rank each buffer lives on."""
    from megamoe.figures import new_figure

    fig, axes = new_figure(2, 1, size=(12.5, 6.6), height_ratios=[1, 1.25])
    src, dst, net = "#c6dbef", "#fdd0a2", "#e0e0e0"
    ax = axes[0, 0]
    ax.set_xlim(0, 13)
    ax.set_ylim(0, 3.2)
    ax.axis("off")
    ax.set_title("DeepEP (normal kernels): the source PUSHES; five buffer levels between router and expert",
                 loc="left")
    boxes = [("Token buffer\n(token-major,\nrouter output)", src), ("Dispatch buffer\n(destination-major)", src),
             ("Chunk buffer\n(aggregated\nfor the wire)", src), ("Network\nNVLink / RDMA\n(+ forwarding)", net),
             ("Receive buffer\n(on the\nexpert's GPU)", dst), ("Expert buffer\n(expert-major,\nGEMM input)", dst)]
    for i, (t, c) in enumerate(boxes):
        _box(ax, 0.2 + i * 2.1, 1.35, 1.75, 1.2, t, c)
        if i:
            _arrow(ax, 0.2 + (i - 1) * 2.1 + 1.75, 1.95, 0.2 + i * 2.1, 1.95)
    ax.text(0.2, 0.75, "source GPU: layout kernel + CPU sync on counts, copy into send buffers", fontsize=8,
            color="#2b5d8c")
    ax.text(8.6, 0.75, "destination GPU: unpack, then grouped GEMM;\ncombine = the mirror image", fontsize=8,
            color="#a3541d")
    ax.text(0.2, 0.25, "token = scheduling unit, chunk = communication unit; a separate kernel each way, "
            "buffers sized per destination", fontsize=8)

    ax = axes[1, 0]
    ax.set_xlim(0, 13)
    ax.set_ylim(0, 4.3)
    ax.axis("off")
    ax.set_title("Mega MoE: the expert's rank PULLS from the source's symmetric buffer; three levels: "
                 "input -> pool -> combine", loc="left")
    _box(ax, 0.2, 2.7, 2.4, 1.25, "input segments\nx (FP8), x_sf, topk_idx,\ntopk_weights", src)
    _box(ax, 0.2, 0.35, 2.4, 1.25, "combine buffer\n[top-k slot][token] (BF16)\n-> top-k reduce -> y", src)
    _box(ax, 4.3, 2.7, 2.2, 1.25, "L1 pool\nexpert-major,\npadded to block_m", dst)
    _box(ax, 7.3, 2.7, 2.4, 1.25, "L1 GEMM (FP8xFP4)\n+ SwiGLU x weight\n+ FP8 requant", dst, alpha=0.6)
    _box(ax, 10.4, 2.7, 2.3, 1.25, "L2 pool\n(FP8, per-32 scales)", dst)
    _box(ax, 10.4, 0.35, 2.3, 1.25, "L2 GEMM\n(FP8xFP4 -> BF16)", dst, alpha=0.6)
    _arrow(ax, 2.6, 3.33, 4.3, 3.33, "pull: map(&x[t], src)\n(NVLink read)", color="#a3541d")
    _arrow(ax, 6.5, 3.33, 7.3, 3.33)
    _arrow(ax, 9.7, 3.33, 10.4, 3.33)
    _arrow(ax, 11.55, 2.7, 11.55, 1.6)
    _arrow(ax, 10.4, 0.97, 2.6, 0.97, "write-back: map(&combine[slot][t], src)  (NVLink write)", color="#a3541d")
    _box(ax, 4.3, 1.75, 2.2, 0.7, "workspace: recv counts,\nsource indices", dst, fontsize=7, alpha=0.5)
    _arrow(ax, 2.6, 2.85, 4.3, 2.1, "", ls=":")
    ax.text(2.75, 2.05, "step 1: remote stores\n+ atomics (no data)", fontsize=7)
    _arrow(ax, 5.4, 2.45, 5.4, 2.7, "", ls=":")
    ax.text(0.2, 4.1, "source rank (every rank is a source)", fontsize=8, color="#2b5d8c")
    ax.text(4.3, 4.1, "expert's rank (every rank owns E/R experts)", fontsize=8, color="#a3541d")
    return fig


_STEP_TEXT = {
    "count": "count\npairs per expert;\natomic slot; write\nsrc index to owner",
    "publish": "publish\nsend counts ->\nowner's recv_count",
    "pull": "pull\nowner copies x, x_sf,\nweights of its pairs\ninto the L1 pool",
    "push": "push\nsource copies its\nrows into the\nowner's L1 pool",
    "l1": "l1\nFP8xFP4 GEMM,\nSwiGLU x weight,\nFP8 requant -> L2 pool",
    "l2": "l2\nFP8xFP4 GEMM -> BF16\nstored into the source's\ncombine[slot][token]",
    "combine": "combine\nsum the top-k slots\n-> y (BF16)",
    "cleanup": "cleanup\nzero the counters\n(+ recv stats)",
}


def pipeline_figure(dispatch: str = "pull"):
    """Top: the staged pipeline of one call (one launch per step, names from ``megamoe.ops.pipeline_steps``) with the
    cross-rank barriers. Bottom: a schematic of the same work in a fused persistent kernel, where the launch
    boundaries inside each barrier interval become per-block arrival counters and the roles overlap."""
    from matplotlib.patches import Rectangle

    from megamoe.figures import new_figure

    names = stage_names(dispatch)
    colors = {"count": "#c6dbef", "publish": "#c6dbef", "pull": "#9ecae1", "push": "#9ecae1", "l1": "#fdd0a2",
              "l2": "#fdae6b", "combine": "#c7e9c0", "cleanup": "#e0e0e0"}
    fig, axes = new_figure(2, 1, size=(13.0, 6.4), height_ratios=[1.1, 1])
    ax = axes[0, 0]
    ax.axis("off")
    x = 0.0
    for name in names:
        if name.endswith("_arrive"):
            continue
        if name.endswith("_wait"):
            tag = name.removeprefix("barrier").split("_")[0]
            ax.add_patch(Rectangle((x, 0.5), 0.16, 1.9, color="k"))
            ax.text(x + 0.08, 2.5, f"barrier\ntag {tag}", ha="center", va="bottom", fontsize=7)
            x += 0.45
            continue
        _box(ax, x, 0.7, 1.55, 1.5, _STEP_TEXT.get(name, name), colors.get(name, "#ffffff"), fontsize=7)
        x += 1.75
    ax.set_xlim(-0.2, x)
    ax.set_ylim(0.0, 3.2)
    ax.set_title(f"This repo: one call of fp8_fp4_mega_moe (dispatch={dispatch!r}); every box is one kernel launch "
                 "per rank, each launch boundary a grid-wide sync", loc="left")

    ax = axes[1, 0]
    ax.set_xlim(-0.2, 15.5)
    ax.set_ylim(-0.9, 4.3)
    ax.axis("off")
    lanes = ["dispatch warps", "TMA + MMA warps", "epilogue warps"]
    for i, lane in enumerate(lanes):
        ax.text(-0.1, 3.3 - i, lane, ha="right", va="center", fontsize=8)
    spans = [(0, 0.0, 1.6, "count + publish", "#c6dbef"), (0, 2.1, 4.6, "pull token rows (per pool block)", "#9ecae1"),
             (1, 2.6, 6.9, "L1 blocks start when their rows arrived; then L2 blocks", "#fdd0a2"),
             (2, 3.0, 7.6, "L1 epilogue (SwiGLU, requant) | L2 epilogue + write-back", "#fdae6b"),
             (2, 8.2, 10.4, "combine: sum slots -> y", "#c7e9c0"), (0, 8.2, 9.6, "cleanup", "#e0e0e0")]
    for lane, x0, x1, text, color in spans:
        _box(ax, x0 + 0.15, 3.0 - lane, x1 - x0, 0.6, text, color, fontsize=7)
    for xb, tag in ((1.95, 1), (8.0, 2), (10.75, 3)):
        ax.add_patch(Rectangle((xb, 0.6), 0.1, 3.2, color="k"))
        ax.text(xb + 0.05, 3.9, f"barrier tag {tag}", ha="center", fontsize=7)
    ax.text(0.0, 0.15, "A fused persistent kernel (DeepGEMM) keeps one CTA per SM for the whole layer. Inside a "
            "barrier interval the launch boundaries become per-block arrival counters (l1_arrival_count,\n"
            "l2_arrival_mask in the workspace): a GEMM block starts as soon as its pool rows have landed, so "
            "pulling, both GEMMs and the write-back overlap. Only the three cross-rank barriers remain.",
            fontsize=8, va="top")
    ax.set_title("Where a fused kernel would fuse (schematic, not to scale)", loc="left")
    return fig


def pool_figure(pool_maps: Sequence[PoolMap], title: str = ""):
    """Pool rows of each rank as a grid (one line per pool block of ``block_m`` rows): colour = local expert,
    hatch = source rank, white = padding, light grey = allocated but unused (up to the worst-case capacity)."""
    from matplotlib.patches import Patch, Rectangle

    from megamoe.figures import new_figure

    n = len(pool_maps)
    bm = pool_maps[0].block_m
    cap_blocks = pool_maps[0].capacity // bm
    fig, axes = new_figure(1, n, size=(min(5.5 * n, 16), 0.9 + 0.28 * cap_blocks))
    num_src = 1 + max(int(pm.src_rank.max()) if pm.used_rows else 0 for pm in pool_maps)
    for ax, pm in zip(axes[0], pool_maps):
        for b in range(cap_blocks):
            for i in range(bm):
                p = b * bm + i
                y = cap_blocks - 1 - b
                if p >= pm.used_rows:
                    ax.add_patch(Rectangle((i, y), 1, 0.9, fc="#f2f2f2", ec="none"))
                    continue
                e = int(pm.expert[p])
                if not pm.valid[p]:
                    ax.add_patch(Rectangle((i, y), 1, 0.9, fc="white", ec=_EXPERT_COLORS[e % 10], lw=0.4))
                    continue
                s = int(pm.src_rank[p])
                ax.add_patch(Rectangle((i, y), 1, 0.9, fc=_EXPERT_COLORS[e % 10], ec="k", lw=0.15,
                                       hatch=_RANK_HATCHES[s % len(_RANK_HATCHES)]))
        for e, (lo, nb) in enumerate(zip(pm.first_row, pm.blocks)):
            if nb:
                ax.text(-0.8, cap_blocks - 1 - lo // bm + 0.45, f"e{e}", ha="right", va="center", fontsize=7)
        ax.set_xlim(-4, bm)
        ax.set_ylim(0, cap_blocks)
        ax.set_xticks([0, bm // 2, bm])
        ax.set_yticks([cap_blocks - 0.55 - b for b in range(cap_blocks)], [str(b) for b in range(cap_blocks)])
        ax.set_xlabel("row within the block")
        ax.set_ylabel("pool block")
        ax.grid(False)
        s = pm.summary()
        ax.set_title(f"rank {pm.rank}: {s['pairs received']} pairs, {s['rows used']} rows used "
                     f"({s['padding rows']} padding) of {pm.capacity}", fontsize=8)
    handles = [Patch(fc=_EXPERT_COLORS[e % 10], label=f"local expert {e}")
               for e in range(len(pool_maps[0].n))]
    handles += [Patch(fc="white", ec="k", hatch=_RANK_HATCHES[s % len(_RANK_HATCHES)], label=f"from rank {s}")
                for s in range(num_src)]
    handles += [Patch(fc="white", ec="#999999", label="padding"), Patch(fc="#f2f2f2", label="unused capacity")]
    fig.legend(handles=handles, loc="outside right center", fontsize=7)
    if title:
        fig.suptitle(title)
    return fig


# ==================================================================================================== 03: pool sizing
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
