"""SymmBuffer (cpu and local backends), sym_map/copy kernels and the barrier, on CPU under Triton's interpreter.

Multi-rank tests spawn one process per rank through ``megamoe.launch`` and run the functions in ``rank_fns``.
"""
import math
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

# Spawned ranks import rank_fns by name; they inherit this sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parent))
import rank_fns  # noqa: E402

import megamoe.symm  # noqa: E402
from megamoe.kernels import symm as ks  # noqa: E402
from megamoe.launch import LaunchError, launch  # noqa: E402
from megamoe.layout import Layout  # noqa: E402
from megamoe.symm import (  # noqa: E402
    SHM_DIR,
    SHM_PREFIX,
    STALE_SHM_MIN_AGE_S,
    VIEW_NAMES,
    SymmBuffer,
    get_symm_buffer_for_mega_moe,
    shm_files_of,
    sweep_stale_shm,
)

# xdist_group: these tests list /dev/shm for leaked files of dead ranks, kill ranks on purpose and time barrier
# timeouts; under `make test` (pytest-xdist, --dist loadgroup) they all run on one worker, one after another
# (see tests/conftest.py).
pytestmark = [pytest.mark.usefixtures("no_leftovers"), pytest.mark.xdist_group("shm")]

SHAPE = dict(num_experts=8, num_max_tokens_per_rank=rank_fns.T, num_topk=rank_fns.TOPK, hidden=rank_fns.H,
             intermediate_hidden=rank_fns.I, block_m=rank_fns.BLOCK_M)


# ---------------------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize("override, exc, name", [
    (dict(hidden=200), ValueError, "hidden"),
    (dict(intermediate_hidden=384 + 64), ValueError, "intermediate_hidden"),
    (dict(block_m=48), ValueError, "block_m"),
    (dict(block_m=8), ValueError, "block_m"),
    (dict(block_m=16.0), TypeError, "block_m"),
    (dict(mma_type="bf16xbf16"), ValueError, "mma_type"),
    (dict(activation="gelu"), ValueError, "activation"),
    (dict(barrier_timeout_s=0), ValueError, "barrier_timeout_s"),
    (dict(barrier_timeout_s=math.inf), ValueError, "barrier_timeout_s"),
    (dict(barrier_timeout_s="5"), TypeError, "barrier_timeout_s"),
    (dict(backend="tpu"), ValueError, "backend"),
    (dict(backend="local"), ValueError, "SymmBuffer.local"),
    (dict(num_topk=0), ValueError, "num_topk"),
])
def test_validation_names_the_argument(override, exc, name):
    with pytest.raises(exc, match=name):
        SymmBuffer(None, **(SHAPE | override))


def test_num_experts_must_divide_over_ranks():
    with pytest.raises(ValueError, match="num_experts=6 must be divisible by num_ranks=4"):
        SymmBuffer.local(4, **(SHAPE | dict(num_experts=6)))


# ---------------------------------------------------------------------------------------------------- single rank
def test_single_rank_without_process_group():
    with get_symm_buffer_for_mega_moe(None, **SHAPE, barrier_timeout_s=1.0) as sb:
        assert (sb.rank, sb.num_ranks, sb.backend, sb.group) == (0, 1, "cpu", None)
        assert sb.layout.num_bytes == Layout(1, 8, 16, 2, 384, 256, 16).num_bytes == sb.buffer.numel()
        assert sb.buffer_ptrs.tolist() == [sb.buffer.data_ptr()]
        assert int(sb.buffer.count_nonzero()) == 0
        for name in VIEW_NAMES:
            v = getattr(sb, name)
            assert v.dtype == sb.layout[name].dtype and tuple(v.shape) == sb.layout[name].shape
            assert v.data_ptr() == sb.buffer.data_ptr() + sb.layout.offset(name)
        assert sb.l1_acts_sf.stride() == (1, sb.layout.num_padded_sf_pool_tokens)
        ks.barrier(sb, ks.TAG_BEFORE_DISPATCH_PULL)
        ks.barrier(sb, ks.TAG_BEFORE_COMBINE_REDUCE)
        assert sb.view("barrier_state").tolist() == [2, 0, -1, 0]
    with pytest.raises(RuntimeError, match="destroyed"):
        sb.x
    sb.destroy()


