"""Fused kernel, SM90 FP8 x FP8 format: tile configurations and the task schedule, one EP8 rank's 48 V4-Pro experts.

``python fused_fp8_sched_probe.py TAG "T,T,..:auto;T,..:kind:bm:warps:stages:ppsm;..."`` appends JSON lines to
$OUT/fused_fp8_sched_probe.jsonl: a provenance line (GPU, versions, commit, command), then per (T, variant) the
median time (L2 flushed), the error against the reference, and for ``auto`` (the configuration ``megamoe.fused.fused_config`` picks) a timeline summary -- per event kind count
and mean, the span, and how far apart the programs finish their last task (the schedule's tail). ``TAG`` names the
kernel source being measured (e.g. the task schedule), so two runs with different sources can be compared."""
import json, os, sys, torch
from megamoe.bench import _median_ms
from megamoe.env import provenance
from megamoe.cases import MoECase, prepare_rank
from megamoe.fused import TIMELINE_KINDS, FusedConfig, fused_config, run_fused
from megamoe.kernels.symm import BarrierTimeout, check_barrier_state, reset_workspace
from megamoe.ops_fp8 import bind_calls_fp8
from megamoe.quant_fp8 import SM90_RECIPE
from megamoe.symm import SymmBuffer
from megamoe.testing import moe_error_stats

tag = sys.argv[1]
plan = []
for part in sys.argv[2].split(";"):
    ts, _, spec = part.partition(":")
    plan += [(int(t), spec) for t in ts.split(",")]
case = MoECase(num_ranks=1, hidden=7168, intermediate=3072, num_experts=48, num_topk=6, block_m=128, format="fp8")
sms = torch.cuda.get_device_properties(0).multi_processor_count
sb = SymmBuffer.local(1, 48, max(t for t, _ in plan), 6, 7168, 3072, block_m=128, device="cuda",
                      barrier_timeout_s=5.0, format="fp8")[0]
out = open(os.path.join(os.environ.get("OUT", "/tmp"), "fused_fp8_sched_probe.jsonl"), "a")
out.write(json.dumps({"tag": tag, "provenance": provenance(" ".join(["python"] + sys.argv))}) + "\n")
problems = {}
for n, spec in plan:
    if n not in problems:
        case.num_tokens = n
        problems[n] = case.problem(device="cuda")
    problem = problems[n]
    y, l1, l2, stats = prepare_rank(sb, problem, 0)
    ref = problem.reference()[0]
    calls = bind_calls_fp8(y, l1, l2, sb, None, SM90_RECIPE, "swiglu", None, True, "pull", False)
    if spec == "auto":
        cfg = fused_config(sb.layout, n, 1, sb.buffer.device)
    else:
        kind, bm, warps, stages, ppsm = spec.split(":")
        cfg = FusedConfig(int(bm), int(ppsm) * sms, "exact", num_warps=int(warps), num_stages=int(stages), kind=kind)
    row = dict(tag=tag, T=n, spec=spec, kind=cfg.kind, block_m=cfg.block_m, num_warps=cfg.num_warps,
               num_stages=cfg.num_stages, programs=cfg.programs_per_rank)
    try:
        y.fill_(float("nan"))
        run_fused(calls, config=cfg)
        check_barrier_state(sb)
        row["rel_fro"] = moe_error_stats(y, ref)["rel_fro"]
        row["us"] = 1e3 * _median_ms(lambda: run_fused(calls, config=cfg))
        if spec == "auto":
            for _ in range(2):
                (ev,) = run_fused(calls, config=cfg, timeline=True)
            torch.cuda.synchronize()
            ev = ev.cpu()
            valid = ev[..., 0] >= 0
            t_min = int(ev[..., 1][valid].min())
            summ = {}
            for i, name in enumerate(TIMELINE_KINDS):
                d = (ev[..., 2] - ev[..., 1])[ev[..., 0] == i].double()
                if d.numel():
                    summ[name] = [int(d.numel()), round(float(d.mean()) / 1e3, 2), round(float(d.max()) / 1e3, 2)]
            gemm = (ev[..., 0] == 3) | (ev[..., 0] == 4) | (ev[..., 0] == 2)
            last_end = torch.where(gemm, ev[..., 2], torch.zeros_like(ev[..., 2])).max(dim=1).values
            first_start = torch.where(gemm, ev[..., 1], torch.full_like(ev[..., 1], 2**62)).min(dim=1).values
            busy = torch.where(gemm, ev[..., 2] - ev[..., 1], torch.zeros_like(ev[..., 2])).sum(dim=1)
            row["timeline"] = dict(
                span_us=(int(ev[..., 2][valid].max()) - t_min) / 1e3, kinds_count_mean_max_us=summ,
                task_loop_start_us=[(int(first_start.min()) - t_min) / 1e3, (int(first_start.max()) - t_min) / 1e3],
                task_loop_end_us=[(int(last_end.min()) - t_min) / 1e3, (int(last_end.max()) - t_min) / 1e3],
                busy_fraction=float(busy.sum()) / float((last_end - first_start).sum()))
    except (BarrierTimeout, RuntimeError) as e:
        reset_workspace(sb)
        row["failed"] = str(e)[:300]
    print(json.dumps(row), flush=True)
    out.write(json.dumps(row) + "\n")
    out.flush()
sb.destroy()
