"""Fused kernel, SM90 FP8 x FP8 format (``fp8_mega_moe``): block_m x warps x stages x programs per SM, one EP8
rank's 48 V4-Pro experts, beside the staged pipeline. ``python fused_fp8_config_probe.py T,T,.. "bm:warps:stages:ppsm;..."``
writes $OUT/fused_fp8_config_probe.json."""
import json, os, sys, torch
from megamoe.bench import _median_ms
from megamoe.cases import MoECase, prepare_rank
from megamoe.fused import FusedConfig, run_fused
from megamoe.kernels.symm import BarrierTimeout, check_barrier_state, reset_workspace
from megamoe.ops_fp8 import bind_calls_fp8, fp8_mega_moe
from megamoe.quant_fp8 import SM90_RECIPE
from megamoe.symm import SymmBuffer
from megamoe.testing import moe_error_stats

case = MoECase(num_ranks=1, hidden=7168, intermediate=3072, num_experts=48, num_topk=6, block_m=128, format="fp8")
sms = torch.cuda.get_device_properties(0).multi_processor_count
tokens = [int(t) for t in sys.argv[1].split(",")]
variants = [[int(x) for x in v.split(":")] for v in sys.argv[2].split(";")]
sb = SymmBuffer.local(1, 48, max(tokens), 6, 7168, 3072, block_m=128, device="cuda", barrier_timeout_s=5.0,
                      format="fp8")[0]
rows = []
for n in tokens:
    case.num_tokens = n
    problem = case.problem(device="cuda")
    y, l1, l2, stats = prepare_rank(sb, problem, 0)
    ref = problem.reference()[0]
    calls = bind_calls_fp8(y, l1, l2, sb, None, SM90_RECIPE, "swiglu", None, True, "pull", False)
    staged = 1e3 * _median_ms(lambda: fp8_mega_moe(y, l1, l2, sb, impl="staged", check=False))
    rows.append(dict(T=n, impl="staged", us=staged))
    print(json.dumps(rows[-1]), flush=True)
    for bm, warps, stages, ppsm in variants:
        cfg = FusedConfig(bm, ppsm * sms, "exact", num_warps=warps, num_stages=stages)
        row = dict(T=n, impl="fused", block_m=bm, num_warps=warps, num_stages=stages, programs_per_sm=ppsm)
        try:
            y.fill_(float("nan"))
            run_fused(calls, numerics="exact", config=cfg)
            check_barrier_state(sb)
            row["rel_fro"] = moe_error_stats(y, ref)["rel_fro"]
            row["us"] = 1e3 * _median_ms(lambda: run_fused(calls, numerics="exact", config=cfg))
        except (BarrierTimeout, RuntimeError) as e:
            reset_workspace(sb)
            row["failed"] = str(e)[:300]
        print(json.dumps(row), flush=True)
        rows.append(row)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "fused_fp8_config_probe.json"), "w"), indent=1)
