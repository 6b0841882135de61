"""SymmBuffer: one symmetric byte buffer per rank, every peer's copy addressable from every rank.

Three backends, one interface (``buffer``, ``buffer_ptrs``, ``rank``, ``layout``, typed views):

* ``cuda``: ``torch.distributed._symmetric_memory`` (NVLink peer memory); world size 1 uses a plain allocation.
* ``cpu``: one process per rank, a gloo group. Each rank creates a POSIX shm file, every rank maps every peer's
  file, then each rank unlinks its own file at once (the mappings stay valid). A rank killed (SIGKILL) inside that
  window leaves its file behind; ``megamoe.launch`` removes it, and without ``launch`` (torchrun) the next cpu
  SymmBuffer made on the machine sweeps it (:func:`sweep_stale_shm`).
  Kernels run under Triton's interpreter directly on those host mappings.
* ``local``: N ranks in one process on one device (:meth:`SymmBuffer.local`), driven in lock-step.

``buffer_ptrs`` (int64 ``[R]``, on the kernel device) holds each rank's buffer base *as seen from this process*;
kernels translate addresses with ``megamoe.kernels.symm.sym_map``.

Before allocating, the ranks of a group exchange their layouts' fingerprints (``Layout.fingerprint``): ranks that
disagree on T, E, H, I, top-k or block_m all raise a ValueError naming the field and every rank's value.
"""
from __future__ import annotations

import fcntl
import glob
import math
import mmap
import os
import time
import uuid

import torch
import torch.distributed as dist

from megamoe.env import cuda_available, kernel_device, resolve_backend
from megamoe.launch import pid_alive as _pid_alive
from megamoe.layout import MIN_BLOCK_M, Layout

#: The views DeepGEMM's SymmBuffer exposes as attributes.
VIEW_NAMES = ("x", "x_sf", "topk_idx", "topk_weights", "l1_acts", "l1_acts_sf", "l2_acts", "l2_acts_sf")
SHM_DIR = "/dev/shm"
SHM_PREFIX = "megamoe-"
#: A leftover shm file is swept only if it is at least this old (its creator holds a lock on it from a moment after
#: creating it until it unlinks it; the age covers that moment, see :func:`sweep_stale_shm`).
STALE_SHM_MIN_AGE_S = 5.0
BACKENDS = ("cuda", "cpu", "local")


def shm_path(rank: int) -> str:
    """A fresh shm file name for ``rank``: ``/dev/shm/megamoe-<pid>-<uuid>-r<rank>`` (the pid lets a launcher
    sweep what a killed child left behind)."""
    return os.path.join(SHM_DIR, f"{SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:16]}-r{rank}")


def shm_files_of(pid: int) -> list[str]:
    """The shm files that process ``pid`` created and has not unlinked (see :func:`shm_path`)."""
    return glob.glob(os.path.join(SHM_DIR, f"{SHM_PREFIX}{int(pid)}-*"))


def _shm_creator_pid(path: str) -> int | None:
    """The creator pid in a :func:`shm_path` name, or None for a name of another form."""
    head = os.path.basename(path).removeprefix(SHM_PREFIX).split("-", 1)[0]
    return int(head) if head.isdigit() else None


def sweep_stale_shm(min_age_s: float = STALE_SHM_MIN_AGE_S) -> list[str]:
    """Remove the shm files that ranks killed while setting up a cpu SymmBuffer left behind; return their paths.

    A file ``SHM_DIR/SHM_PREFIX<pid>-…`` is removed only when all three hold:

    * its creator ``pid`` does not exist (a live process with that pid, even a reused one, keeps the file);
    * nobody holds the shared ``flock`` its creator keeps on it until unlinking it (locks die with their process,
      so this also protects a live creator that is invisible here, in another pid namespace sharing ``/dev/shm``);
    * it is at least ``min_age_s`` old (covers the moment between the creator's ``open`` and its ``flock``).

    Files of other users, or that vanish meanwhile, are skipped. Called by every cpu :class:`SymmBuffer` before it
    creates its own file, so a crashed torchrun job's leftovers go at the next start.
    """
    removed = []
    now = time.time()
    for path in glob.glob(os.path.join(SHM_DIR, f"{SHM_PREFIX}*")):
        pid = _shm_creator_pid(path)
        if pid is None or _pid_alive(pid):
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            if now - os.fstat(fd).st_mtime < min_age_s:
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: a live process holds the lock
            os.unlink(path)
            removed.append(path)
        except OSError:
            continue
        finally:
            os.close(fd)
    return removed


