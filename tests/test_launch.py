"""megamoe.launch: rank order, argument passing, failure forwarding, and no process left behind."""
import importlib
import multiprocessing as mp
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch.distributed as dist

# Spawned ranks import rank_fns by name; they inherit this sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parent))
import rank_fns  # noqa: E402

launch_mod = importlib.import_module("megamoe.launch")
from megamoe.launch import LaunchError, PeerFailure, init_from_env, is_communication_error, launch  # noqa: E402

# xdist_group: these tests list /dev/shm for leaked files of dead ranks, kill ranks on purpose and time barrier
# timeouts; under `make test` (pytest-xdist, --dist loadgroup) they all run on one worker, one after another
# (see tests/conftest.py).
pytestmark = [pytest.mark.usefixtures("no_leftovers"), pytest.mark.xdist_group("shm")]


def test_results_in_rank_order_with_args_and_env():
    out = launch(rank_fns.whoami, 3, {"a": [1, 2]}, backend="cpu", timeout_s=60, scale=7)
    assert [o["rank"] for o in out] == [0, 1, 2]
    for rank, o in enumerate(out):
        assert (o["world_size"], o["payload"], o["scale"]) == (3, {"a": [1, 2]}, 7)
        assert (o["dist_rank"], o["dist_world"], o["backend"]) == (rank, 3, "gloo")
        env = o["env"]
        assert (env["RANK"], env["LOCAL_RANK"]) == (str(rank), str(rank))
        assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("3", "3")
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"].isdigit()
        assert env["TRITON_INTERPRET"] == "1"
    assert len({o["pid"] for o in out}) == 3 and os.getpid() not in {o["pid"] for o in out}
    assert mp.active_children() == []


def test_ranks_get_the_launchers_environment_of_each_launch(monkeypatch):
    """A rank's environment is the launcher's when ``launch`` is called (as spawn copies it), also where ranks are
    forked from a fork server started by an earlier launch with another environment."""
    keys = ["MEGAMOE_TEST_VALUE", "MEGAMOE_TEST_GONE"]
    monkeypatch.setenv("MEGAMOE_TEST_GONE", "here")
    assert launch(rank_fns.environ_of, 2, keys, backend="cpu", timeout_s=60) == [{keys[0]: None, keys[1]: "here"}] * 2
    monkeypatch.setenv("MEGAMOE_TEST_VALUE", "set later")
    monkeypatch.delenv("MEGAMOE_TEST_GONE")
    assert launch(rank_fns.environ_of, 2, keys, backend="cpu", timeout_s=60) == [{keys[0]: "set later",
                                                                                  keys[1]: None}] * 2
    assert mp.active_children() == []


def test_exception_is_forwarded_with_rank_and_traceback():
    with pytest.raises(LaunchError, match="rank 1 raised") as info:
        launch(rank_fns.raise_on, 2, 1, backend="cpu", timeout_s=60)
    e = info.value
    assert e.rank == 1 and e.exitcode is None
    assert "ValueError: deliberate failure on rank 1" in str(e) and "raise_on" in e.child_traceback
    assert mp.active_children() == []


@pytest.mark.slow  # + BLAME_GRACE_S: the other ranks never finish
def test_crashed_rank_reported_with_exit_code_and_others_stopped(tmp_path):
    with pytest.raises(LaunchError, match="rank 1 exited with code 3 without returning a result") as info:
        launch(rank_fns.exit_on, 3, 1, 3, str(tmp_path), backend="cpu", timeout_s=60)
    assert (info.value.rank, info.value.exitcode) == (1, 3)
    assert len(list(tmp_path.glob("*.pid"))) == 3
    assert rank_fns.pids_alive(tmp_path) == [] and mp.active_children() == []


@pytest.mark.slow
def test_timeout_stops_every_rank(tmp_path):
    with pytest.raises(LaunchError, match=r"timed out after 10\.0 s; ranks \[(0, )?1\] had not finished"):
        launch(rank_fns.sleep_on, 2, 1, str(tmp_path), backend="cpu", timeout_s=10.0)
    assert rank_fns.pids_alive(tmp_path) == [] and mp.active_children() == []


def test_main_module_functions_rejected():
    def rank_fn(rank, world_size):
        return rank

    rank_fn.__module__ = "__main__"
    with pytest.raises(ValueError, match="__main__.*move the rank function into a module"):
        launch(rank_fn, 2)


@pytest.mark.parametrize("kw, match", [(dict(world_size=0), "world_size"),
                                       (dict(world_size=2, backend="tpu"), "backend"),
                                       (dict(world_size=1024, backend="cuda"), "GPUs")])
