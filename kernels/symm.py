"""Symmetric-memory device helpers: address translation, the cross-rank barrier and a row copy.

Every rank owns one byte buffer of identical :class:`~megamoe.layout.Layout`. ``buffer_ptrs`` (int64 ``[R]``) holds
each rank's buffer base address *as seen from this process*, so the same offset in rank ``r``'s buffer is
``ptr + buffer_ptrs[r] - buffer_ptrs[me]`` (DeepGEMM's ``SymBuffer::map``). On CUDA the addresses come from
``torch.distributed._symmetric_memory`` (peer memory over NVLink); on CPU each rank maps every peer's POSIX shm
segment and the kernels run under Triton's interpreter on those real host addresses.

The barrier (tags below follow DeepGEMM's ``kBeforeDispatchPullBarrierTag`` etc.) uses two workspace segments:

* ``barrier_signal`` i32[R]: slot ``r`` = the last epoch rank ``r`` signalled to this rank (written remotely);
* ``barrier_state`` i32[4]: ``[epoch, failed tag, missing rank, spare]``.

*Arrive* bumps this rank's epoch and writes it (``xchg``, release, system scope) into slot ``me`` of every rank.
*Wait* polls the local slots (acquire, system scope) until all reach the epoch. Epochs only grow, so nothing is ever
reset between barriers. A wait that runs out of time records ``[tag, lowest missing rank]`` in the state; every
later wait then returns at once, and :func:`check_barrier_state` raises :class:`BarrierTimeout`.

**Timeouts mean "no progress", not "slow".** A third segment, ``progress`` i32[R], holds per-rank heartbeats: rank
``r`` bumps its count with :func:`heartbeat` (between the steps of a call, and on the interpreter also from a
:class:`ProgressBeacon` thread while a long step executes) and writes it into slot ``r`` of every rank. A wait
restarts its clock for a missing rank whenever that rank's heartbeat moves, so it fails only when some missing
rank neither arrived nor showed progress for ``barrier_timeout_s``. A dead or stuck rank is still named after one
timeout. The GPU wait does the same inside its single ``%globaltimer``-bounded launch (one deadline, restarted by
any missing rank's heartbeat).

:func:`reset_workspace` zeroes a rank's whole workspace (counters, epochs, signals, state, heartbeats): the host
side of the collective ``SymmBuffer.reset()``.

Arrive and wait are separate launches so that the ``local`` backend (all ranks in one process, one device) can run
them in lock-step: arrive for every rank, then wait for every rank.
"""
from __future__ import annotations

import sys
import threading
import time
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from megamoe.env import interpreting

TAG_BEFORE_DISPATCH_PULL = 1
TAG_BEFORE_COMBINE_REDUCE = 2
TAG_AFTER_WORKSPACE_CLEAN = 3
#: Recorded in ``barrier_state[1]`` by the fused kernel when one of its intra-rank waits times out (a bug).
TAG_FUSED_INTERNAL_WAIT = 9
#: Likewise by a Gluon GEMM phase (``megamoe.kernels.gemm_fp8_ws`` / ``gemm_fp4_ws``), the launch after the front: a
#: GEMM phase that finds it already recorded (by one of its own programs) still runs its tiles, where one that finds
#: any other failure (the front's) runs none.
TAG_GEMM_PHASE_WAIT = 10

#: Polls per wait launch under the interpreter; the host re-launches (after a short sleep) until the deadline.
INTERPRETER_POLLS_PER_LAUNCH = 16
INTERPRETER_SLEEP_S = 1e-3
#: How often a :class:`ProgressBeacon` looks at its thread (at most; also at most a quarter of the timeout).
BEACON_INTERVAL_S = 0.1
#: CPU time the watched thread must have spent since the last look to count as moving (a thread blocked in a sleep,
#: a lock or a wait spends none; one running the interpreter or Python spends nearly the whole interval).
BEACON_MIN_CPU_S = 1e-3


# ---------------------------------------------------------------------------------------------------- device code
@triton.jit
def sym_map(ptr, buffer_ptrs, rank, dst_rank):
    """``ptr`` (any pointer type, scalar or block) moved to the same byte offset in ``dst_rank``'s buffer.

    ``buffer_ptrs``: int64 ``[R]`` base addresses as seen from this process; ``rank``: this rank;
    ``dst_rank``: scalar or a block broadcastable against ``ptr``.
    """
    # Buffers start 16-byte aligned on every backend (allocator / page boundaries): saying so keeps Triton's
    # 16-byte vector accesses through the mapped pointer (an unknown delta would make them byte-wise).
    delta = (tl.load(buffer_ptrs + dst_rank) - tl.load(buffer_ptrs + rank)) // 16 * 16  # exact: a multiple
    return (ptr.to(tl.pointer_type(tl.uint8)) + delta).to(ptr.dtype)