#: DeepGEMM's ``mma_type`` of each :data:`megamoe.layout.FORMATS` entry.
MMA_TYPES = {"fp8_fp4": "fp8xfp4", "fp8": "fp8xfp8"}


def _check_config(block_m, mma_type, activation, barrier_timeout_s, backend, format="fp8_fp4") -> None:
    """Arguments that :class:`Layout` does not check (it validates the shapes). ``mma_type`` None = the format's."""
    if isinstance(block_m, bool) or not isinstance(block_m, int):
        raise TypeError(f"block_m must be an int, got {type(block_m).__name__}")
    if block_m < MIN_BLOCK_M or block_m & (block_m - 1):
        raise ValueError(f"block_m={block_m} must be a power of two >= {MIN_BLOCK_M}")
    if format not in MMA_TYPES:
        raise ValueError(f"format={format!r} must be one of {tuple(MMA_TYPES)}")
    if mma_type is not None and mma_type != MMA_TYPES[format]:
        raise ValueError(f"mma_type={mma_type!r} does not match format={format!r} (which is "
                         f"{MMA_TYPES[format]!r}; mma_type may be left None)")
    if activation != "swiglu":
        raise ValueError(f"activation={activation!r} is not supported (only 'swiglu')")
    if isinstance(barrier_timeout_s, bool) or not isinstance(barrier_timeout_s, (int, float)):
        raise TypeError(f"barrier_timeout_s must be a number, got {type(barrier_timeout_s).__name__}")
    if not (math.isfinite(barrier_timeout_s) and barrier_timeout_s > 0):
        raise ValueError(f"barrier_timeout_s={barrier_timeout_s} must be a finite number > 0")
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} must be one of {BACKENDS} or None (auto)")


def _group_info(group) -> tuple[int, int, str]:
    """``(rank, world size, backend)`` of ``group``; no initialized process group means a single rank."""
    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise ValueError("group was given but torch.distributed is not initialized")
        return 0, 1, resolve_backend(local=False)
    group = group or dist.group.WORLD
    pg_backend = str(dist.get_backend(group)).lower()
    backend = "cuda" if "nccl" in pg_backend or (pg_backend != "gloo" and cuda_available()) else "cpu"
    return dist.get_rank(group), dist.get_world_size(group), backend


class _View:
    """Descriptor: the typed view of the segment it is named after (cached per buffer, dropped by ``destroy()``)."""

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, sb, owner=None):
        if sb is None:
            return self
        return sb.view(self.name)


def _warm_up(sb) -> None:
    """:func:`megamoe.kernels.symm.warm_up` (imported here: the kernels need the interpreter chosen first)."""
    from megamoe.kernels.symm import warm_up

    warm_up(sb)


