"""Fused kernel: programs per SM x register cap, per numerics, at T = 8 / 128 / 512 (one EP8 rank's 48 experts)."""
import json, os, sys, torch
from megamoe.bench import _median_ms
from megamoe.fused import FusedConfig, fused_config, run_fused
from megamoe.kernels.symm import BarrierTimeout, check_barrier_state, reset_workspace
from megamoe.ops import bind_calls
from megamoe.cases import MoECase, prepare_rank
from megamoe.symm import SymmBuffer
from megamoe.testing import moe_error_stats

case = MoECase(num_ranks=1, hidden=7168, intermediate=3072, num_experts=48, num_topk=6, block_m=128)
sms = torch.cuda.get_device_properties(0).multi_processor_count
tokens = [int(t) for t in sys.argv[1].split(",")]
variants = [v.split(":") for v in sys.argv[2].split(";")]  # numerics:ppsm:maxnreg:stages
sb = SymmBuffer.local(1, 48, max(tokens), 6, 7168, 3072, block_m=128, device="cuda", barrier_timeout_s=5.0)[0]
rows = []
for n in tokens:
    case.num_tokens = n
    problem = case.problem(device="cuda")
    y, l1, l2, stats = prepare_rank(sb, problem, 0)
    calls = bind_calls(y, l1, l2, sb, None, "swiglu", None, "pull", False)
    refs = {}
    for numerics, ppsm, mr, st in variants:
        base = fused_config(sb.layout, n, 1, sb.buffer.device, numerics)
        cfg = FusedConfig(base.block_m, int(ppsm) * sms, numerics, base.promote_every, num_warps=4,
                          num_stages=int(st), maxnreg=int(mr) or None)
        row = dict(T=n, numerics=numerics, block_m=cfg.block_m, programs_per_sm=int(ppsm), maxnreg=cfg.maxnreg,
                   num_stages=cfg.num_stages)
        try:
            y.fill_(float("nan"))
            run_fused(calls, numerics=numerics, config=cfg)
            check_barrier_state(sb)
            if numerics not in refs:
                refs[numerics] = problem.reference(numerics=numerics)[0]
            row["rel_fro"] = moe_error_stats(y, refs[numerics])["rel_fro"]
            row["us"] = 1e3 * _median_ms(lambda: run_fused(calls, numerics=numerics, config=cfg))
        except BarrierTimeout as e:
            reset_workspace(sb)
            row["failed"] = str(e)[:200]
        print(json.dumps(row), flush=True)
        rows.append(row)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "occupancy_probe.json"), "w"), indent=1)
