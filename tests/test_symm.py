"""SymmBuffer (cpu and local backends), sym_map/copy kernels and the barrier, on CPU under Triton's interpreter.

Multi-rank tests spawn one process per rank through ``megamoe.launch`` and run the functions in ``rank_fns``.
"""
import math
import sys
import time
from pathlib import Path

import pytest
import torch

# Spawned ranks import rank_fns by name; they inherit this sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parent))
import rank_fns  # noqa: E402

from megamoe.kernels import symm as ks  # noqa: E402
from megamoe.launch import LaunchError, launch  # noqa: E402
from megamoe.layout import Layout  # noqa: E402
from megamoe.symm import VIEW_NAMES, SymmBuffer, get_symm_buffer_for_mega_moe  # noqa: E402

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


# ---------------------------------------------------------------------------------------------------- local backend
def test_local_backend_copy_and_lockstep_barrier():
    R = 4
    sbs = SymmBuffer.local(R, **(SHAPE | dict(num_experts=2 * R)), barrier_timeout_s=0.5)
    assert [sb.rank for sb in sbs] == list(range(R)) and {sb.backend for sb in sbs} == {"local"}
    assert all(torch.equal(sb.buffer_ptrs, sbs[0].buffer_ptrs) for sb in sbs)
    assert sbs[0].buffer_ptrs.tolist() == [sb.buffer.data_ptr() for sb in sbs]
    for sb in sbs:
        rank_fns.fill_x(sb)
    ks.barrier_lockstep(sbs, ks.TAG_BEFORE_DISPATCH_PULL)
    for sb in sbs:
        rank_fns.exchange_rows(sb)
    ks.barrier_lockstep(sbs, ks.TAG_BEFORE_COMBINE_REDUCE)
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