class SymmBuffer:
    """One rank's symmetric buffer of :class:`~megamoe.layout.Layout` (DeepGEMM's ``SymmBuffer``).

    Args:
        group: the expert-parallel process group (None: the default group, or a single rank when torch.distributed
            is not initialized). Its size is the number of ranks R.
        num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden, block_m: see ``Layout``.
        backend: "cuda", "cpu" or None (auto: "cuda" for an NCCL group / a CUDA machine, "cpu" for gloo).
        barrier_timeout_s: how long a barrier waits for a missing rank before failing.
        format: ``"fp8_fp4"`` (default; ``fp8_fp4_mega_moe``) or ``"fp8"`` (DeepGEMM SM90's ``fp8_mega_moe``: float32
            activation scales per 128 columns); it is part of the layout and of its fingerprint.
        mma_type: DeepGEMM's name for the format, None (default) = the format's: "fp8xfp4" or "fp8xfp8".
        activation: only "swiglu".

    Attributes: ``layout``, ``rank``, ``num_ranks``, ``group``, ``backend``, ``device``, ``buffer`` (u8
    ``[layout.num_bytes]``, zeroed), ``buffer_ptrs`` (int64 ``[R]`` on ``device``), ``barrier_timeout_s`` and the
    views ``x, x_sf, topk_idx, topk_weights, l1_acts, l1_acts_sf, l2_acts, l2_acts_sf``.
    """

    x = _View()
    x_sf = _View()
    topk_idx = _View()
    topk_weights = _View()
    l1_acts = _View()
    l1_acts_sf = _View()
    l2_acts = _View()
    l2_acts_sf = _View()

    def __init__(self, group, num_experts: int, num_max_tokens_per_rank: int, num_topk: int, hidden: int,
                 intermediate_hidden: int, *, block_m: int = 128, backend: str | None = None,
                 barrier_timeout_s: float = 30.0, mma_type: str | None = None, activation: str = "swiglu",
                 format: str = "fp8_fp4"):
        _check_config(block_m, mma_type, activation, barrier_timeout_s, backend, format)
        if backend == "local":
            raise ValueError("backend='local' runs every rank in one process: use SymmBuffer.local(num_ranks, ...)")
        rank, world, auto = _group_info(group)
        layout = Layout(world, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden, block_m,
                        format)
        self._init_fields(layout, rank, group, backend or auto, barrier_timeout_s)
        if world > 1:
            _check_same_layout(layout, rank, group)
        if self.backend == "cpu":
            sweep_stale_shm()
        if self.backend == "cuda":
            self._alloc_cuda()
            _warm_up(self)
        elif world == 1:
            self._adopt(torch.zeros(layout.num_bytes, dtype=torch.uint8), [])
        else:
            self._alloc_cpu_shm()

    @classmethod
    def local(cls, num_ranks: int, num_experts: int, num_max_tokens_per_rank: int, num_topk: int, hidden: int,
              intermediate_hidden: int, *, block_m: int = 128, device=None, barrier_timeout_s: float = 30.0,
              mma_type: str | None = None, activation: str = "swiglu",
              format: str = "fp8_fp4") -> list["SymmBuffer"]:
        """``num_ranks`` buffers in this process on one device (default: the kernel device), rank = list index.

        Every rank's ``buffer_ptrs`` holds the same addresses; drive the ranks in lock-step (e.g. arrive for all,
        then wait for all: ``megamoe.kernels.symm.barrier_lockstep``).
        """
        _check_config(block_m, mma_type, activation, barrier_timeout_s, None, format)
        layout = Layout(num_ranks, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden,
                        block_m, format)
        device = torch.device(device) if device is not None else kernel_device()
        buffers = [torch.zeros(layout.num_bytes, dtype=torch.uint8, device=device) for _ in range(num_ranks)]
        ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64, device=device)
        sbs = []
        for rank, buf in enumerate(buffers):
            sb = cls.__new__(cls)
            sb._init_fields(layout, rank, None, "local", barrier_timeout_s)
            sb._adopt(buf, [])
            sb.buffer_ptrs = ptrs
            sb._peers = buffers
            sbs.append(sb)
        for sb in sbs:
            _warm_up(sb)
        return sbs

    # ------------------------------------------------------------------ set-up
    def _init_fields(self, layout: Layout, rank: int, group, backend: str, barrier_timeout_s: float) -> None:
        self.layout = layout
        self.rank = rank
        self.num_ranks = layout.num_ranks
        self.group = group
        self.backend = backend
        self.barrier_timeout_s = float(barrier_timeout_s)
        self._handle = None
        self._maps: list[mmap.mmap] = []
        self._views: dict[str, torch.Tensor] | None = None
        self._host_caches: dict[str, dict] = {}

    def _adopt(self, buffer: torch.Tensor, peers: list[torch.Tensor]) -> None:
        """Install ``buffer`` (this rank's bytes) and ``peers`` (every rank's bytes as seen here, [] = [buffer])."""
        self.buffer = buffer
        self.device = buffer.device
        self._peers = peers or [buffer]
        self.buffer_ptrs = torch.tensor([p.data_ptr() for p in self._peers], dtype=torch.int64, device=self.device)
        self._views = {}

    def _alloc_cuda(self) -> None:
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        device = torch.device("cuda", torch.cuda.current_device())
        n = self.layout.num_bytes
        if self.num_ranks == 1:
            self._adopt(torch.zeros(n, dtype=torch.uint8, device=device), [])
            return
        import torch.distributed._symmetric_memory as symm_mem

        buffer = symm_mem.empty(n, dtype=torch.uint8, device=device)
        self._handle = symm_mem.rendezvous(buffer, self.group or dist.group.WORLD)
        peers = [self._handle.get_buffer(r, (n,), torch.uint8) for r in range(self.num_ranks)]
        buffer.zero_()
        self._adopt(buffer, peers)
        self.buffer_ptrs = torch.tensor(list(self._handle.buffer_ptrs), dtype=torch.int64, device=device)
        if self._handle.buffer_ptrs[self.rank] != buffer.data_ptr():
            raise RuntimeError("symmetric memory handle's buffer_ptrs[rank] is not the buffer's address")
        dist.barrier(group=self.group)
        torch.cuda.synchronize(device)

    def _alloc_cpu_shm(self) -> None:
        """Create, exchange and map the shm files; this rank's file is unlinked before returning (or on error).

        While the file is linked this rank holds a shared ``flock`` on it, which tells :func:`sweep_stale_shm` on
        another rank or job that its creator is alive (the lock dies with the process, e.g. on SIGKILL). A peer's
        file that is gone when this rank maps it means that peer failed: that raises :class:`PeerFailure`."""
        from megamoe.launch import PeerFailure

        n = self.layout.num_bytes
        path = shm_path(self.rank)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            os.ftruncate(fd, n)
            own = mmap.mmap(fd, n)
            self._maps.append(own)
            paths = [None] * self.num_ranks
            dist.all_gather_object(paths, path, group=self.group)
            peers = []
            for r, p in enumerate(paths):
                try:
                    m = own if r == self.rank else _map_file(p, n)
                except FileNotFoundError as e:
                    raise PeerFailure(f"rank {self.rank}: rank {r}'s shm file {p} was removed before this rank mapped "
                                      f"it: rank {r} failed during SymmBuffer set-up") from e
                if m is not own:
                    self._maps.append(m)
                peers.append(torch.frombuffer(m, dtype=torch.uint8))
            dist.barrier(group=self.group)
        finally:
            os.unlink(path)
            os.close(fd)  # the lock lasts while the file is referenced (by the mapping): it is unlinked by now
        self._adopt(peers[self.rank], peers)

    # ------------------------------------------------------------------ access
    def view(self, name: str) -> torch.Tensor:
        """Typed view of segment ``name`` of this rank's buffer (see ``layout.table()``)."""
        if self._views is None:
            raise RuntimeError("this SymmBuffer was destroyed")
        if name not in self._views:
            self._views[name] = self.layout.view(self.buffer, name)
        return self._views[name]

    def peer_view(self, rank: int, name: str) -> torch.Tensor:
        """Typed view of segment ``name`` in ``rank``'s buffer, as mapped into this process (host-side access,
        for tests and debugging; kernels use ``buffer_ptrs``)."""
        if self._views is None:
            raise RuntimeError("this SymmBuffer was destroyed")
        return self.layout.view(self._peers[rank], name)

    def host_cache(self, name: str) -> dict:
        """The dict ``name`` of host objects made from this buffer (``megamoe.fused``: TMA descriptors, launch
        keywords, argument and tile tables), kept while the buffer lives and emptied by :meth:`destroy`, so that
        none of them keeps the buffer's memory -- or a caller's weights, which descriptors view -- alive after it."""
        return self._host_caches.setdefault(name, {})

    # ------------------------------------------------------------------ teardown
    def destroy(self) -> None:
        """Drop the views and the host caches and release the memory (idempotent). A mapping still exported by a
        tensor the caller holds is released when that tensor dies."""
        if self._views is None:
            return
        self._views = None
        for cache in self._host_caches.values():
            cache.clear()
        self._host_caches = {}
        self.buffer = self.buffer_ptrs = None
        self._peers = []
        self._handle = None
        for m in self._maps:
            try:
                m.close()
            except BufferError:
                pass
        self._maps = []

    def __enter__(self) -> "SymmBuffer":
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    def __repr__(self) -> str:
        state = "destroyed" if self._views is None else f"{self.layout.num_bytes:,} bytes on {self.device}"
        return f"SymmBuffer(rank={self.rank}/{self.num_ranks}, backend={self.backend!r}, {state})"

    # ------------------------------------------------------------------ recovery
    #: Why the last ``fp8_fp4_mega_moe`` call on this buffer did not complete (set by ``megamoe.ops``), else None.
    #: While set, calls refuse to run until :meth:`reset`.
    fault: str | None = None

    def reset(self) -> None:
        """Collective: bring the workspace of every rank back to its initial state after a call that did not
        complete (an exception, a KeyboardInterrupt, a ``BarrierTimeout``). Call it on **every** rank of the group.

        Host barrier over the group (no rank still writes into a peer), zero this rank's whole workspace
        (counters, barrier epochs/signals/state, heartbeats, call state: ``megamoe.kernels.symm.reset_workspace``),
        host barrier again (no rank starts a call before every workspace is zero), and clear :attr:`fault`. With the
        ``local`` backend there is no concurrency: call it for every rank of the group, in any order, between
        calls. Inputs, pools and the combine buffer are left alone (each call overwrites what it reads). Every rank
        must be alive: with a dead peer, rebuild the group instead.
        """
        from megamoe.kernels.symm import reset_workspace

        if self._views is None:
            raise RuntimeError("this SymmBuffer was destroyed")
        collective = self.backend != "local" and self.num_ranks > 1
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if collective:
            dist.barrier(group=self.group)
        reset_workspace(self)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if collective:
            dist.barrier(group=self.group)
        self.fault = None