@triton.jit
def _globaltimer_ns():
    """The GPU's global nanosecond timer (PTX ``%globaltimer``); not available under the interpreter."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def barrier_arrive_kernel(signal_ptr, state_ptr, buffer_ptrs, rank, num_ranks, BLOCK_R: tl.constexpr):
    """One program: ``state[0] += 1`` and write the new epoch into ``signal[rank]`` of every rank (release, sys).

    ``signal_ptr``: this rank's ``barrier_signal`` (i32 ``[R]``); ``state_ptr``: its ``barrier_state`` (i32 ``[4]``).
    """
    epoch = tl.load(state_ptr) + 1
    tl.store(state_ptr, epoch)
    peers = tl.arange(0, BLOCK_R)
    valid = peers < num_ranks
    remote = sym_map(signal_ptr + rank, buffer_ptrs, rank, tl.where(valid, peers, rank))  # no read past [R]
    tl.atomic_xchg(remote, tl.full([BLOCK_R], 0, tl.int32) + epoch, mask=valid, sem="release", scope="sys")


@triton.jit
def barrier_wait_kernel(signal_ptr, state_ptr, progress_ptr, num_ranks, fail_tag, max_polls, timeout_ns,
                        BLOCK_R: tl.constexpr, USE_GLOBALTIMER: tl.constexpr):
    """One program: poll ``signal[r] >= state[0]`` for every rank ``r`` (acquire, sys), bounded.

    The bound is ``timeout_ns`` of ``%globaltimer`` without progress when ``USE_GLOBALTIMER`` (GPU): the deadline
    restarts whenever the heartbeat ``progress[r]`` (i32 ``[R]``, written remotely) of a rank still missing changes.
    (One deadline for all missing ranks: while one of them beats, a stuck one is named only after the beating one
    arrived plus one timeout.) Else (interpreter) the bound is ``max_polls`` polls and ``progress_ptr`` is unused:
    the host loop watches the heartbeats, per rank. Unless an earlier barrier failed (``state[1] != 0``, then
    nothing is touched), ``state[2]`` is set to the lowest rank still missing, or -1 when complete; on expiry a
    non-zero ``fail_tag`` is recorded in ``state[1]`` (the interpreter's host loop passes 0 and records the failure
    itself).
    """
    epoch = tl.load(state_ptr)
    failed = tl.load(state_ptr + 1)
    peers = tl.arange(0, BLOCK_R)
    valid = peers < num_ranks
    seen = tl.atomic_add(signal_ptr + peers, 0, mask=valid, sem="acquire", scope="sys")
    missing = tl.sum((valid & (seen < epoch)).to(tl.int32))
    polls = 1
    in_time = failed == 0
    if USE_GLOBALTIMER:
        beat = tl.atomic_add(progress_ptr + peers, 0, mask=valid, sem="relaxed", scope="sys")
        deadline = _globaltimer_ns() + timeout_ns
    while (missing > 0) & in_time:
        seen = tl.atomic_add(signal_ptr + peers, 0, mask=valid, sem="acquire", scope="sys")
        waiting_on = valid & (seen < epoch)
        missing = tl.sum(waiting_on.to(tl.int32))
        polls += 1
        if USE_GLOBALTIMER:
            beat_now = tl.atomic_add(progress_ptr + peers, 0, mask=valid, sem="relaxed", scope="sys")
            moved = tl.sum((waiting_on & (beat_now != beat)).to(tl.int32)) > 0
            beat = beat_now
            now = _globaltimer_ns()
            deadline = tl.where(moved, now + timeout_ns, deadline)
            in_time = now <= deadline
        else:
            in_time = polls < max_polls
    if failed == 0:
        lowest = tl.min(tl.where(valid & (seen < epoch), peers, BLOCK_R))
        tl.store(state_ptr + 2, tl.where(missing > 0, lowest, -1))
        if (missing > 0) & (fail_tag != 0):
            tl.store(state_ptr + 1, fail_tag)


@triton.jit
def heartbeat_kernel(progress_ptr, buffer_ptrs, rank, num_ranks, BLOCK_R: tl.constexpr):
    """One program: ``progress[rank] += 1`` here and the new count into slot ``rank`` of every rank (xchg,
    release, sys). ``progress_ptr``: this rank's ``progress`` (i32 ``[R]``)."""
    beat = tl.load(progress_ptr + rank) + 1
    peers = tl.arange(0, BLOCK_R)
    valid = peers < num_ranks
    remote = sym_map(progress_ptr + rank, buffer_ptrs, rank, tl.where(valid, peers, rank))
    tl.atomic_xchg(remote, tl.full([BLOCK_R], 0, tl.int32) + beat, mask=valid, sem="release", scope="sys")


