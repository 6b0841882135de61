"""Run a function on N ranks, one spawned process per rank, and collect the results in rank order.

    results = launch(my_module.rank_fn, 4, arg, backend="cpu")    # rank_fn(rank, world_size, arg) on 4 processes

``cpu``: gloo ranks and Triton's interpreter (``TRITON_INTERPRET=1``) in every child; ``cuda``: NCCL, one GPU per
rank. The process group is initialized from a FileStore in a temporary directory (no ports are opened); the
torchrun variables RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT are set anyway so
that code written for torchrun runs unchanged. Scripts started by torchrun call :func:`init_from_env` instead.

Failures come back as :class:`LaunchError` naming the rank: its traceback if it raised, its exit code or signal if
it died without a result, or a timeout. The other ranks are then terminated (then killed); no child outlives
``launch``, and ``/dev/shm`` files that a killed child created (``megamoe.symm``) are removed.
"""
from __future__ import annotations

import contextlib
import ctypes
import glob
import multiprocessing as mp
import os
import shutil
import signal
import socket
import tempfile
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import wait

#: Seconds a terminated child gets to run its ``finally`` blocks before it is killed.
TERMINATE_GRACE_S = 5.0


class LaunchError(RuntimeError):
    """A rank failed: ``rank`` (None for a timeout of several ranks), ``exitcode`` (None if it raised) and
    ``child_traceback`` (the rank's formatted traceback, or "")."""

    def __init__(self, message: str, rank: int | None = None, exitcode: int | None = None, child_traceback: str = ""):
        super().__init__(message)
        self.rank, self.exitcode, self.child_traceback = rank, exitcode, child_traceback


def launch(fn, world_size: int, *args, backend: str = "auto", timeout_s: float = 600.0, **kwargs) -> list:
    """Call ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` spawned ranks; return the results in rank
    order (they travel pickled).

    ``backend``: "cpu" (gloo + Triton interpreter), "cuda" (NCCL, needs ``world_size`` GPUs) or "auto" ("cuda"
    when that many GPUs exist, else "cpu"). ``fn`` must be importable by the children: a module-level function
    of a module other than ``__main__`` (not one defined in a notebook cell or a script body).
    """
    if getattr(fn, "__module__", None) == "__main__":
        raise ValueError(f"{getattr(fn, '__qualname__', fn)!r} is defined in __main__ (a notebook or script), which "
                         "spawned ranks cannot import: move the rank function into a module and import it")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be a positive int")
    backend = _resolve_backend(backend, world_size)
    ctx = mp.get_context("spawn")
    store_dir = tempfile.mkdtemp(prefix="megamoe-launch-")
    env = _child_env(backend, world_size)
    procs, readers = [], []
    try:
        with _environ(env):
            for rank in range(world_size):
                reader, writer = ctx.Pipe(duplex=False)
                p = ctx.Process(target=_child_main, name=f"megamoe-rank{rank}",
                                args=(fn, rank, world_size, backend, store_dir, os.getpid(), args, kwargs, writer))
                p.start()
                writer.close()
                procs.append(p)
                readers.append(reader)
        results = _collect(procs, readers, timeout_s)
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
def _resolve_backend(backend: str, world_size: int) -> str:
    if backend not in ("auto", "cpu", "cuda"):
        raise ValueError(f"backend={backend!r} must be 'auto', 'cpu' or 'cuda'")
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        return "cuda" if gpus >= world_size else "cpu"
    if backend == "cuda" and gpus < world_size:
        raise ValueError(f"backend='cuda' needs {world_size} GPUs, found {gpus}")
    return backend


def _child_env(backend: str, world_size: int) -> dict[str, str]:
    """Variables the children inherit (set around ``Process.start``, since spawn copies the environment)."""
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


def _collect(procs, readers, timeout_s: float) -> list:
    """Wait for one message per rank; raise LaunchError on the first failure or at the deadline."""
    results: dict[int, object] = {}
    deadline = time.monotonic() + timeout_s
    while len(results) < len(procs):
        pending = [r for r in range(len(procs)) if r not in results]
        left = deadline - time.monotonic()
        if left <= 0:
            raise LaunchError(f"launch timed out after {timeout_s} s; ranks {pending} had not finished")
        handles = {readers[r]: r for r in pending} | {procs[r].sentinel: r for r in pending}
        for h in wait(list(handles), timeout=left):
            rank = handles[h]
            if rank in results:
                continue
            message = _receive(readers[rank], procs[rank])
            if message is None:
                continue
            status, payload = message
            if status == "error":
                raise LaunchError(f"rank {rank} raised:\n{payload}", rank=rank, child_traceback=payload)
            results[rank] = payload
    return [results[r] for r in range(len(procs))]


def _receive(reader, proc):
    """The rank's ``(status, payload)`` if one is ready; None if it is still running; LaunchError if it died."""
    if reader.poll():
        try:
            return reader.recv()
        except EOFError:
            pass
    elif proc.exitcode is None:
        return None
    proc.join()
    code = proc.exitcode
    how = f"was killed by signal {_signal_name(-code)}" if code < 0 else f"exited with code {code}"
    raise LaunchError(f"rank {_rank_of(proc)} {how} without returning a result", rank=_rank_of(proc), exitcode=code)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)


def _rank_of(proc) -> int:
    return int(proc.name.removeprefix("megamoe-rank"))


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
    for p in procs:
        for path in glob.glob(f"/dev/shm/megamoe-{p.pid}-*"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


# ---------------------------------------------------------------------------------------------------- child side
def _raise_system_exit(signum, frame):
    raise SystemExit(128 + signum)


def _die_with_parent(parent_pid: int) -> None:
    """Ask Linux to send SIGTERM to this rank when the launching process dies (prctl PR_SET_PDEATHSIG)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        raise SystemExit(1)


def _child_main(fn, rank: int, world_size: int, backend: str, store_dir: str, parent_pid: int, args, kwargs,
                conn) -> None:
    """Entry point of one rank: init the process group, run ``fn``, send ``("ok", result)`` or ``("error", tb)``."""
    signal.signal(signal.SIGTERM, _raise_system_exit)  # so that `finally` blocks (shm unlink) run on terminate
    _die_with_parent(parent_pid)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))
    import torch
    import torch.distributed as dist

    try:
        if backend == "cuda":
            torch.cuda.set_device(rank)
        else:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        store = dist.FileStore(os.path.join(store_dir, "store"), world_size)
        dist.init_process_group("nccl" if backend == "cuda" else "gloo", store=store, rank=rank,
                                world_size=world_size, timeout=timedelta(minutes=10))
        try:
            result = fn(rank, world_size, *args, **kwargs)
        finally:
            dist.destroy_process_group()
        conn.send(("ok", result))
    except BaseException:
        with contextlib.suppress(OSError):  # the parent may already have given up on this rank
            conn.send(("error", traceback.format_exc()))
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # nothing left to clean up: a late terminate just ends us
        conn.close()
