"""GPU versions of the SymmBuffer / copy / barrier tests: the ``local`` backend with 4 ranks on one GPU, and the
``cuda`` backend (symmetric memory, one process per GPU) through ``megamoe.launch`` when there are >= 2 GPUs."""
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # spawned ranks import rank_fns by name
import rank_fns  # noqa: E402

from megamoe.kernels import symm as ks  # noqa: E402
from megamoe.launch import launch  # noqa: E402
from megamoe.symm import SymmBuffer  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
NUM_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_2_gpus = pytest.mark.skipif(NUM_GPUS < 2, reason="the cuda backend needs >= 2 GPUs")
SHAPE = dict(num_max_tokens_per_rank=rank_fns.T, num_topk=rank_fns.TOPK, hidden=rank_fns.H,
             intermediate_hidden=rank_fns.I, block_m=rank_fns.BLOCK_M)


def test_local_backend_copy_and_barrier_on_one_gpu():
    R = 4
    sbs = SymmBuffer.local(R, 2 * R, **SHAPE, device="cuda", barrier_timeout_s=0.5)
    assert {sb.device.type for sb in sbs} == {"cuda"} and sbs[0].buffer_ptrs.is_cuda
    rank_fns.exchange_rows_lockstep(sbs)
    for sb in sbs:
        ks.check_barrier_state(sb)
    assert [rank_fns.count_bad_bytes(sb) for sb in sbs] == [0] * R
    assert [sb.view("barrier_state").tolist() for sb in sbs] == [[2, 0, -1, 0]] * R

    for sb in sbs[:-1]:  # rank 3 never arrives: the wait kernel gives up at its %globaltimer deadline
        ks.barrier_arrive(sb)
    torch.cuda.synchronize()
    start = time.monotonic()
    ks.barrier_wait(sbs[0], ks.TAG_AFTER_WORKSPACE_CLEAN)
    with pytest.raises(ks.BarrierTimeout, match="rank 0: barrier tag 3 timed out after 0.5 s waiting for rank 3"):
        ks.check_barrier_state(sbs[0])
    assert 0.5 <= time.monotonic() - start < 1.5
    for sb in sbs:
        sb.destroy()


@needs_2_gpus
def test_cuda_backend_views_and_copy():
    R = min(NUM_GPUS, 8)
    for info in launch(rank_fns.symm_views_and_copy, R, backend="cuda", timeout_s=300):
        assert info["backend"] == "cuda" and info["bad_bytes"] == 0
        assert info["peer_value"] == 1000 + (info["rank"] + 1) % R
        assert len(set(info["buffer_ptrs"])) == R and info["buffer_ptrs"][info["rank"]] == info["own_ptr"]


@needs_2_gpus
def test_cuda_backend_barrier_rounds_and_timeout():
    R = min(NUM_GPUS, 8)
    for info in launch(rank_fns.symm_barrier_rounds, R, 4, 0.3, backend="cuda", timeout_s=300):
        assert info["wrong"] == [] and info["state"] == [8, 0, -1, 0] and info["signal"] == [8] * R
    out = launch(rank_fns.symm_barrier_timeout, R, 1, 2.0, backend="cuda", timeout_s=300)
    assert out[1] is None
    for rank in set(range(R)) - {1}:
        assert (out[rank]["tag"], out[rank]["missing_rank"]) == (ks.TAG_BEFORE_COMBINE_REDUCE, 1)
        assert 2.0 <= out[rank]["elapsed_s"] < 4.0
        assert out[rank]["again"][:2] == (2, 1)


def _beat(sb) -> None:
    """Rank ``sb``'s heartbeat into every rank (the kernel; ``ks.heartbeat`` is a no-op for the local backend)."""
    ks.heartbeat_kernel[(1,)](ks._progress_view(sb), sb.buffer_ptrs, sb.rank, sb.layout.num_ranks,
                              BLOCK_R=ks._block_r(sb))


@pytest.mark.parametrize("beating", [True, False])
def test_gpu_wait_extends_its_deadline_while_the_missing_rank_beats(beating):
    """Rank 0 waits (one %globaltimer-bounded launch, timeout 0.5 s) for rank 1, which arrives only after 1.5 s.
    While rank 1 beats its heartbeat every 0.1 s from another stream the wait must not time out; without beats it
    must fail naming rank 1 after about 0.5 s."""
    sbs = SymmBuffer.local(2, 4, **SHAPE, device="cuda", barrier_timeout_s=0.5)
    _beat(sbs[1])  # compile the heartbeat kernel first: a JIT compile inside the timed window outlasts 0.5 s
    torch.cuda.synchronize()
    ks.barrier_arrive(sbs[0])
    waiting, other = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    start = time.monotonic()
    with torch.cuda.stream(waiting):
        ks.barrier_wait(sbs[0], ks.TAG_BEFORE_DISPATCH_PULL)
    with torch.cuda.stream(other):
        while time.monotonic() - start < 1.5:
            if beating:
                _beat(sbs[1])
                other.synchronize()
            time.sleep(0.1)
        ks.barrier_arrive(sbs[1])
    torch.cuda.synchronize()
    state = sbs[0].view("barrier_state").tolist()
    if beating:
        assert state == [1, 0, -1, 0], state
    else:
        assert state[1:3] == [ks.TAG_BEFORE_DISPATCH_PULL, 1], state
    for sb in sbs:
        sb.destroy()