# ---------------------------------------------------------------------------------------------------- cpu backend
@pytest.mark.parametrize("world_size", [2, 4])
def test_cpu_backend_views_mapping_and_copy(world_size):
    out = launch(rank_fns.symm_views_and_copy, world_size, backend="cpu", timeout_s=60)
    layout = Layout(world_size, 2 * world_size, rank_fns.T, rank_fns.TOPK, rank_fns.H, rank_fns.I, rank_fns.BLOCK_M)
    for rank, info in enumerate(out):
        assert (info["rank"], info["num_ranks"], info["backend"]) == (rank, world_size, "cpu")
        assert info["num_bytes"] == layout.num_bytes
        assert info["segments"] == out[0]["segments"] == [(s.name, s.offset, s.nbytes) for s in layout]
        assert info["views"] == out[0]["views"]
        ptrs = info["buffer_ptrs"]
        assert len(set(ptrs)) == world_size and ptrs[rank] == info["own_ptr"]
        assert info["peer_value"] == 1000 + (rank + 1) % world_size  # a host write on one rank, read on another
        assert info["bad_bytes"] == 0
        assert info["files_after_init"] == [] and info["files_after_destroy"] == []
    views = out[0]["views"]
    assert views["x"][:2] == ("torch.float8_e4m3fn", (rank_fns.T, rank_fns.H))
    assert views["topk_idx"][:2] == ("torch.int64", (rank_fns.T, rank_fns.TOPK))
    assert views["l1_acts_sf"][2] == (1, layout.num_padded_sf_pool_tokens)


def test_barrier_rounds_with_skew_self_reset():
    rounds = 4
    out = launch(rank_fns.symm_barrier_rounds, 4, rounds, 0.3, backend="cpu", timeout_s=60)
    for info in out:
        assert info["wrong"] == []
        assert info["state"] == [2 * rounds, 0, -1, 0]  # epochs only grow; nothing was zeroed
        assert info["signal"] == [2 * rounds] * 4


@pytest.mark.alone  # bounds on elapsed time: `make test` runs it alone, after the parallel part (Makefile)
def test_barrier_timeout_names_missing_rank_and_tag():
    timeout = 2.0
    out = launch(rank_fns.symm_barrier_timeout, 3, 1, timeout, backend="cpu", timeout_s=60)
    assert out[1] is None
    for rank in (0, 2):
        info = out[rank]
        assert (info["rank"], info["tag"], info["missing_rank"]) == (rank, ks.TAG_BEFORE_COMBINE_REDUCE, 1)
        assert info["message"] == f"rank {rank}: barrier tag 2 timed out after {timeout} s waiting for rank 1"
        assert timeout <= info["elapsed_s"] < 2 * timeout
        tag, missing, elapsed = info["again"]  # a failed buffer fails every later barrier at once
        assert (tag, missing) == (2, 1) and elapsed < 1.0


def test_setup_failure_unlinks_own_segment():
    assert launch(rank_fns.symm_setup_fails, 2, backend="cpu", timeout_s=60) == [[], []]


def test_rank_dying_during_setup_leaves_no_segment(tmp_path):
    with pytest.raises(LaunchError) as info:
        launch(rank_fns.symm_setup_dies, 2, 1, str(tmp_path), backend="cpu", timeout_s=60)
    assert info.value.rank == 1 and info.value.exitcode == 3
    assert rank_fns.pids_alive(tmp_path) == []
    assert rank_fns.pid_shm_files(tmp_path) == []


# ---------------------------------------------------------------------------------------------------- layout agreement
@pytest.mark.parametrize("field, value", [("num_max_tokens_per_rank", 32), ("num_experts", 16), ("num_topk", 3),
                                          ("hidden", 512), ("intermediate_hidden", 384), ("block_m", 32),
                                          ("format", "fp8")])
def test_layout_mismatch_names_the_field_on_every_rank(monkeypatch, field, value):
    """The fingerprint check, without processes: rank 0 of 2 sees rank 1's fingerprint differ in ``field``."""
    def fake_all_gather_object(out, obj, group=None):
        other = Layout(**(dict(num_ranks=2) | SHAPE | {field: value}))
        out[:] = [obj, other.fingerprint()]

    monkeypatch.setattr(megamoe.symm.dist, "all_gather_object", fake_all_gather_object)
    mine = Layout(2, **SHAPE)
    with pytest.raises(ValueError, match=rf"rank 0: the ranks' SymmBuffer layouts differ .*: {field}: "
                                         rf"rank 0={getattr(mine, field)}, rank 1={value}$"):
        megamoe.symm._check_same_layout(mine, 0, None)
    fake = Layout(2, **SHAPE).fingerprint()
    monkeypatch.setattr(megamoe.symm.dist, "all_gather_object", lambda out, obj, group=None: out.__setitem__(
        slice(None), [obj, fake]))
    megamoe.symm._check_same_layout(mine, 0, None)  # equal layouts pass


