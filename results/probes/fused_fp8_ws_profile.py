"""python results/probes/fused_fp8_ws_profile.py T[,T...] [FP8_WS_MIN_EXPECTED [FP8_BLOCK64_MAX_EXPECTED]]

Per-launch GPU time of the fused FP8 call (front / Gluon GEMM phase / back) at V4-Pro, one EP8 rank's 48 experts."""
import json, sys, os
import torch
import megamoe.fused as mf
from megamoe.cases import MoECase, prepare_rank
from megamoe.symm import SymmBuffer
from megamoe.ops_fp8 import fp8_mega_moe
from torch.profiler import profile, ProfilerActivity

tokens = [int(t) for t in sys.argv[1].split(",")]
if len(sys.argv) > 2:
    mf.FP8_WS_MIN_EXPECTED = int(sys.argv[2])
if len(sys.argv) > 3 and hasattr(mf, "FP8_BLOCK64_MAX_EXPECTED"):  # e.g. 0: no 64-row tile
    mf.FP8_BLOCK64_MAX_EXPECTED = int(sys.argv[3])
case = MoECase(num_ranks=1, hidden=7168, intermediate=3072, num_experts=48, num_topk=6, block_m=128, format="fp8")
sb = SymmBuffer.local(1, 48, max(tokens), 6, 7168, 3072, block_m=128, device="cuda", format="fp8")[0]
for n in tokens:
    case.num_tokens = n
    problem = case.problem(device="cuda")
    y, l1, l2, stats = prepare_rank(sb, problem, 0)
    cfg = mf.fused_config(sb.layout, n, 1, sb.buffer.device)
    kind = cfg.kind
    for _ in range(3):
        fp8_mega_moe(y, l1, l2, sb, impl="fused", check=False)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fp8_mega_moe(y, l1, l2, sb, impl="fused", check=False)
        torch.cuda.synchronize()
    agg = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            agg.setdefault(e.name[:60], []).append(e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total)
    print(json.dumps({"T": n, "kind": kind, "block_m": cfg.block_m, "kernels_us": {k: round(sum(v) / 5, 1) for k, v in agg.items()}}))