def _check_same_layout(layout: Layout, rank: int, group) -> None:
    """Exchange ``layout.fingerprint()`` over ``group`` (one ``all_gather_object``, gloo or NCCL) before anything is
    allocated; raise the same ValueError on every rank when the ranks disagree, naming each differing field and
    every rank's value."""
    mine = layout.fingerprint()
    fingerprints: list = [None] * layout.num_ranks
    dist.all_gather_object(fingerprints, mine, group=group)
    differing = [k for k in mine if len({fp[k] for fp in fingerprints}) > 1]
    if differing:
        details = "; ".join(f"{k}: " + ", ".join(f"rank {r}={fp[k]}" for r, fp in enumerate(fingerprints))
                            for k in differing if k != "num_bytes" or len(differing) == 1)
        raise ValueError(f"rank {rank}: the ranks' SymmBuffer layouts differ (every rank must pass the same "
                         f"arguments): {details}")


def _map_file(path: str, num_bytes: int) -> mmap.mmap:
    """Map an existing shm file of ``num_bytes`` read-write."""
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, num_bytes)
    finally:
        os.close(fd)


def get_symm_buffer_for_mega_moe(group, num_experts: int, num_max_tokens_per_rank: int, num_topk: int, hidden: int,
                                 intermediate_hidden: int, *, block_m: int = 128, backend: str | None = None,
                                 barrier_timeout_s: float = 30.0, mma_type: str | None = None,
                                 activation: str = "swiglu", format: str = "fp8_fp4") -> SymmBuffer:
    """DeepGEMM's factory name for :class:`SymmBuffer` (same arguments; ``format="fp8"`` or
    ``mma_type="fp8xfp8"`` gives the buffer of DeepGEMM SM90's ``fp8_mega_moe``)."""
    if mma_type is not None and format == "fp8_fp4":
        format = {v: k for k, v in MMA_TYPES.items()}.get(mma_type, format)
    return SymmBuffer(group, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden,
                      block_m=block_m, backend=backend, barrier_timeout_s=barrier_timeout_s, mma_type=mma_type,
                      activation=activation, format=format)