@pytest.mark.slow
def test_mismatched_layouts_fail_on_every_rank_naming_the_field():
    with pytest.raises(LaunchError) as info:
        launch(rank_fns.mismatched_buffer, 2, "num_max_tokens_per_rank", 2 * rank_fns.T, backend="cpu",
               timeout_s=60)
    e = info.value
    detail = f"num_max_tokens_per_rank: rank 0={rank_fns.T}, rank 1={2 * rank_fns.T}"
    assert "layouts differ" in str(e) and detail in e.child_traceback
    assert sorted(e.failures) == [0, 1] and all(detail in f for f in e.failures.values())
    assert "mmap length" not in str(e)


# ---------------------------------------------------------------------------------------------------- stale shm sweep
def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert not megamoe.symm._pid_alive(proc.pid)
    return proc.pid


def _fake_shm(pid, age_s: float, tag: str) -> str:
    path = os.path.join(SHM_DIR, f"{SHM_PREFIX}{pid}-{tag}{os.getpid()}-r0")
    with open(path, "wb") as f:
        f.write(b"x" * 64)
    os.utime(path, (time.time() - age_s, time.time() - age_s))
    return path


@pytest.mark.alone  # sweeps every megamoe shm file (min_age_s=0): never beside another test's ranks (Makefile)
def test_sweep_removes_only_stale_files_of_dead_creators():
    import fcntl

    dead = _dead_pid()
    old = STALE_SHM_MIN_AGE_S + 60
    stale = _fake_shm(dead, old, "stale")
    fresh = _fake_shm(dead, 0, "fresh")               # a creator between open() and flock(): too young to judge
    live = _fake_shm(os.getpid(), old, "live")        # its creator (this process) is alive
    locked = _fake_shm(dead, old, "locked")           # a live process (here) holds the lock: pid namespace case
    other = os.path.join(SHM_DIR, f"{SHM_PREFIX}notapid-{os.getpid()}")
    open(other, "wb").close()
    lock_fd = os.open(locked, os.O_RDONLY)
    fcntl.flock(lock_fd, fcntl.LOCK_SH)
    try:
        with SymmBuffer(None, **SHAPE) as sb:         # a new cpu buffer sweeps first
            assert sb.backend == "cpu"
        assert not os.path.exists(stale)
        assert all(os.path.exists(p) for p in (fresh, live, locked, other))
        assert sweep_stale_shm() == []                # nothing else to do
        assert sweep_stale_shm(min_age_s=0) == [fresh]
        fcntl.flock(lock_fd, fcntl.LOCK_UN)
        assert sweep_stale_shm() == [locked]
        assert os.path.exists(live) and os.path.exists(other)
    finally:
        os.close(lock_fd)
        for p in (stale, fresh, live, locked, other):
            if os.path.exists(p):
                os.unlink(p)


TORCHRUN_STYLE_RANK = """
    import os, sys
    sys.path.insert(0, {tests!r})
    import torch.distributed as dist
    import rank_fns

    rank = int(sys.argv[1])
    dist.init_process_group("gloo", store=dist.FileStore({store!r}, 2), rank=rank, world_size=2)
    rank_fns.fail_during_setup(rank, 2, 1, "sigkill_mapping", {pid_dir!r})  # rank 1 SIGKILLs itself mid-set-up
"""