def test_bad_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        launch(rank_fns.whoami, **kw)


def test_init_from_env_single_rank(monkeypatch):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    try:
        assert init_from_env() == (0, 1)
        assert dist.get_backend() == "gloo"
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------- blame
GLOO_CLOSED = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
               "[127.0.0.1]:4242. This is typically caused by a remote worker crashing.")


def _raised(exc):
    try:
        raise exc
    except BaseException as e:
        return e


@pytest.mark.parametrize("exc, secondary", [
    (RuntimeError(GLOO_CLOSED), True),
    (RuntimeError("[pair.cc:537] Read error [127.0.0.1]:30948: Connection reset by peer"), True),
    (dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1, remote process exited"), True),
    (dist.DistStoreError("wait timeout after 30000ms, keys: /rank1"), True),
    (ConnectionResetError(104, "reset"), True),
    (PeerFailure("rank 1's shm file was removed"), True),
    (ValueError("hidden=448 must be a multiple of 128"), False),
    (RuntimeError("CUDA error: an illegal memory access was encountered"), False),
    (KeyboardInterrupt(), False),
])
def test_communication_errors_are_classified(exc, secondary):
    assert is_communication_error(exc) is secondary


def test_communication_error_found_in_the_cause_chain():
    try:
        try:
            raise RuntimeError(GLOO_CLOSED)
        except RuntimeError as e:
            raise ValueError("all_gather_object failed") from e
    except ValueError as e:
        assert is_communication_error(e)
    from megamoe.kernels.symm import BarrierTimeout

    assert is_communication_error(BarrierTimeout(0, 2, 1, 1.0))


def _outcome(rank, kind, t, secondary=False, summary="", exitcode=None):
    if kind == "error":
        return launch_mod._Outcome(rank, "error", t, traceback=f"Traceback ...\n{summary}\n", secondary=secondary)
    return launch_mod._Outcome(rank, kind, t, exitcode=exitcode,
                               message=f"rank {rank} was killed by signal SIGKILL without returning a result")


def test_blame_prefers_the_earliest_non_communication_failure():
    outcomes = {0: _outcome(0, "error", 1.0, True, "RuntimeError: " + GLOO_CLOSED),
                1: _outcome(1, "error", 3.0, False, "ValueError: deliberate failure on rank 1"),
                2: _outcome(2, "died", 2.0, exitcode=-9),
                3: launch_mod._Outcome(3, "ok", 0.5, result=3)}
    e = launch_mod._blame(outcomes, 5)
    assert (e.rank, e.exitcode) == (2, -9)  # the death precedes rank 1's ValueError; rank 0's error is secondary
    assert str(e).startswith("rank 2 was killed by signal SIGKILL")
    for line in ("rank 0: raised RuntimeError: [/pytorch", "(a communication error)",
                 "rank 1: raised ValueError: deliberate failure on rank 1", "rank 3: returned a result",
                 "rank 4: still running"):
        assert line in str(e)
    assert sorted(e.failures) == [0, 1, 2]
    del outcomes[2]
    e = launch_mod._blame(outcomes, 5)
    assert e.rank == 1 and e.exitcode is None and str(e).startswith("rank 1 raised:")
    assert "ValueError: deliberate" in e.child_traceback


def test_blame_with_only_communication_errors_names_the_earliest():
    outcomes = {0: _outcome(0, "error", 2.0, True, "RuntimeError: " + GLOO_CLOSED),
                1: _outcome(1, "error", 1.0, True, "RuntimeError: " + GLOO_CLOSED)}
    e = launch_mod._blame(outcomes, 2)
    assert e.rank == 1 and str(e).startswith("every failed rank reported a communication error")


def test_launch_error_pickles():
    import pickle

    e = pickle.loads(pickle.dumps(LaunchError("m", rank=1, exitcode=-9, child_traceback="tb", failures={1: "x"})))
    assert (str(e), e.rank, e.exitcode, e.child_traceback, e.failures) == ("m", 1, -9, "tb", {1: "x"})


#: (how rank 1 fails, its expected exit code, a line of its traceback or message)
SETUP_FAULTS = [("raise_before", None, "ValueError: deliberate failure on rank 1 before the SymmBuffer"),
                ("bad_args", None, "ValueError: hidden=448 must be a multiple of 128"),
                ("raise_mapping", None, "OSError: deliberate failure on rank 1 mapping"),
                ("sigkill_mapping", -9, "rank 1 was killed by signal SIGKILL without returning a result")]


@pytest.mark.slow
@pytest.mark.parametrize("how, exitcode, expected", SETUP_FAULTS, ids=[f[0] for f in SETUP_FAULTS])
def test_blame_names_the_rank_that_failed_first_during_setup(tmp_path, how, exitcode, expected):
    """Rank 1 of 3 fails before / inside SymmBuffer set-up; ranks 0 and 2 then fail in the rendezvous with gloo
    errors (often first). launch must name rank 1 with its own traceback and list the others as consequences."""
    with pytest.raises(LaunchError) as info:
        launch(rank_fns.fail_during_setup, 3, 1, how, str(tmp_path), backend="cpu", timeout_s=60)
    e = info.value
    assert (e.rank, e.exitcode) == (1, exitcode), str(e)
    assert expected in (e.child_traceback if exitcode is None else str(e))
    head, _, others = str(e).partition("The other ranks")
    assert head.startswith("rank 1 raised:" if exitcode is None else "rank 1 was killed")
    assert "rank 0:" in others and "rank 2:" in others
    for r, summary in e.failures.items():
        if r != 1:
            assert "(a communication error)" in summary, summary
    assert rank_fns.pids_alive(tmp_path) == [] and rank_fns.pid_shm_files(tmp_path) == []


UNGUARDED_SCRIPT = """
    import sys
    sys.path.insert(0, {tests!r})
    import rank_fns
    from megamoe.launch import LaunchError, launch

    try:  # no `if __name__ == "__main__":` -- the spawned ranks run this again
        launch(rank_fns.whoami, 2, None, backend="cpu", timeout_s=60)
    except LaunchError as e:
        print("LaunchError rank", e.rank, "exitcode", e.exitcode)
        print(e)
"""


@pytest.mark.slow
def test_unguarded_launching_script_gets_the_main_guard_fix(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent(UNGUARDED_SCRIPT.format(tests=str(Path(__file__).resolve().parent))))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    first, message = proc.stdout.split("\n", 1)
    assert first in ("LaunchError rank 0 exitcode 1", "LaunchError rank 1 exitcode 1")
    assert "before it started" in message and "called launch() again" in message and str(script) in message
    assert 'Fix: guard the script\'s entry point with `if __name__ == "__main__":`' in message
    assert "the same" in message  # the other rank failed identically
    # each rank's own stderr says it too
    assert proc.stderr.count('guard the script\'s entry point with `if __name__ == "__main__":`') == 2


def test_rank_dying_before_it_starts_is_reported_as_such():
    with pytest.raises(LaunchError, match=r"rank [01] exited with code 1 before it started running 'whoami': its "
                                          r"interpreter failed while re-importing .*or unpickling") as info:
        launch(rank_fns.whoami, 2, rank_fns.FailsToUnpickle(), backend="cpu", timeout_s=60)
    assert info.value.exitcode == 1 and 'if __name__ == "__main__":' in str(info.value)


def test_folders_of_killed_launchers_are_swept_by_the_next(tmp_path):
    """A process killed before its atexit ran (a notebook kernel shut down by papermill, a timeout) leaves its marker
    / store folders behind; the next process that makes its marker folder removes those whose owner is gone, and
    leaves a live process's, its own and unrelated folders alone."""
    import megamoe.launch as ml

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphans = [tmp_path / f"{ml.TEMP_PREFIX}markers-{dead.pid}-abc", tmp_path / f"{ml.TEMP_PREFIX}{dead.pid}-def"]
    kept = [tmp_path / f"{ml.TEMP_PREFIX}markers-{os.getppid()}-ghi", tmp_path / f"{ml.TEMP_PREFIX}{os.getpid()}-jkl",
            tmp_path / f"{ml.TEMP_PREFIX}nopid", tmp_path / "unrelated-123-x"]
    for d in orphans + kept:
        d.mkdir()
        (d / "marker").write_text("x")
    removed = ml.sweep_orphaned_temp_dirs(str(tmp_path))
    assert sorted(removed) == sorted(str(d) for d in orphans)
    assert not any(d.exists() for d in orphans) and all(d.exists() for d in kept)


def test_a_new_marker_folder_sweeps_the_temporary_directory(tmp_path, monkeypatch):
    """``_marker_dir`` runs the sweep where it makes its folder (the system's temporary directory)."""
    import tempfile

    import megamoe.launch as ml

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(ml, "_MARKER_DIR", [])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan = tmp_path / f"{ml.TEMP_PREFIX}markers-{dead.pid}-abc"
    orphan.mkdir()
    made = ml._marker_dir()
    assert not orphan.exists() and os.path.isdir(made) and os.path.dirname(made) == str(tmp_path)
    import shutil

    shutil.rmtree(made)