@triton.jit
def remote_copy_rows_kernel(buffer, buffer_ptrs, rank, src_rank, dst_rank, src_offset, dst_offset, src_rows,
                            dst_rows, row_words, BLOCK: tl.constexpr, WORD: tl.constexpr):
    """Copy rows between two ranks' buffers in ``WORD``-typed words; grid ``(num_rows, cdiv(row_words, BLOCK))``.

    Row ``src_rows[i]`` of the segment at word ``src_offset`` of ``src_rank``'s buffer goes to row ``dst_rows[i]``
    of the segment at word ``dst_offset`` of ``dst_rank``'s buffer; a row is ``row_words`` words. ``buffer``: this
    rank's buffer (u8); ``src_rows``/``dst_rows``: i32 ``[num_rows]``; ``WORD``: an integer type of 1, 2, 4 or 8
    bytes. Either rank may be remote (pull: ``src_rank`` remote; push: ``dst_rank`` remote).
    """
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < row_words
    words = buffer.to(tl.pointer_type(WORD))
    src_row = tl.load(src_rows + i).to(tl.int64)
    dst_row = tl.load(dst_rows + i).to(tl.int64)
    src = sym_map(words + src_offset + src_row * row_words + cols, buffer_ptrs, rank, src_rank)
    dst = sym_map(words + dst_offset + dst_row * row_words + cols, buffer_ptrs, rank, dst_rank)
    tl.store(dst, tl.load(src, mask=mask), mask=mask)


# ---------------------------------------------------------------------------------------------------- host side
class BarrierTimeout(RuntimeError):
    """A barrier's wait ran out of time; ``missing_rank`` is the lowest rank whose signal never arrived."""

    def __init__(self, rank: int, tag: int, missing_rank: int, timeout_s: float):
        if tag in (TAG_FUSED_INTERNAL_WAIT, TAG_GEMM_PHASE_WAIT):
            msg = (f"rank {rank}: an in-kernel wait of the fused kernel (grid sync, arrival count or mask) made no "
                   f"progress for {timeout_s} s -- a bug in the kernel, not a missing rank; call reset() to go on")
        else:
            msg = f"rank {rank}: barrier tag {tag} timed out after {timeout_s} s waiting for rank {missing_rank}"
        super().__init__(msg)
        self.rank, self.tag, self.missing_rank, self.timeout_s = rank, tag, missing_rank, timeout_s

    def __reduce__(self):
        return type(self), (self.rank, self.tag, self.missing_rank, self.timeout_s)


def _barrier_views(sb) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's ``barrier_signal`` (i32 [R]) and ``barrier_state`` (i32 [4]) views."""
    return sb.layout.view(sb.buffer, "barrier_signal"), sb.layout.view(sb.buffer, "barrier_state")


def _progress_view(sb) -> torch.Tensor:
    """This rank's ``progress`` (i32 [R]) view: slot r = rank r's last heartbeat."""
    return sb.layout.view(sb.buffer, "progress")


_HEARTBEAT_LOCK = threading.Lock()


def heartbeat(sb) -> None:
    """Tell every rank that this rank is making progress: bump ``progress[rank]`` and write it into slot ``rank``
    of every rank's ``progress``. No-op for a single rank and for the ``local`` backend (its ranks run in
    lock-step in one thread, so none can be slow while another waits).

    Interpreter (CPU tensors; the cpu and local backends map every peer into this process): plain host writes,
    safe from any thread (a lock orders them). CUDA: one single-program launch, ordered after the work queued
    before it on the current stream.
    """
    if sb.num_ranks == 1 or sb.backend == "local":
        return
    if interpreting():
        with _HEARTBEAT_LOCK:
            beat = int(_progress_view(sb)[sb.rank]) + 1
            for r in range(sb.num_ranks):
                sb.peer_view(r, "progress")[sb.rank] = beat
        return
    heartbeat_kernel[(1,)](_progress_view(sb), sb.buffer_ptrs, sb.rank, sb.layout.num_ranks, BLOCK_R=_block_r(sb))


