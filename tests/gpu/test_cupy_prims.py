"""GPU tests of the CUDA primitives (SymBuffer::map, 1-D bulk pull/push, the epoch barrier) through CuPy.

Two allocations on one GPU and a 2-entry ``buffer_ptrs`` table stand in for two ranks: ``map`` only adds the
difference of the two base addresses, exactly as it would between peers over NVLink.
"""
import pytest
import torch

cupy = pytest.importorskip("cupy")

from megamoe.kernels import cupy_prims  # noqa: E402
from megamoe.layout import Layout  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

GUARD = 4096  # bytes around every destination region that must stay untouched


def _random_bytes(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=g)


def _two_ranks(nbytes: int):
    """Two random byte buffers (rank 0, rank 1) and their rendezvous table."""
    bufs = [_random_bytes(nbytes, seed) for seed in (0, 1)]
    return bufs, [b.data_ptr() for b in bufs]


COPY_CASES = [
    # row_bytes, num_rows, chunk_bytes, num_stages, num_ctas
    (7168, 300, None, 4, None),     # V4-Pro token row, default chunking (8192 >= row: one chunk per row)
    (7168, 97, 4096, 2, 3),         # two chunks per row, the second short; few CTAs, many items each
    (16, 1000, 16, 8, 1),           # smallest row, one CTA cycling all 8 slots many times
    (4112, 61, 1024, 3, 7),         # 5 chunks per row, last one 16 bytes
    (65536, 9, 16384, 4, None),     # 64 KiB of dynamic shared memory: exercises the > 48 KiB opt-in
]


@pytest.mark.parametrize("row_bytes,num_rows,chunk_bytes,num_stages,num_ctas", COPY_CASES)
@pytest.mark.parametrize("op", ["pull", "push"])
def test_copy_rows_every_byte(op, row_bytes, num_rows, chunk_bytes, num_stages, num_ctas):
    size = num_rows * row_bytes
    src_offset, dst_offset = 256, 256 + size + GUARD
    bufs, ptrs = _two_ranks(dst_offset + size + GUARD)
    before = [b.clone() for b in bufs]
    if op == "pull":   # rank 0 reads rank 1's rows into its own buffer
        cupy_prims.pull_rows(ptrs, 0, 1, src_offset, dst_offset, num_rows, row_bytes, chunk_bytes=chunk_bytes,
                             num_stages=num_stages, num_ctas=num_ctas)
        reader, writer = 1, 0
    else:              # rank 0 writes its rows into rank 1's buffer
        cupy_prims.push_rows(ptrs, 0, 1, src_offset, dst_offset, num_rows, row_bytes, chunk_bytes=chunk_bytes,
                             num_stages=num_stages, num_ctas=num_ctas)
        reader, writer = 0, 1
    torch.cuda.synchronize()
    expected = before[writer].clone()
    expected[dst_offset:dst_offset + size] = before[reader][src_offset:src_offset + size]
    assert torch.equal(bufs[writer], expected)          # the rows, and nothing outside them
    assert torch.equal(bufs[reader], before[reader])    # the source is untouched


def test_pull_from_self_is_a_local_copy():
    row_bytes, num_rows = 512, 128
    bufs, ptrs = _two_ranks(2 * row_bytes * num_rows)
    src = bufs[1][: row_bytes * num_rows].clone()
    cupy_prims.pull_rows(ptrs, 1, 1, 0, row_bytes * num_rows, num_rows, row_bytes)
    torch.cuda.synchronize()
    assert torch.equal(bufs[1][row_bytes * num_rows:], src)


def test_copy_on_a_side_stream():
    row_bytes, num_rows = 1024, 64
    bufs, ptrs = _two_ranks(2 * row_bytes * num_rows)
    expected = bufs[1][: row_bytes * num_rows].clone()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        cupy_prims.pull_rows(ptrs, 0, 1, 0, row_bytes * num_rows, num_rows, row_bytes, stream=stream)
    stream.synchronize()
    assert torch.equal(bufs[0][row_bytes * num_rows:], expected)


@pytest.mark.parametrize("bad", [dict(src_offset=8), dict(row_bytes=100), dict(num_stages=1), dict(num_stages=9),
                                 dict(chunk_bytes=24), dict(src_rank=2)])
def test_copy_argument_checks(bad):
    _, ptrs = _two_ranks(8192)
    args = dict(rank=0, src_rank=1, src_offset=0, dst_offset=4096, num_rows=4, row_bytes=256) | bad
    with pytest.raises(ValueError):
        cupy_prims.pull_rows(ptrs, **args)


