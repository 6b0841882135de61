"""Run a function on N ranks, one process per rank, and collect the results in rank order.

    results = launch(my_module.rank_fn, 4, arg, backend="cpu")    # rank_fn(rank, world_size, arg) on 4 processes

``cpu``: gloo ranks and Triton's interpreter (``TRITON_INTERPRET=1``) in every child; ``cuda``: NCCL, one GPU per
rank. Ranks are spawned (a fresh interpreter each), except CPU ranks on a machine without CUDA, which are forked from
multiprocessing's fork server with torch, Triton and megamoe already imported (:func:`_context` says why that is
safe and what stays the same). The process group is initialized from a FileStore in a temporary directory (no
ports are opened); the torchrun variables RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT
are set anyway so that code written for torchrun runs unchanged. Scripts started by torchrun call
:func:`init_from_env` instead.

Failures come back as :class:`LaunchError` naming the rank that caused them: its traceback if it raised, its exit
code or signal if it died without a result, or a timeout. One rank's failure makes its peers fail too (a collective
they were in loses its peer: gloo's "Connection closed by peer", NCCL errors, store or barrier timeouts), and those
secondary errors can arrive first. So after the first failure ``launch`` keeps collecting outcomes for up to
:data:`BLAME_GRACE_S`, classifies each rank's error (:func:`is_communication_error`), and names the earliest failure
that is *not* a communication error (a raised exception, or a death without a result) as ``LaunchError.rank``, with
its traceback; the other ranks' outcomes follow in the message and in ``LaunchError.failures``. A rank that dies
before it starts (the spawned interpreter re-runs the launching script's top-level code: a script without
``if __name__ == "__main__":`` calls ``launch`` again there) is reported with that fix.

The other ranks are then terminated (then killed); no child outlives ``launch``, and ``/dev/shm`` files that a
killed child created (``megamoe.symm``) are removed.

Why this is not built on ``torch.multiprocessing.start_processes`` (tried for issue #9, branch ``wt9b``; it passed
the launch tests but was not merged): ``ProcessContext.join`` raises the first error it sees, which is a peer's
secondary "Connection closed by peer" in the blame test (3 runs of 3), so the root-cause search above is needed
anyway; ``join`` stops the other ranks only after one exited non-zero, so timeouts and interrupts still need their
own stop; torch's SIGINT parent-death signal leaves ranks alive under a launcher that ignores SIGINT (a background
job), hence our SIGTERM one; a result queue shared by the ranks can block forever when a rank is SIGKILLed while it
holds the queue's lock, hence one pipe per rank. Only spawning and traceback files could be delegated, and the
rebuilt module was longer (321 lines against 306), so this one stays.
"""
from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import wait

#: Seconds a terminated child gets to run its ``finally`` blocks before it is killed.
TERMINATE_GRACE_S = 5.0
#: Seconds ``launch`` keeps collecting the other ranks' outcomes after the first failure, so that the root cause
#: (which may be reported after its peers' secondary communication errors) can be named.
BLAME_GRACE_S = 3.0
#: Lower-case fragments of the messages of errors that collectives raise when a peer is gone or late (gloo's TCP
#: transport, NCCL, the store). An error whose message (or cause's) holds one is secondary: see
#: :func:`is_communication_error`.
COMM_ERROR_PATTERNS = ("connection closed by peer", "connection reset by peer", "broken pipe", "gloo/transport",
                       "timed out waiting", "socket timeout", "nccl error", "ncclremoteerror", "ncclsystemerror",
                       "ncclinternalerror", "watchdog caught collective operation timeout")
#: Set in the children's environment: the folder where a child records that it called ``launch`` while it was still
#: bootstrapping (an unguarded launching script), see :func:`_refuse_launch_while_bootstrapping`.
LAUNCH_DIR_ENV = "MEGAMOE_LAUNCH_DIR"
#: The fix for a launching script whose top-level code the spawned ranks re-run.
MAIN_GUARD_FIX = 'guard the script\'s entry point with `if __name__ == "__main__":`'