class ProgressBeacon:
    """While active, beat :func:`heartbeat` for ``sbs`` from a daemon thread whenever the thread that created the
    beacon has moved since the last look, at most every ``min(BEACON_INTERVAL_S, timeout / 4)`` seconds. Moved: it
    spent at least ``BEACON_MIN_CPU_S`` of CPU time (its own thread clock, ``time.pthread_getcpuclockid``), or,
    where there is no thread clock, its innermost Python frame or instruction changed.

    Used on the interpreter, where one step (a kernel run by Triton's interpreter) can take longer than the barrier
    timeout: the executing rank keeps its heartbeat moving, so its peers' waits do not expire. A thread blocked (in
    ``sleep``, a lock, a hung call) does not move, so a stuck rank still stops beating. ``active`` is a flag the
    owner clears while it waits in a barrier itself (waiting is not progress). Use as a context manager.

    Why CPU time first: a thread busy in pure Python gives up the GIL at the same few instructions, so the beacon,
    which needs the GIL to look, mostly finds it at the same frame and instruction (measured with CPython 3.11: 126
    of 150 looks 0.1 s apart saw the same position, up to 25 in a row, while its CPU time advanced every time). The
    position alone let a slow but live rank be named dead.
    """

    def __init__(self, sbs: Sequence, timeout_s: float):
        self.sbs = [sb for sb in sbs if sb.num_ranks > 1 and sb.backend != "local"]
        self.interval = min(BEACON_INTERVAL_S, timeout_s / 4)
        self.active = False
        self._owner = threading.get_ident()
        try:
            self._clock = time.pthread_getcpuclockid(self._owner)
        except (AttributeError, OSError):  # no per-thread CPU clock on this platform: the frame position only
            self._clock = None
        self._stop = self._thread = None  # (made in __enter__, only where a thread beats: a fused call has none)

    def _start(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="megamoe-progress-beacon", daemon=True)
        self._thread.start()

    def _position(self):
        """The owner's CPU seconds (its thread clock), or without one its ``(frame id, line, instruction)``; None
        once the thread is gone."""
        if self._clock is not None:
            try:
                return time.clock_gettime(self._clock)
            except OSError:  # the owner thread has exited
                return None
        frame = sys._current_frames().get(self._owner)
        return None if frame is None else (id(frame), frame.f_lineno, frame.f_lasti)

    def moved(self, last, now) -> bool:
        """Whether the owner made progress between two :meth:`_position` looks."""
        if self._clock is None:
            return now != last
        return last is not None and now is not None and now - last >= BEACON_MIN_CPU_S

    def _run(self) -> None:
        last = self._position()
        while not self._stop.wait(self.interval):
            now = self._position()
            if self.active and self.moved(last, now):
                for sb in self.sbs:
                    heartbeat(sb)
            last = now

    def __enter__(self) -> "ProgressBeacon":
        if self.sbs and interpreting():
            self._start()
        return self

    def __exit__(self, *exc) -> None:
        self.active = False
        if self._thread is not None:
            self._stop.set()
            self._thread.join()


def _block_r(sb) -> int:
    return max(2, triton.next_power_of_2(sb.layout.num_ranks))


def barrier_arrive(sb) -> None:
    """Signal this rank's next barrier epoch to every rank (one single-program launch)."""
    signal, state = _barrier_views(sb)
    barrier_arrive_kernel[(1,)](signal, state, sb.buffer_ptrs, sb.rank, sb.layout.num_ranks, BLOCK_R=_block_r(sb))


def _launch_wait(sb, fail_tag: int, max_polls: int, timeout_ns: int, use_globaltimer: bool) -> None:
    signal, state = _barrier_views(sb)
    barrier_wait_kernel[(1,)](signal, state, _progress_view(sb), sb.layout.num_ranks, fail_tag, max_polls,
                              timeout_ns, BLOCK_R=_block_r(sb), USE_GLOBALTIMER=use_globaltimer)


