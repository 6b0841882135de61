"""Instrumented copy of barrier_wait_kernel (start/end %globaltimer, polls, observed beat moves, whether the late rank was seen): `python barrier_wait_debug_probe.py asis|prewarm` from the repo root; one JSON line."""
import json, sys, time
sys.path.insert(0, "tests")
import torch, triton, triton.language as tl
import rank_fns
from megamoe.kernels import symm as ks
from megamoe.symm import SymmBuffer

@triton.jit
def wait_dbg(signal_ptr, state_ptr, progress_ptr, dbg, num_ranks, timeout_ns, BLOCK_R: tl.constexpr):
    epoch = tl.load(state_ptr)
    peers = tl.arange(0, BLOCK_R)
    valid = peers < num_ranks
    seen = tl.atomic_add(signal_ptr + peers, 0, mask=valid, sem="acquire", scope="sys")
    missing = tl.sum((valid & (seen < epoch)).to(tl.int32))
    beat = tl.atomic_add(progress_ptr + peers, 0, mask=valid, sem="relaxed", scope="sys")
    first = tl.sum(tl.where(peers == 1, beat, 0))
    t0 = ks._globaltimer_ns()
    deadline = t0 + timeout_ns
    in_time = True
    polls = 0
    moves = 0
    while (missing > 0) & in_time:
        seen = tl.atomic_add(signal_ptr + peers, 0, mask=valid, sem="acquire", scope="sys")
        waiting_on = valid & (seen < epoch)
        missing = tl.sum(waiting_on.to(tl.int32))
        polls += 1
        beat_now = tl.atomic_add(progress_ptr + peers, 0, mask=valid, sem="relaxed", scope="sys")
        moved = tl.sum((waiting_on & (beat_now != beat)).to(tl.int32)) > 0
        moves += moved.to(tl.int32)
        beat = beat_now
        now = ks._globaltimer_ns()
        deadline = tl.where(moved, now + timeout_ns, deadline)
        in_time = now <= deadline
    t1 = ks._globaltimer_ns()
    tl.store(dbg + 0, t0)
    tl.store(dbg + 1, t1)
    tl.store(dbg + 2, polls.to(tl.int64))
    tl.store(dbg + 3, moves.to(tl.int64))
    tl.store(dbg + 4, first.to(tl.int64))
    tl.store(dbg + 5, tl.sum(tl.where(peers == 1, beat, 0)).to(tl.int64))
    tl.store(dbg + 6, missing.to(tl.int64))
    tl.store(dbg + 7, epoch.to(tl.int64))

variant = sys.argv[1]
SHAPE = dict(num_max_tokens_per_rank=rank_fns.T, num_topk=rank_fns.TOPK, hidden=rank_fns.H,
             intermediate_hidden=rank_fns.I, block_m=rank_fns.BLOCK_M)
sbs = SymmBuffer.local(2, 4, **SHAPE, device="cuda", barrier_timeout_s=0.5)
def beat(sb):
    ks.heartbeat_kernel[(1,)](ks._progress_view(sb), sb.buffer_ptrs, sb.rank, sb.layout.num_ranks, BLOCK_R=ks._block_r(sb))
dbg = torch.zeros(8, dtype=torch.int64, device="cuda")
signal, state = ks._barrier_views(sbs[0])
def launch(timeout_ns):
    wait_dbg[(1,)](signal, state, ks._progress_view(sbs[0]), dbg, 2, timeout_ns, BLOCK_R=2)
launch(500_000_000); torch.cuda.synchronize()   # compile (epoch 0: returns at once)
beat(sbs[1]); torch.cuda.synchronize()
if variant == "prewarm":
    for sb in sbs: ks.barrier_arrive(sb)
    for sb in sbs: ks.barrier_wait(sb, 1)
    torch.cuda.synchronize()
ks.barrier_arrive(sbs[0])
waiting, other = torch.cuda.Stream(), torch.cuda.Stream()
torch.cuda.synchronize()
start = time.monotonic()
with torch.cuda.stream(waiting):
    launch(500_000_000)
n = 0
with torch.cuda.stream(other):
    while time.monotonic() - start < 1.5:
        beat(sbs[1]); other.synchronize(); n += 1
        time.sleep(0.1)
    ks.barrier_arrive(sbs[1])
torch.cuda.synchronize()
d = dbg.tolist()
print(json.dumps({"variant": variant, "kernel_s": (d[1] - d[0]) / 1e9, "polls": d[2], "moves": d[3], "first_beat": d[4],
                  "last_beat": d[5], "missing_at_end": d[6], "epoch": d[7], "host_beats": n,
                  "progress0": sbs[0].view("progress").tolist(), "signal0": sbs[0].view("barrier_signal").tolist()}))
