"""python results/probes/fused_fp8_wall_gap_probe.py T[,T...]

Where the fused FP8 call's wall time goes beyond its kernels' sum, at V4-Pro (one EP8 rank's 48 experts): per T,
the bench's timing (``triton.testing.do_bench``, L2 flushed, median) of the eager call, the same without the flush,
a CUDA graph of the call replayed under the same timing, the host time to enqueue one call (no sync), and the
kernels' own times and start offsets in one call (torch.profiler). One JSON line per T."""
import json, sys, time
import torch
import triton
import megamoe.fused as mf
from megamoe.bench import _events_median_us as events_median_us
from megamoe.cases import MoECase, prepare_rank
from megamoe.symm import SymmBuffer
from megamoe.ops_fp8 import fp8_mega_moe
from torch.profiler import profile, ProfilerActivity

tokens = [int(t) for t in sys.argv[1].split(",")]
case = MoECase(num_ranks=1, hidden=7168, intermediate=3072, num_experts=48, num_topk=6, block_m=128, format="fp8")
sb = SymmBuffer.local(1, 48, max(tokens), 6, 7168, 3072, block_m=128, device="cuda", format="fp8")[0]


for n in tokens:
    case.num_tokens = n
    y, l1, l2, stats = prepare_rank(sb, case.problem(device="cuda"), 0)
    call = lambda: fp8_mega_moe(y, l1, l2, sb, impl="fused", check=False)
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    out = {"T": n, "kind": mf.fused_config(sb.layout, n, 1, sb.buffer.device).kind}
    out["bench_us"] = triton.testing.do_bench(call, warmup=50, rep=300, return_mode="median") * 1e3
    out["no_flush_us"] = events_median_us(call)
    host = []
    for _ in range(20):
        torch.cuda.synchronize(); t0 = time.perf_counter(); call(); host.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    out["host_enqueue_us"] = sorted(host)[10] * 1e6
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        call()
    g.replay(); torch.cuda.synchronize()
    out["graph_bench_us"] = triton.testing.do_bench(g.replay, warmup=50, rep=300, return_mode="median") * 1e3
    out["graph_no_flush_us"] = events_median_us(g.replay)
    del g
    cache = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        cache.zero_()
        call()
        torch.cuda.synchronize()
    ks = sorted((e.time_range.start, e.time_range.end, e.name[:40]) for e in prof.events()
                if e.device_type.name == "CUDA")
    t0 = ks[0][0]
    out["kernels"] = [(name, round(a - t0, 1), round(b - a, 1)) for a, b, name in ks]
    print(json.dumps(out), flush=True)
sb.destroy()