def warm_up(sb) -> None:
    """Compile and load this rank's single-program barrier kernels (arrive, wait at the ``barrier_timeout_s`` it will
    use, heartbeat) when a CUDA buffer is built, leaving the workspace as it was (the wait and the heartbeat run
    once; the arrive, which would start an epoch, is only loaded).

    Why (measured on an H200, ``results/probes/README.md``): loading a kernel's module waits for the kernels running
    in the process. A first-ever launch while this process spins in a barrier wait -- a late rank's arrive (``rank``
    equal to 1 is a separate Triton specialisation), or a heartbeat -- was held back until the wait had timed out,
    so a live rank was reported dead. A no-op on the interpreter."""
    if interpreting() or sb.buffer.device.type != "cuda":
        return
    signal, state = _barrier_views(sb)
    saved = state.clone()
    _launch_wait(sb, 0, 0, int(sb.barrier_timeout_s * 1e9), True)  # epoch 0: every rank counts as arrived
    heartbeat_kernel[(1,)](_progress_view(sb), sb.buffer_ptrs, sb.rank, sb.layout.num_ranks, BLOCK_R=_block_r(sb))
    barrier_arrive_kernel.warmup(signal, state, sb.buffer_ptrs, sb.rank, sb.layout.num_ranks, BLOCK_R=_block_r(sb),
                                 grid=(1,))._init_handles()
    state.copy_(saved)
    torch.cuda.synchronize(sb.buffer.device)


def barrier_wait(sb, tag: int) -> None:
    """Wait until every rank has arrived at this rank's current epoch; fail when a missing rank shows no progress
    (its ``progress`` heartbeat does not move) for ``sb.barrier_timeout_s``.

    CUDA: one launch bounded by ``%globaltimer``; a timeout is only recorded in ``barrier_state`` (no host sync) and
    raised later by :func:`check_barrier_state`. Interpreter: short launches re-issued from the host (sleeping
    ~1 ms in between so spinning ranks do not starve each other on few cores); the host restarts a missing rank's
    clock whenever its heartbeat moves and, when one has stood still for the timeout, records the failure (tag,
    that rank) and raises :class:`BarrierTimeout` at once.
    """
    if not isinstance(tag, int) or tag <= 0:
        raise ValueError(f"tag={tag!r} must be a positive int")
    if not interpreting():
        _launch_wait(sb, tag, 0, int(sb.barrier_timeout_s * 1e9), True)
        return
    signal, state = _barrier_views(sb)
    progress = _progress_view(sb)
    beats = progress.tolist()
    moved = [time.monotonic()] * sb.layout.num_ranks  # when each rank last showed progress
    while True:
        _launch_wait(sb, 0, INTERPRETER_POLLS_PER_LAUNCH, 0, False)
        failed_tag, missing = state[1].item(), state[2].item()
        if failed_tag != 0:
            check_barrier_state(sb)
        if missing < 0:
            return
        now = time.monotonic()
        for r, b in enumerate(progress.tolist()):
            if b != beats[r]:
                beats[r], moved[r] = b, now
        epoch = state[0].item()
        stuck = [r for r, s in enumerate(signal.tolist()) if s < epoch and now - moved[r] > sb.barrier_timeout_s]
        if stuck:
            state[2] = stuck[0]
            state[1] = tag
            check_barrier_state(sb)
        time.sleep(INTERPRETER_SLEEP_S)


def barrier(sb, tag: int) -> None:
    """Arrive, then wait: a full barrier across all ranks of ``sb`` (one process per rank)."""
    barrier_arrive(sb)
    barrier_wait(sb, tag)


def barrier_lockstep(sbs: Sequence, tag: int) -> None:
    """A barrier over the ranks of a ``local`` backend (all in this process): arrive for all, then wait for all."""
    for sb in sbs:
        barrier_arrive(sb)
    for sb in sbs:
        barrier_wait(sb, tag)


def check_barrier_state(sb) -> None:
    """Raise :class:`BarrierTimeout` if any barrier of ``sb`` has timed out (a host sync on CUDA)."""
    _, state = _barrier_views(sb)
    _, failed_tag, missing, _ = state.tolist()
    if failed_tag != 0:
        raise BarrierTimeout(sb.rank, failed_tag, missing, sb.barrier_timeout_s)


