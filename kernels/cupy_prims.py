"""The seed's CUDA primitives (``cuda/*.cuh``, entry points in ``cuda/cupy_kernels.cu``) compiled at run time with CuPy,
and thin launchers for them.

Three kernels, all addressing symmetric buffers through a rendezvous table ``buffer_ptrs`` (one device address per
rank, in this process's address space -- ``handle.buffer_ptrs`` of ``torch.distributed._symmetric_memory``, or
several allocations on one GPU to emulate ranks in a test):

* ``pull_rows``: rank ``rank`` copies ``num_rows`` contiguous rows of ``row_bytes`` from byte ``src_offset`` of rank
  ``src_rank``'s buffer to byte ``dst_offset`` of its own buffer: 1-D bulk load (peer HBM -> smem, completing on an
  mbarrier), then 1-D bulk store (smem -> local HBM). Each CTA keeps ``num_stages - 1`` loads in flight.
* ``push_rows``: the mirror: local rows -> smem -> ``dst_rank``'s buffer.
* ``barrier``: one CTA; the epoch barrier of ``barrier.cuh`` on the ``barrier_signal`` / ``barrier_state`` words
  (byte offsets ``Layout.offset("barrier_signal")`` and ``Layout.offset("barrier_state")``).

Everything here is GPU-only. Importing the module needs neither CuPy nor CUDA; calling a launcher without them
raises ``RuntimeError``. Launchers are asynchronous on the given (default: torch's current) stream.

Alignment: offsets, ``row_bytes`` and ``chunk_bytes`` must be multiples of 16 bytes (the bulk-copy granularity).
"""
from __future__ import annotations

import functools
import hashlib
import statistics
from collections.abc import Sequence
from pathlib import Path

#: Directory of the ``.cuh`` headers (passed to the compiler with ``-I``).
CUDA_DIR = Path(__file__).resolve().parent / "cuda"
HEADERS = ("sym_buffer.cuh", "tma_pull.cuh", "barrier.cuh")
#: Bulk copies move multiples of 16 bytes between 16-byte-aligned addresses.
BULK_ALIGNMENT = 16
#: Shared-memory slots (mbarriers) per CTA in the copy kernels; must match kMaxStages below.
MAX_STAGES = 8
#: Largest dynamic shared memory we ask for per CTA (sm_90 allows 227 KiB; the static part is < 1 KiB).
MAX_DYNAMIC_SMEM = 200 * 1024
#: Rows are moved in chunks of at most this many bytes unless ``chunk_bytes`` says otherwise.
DEFAULT_CHUNK_BYTES = 8192
#: CTAs per SM launched by default for the copy kernels (each is one warp, one issuing lane).
DEFAULT_CTAS_PER_SM = 4

COMPILE_OPTIONS = ("-std=c++17", "-arch=sm_90a", f"-I{CUDA_DIR}")

#: The translation unit compiled by :func:`get_module` (``extern "C"`` kernels over the headers).
SOURCE = "cupy_kernels.cu"


KERNEL_NAMES = ("pull_rows", "push_rows", "rank_barrier_kernel")


def kernel_source() -> str:
    """The CUDA C++ translation unit compiled by :func:`get_module`: ``cuda/cupy_kernels.cu`` (it ``#include``\\ s
    the headers).

    A hash of the headers is appended so that CuPy's on-disk cache (keyed on this text) sees header edits.
    """
    digest = hashlib.sha1(b"".join((CUDA_DIR / h).read_bytes() for h in HEADERS)).hexdigest()
    return (CUDA_DIR / SOURCE).read_text() + f"\n// headers sha1 {digest}\n"


def _cupy():
    try:
        import cupy
    except ImportError as e:
        raise RuntimeError("megamoe.kernels.cupy_prims needs CuPy (pip install cupy-cuda13x, or "
                           "`pip install -e '.[gpu]'`) and a CUDA GPU (sm_90)") from e
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # no driver / no device
        raise RuntimeError(f"megamoe.kernels.cupy_prims needs a CUDA GPU: {e}") from e
    if count == 0:
        raise RuntimeError("megamoe.kernels.cupy_prims needs a CUDA GPU: none found")
    return cupy


def _require_gpu():
    """CuPy, after checking that both CuPy and torch see a CUDA device (RuntimeError otherwise)."""
    import torch

    cupy = _cupy()
    if not torch.cuda.is_available():
        raise RuntimeError("megamoe.kernels.cupy_prims needs a CUDA build of torch: torch.cuda is unavailable")
    return cupy