def _barrier_buffers(num_ranks: int = 2):
    layout = Layout(num_ranks=num_ranks, num_experts=2 * num_ranks, num_max_tokens_per_rank=16, num_topk=2,
                    hidden=512, intermediate_hidden=512)
    bufs = [torch.zeros(layout.num_bytes, dtype=torch.uint8, device="cuda") for _ in range(num_ranks)]
    return layout, bufs


@pytest.mark.parametrize("first", [0, 1])
def test_barrier_two_ranks_on_two_streams(first):
    layout, bufs = _barrier_buffers()
    ptrs = [b.data_ptr() for b in bufs]
    sig, st = layout.offset("barrier_signal"), layout.offset("barrier_state")
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    rounds = 50
    for _ in range(rounds):
        for rank in (first, 1 - first):   # both ranks' kernels queued without waiting: they must run concurrently
            cupy_prims.barrier(ptrs, rank, sig, st, tag=1, timeout_s=10.0, stream=streams[rank])
    torch.cuda.synchronize()
    for b in bufs:
        assert layout.view(b, "barrier_state").tolist() == [rounds, 0, 0, 0]
        assert layout.view(b, "barrier_signal").tolist() == [rounds, rounds]


def test_barrier_orders_data_before_the_signal():
    """Rank 0 pushes rows into rank 1 then enters the barrier; once rank 1 passes it, it copies them onward."""
    layout, bufs = _barrier_buffers()
    ptrs = [b.data_ptr() for b in bufs]
    sig, st = layout.offset("barrier_signal"), layout.offset("barrier_state")
    x, pool = layout.offset("x"), layout.offset("l1_acts")
    row_bytes, num_rows = layout.hidden, layout.num_max_tokens_per_rank
    payload = _random_bytes(row_bytes * num_rows, 7)
    bufs[0][x:x + payload.numel()] = payload
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    cupy_prims.barrier(ptrs, 1, sig, st, stream=streams[1])                  # rank 1 waits for rank 0 ...
    cupy_prims.pull_rows(ptrs, 1, 1, x, pool, num_rows, row_bytes, stream=streams[1])  # ... then moves x -> pool
    cupy_prims.push_rows(ptrs, 0, 1, x, x, num_rows, row_bytes, stream=streams[0])    # rank 0: x -> rank 1's x
    cupy_prims.barrier(ptrs, 0, sig, st, stream=streams[0])
    torch.cuda.synchronize()
    assert layout.view(bufs[1], "barrier_state").tolist() == [1, 0, 0, 0]
    assert torch.equal(bufs[1][pool:pool + payload.numel()], payload)


def test_barrier_timeout_names_the_missing_rank():
    layout, bufs = _barrier_buffers()
    ptrs = [b.data_ptr() for b in bufs]
    sig, st = layout.offset("barrier_signal"), layout.offset("barrier_state")
    cupy_prims.barrier(ptrs, 0, sig, st, tag=7, timeout_s=0.002)   # rank 1 never comes
    torch.cuda.synchronize()
    assert layout.view(bufs[0], "barrier_state").tolist() == [1, 7, 1, 0]
    assert layout.view(bufs[0], "barrier_signal").tolist() == [1, 0]   # rank 0 signalled itself ...
    assert layout.view(bufs[1], "barrier_signal").tolist() == [1, 0]   # ... and its peer
    assert layout.view(bufs[1], "barrier_state").tolist() == [0, 0, 0, 0]


def test_barrier_many_ranks_one_gpu_timeout_picks_a_missing_rank():
    """R = 72 emulated ranks: only rank 5 runs; the first missing rank recorded is one that never arrived."""
    layout, bufs = _barrier_buffers(72)
    ptrs = [b.data_ptr() for b in bufs]
    sig, st = layout.offset("barrier_signal"), layout.offset("barrier_state")
    cupy_prims.barrier(ptrs, 5, sig, st, tag=3, timeout_s=0.002)
    torch.cuda.synchronize()
    epoch, tag, missing, _ = layout.view(bufs[5], "barrier_state").tolist()
    assert (epoch, tag) == (1, 3) and missing != 5 and 0 <= missing < 72
    for b in bufs:
        signal = layout.view(b, "barrier_signal").tolist()
        assert signal[5] == 1 and sum(signal) == 1


def test_bench_pull_smoke():
    out = cupy_prims.bench_pull(row_bytes=(1024, 7168), total_bytes=8 << 20, iters=2, warmup=1, repeats=2)
    assert out["kind"] == "pull_bandwidth" and [r["row_bytes"] for r in out["rows"]] == [1024, 7168]
    assert all(r["gb_s"] > 0 for r in out["rows"])