def reset_workspace(sb) -> None:
    """Zero this rank's whole workspace (bytes ``[0, layout.workspace_bytes)``): the accumulating counters
    (``expert_send_count``, ``expert_recv_count``, ``expert_recv_count_sum``), barrier signals and state (epoch 0,
    no failure), heartbeats, ``call_state`` and the fused kernel's arrival counters. Every workspace field is valid
    at zero (a fresh buffer is all zeros). Only a step of the collective ``SymmBuffer.reset()``: peers must not run
    kernels meanwhile, and every rank must be zeroed before any starts the next call."""
    sb.buffer[:sb.layout.workspace_bytes].zero_()


_WORD_TYPES = {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.uint8}


def _row_geometry(layout, name: str) -> tuple[int, int, int]:
    """``(byte offset, rows, bytes per row)`` of a row-major segment (rows = its first dimension)."""
    seg = layout[name]
    if seg.mn_major:
        raise ValueError(f"segment {name!r} is MN-major; copy_rows needs a row-major segment")
    return seg.offset, seg.shape[0], seg.nbytes // seg.shape[0]


def _row_index(rows, num_rows: int, what: str, device: torch.device) -> torch.Tensor:
    """``rows`` (ints, range or integer tensor) as an i32 tensor on ``device``, bounds-checked against ``num_rows``."""
    idx = torch.as_tensor(rows if isinstance(rows, torch.Tensor) else list(rows), dtype=torch.int64).flatten()
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= num_rows):
        raise IndexError(f"{what} must lie in [0, {num_rows}), got [{int(idx.min())}, {int(idx.max())}]")
    return idx.to(device=device, dtype=torch.int32)


def copy_rows(sb, src_rank: int, dst_rank: int, segment: str, rows, dst_rows=None, *, dst_segment: str | None = None,
              block_bytes: int = 1024) -> None:
    """Copy rows of ``segment`` from ``src_rank``'s buffer into ``dst_segment`` (default: the same) of ``dst_rank``.

    ``rows``: source row indices (ints, range or integer tensor); ``dst_rows``: destination rows (default ``rows``).
    A row is the segment's first dimension, any dtype, moved as the widest words (<= 8 bytes) dividing the row
    bytes and both segment offsets; both segments must have equal row bytes. ``block_bytes``: bytes per program.
    Pull = ``src_rank`` remote and ``dst_rank == sb.rank``; push = the mirror. The caller orders it with barriers.
    """
    layout = sb.layout
    for name, r in (("src_rank", src_rank), ("dst_rank", dst_rank)):
        if not 0 <= r < layout.num_ranks:
            raise ValueError(f"{name}={r} must be in [0, {layout.num_ranks})")
    src_off, src_n, row_bytes = _row_geometry(layout, segment)
    dst_off, dst_n, dst_row_bytes = _row_geometry(layout, dst_segment or segment)
    if dst_row_bytes != row_bytes:
        raise ValueError(f"row bytes differ: {segment!r} has {row_bytes}, {dst_segment!r} has {dst_row_bytes}")
    src_idx = _row_index(rows, src_n, "rows", sb.buffer.device)
    dst_idx = src_idx if dst_rows is None else _row_index(dst_rows, dst_n, "dst_rows", sb.buffer.device)
    if dst_idx.numel() != src_idx.numel():
        raise ValueError(f"rows ({src_idx.numel()}) and dst_rows ({dst_idx.numel()}) differ in length")
    if src_idx.numel() == 0:
        return
    word = next(w for w in (8, 4, 2, 1) if (row_bytes | src_off | dst_off) % w == 0)
    row_words = row_bytes // word
    block = min(triton.next_power_of_2(row_words), max(1, block_bytes // word))
    grid = (src_idx.numel(), triton.cdiv(row_words, block))
    remote_copy_rows_kernel[grid](sb.buffer, sb.buffer_ptrs, sb.rank, src_rank, dst_rank, src_off // word,
                                  dst_off // word, src_idx, dst_idx, row_words, BLOCK=block, WORD=_WORD_TYPES[word])


def pull_rows(sb, src_rank: int, segment: str, rows, dst_rows=None, **kw) -> None:
    """:func:`copy_rows` from ``src_rank`` into this rank."""
    copy_rows(sb, src_rank, sb.rank, segment, rows, dst_rows, **kw)


def push_rows(sb, dst_rank: int, segment: str, rows, dst_rows=None, **kw) -> None:
    """:func:`copy_rows` from this rank into ``dst_rank``."""
    copy_rows(sb, sb.rank, dst_rank, segment, rows, dst_rows, **kw)