@functools.lru_cache(maxsize=None)
def get_module():
    """The compiled ``cupy.RawModule`` (NVRTC, ``-arch=sm_90a``), built once per process."""
    cupy = _cupy()
    return cupy.RawModule(code=kernel_source(), options=COMPILE_OPTIONS)


@functools.lru_cache(maxsize=None)
def _kernel(name: str):
    """One of :data:`KERNEL_NAMES` as a ``cupy.RawKernel``."""
    return get_module().get_function(name)


@functools.lru_cache(maxsize=64)
def _ptr_table(ptrs: tuple[int, ...], device: int):
    """Device copy (int64[R]) of a rendezvous table, cached by value.

    The copy runs on CuPy's current stream, not the launch stream: synchronise once so that no kernel on another
    (non-blocking) stream can read the table before it has landed.
    """
    import numpy as np

    cupy = _cupy()
    with cupy.cuda.Device(device):
        table = cupy.asarray(np.asarray(ptrs, dtype=np.int64))
        cupy.cuda.runtime.deviceSynchronize()
    return table


def _as_ptrs(buffer_ptrs) -> tuple[int, ...]:
    """Normalise a rendezvous table: a sequence of ints or of byte tensors (their ``data_ptr()``)."""
    if hasattr(buffer_ptrs, "tolist"):  # a tensor of addresses
        buffer_ptrs = buffer_ptrs.tolist()
    ptrs = tuple(p.data_ptr() if hasattr(p, "data_ptr") else int(p) for p in buffer_ptrs)
    if not ptrs:
        raise ValueError("buffer_ptrs is empty")
    for r, p in enumerate(ptrs):
        if p % BULK_ALIGNMENT:
            raise ValueError(f"buffer_ptrs[{r}]={p:#x} is not {BULK_ALIGNMENT}-byte aligned")
    return ptrs


def _resolve_device(device) -> int:
    """CUDA device index of ``device`` (None, an int, a string or a torch.device; None = torch's current)."""
    import torch

    if device is None:
        return torch.cuda.current_device()
    d = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    return torch.cuda.current_device() if d.index is None else d.index


class _StreamHandle:
    """A raw ``cudaStream_t`` exposed through the CUDA stream protocol (``__cuda_stream__``)."""

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


def _external_stream(cupy, stream, device: int):
    """A CuPy stream for ``stream`` (a ``torch.cuda.Stream``, a raw ``cudaStream_t`` int, or None = torch's current).

    CuPy >= 15 wraps foreign streams with ``Stream.from_external``; CuPy 14 with ``ExternalStream``.
    """
    import torch

    if stream is None:
        stream = torch.cuda.current_stream(device)
    ptr = stream if isinstance(stream, int) else stream.cuda_stream
    if hasattr(cupy.cuda.Stream, "from_external"):
        return cupy.cuda.Stream.from_external(_StreamHandle(ptr))
    return cupy.cuda.ExternalStream(ptr, device)


def _check_rank(name: str, value: int, num_ranks: int) -> None:
    if not 0 <= value < num_ranks:
        raise ValueError(f"{name}={value} out of range for {num_ranks} ranks")