@pytest.mark.slow
def test_rank_killed_during_setup_without_launch_leaks_until_next_buffer(tmp_path):
    """torchrun-style ranks (no launch() parent to sweep): rank 1 is SIGKILLed while its shm file is linked; the
    file survives it, and the next cpu SymmBuffer made on the machine removes it once it is old enough."""
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(TORCHRUN_STYLE_RANK.format(
        tests=str(Path(__file__).resolve().parent), store=str(tmp_path / "store"), pid_dir=str(tmp_path))))
    env = os.environ | {"TRITON_INTERPRET": "1"}
    procs = [subprocess.Popen([sys.executable, str(script), str(r)], env=env, stderr=subprocess.PIPE)
             for r in range(2)]
    codes = [p.wait(timeout=120) for p in procs]
    for p in procs:
        p.stderr.close()
    assert codes[1] == -9 and codes[0] == 1
    leaked = rank_fns.pid_shm_files(tmp_path)
    try:
        assert len(leaked) == 1 and f"{SHM_PREFIX}{procs[1].pid}-" in leaked[0]  # rank 0 unlinked its own
        with SymmBuffer(None, **SHAPE):
            pass
        assert os.path.exists(leaked[0])                                         # too young to judge yet
        past = time.time() - STALE_SHM_MIN_AGE_S - 1
        os.utime(leaked[0], (past, past))
        with SymmBuffer(None, **SHAPE):
            pass
        assert rank_fns.pid_shm_files(tmp_path) == []
    finally:
        for p in leaked:
            if os.path.exists(p):
                os.unlink(p)


def test_shm_names_carry_the_creator_pid():
    path = megamoe.symm.shm_path(3)
    assert path.startswith(os.path.join(SHM_DIR, f"{SHM_PREFIX}{os.getpid()}-")) and path.endswith("-r3")
    assert megamoe.symm._shm_creator_pid(path) == os.getpid()
    open(path, "wb").close()
    try:
        assert shm_files_of(os.getpid()) == [path]
    finally:
        os.unlink(path)


# ---------------------------------------------------------------------------------------------------- local backend
def test_local_backend_copy_and_lockstep_barrier():
    R = 4
    sbs = SymmBuffer.local(R, **(SHAPE | dict(num_experts=2 * R)), barrier_timeout_s=0.5)
    assert [sb.rank for sb in sbs] == list(range(R)) and {sb.backend for sb in sbs} == {"local"}
    assert all(torch.equal(sb.buffer_ptrs, sbs[0].buffer_ptrs) for sb in sbs)
    assert sbs[0].buffer_ptrs.tolist() == [sb.buffer.data_ptr() for sb in sbs]
    rank_fns.exchange_rows_lockstep(sbs)
    assert [rank_fns.count_bad_bytes(sb) for sb in sbs] == [0] * R
    assert [sb.view("barrier_state").tolist() for sb in sbs] == [[2, 0, -1, 0]] * R

    for sb in sbs[:-1]:  # rank 3 never arrives
        ks.barrier_arrive(sb)
    start = time.monotonic()
    with pytest.raises(ks.BarrierTimeout, match="rank 0: barrier tag 3 timed out after 0.5 s waiting for rank 3") as e:
        ks.barrier_wait(sbs[0], ks.TAG_AFTER_WORKSPACE_CLEAN)
    assert (e.value.rank, e.value.tag, e.value.missing_rank) == (0, 3, 3)
    assert time.monotonic() - start < 1.0
    with pytest.raises(ks.BarrierTimeout):
        ks.check_barrier_state(sbs[0])
    ks.check_barrier_state(sbs[1])  # rank 1 has not waited yet: nothing recorded
    for sb in sbs:
        sb.destroy()


def test_copy_rows_rejects_bad_arguments():
    sb = SymmBuffer.local(2, **(SHAPE | dict(num_experts=4)))[0]
    with pytest.raises(ValueError, match="MN-major"):
        ks.pull_rows(sb, 1, "l1_acts_sf", [0])
    with pytest.raises(ValueError, match="src_rank=2"):
        ks.copy_rows(sb, 2, 0, "x", [0])
    with pytest.raises(IndexError, match="rows must lie in"):
        ks.pull_rows(sb, 1, "x", [rank_fns.T])
    with pytest.raises(ValueError, match="row bytes differ"):
        ks.pull_rows(sb, 1, "x", [0], dst_segment="l2_acts")
    with pytest.raises(ValueError, match="differ in length"):
        ks.pull_rows(sb, 1, "x", [0, 1], [0])


def test_barrier_timeout_pickles():
    import pickle

    e = pickle.loads(pickle.dumps(ks.BarrierTimeout(1, 2, 3, 5.0)))
    assert (e.rank, e.tag, e.missing_rank) == (1, 2, 3)
    assert str(e) == "rank 1: barrier tag 2 timed out after 5.0 s waiting for rank 3"
