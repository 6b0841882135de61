"""Per-rank functions for the multi-rank tests, called as ``fn(rank, world_size, ...)`` by ``megamoe.launch``.

They live in a module (not in the test files) because spawned ranks import them by name. Each works on either
backend: ``cpu`` ranks (gloo, shm, Triton interpreter) and ``cuda`` ranks (NCCL, symmetric memory).
"""
from __future__ import annotations

import glob
import os
import signal
import time

import torch
import torch.distributed as dist

import megamoe.symm
from megamoe.kernels import symm as ks
from megamoe.symm import SymmBuffer

#: A small layout: T=16 tokens of H=384 FP8 bytes (2 copy blocks of 256 B, the second one masked).
T, H, I, TOPK, BLOCK_M = 16, 384, 256, 2, 16
COPY_BLOCK_BYTES = 256


def make_buffer(world_size: int, **kw) -> SymmBuffer:
    """A SymmBuffer of the test layout on the default group (2 experts per rank)."""
    return SymmBuffer(None, 2 * world_size, T, TOPK, H, I, block_m=BLOCK_M, **kw)


def sync(sb: SymmBuffer) -> None:
    """Finish this rank's queued device work (host-side reads/writes of peers are ordered by a group barrier)."""
    if sb.device.type == "cuda":
        torch.cuda.synchronize(sb.device)


def own_shm_files() -> list[str]:
    """This process's shm files (``megamoe.symm.shm_files_of``; there should never be any after set-up)."""
    return megamoe.symm.shm_files_of(os.getpid())


# ---------------------------------------------------------------------------------------------------- copy pattern
def pattern(rank: int, rows: torch.Tensor, cols: int = H) -> torch.Tensor:
    """u8 ``[len(rows), cols]``: the bytes rank ``rank`` stores in row ``rows[i]`` of its ``x``."""
    c = torch.arange(cols)
    return ((rank * 89 + rows[:, None] * 13 + c[None, :] * 7) % 251).to(torch.uint8)


def fill_x(sb: SymmBuffer) -> None:
    """Write this rank's pattern into every row of ``x``."""
    sb.x.view(torch.uint8).copy_(pattern(sb.rank, torch.arange(T)).to(sb.device))


def exchange_rows(sb: SymmBuffer) -> None:
    """Pull every rank's ``x`` (rows reversed) into ``l1_acts[p*T : (p+1)*T]``; push this rank's ``x`` into every
    rank's ``l1_acts[R*T + rank*T + i]``. Needs ``x`` filled on every rank (a barrier) before."""
    R = sb.num_ranks
    for p in range(R):
        ks.pull_rows(sb, p, "x", range(T - 1, -1, -1), range(p * T, (p + 1) * T), dst_segment="l1_acts",
                     block_bytes=COPY_BLOCK_BYTES)
        ks.push_rows(sb, p, "x", range(T), range(R * T + sb.rank * T, R * T + (sb.rank + 1) * T),
                     dst_segment="l1_acts", block_bytes=COPY_BLOCK_BYTES)


def exchange_rows_lockstep(sbs: list[SymmBuffer]) -> None:
    """The local backend's copy test: :func:`fill_x` on every rank, lock-step barrier tag 1, :func:`exchange_rows`
    on every rank, lock-step barrier tag 2 (on the ranks' device, CPU or GPU)."""
    for sb in sbs:
        fill_x(sb)
    ks.barrier_lockstep(sbs, ks.TAG_BEFORE_DISPATCH_PULL)
    for sb in sbs:
        exchange_rows(sb)
    ks.barrier_lockstep(sbs, ks.TAG_BEFORE_COMBINE_REDUCE)


def count_bad_bytes(sb: SymmBuffer) -> int:
    """Bytes of ``l1_acts`` that differ from what :func:`exchange_rows` on every rank should have left."""
    R = sb.num_ranks
    acts = sb.l1_acts.view(torch.uint8).cpu()
    bad = 0
    for p in range(R):
        pulled = pattern(p, torch.arange(T - 1, -1, -1))
        pushed = pattern(p, torch.arange(T))
        bad += int((acts[p * T:(p + 1) * T] != pulled).sum())
        bad += int((acts[R * T + p * T:R * T + (p + 1) * T] != pushed).sum())
    return bad