def _launch_copy(name: str, buffer_ptrs, rank: int, peer: int, src_offset: int, dst_offset: int, num_rows: int,
                 row_bytes: int, chunk_bytes: int | None, num_stages: int, num_ctas: int | None, stream,
                 device) -> None:
    import numpy as np
    import torch

    ptrs = _as_ptrs(buffer_ptrs)
    _check_rank("rank", rank, len(ptrs))
    _check_rank("peer rank", peer, len(ptrs))
    chunk_bytes = min(row_bytes, DEFAULT_CHUNK_BYTES) if chunk_bytes is None else chunk_bytes
    for label, v in (("src_offset", src_offset), ("dst_offset", dst_offset), ("row_bytes", row_bytes),
                     ("chunk_bytes", chunk_bytes)):
        if v < 0 or v % BULK_ALIGNMENT:
            raise ValueError(f"{label}={v} must be a non-negative multiple of {BULK_ALIGNMENT}")
    if row_bytes == 0 or chunk_bytes == 0:
        raise ValueError("row_bytes and chunk_bytes must be positive")
    if not 2 <= num_stages <= MAX_STAGES:
        raise ValueError(f"num_stages={num_stages} must be in [2, {MAX_STAGES}]")
    smem = num_stages * chunk_bytes
    if smem > MAX_DYNAMIC_SMEM:
        raise ValueError(f"num_stages*chunk_bytes={smem} exceeds {MAX_DYNAMIC_SMEM} bytes of shared memory")
    if num_rows <= 0:
        return
    num_items = num_rows * -(-row_bytes // chunk_bytes)
    if num_items >= 2**31 or row_bytes >= 2**31:
        raise ValueError(f"num_rows * ceil(row_bytes / chunk_bytes) = {num_items} chunks must be < 2**31")
    cupy = _require_gpu()
    dev = _resolve_device(device)
    if num_ctas is None:
        num_ctas = DEFAULT_CTAS_PER_SM * torch.cuda.get_device_properties(dev).multi_processor_count
    grid = max(1, min(num_ctas, num_items))
    with cupy.cuda.Device(dev):
        kernel = _kernel(name)
        if smem > 48 * 1024 and kernel.max_dynamic_shared_size_bytes < smem:
            kernel.max_dynamic_shared_size_bytes = smem
        kernel((grid,), (32,),
               (_ptr_table(ptrs, dev), np.uint32(len(ptrs)), np.uint32(rank), np.uint32(peer),
                np.uint64(src_offset), np.uint64(dst_offset), np.uint32(num_rows), np.uint32(row_bytes),
                np.uint32(chunk_bytes), np.uint32(num_stages)),
               shared_mem=smem, stream=_external_stream(cupy, stream, dev))


def pull_rows(buffer_ptrs: Sequence, rank: int, src_rank: int, src_offset: int, dst_offset: int, num_rows: int,
              row_bytes: int, *, chunk_bytes: int | None = None, num_stages: int = 4, num_ctas: int | None = None,
              stream=None, device=None) -> None:
    """Rank ``rank`` pulls rows from rank ``src_rank`` (1-D bulk load through ``SymBuffer::map``, then bulk store).

    Copies bytes ``[src_offset, src_offset + num_rows*row_bytes)`` of ``src_rank``'s buffer to
    ``[dst_offset, ...)`` of ``rank``'s buffer, row by row.

    Args:
        buffer_ptrs: rendezvous table, R device addresses (ints, or 1-D byte tensors whose ``data_ptr()`` is used).
        rank, src_rank: indices into ``buffer_ptrs`` (``src_rank == rank`` copies locally).
        src_offset, dst_offset: byte offsets into the buffers, multiples of 16.
        num_rows: rows to copy (< 2**32). row_bytes: bytes per row, a multiple of 16.
        chunk_bytes: bytes per bulk copy (multiple of 16); rows longer than this are split. Default
            ``min(row_bytes, 8192)``.
        num_stages: shared-memory slots per CTA (2..8); ``num_stages - 1`` loads are kept in flight.
        num_ctas: grid size (one warp each); default 4 per SM, capped by the number of chunks.
        stream: ``torch.cuda.Stream`` or raw ``cudaStream_t``; default torch's current stream. Asynchronous.
        device: CUDA device of the launch; default torch's current device.
    """
    _launch_copy("pull_rows", buffer_ptrs, rank, src_rank, src_offset, dst_offset, num_rows, row_bytes,
                 chunk_bytes, num_stages, num_ctas, stream, device)


def push_rows(buffer_ptrs: Sequence, rank: int, dst_rank: int, src_offset: int, dst_offset: int, num_rows: int,
              row_bytes: int, *, chunk_bytes: int | None = None, num_stages: int = 4, num_ctas: int | None = None,
              stream=None, device=None) -> None:
    """Rank ``rank`` pushes rows to rank ``dst_rank``: the mirror of :func:`pull_rows`.

    Copies bytes ``[src_offset, src_offset + num_rows*row_bytes)`` of ``rank``'s own buffer to
    ``[dst_offset, ...)`` of ``dst_rank``'s buffer. Arguments as in :func:`pull_rows`.
    """
    _launch_copy("push_rows", buffer_ptrs, rank, dst_rank, src_offset, dst_offset, num_rows, row_bytes,
                 chunk_bytes, num_stages, num_ctas, stream, device)


def barrier(buffer_ptrs: Sequence, rank: int, signal_offset: int, state_offset: int, *, tag: int = 1,
            timeout_s: float = 10.0, stream=None, device=None) -> None:
    """Launch one cross-rank barrier for rank ``rank`` (one CTA, asynchronous).

    Each rank launches it (in the same order of barriers); it returns once every rank has entered the same
    barrier epoch, or after ``timeout_s``. On a timeout the kernel stores ``tag`` and the missing rank into
    ``state[1]``, ``state[2]`` (i32 words at ``state_offset`` of rank ``rank``'s buffer) and returns; the host reads
    them after synchronising and must zero them to clear the failure. ``state[0]`` is the epoch reached.

    Args:
        buffer_ptrs: rendezvous table (R <= 96 entries here; the layout allows 72).
        signal_offset: byte offset of ``barrier_signal`` (i32[R]) -- ``Layout.offset("barrier_signal")``.
        state_offset: byte offset of ``barrier_state`` (i32[4]) -- ``Layout.offset("barrier_state")``.
        tag: non-zero label recorded on timeout (DeepGEMM uses 1 before dispatch, 2 before combine, 3 after
            cleanup).
    """
    import numpy as np

    ptrs = _as_ptrs(buffer_ptrs)
    _check_rank("rank", rank, len(ptrs))
    if len(ptrs) > 96:
        raise ValueError(f"at most 96 ranks per barrier CTA, got {len(ptrs)}")
    if tag == 0 or not -2**31 <= tag < 2**31:
        raise ValueError(f"tag={tag} must be a non-zero int32")
    for label, v in (("signal_offset", signal_offset), ("state_offset", state_offset)):
        if v < 0 or v % 4:
            raise ValueError(f"{label}={v} must be a non-negative multiple of 4")
    cupy = _require_gpu()
    dev = _resolve_device(device)
    threads = 32 * -(-len(ptrs) // 32)
    with cupy.cuda.Device(dev):
        _kernel("rank_barrier_kernel")(
            (1,), (threads,),
            (_ptr_table(ptrs, dev), np.uint32(len(ptrs)), np.uint32(rank), np.uint64(signal_offset),
             np.uint64(state_offset), np.int32(tag), np.uint64(int(timeout_s * 1e9))),
            stream=_external_stream(cupy, stream, dev))


def bench_pull(row_bytes: Sequence[int] = (256, 512, 1024, 2048, 4096, 7168, 8192, 16384, 65536), *,
               total_bytes: int = 256 << 20, op: str = "pull", num_stages: int = 4, chunk_bytes: int | None = None,
               num_ctas: int | None = None, iters: int = 20, warmup: int = 3, repeats: int = 5,
               buffer_ptrs: Sequence | None = None, rank: int = 0, peer: int = 1, src_offset: int = 0,
               dst_offset: int | None = None) -> dict:
    """Bandwidth of :func:`pull_rows` (or :func:`push_rows` with ``op="push"``) for a sweep of row sizes.

    For each row size, ``total_bytes // row_bytes`` rows are copied ``iters`` times back to back between two CUDA
    events (after ``warmup`` launches); the median over ``repeats`` such timings is reported.

    Without ``buffer_ptrs`` two byte buffers of ``2 * total_bytes`` are allocated on the current GPU and play rank 0
    and rank 1 (source region at byte 0, destination at ``total_bytes``): the copy then measures HBM -> smem -> HBM
    on one GPU, not NVLink. With a real rendezvous table the caller provides offsets of regions of at least
    ``total_bytes`` in every buffer, and the numbers are this rank's pull bandwidth over NVLink.

    Returns ``{"kind": "pull_bandwidth", "provenance", "config", "rows"}``; each row has ``op``, ``row_bytes``,
    ``num_rows``, ``bytes`` (payload of one copy), ``us`` (one copy) and ``gb_s`` (payload bytes / s / 1e9; the
    memory system moves twice that: read + write).
    """
    import torch

    from megamoe.env import provenance

    if op not in ("pull", "push"):
        raise ValueError(f"op must be 'pull' or 'push', got {op!r}")
    _require_gpu()
    launch = pull_rows if op == "pull" else push_rows
    keep_alive = None
    emulated = buffer_ptrs is None
    if emulated:
        keep_alive = [torch.zeros(2 * total_bytes, dtype=torch.uint8, device="cuda") for _ in range(2)]
        buffer_ptrs = [b.data_ptr() for b in keep_alive]
    dst_offset = total_bytes if dst_offset is None else dst_offset

    rows = []
    for rb in row_bytes:
        num_rows = total_bytes // rb

        def copy():
            launch(buffer_ptrs, rank, peer, src_offset, dst_offset, num_rows, rb, chunk_bytes=chunk_bytes,
                   num_stages=num_stages, num_ctas=num_ctas)

        for _ in range(warmup):
            copy()
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                copy()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / iters)
        us = statistics.median(times)
        nbytes = num_rows * rb
        rows.append({"op": op, "row_bytes": rb, "num_rows": num_rows, "bytes": nbytes, "us": us,
                     "gb_s": nbytes / (us * 1e-6) / 1e9})
    del keep_alive
    config = {"op": op, "total_bytes": total_bytes, "num_stages": num_stages, "chunk_bytes": chunk_bytes,
              "num_ctas": num_ctas, "iters": iters, "repeats": repeats, "emulated_ranks": emulated}
    return {"kind": "pull_bandwidth", "provenance": provenance(f"megamoe.kernels.cupy_prims.bench_pull(op={op!r})"),
            "config": config, "rows": rows}
