"""megamoe.env.resolve_backend (the one backend resolver) and megamoe.harness / megamoe.cases.run_case (the one
switch between local ranks in this process and one process per rank)."""
import pytest
import torch

from megamoe import harness
from megamoe.cases import MoECase, run_case, run_case_local
from megamoe.env import BACKENDS, resolve_backend
from megamoe.launch import launch

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.parametrize("world_size", [1, 2, 8])
def test_auto_picks_one_process_per_gpu_else_local_ranks_else_cpu(world_size):
    expected = "cuda" if GPUS >= world_size else "local" if GPUS else "cpu"
    assert resolve_backend("auto", world_size) == expected
    assert resolve_backend("auto", world_size, local=False) == ("cpu" if expected == "local" else expected)
    assert resolve_backend("cpu", world_size) == "cpu" and resolve_backend("local", world_size) == "local"


def test_bad_backends_are_named():
    assert BACKENDS == ("auto", "cpu", "cuda", "local")
    with pytest.raises(ValueError, match="backend='gpu' must be one of 'auto', 'cpu', 'cuda', 'local'"):
        resolve_backend("gpu", 2)
    with pytest.raises(ValueError, match="backend='local' must be one of 'auto', 'cpu', 'cuda'$"):
        resolve_backend("local", 2, local=False)
    with pytest.raises(ValueError, match=f"backend='cuda' needs {GPUS + 1} GPUs, found {GPUS}"):
        resolve_backend("cuda", GPUS + 1)
    with pytest.raises(ValueError, match="backend='local' must be one of 'auto', 'cpu', 'cuda'"):
        launch(_never_called, 2, backend="local")   # launch runs one process per rank: no local backend


def _never_called(rank, world_size):
    raise AssertionError("launch must refuse before spawning")


def test_on_ranks_runs_the_local_program_for_the_local_backend():
    assert harness.on_ranks(_never_called, lambda a, b: [a, b], 2, "x", "y", backend="local") == ["x", "y"]
    assert harness.on_ranks(_never_called, lambda a: {"all": a}, 2, 7, backend="local") == [{"all": 7}]


def test_run_case_local_is_run_case_local():
    case = MoECase(num_ranks=2, num_tokens=[9, 4], hidden=128, intermediate=128, num_experts=4, num_topk=2,
                   block_m=16, seed=1)
    reports = run_case(case, "local")
    assert [r["rank"] for r in reports] == [0, 1] and all(r["bitwise_equal"] and r["recv_stats_ok"] for r in reports)
    drop = ("seconds_per_call",)
    assert [{k: v for k, v in r.items() if k not in drop} for r in reports] == \
        [{k: v for k, v in r.items() if k not in drop} for r in run_case_local(case)]