class LaunchError(RuntimeError):
    """A rank failed: ``rank`` (the root cause; None for a timeout of several ranks), ``exitcode`` (None if it
    raised), ``child_traceback`` (the rank's formatted traceback, or "") and ``failures`` (every failed rank's
    one-line outcome, by rank, the root cause's included; other ranks' entries are usually consequences)."""

    def __init__(self, message: str, rank: int | None = None, exitcode: int | None = None, child_traceback: str = "",
                 failures: dict[int, str] | None = None):
        super().__init__(message)
        self.rank, self.exitcode, self.child_traceback = rank, exitcode, child_traceback
        self.failures = dict(failures or {})

    def __reduce__(self):
        return type(self), (str(self), self.rank, self.exitcode, self.child_traceback, self.failures)


class PeerFailure(RuntimeError):
    """An error that only reports that *another* rank failed (e.g. a peer's shm file vanished during a rendezvous
    because that peer gave up). :func:`launch` treats it like a communication error: it never names the raising
    rank as the root cause while some rank failed otherwise."""


def is_communication_error(exc: BaseException) -> bool:
    """True when ``exc`` (or an exception in its ``__cause__``/``__context__`` chain) is a symptom of another rank's
    failure rather than a cause: a ``torch.distributed.DistError`` (backend, network, store errors and timeouts),
    a :class:`ConnectionError`, a :class:`PeerFailure`, megamoe's ``BarrierTimeout``, or an error whose message holds
    one of :data:`COMM_ERROR_PATTERNS` (gloo raises plain RuntimeErrors such as "Connection closed by peer")."""
    secondary_types: list[type] = [ConnectionError, PeerFailure]
    dist = sys.modules.get("torch.distributed")
    if dist is not None and hasattr(dist, "DistError"):
        secondary_types.append(dist.DistError)
    kernels_symm = sys.modules.get("megamoe.kernels.symm")  # imported by whoever can raise its BarrierTimeout
    if kernels_symm is not None and isinstance(getattr(kernels_symm, "BarrierTimeout", None), type):
        secondary_types.append(kernels_symm.BarrierTimeout)
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, tuple(secondary_types)):
            return True
        message = str(e).lower()
        if any(p in message for p in COMM_ERROR_PATTERNS):
            return True
        e = e.__cause__ or e.__context__
    return False


def launch(fn, world_size: int, *args, backend: str = "auto", timeout_s: float = 600.0, **kwargs) -> list:
    """Call ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` spawned ranks; return the results in rank
    order (they travel pickled).

    ``backend``: "cpu" (gloo + Triton interpreter), "cuda" (NCCL, needs ``world_size`` GPUs) or "auto" ("cuda"
    when that many GPUs exist, else "cpu"). ``fn`` must be importable by the children: a module-level function
    of a module other than ``__main__`` (not one defined in a notebook cell or a script body), and a launching
    script must guard its entry point with ``if __name__ == "__main__":`` (the spawned ranks re-run its top-level
    code).

    Raises :class:`LaunchError` naming the rank that failed first with something other than a communication error.
    """
    _refuse_launch_while_bootstrapping()
    if getattr(fn, "__module__", None) == "__main__":
        raise ValueError(f"{getattr(fn, '__qualname__', fn)!r} is defined in __main__ (a notebook or script), which "
                         "spawned ranks cannot import: move the rank function into a module and import it")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be a positive int")
    from megamoe.env import resolve_backend

    backend = resolve_backend(backend, world_size, local=False)
    store_dir = tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{os.getpid()}-")
    env = _child_env(backend, world_size) | {LAUNCH_DIR_ENV: _marker_dir()}
    procs, readers = [], []
    try:
        with _environ(env):
            ctx, parent_pid = _context(backend)
            environ = dict(os.environ)  # what a spawned rank would inherit; a forked one gets it from _child_main
            for rank in range(world_size):
                reader, writer = ctx.Pipe(duplex=False)
                p = ctx.Process(target=_child_main, name=f"megamoe-rank{rank}",
                                args=(fn, rank, world_size, backend, store_dir, parent_pid, environ, args, kwargs,
                                      writer))
                p.start()
                writer.close()
                procs.append(p)
                readers.append(reader)
        results = _collect(procs, readers, timeout_s, fn)
        _stop(procs, grace_s=TERMINATE_GRACE_S)
        return results
    finally:
        _stop(procs, grace_s=0.0)
        for r in readers:
            r.close()
        shutil.rmtree(store_dir, ignore_errors=True)