# ---------------------------------------------------------------------------------------------------- rank functions
def symm_views_and_copy(rank: int, world_size: int) -> dict:
    """Build a SymmBuffer, report its layout/views/pointers, read a peer's bytes through the shared mapping, then
    pull and push rows with the copy kernel between barriers and count wrong bytes."""
    sb = make_buffer(world_size)
    files_after_init = own_shm_files()
    views = {name: (str(getattr(sb, name).dtype), tuple(getattr(sb, name).shape), getattr(sb, name).stride())
             for name in megamoe.symm.VIEW_NAMES}
    sb.topk_idx.fill_(1000 + rank)
    sync(sb)
    dist.barrier()
    peer = (rank + 1) % world_size
    peer_value = int(sb.peer_view(peer, "topk_idx")[T - 1, TOPK - 1])
    fill_x(sb)
    ks.barrier(sb, ks.TAG_BEFORE_DISPATCH_PULL)
    exchange_rows(sb)
    ks.barrier(sb, ks.TAG_BEFORE_COMBINE_REDUCE)
    ks.check_barrier_state(sb)
    bad = count_bad_bytes(sb)
    info = {"rank": sb.rank, "num_ranks": sb.num_ranks, "backend": sb.backend, "num_bytes": sb.layout.num_bytes,
            "segments": [(s.name, s.offset, s.nbytes) for s in sb.layout], "views": views,
            "buffer_ptrs": sb.buffer_ptrs.tolist(), "own_ptr": sb.buffer.data_ptr(), "peer_value": peer_value,
            "bad_bytes": bad, "files_after_init": files_after_init}
    ks.barrier(sb, ks.TAG_AFTER_WORKSPACE_CLEAN)  # nobody unmaps while a peer may still write
    sb.destroy()
    sb.destroy()
    info["files_after_destroy"] = own_shm_files()
    return info


def symm_barrier_rounds(rank: int, world_size: int, rounds: int, skew_s: float) -> dict:
    """``rounds`` rounds of: (rank ``i % R`` sleeps ``skew_s``) write a round stamp, barrier, read every peer's
    stamp, barrier. Returns the stamps that were wrong and the final barrier state/signals (no zeroing between)."""
    sb = make_buffer(world_size, barrier_timeout_s=30.0)
    wrong = []
    for i in range(rounds):
        if rank == i % world_size:
            time.sleep(skew_s)
        sb.topk_idx[0, 0] = 100 * i + rank
        ks.barrier(sb, ks.TAG_BEFORE_DISPATCH_PULL)
        for p in range(world_size):
            got = int(sb.peer_view(p, "topk_idx")[0, 0])
            if got != 100 * i + p:
                wrong.append((i, p, got))
        ks.barrier(sb, ks.TAG_BEFORE_COMBINE_REDUCE)
    ks.check_barrier_state(sb)
    out = {"wrong": wrong, "state": sb.view("barrier_state").tolist(), "signal": sb.view("barrier_signal").tolist()}
    sb.destroy()
    return out


def symm_barrier_timeout(rank: int, world_size: int, absent_rank: int, timeout_s: float) -> dict | None:
    """Every rank but ``absent_rank`` enters a tag-2 barrier that ``absent_rank`` skips; the others report the
    BarrierTimeout they get, how long it took, and whether a later wait fails at once."""
    sb = make_buffer(world_size, barrier_timeout_s=timeout_s)
    ks.barrier(sb, ks.TAG_BEFORE_DISPATCH_PULL)
    out = None
    if rank != absent_rank:
        start = time.monotonic()
        try:
            ks.barrier(sb, ks.TAG_BEFORE_COMBINE_REDUCE)
            ks.check_barrier_state(sb)
        except ks.BarrierTimeout as e:
            out = {"rank": e.rank, "tag": e.tag, "missing_rank": e.missing_rank, "message": str(e),
                   "elapsed_s": time.monotonic() - start}
        start = time.monotonic()
        try:
            ks.barrier(sb, ks.TAG_AFTER_WORKSPACE_CLEAN)
            ks.check_barrier_state(sb)
        except ks.BarrierTimeout as e:
            out["again"] = (e.tag, e.missing_rank, time.monotonic() - start)
    sync(sb)
    dist.barrier()
    sb.destroy()
    return out


