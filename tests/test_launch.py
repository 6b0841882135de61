"""megamoe.launch: rank order, argument passing, failure forwarding, and no process left behind."""
import multiprocessing as mp
import os
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

# Spawned ranks import rank_fns by name; they inherit this sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parent))
import rank_fns  # noqa: E402

from megamoe.launch import LaunchError, init_from_env, launch  # noqa: E402


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


def test_exception_is_forwarded_with_rank_and_traceback():
    with pytest.raises(LaunchError, match="rank 1 raised") as info:
        launch(rank_fns.raise_on, 2, 1, backend="cpu", timeout_s=60)
    e = info.value
    assert e.rank == 1 and e.exitcode is None
    assert "ValueError: deliberate failure on rank 1" in str(e) and "raise_on" in e.child_traceback
    assert mp.active_children() == []


def test_crashed_rank_reported_with_exit_code_and_others_stopped(tmp_path):
    with pytest.raises(LaunchError, match="rank 1 exited with code 3 without returning a result") as info:
        launch(rank_fns.exit_on, 3, 1, 3, str(tmp_path), backend="cpu", timeout_s=60)
    assert (info.value.rank, info.value.exitcode) == (1, 3)
    assert len(list(tmp_path.glob("*.pid"))) == 3
    assert rank_fns.pids_alive(tmp_path) == [] and mp.active_children() == []


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