def init_from_env() -> tuple[int, int]:
    """For scripts started by torchrun: init the default process group (NCCL + this rank's GPU when CUDA is
    available, else gloo) from the torchrun environment; return ``(rank, world_size)``."""
    import torch
    import torch.distributed as dist

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", init_method="env://")
    return dist.get_rank(), dist.get_world_size()


# ---------------------------------------------------------------------------------------------------- parent side
#: What the CPU ranks' fork server imports once, so that a rank does not spend ~2.3 s of CPU importing torch, Triton
#: and megamoe (see :func:`_context`).
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "megamoe.launch", "megamoe.cases", "megamoe.process_ranks"]


def _context(backend: str):
    """The multiprocessing context for the ranks and the pid their parent will have.

    ``spawn`` (a fresh interpreter per rank), except for ``cpu`` ranks on a machine without CUDA, which are forked
    from multiprocessing's fork server: one interpreter per launching process that imports
    :data:`FORKSERVER_PRELOAD` once (under ``TRITON_INTERPRET=1``, the only mode CPU ranks run in) and forks a rank
    per request. It never initializes CUDA, threads or a process group, so forking it is safe, and a rank starts in
    milliseconds instead of re-importing torch (the suite starts ~150 ranks). What a rank sees is the same: it
    re-runs the launching script's top-level code as ``__mp_main__`` (multiprocessing's preparation data, as with
    spawn), gets ``sys.path`` and the working directory from the launcher, and the launch's environment is applied
    by :func:`_child_main` (a forked rank otherwise has the server's, from the first launch). Started on the first
    CPU launch of a process with that launch's environment; it exits with the launching process, and the ranks'
    parent-death signal (``_die_with_parent``) then reaches them through it."""
    from megamoe.env import cuda_available, interpreting

    if backend == "cpu" and interpreting() and "forkserver" in mp.get_all_start_methods() and not cuda_available():
        from multiprocessing import forkserver

        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)  # takes effect when the server (re)starts
        forkserver.ensure_running()
        return ctx, forkserver._forkserver._forkserver_pid
    return mp.get_context("spawn"), os.getpid()


_MARKER_DIR: list[str] = []
#: Prefix of this module's temporary folders (``<prefix><pid>-…`` for a launch's rendezvous store,
#: ``<prefix>markers-<pid>-…`` for a process's bootstrap markers): the pid names the process that owns one.
TEMP_PREFIX = "megamoe-launch-"


def _marker_dir() -> str:
    """This process's folder for the bootstrap markers of its ranks (``_refuse_launch_while_bootstrapping``): one
    per launching process, not per launch, because a forked rank bootstraps with the fork server's environment,
    which holds the first launch's ``MEGAMOE_LAUNCH_DIR``. Removed when the process exits; folders of processes
    that could not remove theirs (killed: a notebook kernel shut down by papermill, a test timeout) are removed
    by the next process that makes one (:func:`sweep_orphaned_temp_dirs`)."""
    if not _MARKER_DIR or not os.path.isdir(_MARKER_DIR[0]):
        import atexit

        sweep_orphaned_temp_dirs()
        path, pid = tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}markers-{os.getpid()}-"), os.getpid()
        atexit.register(lambda: os.getpid() == pid and shutil.rmtree(path, ignore_errors=True))
        _MARKER_DIR[:] = [path]
    return _MARKER_DIR[0]


