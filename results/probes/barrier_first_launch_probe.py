"""Why did the heartbeat not extend a GPU barrier wait? Fresh process per variant: `python barrier_first_launch_probe.py asis|prewarm|nosync|peek` (run from the repo root; prints one JSON line)."""
import json, sys, time
sys.path.insert(0, "tests")
import torch
import rank_fns
from megamoe.kernels import symm as ks
from megamoe.symm import SymmBuffer

variant = sys.argv[1]
SHAPE = dict(num_max_tokens_per_rank=rank_fns.T, num_topk=rank_fns.TOPK, hidden=rank_fns.H,
             intermediate_hidden=rank_fns.I, block_m=rank_fns.BLOCK_M)
sbs = SymmBuffer.local(2, 4, **SHAPE, device="cuda", barrier_timeout_s=0.5)
def beat(sb):
    ks.heartbeat_kernel[(1,)](ks._progress_view(sb), sb.buffer_ptrs, sb.rank, sb.layout.num_ranks, BLOCK_R=ks._block_r(sb))
beat(sbs[1]); torch.cuda.synchronize()
if variant == "prewarm":  # one complete round first: the wait kernel (BLOCK_R=2) is compiled and loaded
    for sb in sbs: ks.barrier_arrive(sb)
    for sb in sbs: ks.barrier_wait(sb, 1)
    torch.cuda.synchronize()
t_c = time.monotonic()
ks.barrier_arrive(sbs[0])
waiting, other = torch.cuda.Stream(), torch.cuda.Stream()
torch.cuda.synchronize()
start = time.monotonic()
with torch.cuda.stream(waiting):
    ks.barrier_wait(sbs[0], ks.TAG_BEFORE_DISPATCH_PULL)
t_launched = time.monotonic() - start
log = []
with torch.cuda.stream(other):
    while time.monotonic() - start < 1.5:
        t0 = time.monotonic()
        beat(sbs[1])
        t1 = time.monotonic()
        if variant != "nosync":
            other.synchronize()
        t2 = time.monotonic()
        log.append((round(t0 - start, 3), round(t1 - t0, 4), round(t2 - t1, 4), sbs[0].view("progress").tolist() if variant == "peek" else None))
        time.sleep(0.1)
    ks.barrier_arrive(sbs[1])
torch.cuda.synchronize()
print(json.dumps({"variant": variant, "wait_launch_s": round(t_launched, 3), "state": sbs[0].view("barrier_state").tolist(),
                  "beats": log}))