def symm_setup_fails(rank: int, world_size: int) -> list[str]:
    """Every rank fails while mapping its peers' segments (after the names were exchanged); returns the shm files
    of this process left behind (should be none: SymmBuffer unlinks on error)."""
    def broken_map(path, num_bytes):
        raise OSError(f"injected failure mapping {path}")

    megamoe.symm._map_file = broken_map
    try:
        make_buffer(world_size)
    except OSError as e:
        assert "injected" in str(e)
    else:
        raise AssertionError("SymmBuffer did not fail")
    return own_shm_files()


def symm_setup_dies(rank: int, world_size: int, dying_rank: int, pid_dir: str) -> None:
    """``dying_rank`` exits abruptly (code 3) in the middle of SymmBuffer set-up, its shm file still linked."""
    write_pid(pid_dir, rank)
    if rank == dying_rank:
        def exit_while_mapping(path, num_bytes):
            os._exit(3)

        megamoe.symm._map_file = exit_while_mapping
    make_buffer(world_size)


# ---------------------------------------------------------------------------------------------------- launch tests
def write_pid(pid_dir: str, rank: int) -> None:
    """Record this rank's pid as ``<pid_dir>/rank<rank>.pid`` (read back by the parent after a failed launch)."""
    with open(os.path.join(pid_dir, f"rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))


def _recorded_pids(pid_dir) -> list[int]:
    return [int(open(f).read()) for f in glob.glob(os.path.join(str(pid_dir), "*.pid"))]


def pids_alive(pid_dir) -> list[int]:
    """The recorded rank pids that still exist (none may outlive ``launch``)."""
    alive = []
    for pid in _recorded_pids(pid_dir):
        try:
            os.kill(pid, 0)
            alive.append(pid)
        except ProcessLookupError:
            pass
    return alive


def pid_shm_files(pid_dir) -> list[str]:
    """Shm files created by the recorded rank pids."""
    return [p for pid in _recorded_pids(pid_dir) for p in megamoe.symm.shm_files_of(pid)]


def whoami(rank: int, world_size: int, payload, *, scale: int = 1) -> dict:
    """The rank's view of the launch: arguments, environment and process."""
    return {"rank": rank, "world_size": world_size, "payload": payload, "scale": scale, "pid": os.getpid(),
            "dist_rank": dist.get_rank(), "dist_world": dist.get_world_size(), "backend": dist.get_backend(),
            "env": {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                   "MASTER_ADDR", "MASTER_PORT", "TRITON_INTERPRET")}}


def environ_of(rank: int, world_size: int, keys: list[str]) -> dict:
    """The rank's values of ``keys`` in its environment (None where unset)."""
    return {k: os.environ.get(k) for k in keys}


def raise_on(rank: int, world_size: int, bad_rank: int) -> int:
    """``bad_rank`` raises a ValueError; the others return their rank."""
    if rank == bad_rank:
        raise ValueError(f"deliberate failure on rank {rank}")
    return rank


def exit_on(rank: int, world_size: int, bad_rank: int, code: int, pid_dir: str) -> None:
    """``bad_rank`` dies with ``os._exit(code)`` once every rank has recorded its pid (so that the peers are
    running, not still starting, when it dies: on a loaded machine a spawn can outlast the blame grace period);
    the others hang until terminated."""
    write_pid(pid_dir, rank)
    if rank == bad_rank:
        deadline = time.monotonic() + 60
        while len(glob.glob(os.path.join(pid_dir, "*.pid"))) < world_size and time.monotonic() < deadline:
            time.sleep(0.05)
        os._exit(code)
    time.sleep(600)


def sleep_on(rank: int, world_size: int, slow_rank: int, pid_dir: str) -> int:
    """``slow_rank`` never finishes; the others return at once."""
    write_pid(pid_dir, rank)
    if rank == slow_rank:
        time.sleep(600)
    return rank


# ---------------------------------------------------------------------------------------------------- blame tests
def fail_during_setup(rank: int, world_size: int, bad_rank: int, how: str, pid_dir: str) -> None:
    """Every rank builds a SymmBuffer; ``bad_rank`` fails in a way chosen by ``how`` while its peers are (or soon
    will be) inside a collective of the set-up, so that they fail with secondary communication errors:

    * ``"raise_before"``: raises a ValueError before building the buffer (the peers wait in the rendezvous);
    * ``"bad_args"``: passes an invalid ``hidden`` (the SymmBuffer's own validation raises);
    * ``"raise_mapping"``: raises an OSError while mapping its peers' files (its own shm file already exists);
    * ``"sigkill_mapping"``: SIGKILLs itself while mapping its peers' files (its shm file still linked).
    """
    write_pid(pid_dir, rank)
    kw = {}
    if rank == bad_rank:
        if how == "raise_before":
            raise ValueError(f"deliberate failure on rank {rank} before the SymmBuffer")
        if how == "bad_args":
            kw = {"hidden": H + 64}
        if how in ("raise_mapping", "sigkill_mapping"):
            def failing_map(path, num_bytes):
                if how == "sigkill_mapping":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise OSError(f"deliberate failure on rank {rank} mapping {path}")

            megamoe.symm._map_file = failing_map
    sb = SymmBuffer(None, 2 * world_size, T, TOPK, kw.get("hidden", H), I, block_m=BLOCK_M)
    dist.barrier()  # a rank whose set-up succeeded (it cannot, with a failing peer) would wait here
    sb.destroy()


def mismatched_buffer(rank: int, world_size: int, field: str, value) -> None:
    """Every rank builds a SymmBuffer of the test layout; ``rank == world_size - 1`` sets ``field`` to ``value``."""
    args = dict(num_experts=2 * world_size, num_max_tokens_per_rank=T, num_topk=TOPK, hidden=H,
                intermediate_hidden=I, block_m=BLOCK_M)
    if rank == world_size - 1:
        args[field] = value
    SymmBuffer(None, **args)


class FailsToUnpickle:
    """An argument that cannot be unpickled in another process: a rank given one dies while its interpreter is
    still bootstrapping (before ``launch``'s entry point runs)."""

    def __init__(self):
        self.pid = os.getpid()

    def __setstate__(self, state):
        if state["pid"] != os.getpid():
            raise RuntimeError("FailsToUnpickle: deliberate failure while unpickling in another process")
        self.__dict__.update(state)


def leaked_shm_files() -> list[str]:
    """Shm files whose creator is dead but which are still linked (leaks; files of live creators are in use)."""
    leaked = []
    for path in glob.glob(os.path.join(megamoe.symm.SHM_DIR, megamoe.symm.SHM_PREFIX + "*")):
        pid = megamoe.symm._shm_creator_pid(path)
        if pid is not None and not megamoe.symm._pid_alive(pid) and os.path.exists(path):
            leaked.append(path)
    return sorted(leaked)


# ---------------------------------------------------------------------------------------------------- reliability
#: The Mega MoE case of the progress / stuck-rank tests: every token routed to rank 0, which does all the GEMM work.
def reliability_case(timeout_s: float):
    from megamoe.cases import MoECase

    return MoECase(num_ranks=2, num_tokens=[16, 16], hidden=128, intermediate=128, num_experts=4, num_topk=2,
                   routing="one_expert", block_m=16, seed=21, extra={"barrier_timeout_s": timeout_s})


def _moe_rank_setup(rank: int, case):
    from megamoe.cases import prepare_rank

    sb = SymmBuffer(None, case.num_experts, case.max_tokens(), case.num_topk, case.hidden, case.intermediate,
                    block_m=case.block_m, barrier_timeout_s=case.extra["barrier_timeout_s"])
    problem = case.problem(device=sb.buffer.device)
    y, l1, l2, _ = prepare_rank(sb, problem, rank)
    ref = problem.reference()[rank]
    dist.barrier()  # nobody enters a call (and its barrier timeouts) while a peer still prepares
    return sb, y, l1, l2, ref


def _moe_call(sb, y, l1, l2, ref) -> bool:
    """One checked call; True if ``y`` equals the reference bit for bit."""
    from megamoe.ops import fp8_fp4_mega_moe

    y.fill_(float("nan"))
    fp8_fp4_mega_moe(y, l1, l2, sb, numerics="exact")  # (the reference's; "auto" is a Hopper numerics on a GPU)
    return bool(torch.equal(y.view(torch.int16), ref.view(torch.int16)))


def _slow_l1(mode: str, sb, seconds: float, marks: dict | None = None):
    """A replacement for ``megamoe.ops._l1`` on the slow rank: the real step, then ``seconds`` of either sleeping
    while beating the heartbeat by hand ("sleep_beating"), pure-Python busy work with no explicit heartbeat
    ("busy": the interpreter's progress beacon must notice), or sleeping without a heartbeat ("stuck").
    ``marks["slow_since"]``, if given, receives the ``time.monotonic()`` at which the slow part began (the clock is
    system-wide, so another rank process's times compare with it)."""
    from megamoe import ops

    real = ops._l1

    def l1(c):
        real(c)
        if marks is not None:
            marks["slow_since"] = time.monotonic()
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if mode == "busy":
                sum(i * i for i in range(2000))
            else:
                time.sleep(0.05)
                if mode == "sleep_beating":
                    ks.heartbeat(sb)
    return l1


def slow_rank_calls(rank: int, world_size: int, timeout_s: float, modes: list[str]) -> list[dict]:
    """For each mode (see :func:`_slow_l1`, plus "real": no change, rank 0's genuine GEMM work is timed) one call in
    which rank 0 spends 3 x ``timeout_s`` in its L1 step while rank 1 waits at barrier 2; each rank reports per
    call whether it raised, how long it took, the barrier timeout it ran under and whether ``y`` is bit-exact.

    "real" first times rank 0's genuine L1 step in an untimed call, then runs under a barrier timeout of half that
    step (at most ``timeout_s``, agreed by both ranks), so the genuine work outlasts the timeout on any machine: a
    fixed timeout did not on a faster CI machine (0.37 s of L1 work against 0.4 s)."""
    from megamoe import ops

    case = reliability_case(timeout_s)
    sb, y, l1, l2, ref = _moe_rank_setup(rank, case)
    real_l1, out = ops._l1, []

    def timing(step_s, real=real_l1):
        def timed(c):
            t0 = time.monotonic()
            real(c)
            step_s.append(time.monotonic() - t0)
        return timed

    try:
        for mode in modes:
            sb.barrier_timeout_s = timeout_s
            if rank == 0 and mode != "real":
                ops._l1 = _slow_l1(mode, sb, 3 * timeout_s)
            step_s = []
            if mode == "real":
                if rank == 0:
                    ops._l1 = timing(step_s)
                dist.barrier()
                _moe_call(sb, y, l1, l2, ref)  # the calibration call
                agreed = torch.tensor([min(timeout_s, 0.5 * step_s[0]) if rank == 0 else 0.0], dtype=torch.float64)
                dist.broadcast(agreed, 0)
                sb.barrier_timeout_s, step_s[:] = float(agreed), []
            dist.barrier()
            t0 = time.monotonic()
            try:
                ok, error = _moe_call(sb, y, l1, l2, ref), None
            except Exception as e:  # reported, not raised: the test asserts on it
                ok, error = False, f"{type(e).__name__}: {e}"
            ops._l1 = real_l1
            out.append({"mode": mode, "bitwise_equal": ok, "error": error, "seconds": time.monotonic() - t0,
                        "l1_seconds": step_s, "timeout_s": sb.barrier_timeout_s})
            dist.barrier()
    finally:
        ops._l1 = real_l1
        dist.barrier()
        sb.destroy()
    return out


def time_steps_with_a_busy_rank(rank: int, world_size: int, timeout_s: float) -> dict:
    """The per-step timer (``megamoe.stepping.time_steps``, as notebook 04 and the benchmarks use it) on two
    process ranks while rank 0's L1 step is busy in Python for 3 x ``timeout_s`` (no explicit heartbeat): it must
    not time out (the timer runs the steps as a call does, progress beacon included), and ``y`` is bit-exact."""
    from megamoe import ops
    from megamoe.stepping import time_steps

    case = reliability_case(timeout_s)
    sb, y, l1, l2, ref = _moe_rank_setup(rank, case)
    real_l1 = ops._l1
    try:
        if rank == 0:
            ops._l1 = _slow_l1("busy", sb, 3 * timeout_s)
        calls = ops.bind_calls(y, l1, l2, sb, None, "swiglu", None, "pull", False)
        y.fill_(float("nan"))
        try:
            times, error = time_steps(calls, ops.pipeline_steps("pull"), repeats=1), None
        except Exception as e:  # reported, not raised: the test asserts on it
            times, error = {}, f"{type(e).__name__}: {e}"
        dist.barrier()
        return {"rank": rank, "error": error, "l1_us": times.get("l1"), "timeout_s": sb.barrier_timeout_s,
                "bitwise_equal": bool(torch.equal(y.view(torch.int16), ref.view(torch.int16)))}
    finally:
        ops._l1 = real_l1
        sb.destroy()


#: How many barrier timeouts rank 0 of ``stuck_rank_then_reset`` stays stuck. Rank 1 times out only if it reaches
#: barrier 2 more than one timeout before rank 0 does, so this, less one, is the margin for rank 1's own steps running
#: behind rank 0's: with 2 (a 1.5 s margin at the test's 1.5 s timeout) a fresh-clone CI run once saw rank 1 finish
#: the call without a timeout (session 29, on a CI pass where the parallel tests took 17:23 instead of ~15 min).
STUCK_TIMEOUTS = 4


def stuck_rank_then_reset(rank: int, world_size: int, timeout_s: float) -> dict:
    """Rank 0 stops (sleeps ``STUCK_TIMEOUTS`` x timeout without a heartbeat) inside its L1 step. Rank 1 must time
    out at barrier 2 naming rank 0, within about one timeout; rank 0, when it wakes, times out at barrier 3 naming
    rank 1 (which left). Then: a call on the failed buffer is refused (naming ``reset()``), every rank calls
    ``sb.reset()``, and the next call is bit-exact again.

    Times (``time.monotonic()``, system-wide): ``out["slow_since"]`` (rank 0: its heartbeat stops),
    ``out["wait_since"][tag]`` (when this rank began waiting at barrier ``tag``), ``out["timeout"]["raised_at"]``.
    The protocol's promise is about the wait alone -- a missing rank is named one timeout after the later of "this
    rank arrived" and "that rank's heartbeat last moved" -- so the test reads these, not the whole call's time (which
    also holds this rank's own steps: 4.4 s of them on a slow CI machine)."""
    from megamoe import ops

    case = reliability_case(timeout_s)
    sb, y, l1, l2, ref = _moe_rank_setup(rank, case)
    out = {"rank": rank, "wait_since": {}}
    real_l1, real_wait = ops._l1, ops.barrier_wait

    def timed_wait(sb_, tag):
        out["wait_since"].setdefault(tag, time.monotonic())
        return real_wait(sb_, tag)

    try:
        if rank == 0:
            ops._l1 = _slow_l1("stuck", sb, STUCK_TIMEOUTS * timeout_s, marks=out)
        ops.barrier_wait = timed_wait
        t0 = time.monotonic()
        try:
            _moe_call(sb, y, l1, l2, ref)
        except ks.BarrierTimeout as e:
            now = time.monotonic()
            out["timeout"] = {"tag": e.tag, "missing_rank": e.missing_rank, "seconds": now - t0, "raised_at": now}
        ops._l1, ops.barrier_wait = real_l1, real_wait
        out["fault"] = sb.fault
        try:
            _moe_call(sb, y, l1, l2, ref)
        except ops.WorkspaceStateError as e:
            out["refused"] = str(e)
        sb.reset()
        out["fault_after_reset"] = sb.fault
        out["bitwise_after_reset"] = [_moe_call(sb, y, l1, l2, ref) for _ in range(2)]
        dist.barrier()
    finally:
        ops._l1, ops.barrier_wait = real_l1, real_wait
        sb.destroy()
    return out


# ---------------------------------------------------------------------------------------------------- fused FP8
def run_case_rank_fp8_ws(rank: int, world_size: int, case, block_m: int) -> dict:
    """``megamoe.cases.run_case_rank`` with the fused FP8 path forced onto its three-launch split (``FusedConfig``
    kind ``"fp8_ws"``, pool block ``block_m``; under the interpreter the GEMM phase is ``megamoe.gemm_phase``'s torch
    model). The override lives in this rank process only."""
    import megamoe.fused as mf
    from megamoe.cases import run_case_rank

    cfg = mf.FusedConfig(block_m=block_m, programs_per_rank=1, num_warps=8, num_stages=2, kind="fp8_ws")
    mf.fused_config = lambda *args, **kwargs: cfg
    return run_case_rank(rank, world_size, case)