def pid_alive(pid: int) -> bool:
    """True when a process ``pid`` exists in this pid namespace (a reused pid counts as alive: nothing is swept).
    The test of both sweeps: this module's temporary folders and ``megamoe.symm.sweep_stale_shm``."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def sweep_orphaned_temp_dirs(directory: str | None = None) -> list[str]:
    """Remove this user's ``TEMP_PREFIX`` folders in ``directory`` (default: the temporary directory) whose owning
    process no longer exists; returns their paths. A folder of a live process, of another user, or without a pid
    in its name is left alone."""
    import re

    directory = directory or tempfile.gettempdir()
    pattern = re.compile(re.escape(TEMP_PREFIX) + r"(?:markers-)?(\d+)-")
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = pattern.match(name)
        path = os.path.join(directory, name)
        if m is None or pid_alive(int(m.group(1))):  # (this process is alive too)
            continue
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
        except OSError:  # vanished meanwhile
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _child_env(backend: str, world_size: int) -> dict[str, str]:
    """Variables the children get: set around ``Process.start`` (spawn copies the environment) and applied again by
    ``_child_main`` (a rank forked from the fork server has the server's environment)."""
    env = {"WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port())}
    if backend == "cpu":
        env["TRITON_INTERPRET"] = "1"
    else:
        env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        env["NCCL_NVLS_ENABLE"] = os.environ.get("NCCL_NVLS_ENABLE", "0")
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _environ(env: dict[str, str]):
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@dataclass
class _Outcome:
    """What one rank came to: ``kind`` "ok" (``result``), "error" (it raised: ``traceback``, ``secondary`` when that
    was a communication error) or "died" (no result: ``exitcode``, ``started`` False when it died while its
    interpreter was still bootstrapping). ``time`` is ``time.monotonic()`` (one system-wide clock on Linux) when the
    rank caught its exception, or when the parent saw it dead."""

    rank: int
    kind: str
    time: float
    result: object = None
    traceback: str = ""
    secondary: bool = False
    exitcode: int | None = None
    started: bool = True
    message: str = ""

    def summary(self) -> str:
        """One line: the exception's last line, or how the rank died."""
        if self.kind == "error":
            lines = [ln for ln in self.traceback.strip().splitlines() if ln.strip()]
            last = lines[-1].strip() if lines else "an exception"
            return f"raised {last[:300]}" + (" (a communication error)" if self.secondary else "")
        return self.message.removeprefix(f"rank {self.rank} ")


def _collect(procs, readers, timeout_s: float, fn) -> list:
    """Wait for one outcome per rank. On the first failure, keep collecting for up to :data:`BLAME_GRACE_S` (or
    until every rank has an outcome), then raise :func:`_blame`'s LaunchError; at the deadline raise a timeout."""
    n = len(procs)
    outcomes: dict[int, _Outcome] = {}
    started: set[int] = set()
    deadline = time.monotonic() + timeout_s
    blame_by = None
    while len(outcomes) < n:
        end = deadline if blame_by is None else min(deadline, blame_by)
        left = end - time.monotonic()
        if left <= 0:
            break
        pending = [r for r in range(n) if r not in outcomes]
        handles = {readers[r]: r for r in pending} | {procs[r].sentinel: r for r in pending}
        for h in wait(list(handles), timeout=left):
            rank = handles[h]
            if rank in outcomes:
                continue
            outcome = _poll_rank(rank, readers[rank], procs[rank], started, fn)
            if outcome is None:
                continue
            outcomes[rank] = outcome
            if outcome.kind != "ok" and blame_by is None:
                blame_by = time.monotonic() + BLAME_GRACE_S
    if any(o.kind != "ok" for o in outcomes.values()):
        raise _blame(outcomes, n)
    if len(outcomes) < n:
        pending = [r for r in range(n) if r not in outcomes]
        raise LaunchError(f"launch timed out after {timeout_s} s; ranks {pending} had not finished")
    return [outcomes[r].result for r in range(n)]


def _poll_rank(rank: int, reader, proc, started: set[int], fn) -> _Outcome | None:
    """Read what rank ``rank`` sent; its outcome, or None while it is still running."""
    while reader.poll():
        try:
            status, payload = reader.recv()
        except (EOFError, OSError):  # the child closed its end (it exited): only its exit code is left
            break
        if status == "started":
            started.add(rank)
        elif status == "ok":
            return _Outcome(rank, "ok", time.monotonic(), result=payload)
        else:
            return _Outcome(rank, "error", payload["time"], traceback=payload["traceback"],
                            secondary=payload["secondary"])
    if proc.exitcode is None:
        return None
    proc.join()
    code = proc.exitcode
    how = f"was killed by signal {_signal_name(-code)}" if code < 0 else f"exited with code {code}"
    marker = _bootstrap_marker(_marker_dir(), proc.pid)
    rerun_launch = os.path.exists(marker)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(marker)  # a later rank may get this pid
    if rank in started:
        message = f"rank {rank} {how} without returning a result"
    elif rerun_launch:
        message = (f"rank {rank} {how} before it started: its interpreter re-ran the top-level code of the launching "
                   f"script {_main_file()}, which called launch() again (multiprocessing's 'attempt has been made "
                   f"to start a new process before the current process has finished its bootstrapping phase'). "
                   f"Fix: {MAIN_GUARD_FIX}")
    else:
        message = (f"rank {rank} {how} before it started running {getattr(fn, '__qualname__', fn)!r}: its "
                   f"interpreter failed while re-importing the launching script {_main_file()} or unpickling the "
                   f"function and its arguments (the traceback is on the rank's stderr). If the script runs code "
                   f"at import time, {MAIN_GUARD_FIX}")
    return _Outcome(rank, "died", time.monotonic(), exitcode=code, started=rank in started, message=message)


def _blame(outcomes: dict[int, _Outcome], n: int) -> LaunchError:
    """The LaunchError for a failed launch: the root cause is the earliest failure that is not a communication
    error (any failure if all are); every other rank's outcome is listed after its traceback."""
    failures = [o for o in outcomes.values() if o.kind != "ok"]
    primary = [o for o in failures if not o.secondary]
    root = min(primary or failures, key=lambda o: (o.time, o.rank))
    if root.kind == "error":
        message = f"rank {root.rank} raised:\n{root.traceback}"
    else:
        message = root.message
    if not primary:
        message = ("every failed rank reported a communication error (none raised anything else or died); the "
                   f"earliest was: {message}")
    others = []
    for r in range(n):
        if r == root.rank:
            continue
        o = outcomes.get(r)
        if o is None:
            others.append(f"  rank {r}: still running {BLAME_GRACE_S} s after the first failure (stopped)")
        elif o.kind == "ok":
            others.append(f"  rank {r}: returned a result")
        elif o.kind == "died" and o.summary() == root.summary():
            others.append(f"  rank {r}: the same")
        else:
            others.append(f"  rank {r}: {o.summary()}")
    if others:
        message = message.rstrip("\n") + "\nThe other ranks (a communication error is a consequence):\n" + \
            "\n".join(others)
    return LaunchError(message, rank=root.rank, exitcode=root.exitcode, child_traceback=root.traceback,
                       failures={o.rank: o.summary() for o in sorted(failures, key=lambda o: o.rank)})


def _main_file() -> str:
    """The launching script's path (in a spawned child the script runs as ``__mp_main__``)."""
    main = sys.modules.get("__mp_main__") or sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    return repr(path) if path else "(the __main__ module)"


def _bootstrap_marker(marker_dir: str, pid: int) -> str:
    return os.path.join(marker_dir, f"bootstrap-launch-{pid}")


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)


def _stop(procs, grace_s: float) -> None:
    """Give the children ``grace_s`` to exit, then terminate, then kill the rest; reap all; remove the shm files
    of dead children (a child killed while setting up a SymmBuffer could not unlink its own)."""
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + TERMINATE_GRACE_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
    if not procs:
        return
    from megamoe.symm import shm_files_of  # torch is imported by then: only when ranks were started

    for p in procs:
        for path in shm_files_of(p.pid):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


# ---------------------------------------------------------------------------------------------------- child side
def _refuse_launch_while_bootstrapping() -> None:
    """Raise a clear error when ``launch`` is called by a spawned child that is still bootstrapping: it is re-running
    the launching script's top-level code, which has no ``if __name__ == "__main__":`` guard. A rank spawned by
    ``launch`` also leaves a marker for the parent (see ``_poll_rank``)."""
    import multiprocessing.process

    if not getattr(multiprocessing.process.current_process(), "_inheriting", False):
        return
    marker_dir = os.environ.get(LAUNCH_DIR_ENV)
    if marker_dir and os.path.isdir(marker_dir):
        with contextlib.suppress(OSError), open(_bootstrap_marker(marker_dir, os.getpid()), "w"):
            pass
    raise RuntimeError(f"launch() was called while a spawned rank re-ran the top-level code of the launching script "
                       f"{_main_file()}; {MAIN_GUARD_FIX}")


def _raise_system_exit(signum, frame):
    raise SystemExit(128 + signum)


def _die_with_parent(parent_pid: int) -> None:
    """Ask Linux to send SIGTERM to this rank when the launching process dies (prctl PR_SET_PDEATHSIG)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        raise SystemExit(1)


def _child_main(fn, rank: int, world_size: int, backend: str, store_dir: str, parent_pid: int, env: dict, args,
                kwargs, conn) -> None:
    """Entry point of one rank: send ``("started", pid)``, init the process group, run ``fn``, send ``("ok",
    result)`` or ``("error", report)`` (see :func:`_failure_report`). An exception of ``fn`` is reported *before*
    the process group is torn down (which makes the peers fail), so that the root cause is not reported last.
    ``parent_pid``: the launcher (spawn) or the fork server (see :func:`_context`); ``env``: the launcher's
    environment with the launch's variables, which becomes this rank's."""
    signal.signal(signal.SIGTERM, _raise_system_exit)  # so that `finally` blocks (shm unlink) run on terminate
    _send(conn, ("started", os.getpid()))
    _die_with_parent(parent_pid)
    for key in set(os.environ) - set(env):  # the launcher's environment, as spawn would have copied it
        del os.environ[key]
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank))
    import torch
    import torch.distributed as dist

    reported = False
    try:
        if backend == "cuda":
            torch.cuda.set_device(rank)
        else:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        store = dist.FileStore(os.path.join(store_dir, "store"), world_size)
        dist.init_process_group("nccl" if backend == "cuda" else "gloo", store=store, rank=rank,
                                world_size=world_size, timeout=timedelta(minutes=10))
        if backend != "cuda":
            # every rank through gloo's connect before any runs fn: a rank whose fn returns at once would otherwise
            # tear its pairs down while a slower peer is still in connectFullMesh ("Connection closed by peer"; seen
            # once in CI on a loaded 2-core machine, test_ranks_get_the_launchers_environment_of_each_launch)
            dist.barrier()
        try:
            result = fn(rank, world_size, *args, **kwargs)
        except BaseException as exc:
            reported = _send(conn, ("error", _failure_report(exc)))
            raise
        finally:
            dist.destroy_process_group()
        conn.send(("ok", result))
    except BaseException as exc:
        if not reported:
            _send(conn, ("error", _failure_report(exc)))
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # nothing left to clean up: a late terminate just ends us
        conn.close()


def _failure_report(exc: BaseException) -> dict:
    """What a failed rank sends: when it failed (``time.monotonic()``), its traceback, and whether the error is a
    communication error (``secondary``). Call it inside the ``except`` block that caught ``exc``."""
    return {"time": time.monotonic(), "traceback": traceback.format_exc(), "secondary": is_communication_error(exc)}


def _send(conn, message) -> bool:
    """Send ``message`` to the parent; False when the parent has stopped listening."""
    try:
        conn.send(message)
        return True
    except OSError:
        return False
