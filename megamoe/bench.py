"""GPU benchmarks: ``python -m megamoe.bench [--suite SUITE|all] [--quick]``.

Every suite writes ``results/<suite>_<device>.json`` = ``{"kind", "provenance", "config", "rows"}`` where provenance
holds the GPU, torch/Triton/CUDA versions, the git commit and the command line; the notebooks plot them
(``megamoe.figures.plot_results``), and ``make figures`` (``python -m megamoe.notebooks figures``) writes the
figures. Timing: CUDA events, median of repeated runs after warm-up (``triton.testing.do_bench``, which also flushes
L2 between runs); per-step times come from events recorded between the pipeline's launches. The layer suites also
time each fused and torch row as a CUDA-graph replay (``graph_us``, device time alone) and its host enqueue
(``host_us``): an eager multi-launch call at small T can wait on the host, which ``us`` then includes.

Suites:
  * ``ceilings``: FP8 ``torch._scaled_mm`` 8192^3 and a 1 GiB device copy, the roofline this GPU reaches.
  * ``layer``: one rank's Mega MoE layer (world size 1) at DeepGEMM's V4-Pro shape with the 48 experts an EP8 rank
    owns (H 7168, I 3072, top-6), tokens/rank 8 .. 8192: total and per-step time, TFLOP/s, error vs reference.
  * ``layer_fp8``: the same in the SM90 FP8 x FP8 format (``fp8_mega_moe``, DeepGEMM's Hopper format); add the
    DeepGEMM kit's rows with ``--merge-peer``.
  * ``pull_push``: N local ranks on one GPU (lock-step), pull vs push dispatch on equal terms.
  * ``tma_pull``: the seed's CUDA primitives (CuPy): TMA 1-D bulk copy bandwidth by row size.
  * ``timeline``: the fused kernel's per-program task timeline (``%globaltimer``), one EP8 rank's experts.
  * ``tune`` (not in ``all``): GEMM launch-config sweep behind ``megamoe.ops.GEMM_CONFIG``.
  * ``fused_tune`` (not in ``all``): the fused kernel's launch configurations, next to the staged pipeline.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from megamoe.cases import MoECase, expected_recv_counts, prepare_rank
from megamoe.env import RESULTS_DIR, device_tag, provenance
from megamoe.fused import fused_config
from megamoe.ops import AUTO_GPU_NUMERICS, bind_calls, fp8_fp4_mega_moe, pipeline_steps
from megamoe.stepping import time_steps
from megamoe.symm import SymmBuffer
from megamoe.testing import moe_error_stats


def _median_ms(fn, warmup_ms: float = 50, rep_ms: float = 300) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def _events_median_us(fn, n: int = 30) -> float:
    """Median device time (us) of ``n`` calls of a warmed-up ``fn`` enqueued back to back, CUDA events around each,
    no L2 flush between them (``_median_ms`` flushes before every call): what a call left in L2 is there for the
    next."""
    import torch

    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in zip(starts, ends))[n // 2] * 1e3


#: Eager calls whose host time (enqueue, no sync) ``_host_us`` takes the median of.
HOST_TIMING_CALLS = 20


def _host_us(fn, calls: int | None = None) -> float:
    """Median host time (µs) of one ``fn()`` call from an idle stream (over ``calls``, by default
    :data:`HOST_TIMING_CALLS` as it stands at the call): Python, argument checks and the launches'
    enqueue, without waiting for the GPU. When it approaches the call's ``us`` (``_median_ms``: the GPU waits for
    the host between the L2 flush and the first launch, or between launches) the row is host-bound: ``graph_us``
    is then the device-side time."""
    import time

    samples = []
    for _ in range(HOST_TIMING_CALLS if calls is None else calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return sorted(samples)[len(samples) // 2] * 1e6


def _graph_us(fn) -> float:
    """``fn()`` (one call, already warmed up: compiled, its caches filled) captured once in a CUDA graph, replayed
    under ``_median_ms`` (L2 flushed before each replay): the call's device time without the host's launch
    overhead, as a CUDA-graph-captured decode step runs it. Raises what the capture raises."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    try:
        return _median_ms(graph.replay) * 1e3
    finally:
        del graph


def _timing_fields(fn, graph: bool) -> dict:
    """``host_us`` (:func:`_host_us`) and, with ``graph``, ``graph_us`` (:func:`_graph_us`; ``graph_error`` instead
    if the capture failed) of a row timed by ``_median_ms``."""
    out = {"host_us": _host_us(fn)}
    if graph:
        try:
            out["graph_us"] = _graph_us(fn)
        except Exception as e:  # reported in the row, not raised: the eager time stands
            torch.cuda.synchronize()
            out["graph_error"] = f"{type(e).__name__}: {e}"[:300]
    return out


def layer_flops(num_pairs: int, hidden: int, intermediate: int) -> float:
    """2 * pairs * H * (2I) for L1 plus 2 * pairs * I * H for L2 (DeepGEMM's ``2·recv·H·I·3``)."""
    return 2.0 * num_pairs * hidden * intermediate * 3


def touched_weight_bytes(recv_stats: list[int], hidden: int, intermediate: int, bytes_per_weight: float) -> float:
    """Weights + scales of the experts that received at least one pair (what must stream from HBM), at
    ``bytes_per_weight`` (a format's ``LAYER_FORMATS[...]["weight_bytes"]``)."""
    per_expert = (2 * intermediate * hidden + hidden * intermediate) * bytes_per_weight
    return per_expert * sum(1 for c in recv_stats if c > 0)


def bench_ceilings() -> dict:
    """Measured FP8 matmul rate and device copy bandwidth (the roofline used by the other suites)."""
    n = 8192
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    ms = _median_ms(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms_copy = _median_ms(lambda: dst.copy_(src))
    return {"rows": [{"what": "fp8_scaled_mm_8192", "ms": ms, "tflops": 2 * n**3 / ms / 1e9},
                     {"what": "copy_1GiB", "ms": ms_copy, "tb_per_s": 2 * 2**30 / ms_copy / 1e9}]}


def bench_layer_case(case: MoECase, num_tokens: list[int], sym_buffers: list[SymmBuffer]) -> list[dict]:
    """Time ``case`` (staged pipeline, per-step times) for each tokens/rank in ``num_tokens`` on pre-allocated
    (local) buffers; the pull/push suite's rows."""
    rows = []
    for n in num_tokens:
        case.num_tokens = n
        problem = case.problem(device="cuda")
        prepared = [prepare_rank(sb, problem, r) for r, sb in enumerate(sym_buffers)]
        ys, l1s, l2s, stats = (list(t) for t in zip(*prepared))
        single = len(sym_buffers) == 1
        args = (ys[0], l1s[0], l2s[0], sym_buffers[0]) if single else (ys, l1s, l2s, sym_buffers)
        fp8_fp4_mega_moe(*args, cumulative_local_expert_recv_stats=stats[0] if single else stats,
                         dispatch=case.dispatch, impl="staged")
        refs = problem.reference()
        err = max(moe_error_stats(ys[r].cpu(), refs[r].cpu())["rel_fro"] for r in range(len(ys)))
        bitwise = all(torch.equal(ys[r].view(torch.int16), refs[r].view(torch.int16)) for r in range(len(ys)))
        recv = [int(v) for s in stats for v in s.tolist()]
        ms = _median_ms(lambda: fp8_fp4_mega_moe(*args, dispatch=case.dispatch, check=False, impl="staged"))
        calls = bind_calls(*args, None, "swiglu", None, case.dispatch, False)
        steps = time_steps(calls, pipeline_steps(case.dispatch))
        pairs = sum(recv)
        flops = layer_flops(pairs, case.hidden, case.intermediate)
        rows.append({"impl": "staged", "num_tokens_per_rank": n, "num_ranks": case.num_ranks,
                     "dispatch": case.dispatch, "num_pairs": pairs, "us": ms * 1e3, "tflops": flops / ms / 1e9,
                     "weight_bytes_touched": touched_weight_bytes(recv, case.hidden, case.intermediate,
                                                                  LAYER_FORMATS["fp8_fp4"]["weight_bytes"]),
                     "flops": flops, "rel_fro_vs_reference": err, "bitwise_equal_reference": bitwise,
                     "steps_us": steps})
        print(f"  T={n:>6} ranks={case.num_ranks} {case.dispatch:<4} {ms * 1e3:10.1f} us  "
              f"{flops / ms / 1e9:7.1f} TFLOP/s  err={err:.2e} bitwise={bitwise}  "
              + " ".join(f"{k}={v:.0f}" for k, v in steps.items() if not k.endswith("arrive")), flush=True)
    return rows


def torch_grouped_mm_peer(recv_counts: list[int], hidden: int, intermediate: int):
    """The in-run yardstick: ``torch._scaled_grouped_mm`` FP8 (row-wise scales) for L1 (N = 2I) then L2 (N = H) over
    the rows each local expert received, GEMMs only (no dispatch, SwiGLU or combine). Reads every local expert's
    FP8 weights whether or not it received rows. Returns a zero-argument callable."""
    E = len(recv_counts)
    counts = torch.tensor(recv_counts, dtype=torch.int64)
    offs = torch.cumsum(counts, 0).to(torch.int32).cuda()
    m = max(int(counts.sum()), 1)
    fp8 = torch.float8_e4m3fn
    a1 = (torch.randn(m, hidden, device="cuda") * 0.5).to(fp8)
    w1 = (torch.randn(E, 2 * intermediate, hidden, device="cuda") * 0.5).to(fp8)
    a2 = (torch.randn(m, intermediate, device="cuda") * 0.5).to(fp8)
    w2 = (torch.randn(E, hidden, intermediate, device="cuda") * 0.5).to(fp8)
    sa1, sa2 = torch.ones(m, device="cuda"), torch.ones(m, device="cuda")
    sw1, sw2 = torch.ones(E, 2 * intermediate, device="cuda"), torch.ones(E, hidden, device="cuda")

    def run():
        torch._scaled_grouped_mm(a1, w1.transpose(-2, -1), sa1, sw1, offs=offs, out_dtype=torch.bfloat16)
        torch._scaled_grouped_mm(a2, w2.transpose(-2, -1), sa2, sw2, offs=offs, out_dtype=torch.bfloat16)
    return run


LAYER_TOKENS = (8, 32, 128, 512, 2048, 8192)
LAYER_ROUTINGS = ("uniform", "skewed")
#: Per format: the (impl, numerics) rows the layer suite times besides the torch peer, and the bytes one weight
#: element costs in HBM with its scales (FP4 + a UE8M0 byte per 32; FP8 + an fp32 per 128x128 block).
LAYER_FORMATS = {
    "fp8_fp4": {"impls": (("fused", "exact"), ("fused", "hopper"), ("fused", "hopper_l2_per_block"),
                          ("staged", "exact")),
                "weight_bytes": 0.5 + 1 / 32},
    "fp8": {"impls": (("fused", "exact"), ("staged", "exact")), "weight_bytes": 1 + 4 / (128 * 128)},
}


def _layer_call(fmt: str):
    """``call(y, l1, l2, sb, impl, numerics, check)`` of one weight format's op: ``fp8_fp4_mega_moe`` (FP4 weights)
    or ``fp8_mega_moe`` (SM90 FP8 weights, 128x128 blocks; one numerics)."""
    if fmt == "fp8_fp4":
        return lambda y, l1, l2, sb, impl, numerics, check: fp8_fp4_mega_moe(
            y, l1, l2, sb, impl=impl, numerics=numerics, check=check)
    from megamoe.ops_fp8 import fp8_mega_moe

    return lambda y, l1, l2, sb, impl, numerics, check: fp8_mega_moe(y, l1, l2, sb, impl=impl, check=check)


def bench_layer(quick: bool, fmt: str = "fp8_fp4", tokens: list[int] | None = None) -> dict:
    """Our implementations and the torch grouped-mm peer side by side, same inputs, same run (one EP8 rank's 48
    V4-Pro experts at world size 1) in weight format ``fmt``; per row: µs, TFLOP/s, weight GB/s (FP4 or FP8 with
    scales), % of this run's roofline for that format, error vs the implementation's reference numerics; fused rows
    also ``tile_kind``, ``tile_block_m``, ``tile_predecode``, ``tile_rs_block_n`` and ``tile_idle_decode``, the tile
    family, pool block, whether the FP4 weights were decoded once per call (``megamoe.fold_decode``), the
    register-operand tile's token chunk (0: not that tile) and whether the idle math warpgroup decodes
    (``FusedConfig.idle_decode``) that ``megamoe.fused.fused_config`` chose."""
    spec = LAYER_FORMATS[fmt]
    call = _layer_call(fmt)
    case = MoECase(num_ranks=1, hidden=7168, intermediate=3072, num_experts=48, num_topk=6, block_m=128, format=fmt)
    tokens = tokens or ([8, 512] if quick else list(LAYER_TOKENS))
    ceil = {r["what"]: r for r in bench_ceilings()["rows"]}
    fp8_tflops, copy_tbs = ceil["fp8_scaled_mm_8192"]["tflops"], ceil["copy_1GiB"]["tb_per_s"]
    sb = SymmBuffer.local(1, case.num_experts, max(tokens), case.num_topk, case.hidden, case.intermediate,
                          block_m=case.block_m, device="cuda", format=fmt)[0]
    rows = []
    for routing in (("uniform",) if quick else LAYER_ROUTINGS):
        case.routing = routing
        for n in tokens:
            case.num_tokens = n
            problem = case.problem(device="cuda")
            y, l1, l2, stats = prepare_rank(sb, problem, 0)
            recv = expected_recv_counts(problem, 0).tolist()
            pairs = sum(recv)
            flops = layer_flops(pairs, case.hidden, case.intermediate)
            wbytes = touched_weight_bytes(recv, case.hidden, case.intermediate, spec["weight_bytes"])
            roof_us = max(wbytes / copy_tbs / 1e6, flops / fp8_tflops / 1e6)
            base = {"format": fmt, "num_tokens_per_rank": n, "routing": routing, "num_pairs": pairs, "flops": flops,
                    "weight_bytes_touched": wbytes, "roofline_us": roof_us}
            refs = {}
            for impl, numerics in spec["impls"]:
                y.fill_(float("nan"))
                call(y, l1, l2, sb, impl, numerics, True)
                if numerics not in refs:
                    refs[numerics] = problem.reference(numerics=numerics)[0]
                err = moe_error_stats(y, refs[numerics])
                def run(impl=impl, numerics=numerics):
                    call(y, l1, l2, sb, impl, numerics, False)
                ms = _median_ms(run)
                timing = _timing_fields(run, graph=impl == "fused")  # (the staged path is not graph-tested)
                if impl == "fused":  # which tile family and pool block megamoe.fused.fused_config chose for this call
                    cfg = fused_config(sb.layout, n, 1, sb.buffer.device, numerics)
                    base_impl = {"tile_kind": cfg.kind, "tile_block_m": cfg.block_m, "tile_predecode": cfg.predecode,
                                 "tile_rs_block_n": cfg.rs_block_n, "tile_idle_decode": cfg.idle_decode}
                else:
                    base_impl = {}
                rows.append({**base, **base_impl, "impl": impl, "numerics": numerics, "us": ms * 1e3, **timing,
                             "tflops": flops / ms / 1e9,
                             "weight_gb_per_s": wbytes / ms / 1e6, "roofline_pct": 100 * roof_us / (ms * 1e3),
                             "rel_fro_vs_reference": err["rel_fro"], "max_row_rel_vs_reference": err["max_row_rel"]})
            peer = torch_grouped_mm_peer(recv, case.hidden, case.intermediate)
            ms = _median_ms(peer)
            rows.append({**base, "impl": "torch_grouped_mm", "us": ms * 1e3, **_timing_fields(peer, graph=True),
                         "tflops": flops / ms / 1e9,
                         "roofline_pct": 100 * roof_us / (ms * 1e3), "note": "FP8 weights, GEMMs only"})
            last = rows[-len(spec["impls"]) - 1:]
            print(f"  {fmt} {routing:<8} T={n:>5} pairs={pairs:>6} roof={roof_us:6.0f}us  "
                  + "  ".join(f"{r['impl']}{'/' + r['numerics'] if 'numerics' in r else ''}={r['us']:7.0f}us"
                              f"[graph {r.get('graph_us', float('nan')):.0f} host {r['host_us']:.0f}]"
                              f"({r.get('rel_fro_vs_reference', 0):.0e})" for r in last), flush=True)
    sb.destroy()
    return {"config": {"shape": "V4-Pro, one EP8 rank's 48 experts", "format": fmt, "hidden": 7168,
                       "intermediate": 3072, "num_experts": 48, "num_topk": 6, "block_m": 128, "world_size": 1,
                       "backend": "local", "ceilings": {"fp8_tflops": fp8_tflops, "copy_tb_per_s": copy_tbs},
                       # which fused row numerics="auto" runs on a GPU at this commit (the README's default row)
                       **({"default_numerics": AUTO_GPU_NUMERICS} if fmt == "fp8_fp4" else {}),
                       "timing": "us: median of triton.testing.do_bench (L2 flushed), one eager call per sample; "
                                 "graph_us: the same over replays of one call captured in a CUDA graph (fused and "
                                 "torch rows; device time without the host's launch overhead); host_us: median "
                                 "host time of one eager call from an idle stream (no sync)"},
            "rows": rows}


def bench_timeline(quick: bool) -> dict:
    """The fused kernel's intra-kernel timeline (``%globaltimer`` per task) at two token counts, one EP8 rank's 48
    V4-Pro experts: per program ``(kind, start, end)`` events (ns from the earliest), and per kind the count and the
    summed / mean duration -- where the time of one launch goes, and how the pull overlaps the GEMMs."""
    from megamoe.fused import TIMELINE_KINDS, fused_config, run_fused

    case = MoECase(num_ranks=1, hidden=7168, intermediate=3072, num_experts=48, num_topk=6, block_m=128)
    tokens = [128] if quick else [128, 2048]
    sb = SymmBuffer.local(1, case.num_experts, max(tokens), case.num_topk, case.hidden, case.intermediate,
                          block_m=case.block_m, device="cuda")[0]
    runs = []
    for n, numerics in [(n, num) for num in ("exact", "hopper") for n in tokens]:
        case.num_tokens = n
        problem = case.problem(device="cuda")
        y, l1, l2, stats = prepare_rank(sb, problem, 0)
        calls = bind_calls(y, l1, l2, sb, None, "swiglu", None, "pull", False)
        for _ in range(3):  # warm-up (compile), then keep the last
            (events,) = run_fused(calls, numerics=numerics, timeline=True)
        torch.cuda.synchronize()
        ev = events.cpu()
        valid = ev[..., 0] >= 0
        t_min = int(ev[..., 1][valid].min())
        per_program = [[[int(k), int(a) - t_min, int(b) - t_min] for k, a, b in prog[prog[:, 0] >= 0].tolist()]
                       for prog in ev]
        summary = {}
        for i, name in enumerate(TIMELINE_KINDS):
            sel = ev[..., 0] == i
            d = (ev[..., 2] - ev[..., 1])[sel].double()
            if d.numel():
                summary[name] = {"count": int(d.numel()), "sum_us": float(d.sum()) / 1e3,
                                 "mean_us": float(d.mean()) / 1e3}
        span_us = (int(ev[..., 2][valid].max()) - t_min) / 1e3
        cfg = fused_config(sb.layout, n, 1, sb.buffer.device, numerics)
        runs.append({"num_tokens_per_rank": n, "numerics": numerics, "block_m": cfg.block_m,
                     "programs": cfg.programs_per_rank, "span_us": span_us, "summary": summary, "events": per_program})
        print(f"  {numerics} T={n}: span {span_us:.0f} us, block_m {cfg.block_m}: "
              + "  ".join(f"{k}: {v['count']} x {v['mean_us']:.1f} us" for k, v in summary.items()), flush=True)
    sb.destroy()
    return {"config": {"shape": "V4-Pro, one EP8 rank's 48 experts", "kinds": list(TIMELINE_KINDS), "world_size": 1,
                       "backend": "local",
                       "clock": "%globaltimer (ns), per program: [kind, start, end]"}, "rows": runs}


def bench_fused_tune(quick: bool) -> dict:
    """Launch configurations of the fused kernel (exact and hopper numerics) at three token counts, one EP8 rank's
    48 V4-Pro experts: time and error of each variant, side by side with the staged pipeline of the same run."""
    from megamoe.fused import FusedConfig, fused_config, run_fused
    from megamoe.kernels.symm import BarrierTimeout, check_barrier_state, reset_workspace

    case = MoECase(num_ranks=1, hidden=7168, intermediate=3072, num_experts=48, num_topk=6, block_m=128)
    tokens = [8, 512] if quick else [8, 512, 2048]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    sb = SymmBuffer.local(1, case.num_experts, max(tokens), case.num_topk, case.hidden, case.intermediate,
                          block_m=case.block_m, device="cuda", barrier_timeout_s=5.0)[0]
    rows = []
    for n in tokens:
        case.num_tokens = n
        problem = case.problem(device="cuda")
        y, l1, l2, stats = prepare_rank(sb, problem, 0)
        calls = bind_calls(y, l1, l2, sb, None, "swiglu", None, "pull", False)
        refs = {num: problem.reference(numerics=num)[0] for num in ("exact", "hopper")}
        staged_ms = _median_ms(lambda: fp8_fp4_mega_moe(y, l1, l2, sb, impl="staged", check=False))
        variants = []
        for numerics in ("exact", "hopper"):
            base = fused_config(sb.layout, n, 1, sb.buffer.device, numerics)
            variants.append(base)
            # the earlier default: two uncapped programs per SM
            variants.append(FusedConfig(base.block_m, 2 * sms, numerics, base.promote_every, num_warps=4))
            if numerics == "exact":
                other = 64 if base.block_m == 128 else 128
                variants.append(FusedConfig(other, base.programs_per_rank, numerics, num_warps=4,
                                            maxnreg=base.maxnreg))
        for cfg in variants:
            y.fill_(float("nan"))
            run_fused(calls, numerics=cfg.numerics, config=cfg)
            try:
                check_barrier_state(sb)
            except BarrierTimeout as e:  # e.g. programs that cannot all be resident: the grid sync times out
                reset_workspace(sb)
                rows.append({"num_tokens_per_rank": n, "numerics": cfg.numerics, "block_m": cfg.block_m,
                             "programs_per_rank": cfg.programs_per_rank, "num_warps": cfg.num_warps, "failed": str(e)})
                print(f"  T={n:>5} {cfg} failed: {e}", flush=True)
                continue
            err = moe_error_stats(y, refs[cfg.numerics])
            ms = _median_ms(lambda: run_fused(calls, numerics=cfg.numerics, config=cfg))
            rows.append({"num_tokens_per_rank": n, "numerics": cfg.numerics, "block_m": cfg.block_m,
                         "programs_per_rank": cfg.programs_per_rank, "num_warps": cfg.num_warps,
                         "num_stages": cfg.num_stages, "maxnreg": cfg.maxnreg, "us": ms * 1e3,
                         "staged_us": staged_ms * 1e3,
                         "rel_fro_vs_reference": err["rel_fro"], "max_row_rel_vs_reference": err["max_row_rel"]})
            print(f"  T={n:>5} {cfg.numerics:<6} bm={cfg.block_m:<3} programs={cfg.programs_per_rank:<3} "
                  f"warps={cfg.num_warps} maxnreg={cfg.maxnreg}: {ms * 1e3:8.0f} us (staged {staged_ms * 1e3:6.0f})  "
                  f"err={err['rel_fro']:.1e}",
                  flush=True)
    sb.destroy()
    return {"config": {"shape": "V4-Pro, one EP8 rank's 48 experts", "num_sms": sms, "world_size": 1,
                       "backend": "local"}, "rows": rows}


def merge_peer_rows(layer_json: Path, peer_json: Path, impl: str = "deepgemm_sm90") -> None:
    """Add the rows of a peer kit's JSON (e.g. ../shared/peers/deepgemm_sm90: ``rows`` of ``T``, ``us``) to a layer
    result as ``impl`` rows, so every implementation of one device run sits in one file."""
    layer, peer = json.loads(layer_json.read_text()), json.loads(peer_json.read_text())
    routing = peer.get("config", {}).get("routing", "uniform")
    ours = {(r["num_tokens_per_rank"], r.get("routing")): r for r in layer["rows"] if r["impl"] == "staged"}
    for r in peer["rows"]:
        row = {"impl": impl, "num_tokens_per_rank": r["T"], "routing": routing, "us": r["us"],
               "kernel_us": r.get("kernel_us"),  # the kit's torch.profiler time of the kernel alone
               "num_pairs": r.get("pairs"), "tflops": r.get("tflops"), "rel_fro_vs_reference": r.get("rel_err"),
               "note": ("FP8 e4m3 weights with 128x128 block scales (DeepGEMM's Hopper format): the same format, "
                        "bytes and roofline as this file's rows" if layer.get("config", {}).get("format") == "fp8" else
                        "FP8 e4m3 weights with 128x128 block scales (DeepGEMM's Hopper format): twice the weight "
                        "bytes of FP4; its roofline_pct uses the FP4 roofline of the same work")}
        same = ours.get((r["T"], routing))
        if same:
            row.update(flops=same["flops"], roofline_us=same["roofline_us"],
                       roofline_pct=100 * same["roofline_us"] / r["us"])
        layer["rows"].append(row)
    layer.setdefault("peers", {})[impl] = {"provenance": peer.get("provenance"), "config": peer.get("config"),
                                           "source": str(peer_json.name)}
    layer_json.write_text(json.dumps(layer, indent=1))


def bench_pull_push(quick: bool, num_ranks: int = 4) -> dict:
    rows = []
    tokens = [128] if quick else [128, 1024]
    case = MoECase(num_ranks=num_ranks, hidden=7168, intermediate=3072, num_experts=48 * num_ranks // 2,
                   num_topk=6, block_m=128)
    sbs = SymmBuffer.local(num_ranks, case.num_experts, max(tokens), case.num_topk, case.hidden, case.intermediate,
                           block_m=case.block_m, device="cuda")
    for dispatch in ("pull", "push"):
        case.dispatch = dispatch
        rows += bench_layer_case(case, tokens, sbs)
    for sb in sbs:
        sb.destroy()
    return {"config": {"num_ranks": num_ranks, "hidden": 7168, "intermediate": 3072,
                       "num_experts": case.num_experts, "num_topk": 6, "block_m": 128,
                       "note": "local ranks on one GPU: 'remote' accesses stay in this GPU's HBM"}, "rows": rows}


def bench_tune(quick: bool) -> dict:
    """Sweep GEMM launch configs and block_m at two token counts; time the L1 and L2 steps (V4-Pro, 48 experts)."""
    from megamoe import ops

    rows = []
    base = {k: dict(v) for k, v in ops.GEMM_CONFIG.items()}
    fp8 = {"scaled_operands": False, "prmt_decode": True}
    variants = [fp8, {**fp8, "prmt_decode": False}, {**fp8, "num_warps": 8, "l1_only": True},
                {"scaled_operands": True}]
    for block_m in ((128,) if quick else (64, 128)):
        case = MoECase(num_ranks=1, hidden=7168, intermediate=3072, num_experts=48, num_topk=6, block_m=block_m)
        sbs = SymmBuffer.local(1, 48, 2048, 6, 7168, 3072, block_m=block_m, device="cuda")
        for n in ((8, 512) if quick else (8, 512, 2048)):
            case.num_tokens = n
            problem = case.problem(device="cuda")
            y, l1, l2, stats = prepare_rank(sbs[0], problem, 0)
            for v in variants:
                for step in ("l1", "l2"):
                    if v.get("l1_only") and step == "l2":
                        continue
                    ops.GEMM_CONFIG[step] = {**base[step], **{k: x for k, x in v.items() if not k.endswith("_only")}}
                fp8_fp4_mega_moe(y, l1, l2, sbs[0], numerics="exact")
                calls = bind_calls(y, l1, l2, sbs[0], None, "swiglu", None, "pull", False)
                steps = time_steps(calls, pipeline_steps("pull"), repeats=10)
                row = {"block_m": block_m, "num_tokens": n, "variant": {k: x for k, x in v.items()},
                       "l1_us": steps["l1"], "l2_us": steps["l2"],
                       "config": {k: dict(x) for k, x in ops.GEMM_CONFIG.items()}}
                rows.append(row)
                print(f"  bm={block_m} T={n} {v}: l1={steps['l1']:.0f} us l2={steps['l2']:.0f} us", flush=True)
                ops.GEMM_CONFIG.update({k: dict(x) for k, x in base.items()})
        sbs[0].destroy()
    return {"config": {"shape": "V4-Pro, 48 experts, top-6"}, "rows": rows}


def bench_tma_pull(quick: bool) -> dict:
    """The seed's CUDA primitives (CuPy): TMA 1-D bulk pull/push bandwidth vs row size, two buffers on one GPU."""
    from megamoe.kernels import cupy_prims

    rows = []
    for op in ("pull", "push"):
        res = cupy_prims.bench_pull(op=op, row_bytes=(1024, 7168) if quick else (256, 1024, 4096, 7168, 16384, 65536))
        rows += res["rows"]
    return {"config": res["config"], "rows": rows}


SUITES = {"tune": bench_tune, "tma_pull": bench_tma_pull, "ceilings": lambda quick: bench_ceilings(),
          "layer": bench_layer, "layer_fp8": lambda quick: bench_layer(quick, "fp8"),
          "pull_push": bench_pull_push, "timeline": bench_timeline,
          "fused_tune": bench_fused_tune}
#: Sweeps that ``--suite all`` leaves out.
NOT_IN_ALL = ("tune", "fused_tune")
__doc__ = __doc__.replace("--suite SUITE|all", f"--suite {'|'.join([*SUITES, 'all'])}", 1)


def write_result(kind: str, result: dict, command: str, out_dir: Path = RESULTS_DIR) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{kind}_{device_tag()}.json"
    payload = {"kind": kind, "provenance": provenance(command), **result}
    path.write_text(json.dumps(payload, indent=1))
    return path


#: The layer suites and their weight format (``--tokens`` applies to them).
LAYER_SUITES = {"layer": "fp8_fp4", "layer_fp8": "fp8"}


def _token_list(text: str) -> list[int]:
    """``--tokens`` "8,512" -> [8, 512] (positive ints)."""
    try:
        tokens = [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tokens: expected comma-separated ints, got {text!r}") from None
    if not tokens or min(tokens) < 1:
        raise argparse.ArgumentTypeError(f"--tokens: expected positive ints, got {text!r}")
    return tokens


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=[*SUITES, "all"], default="all")
    parser.add_argument("--quick", action="store_true", help="fewer sizes")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--tokens", type=_token_list, default=None, metavar="T1,T2,...",
                        help="layer suites only: these tokens per rank instead of LAYER_TOKENS (e.g. to time one "
                             "kernel change quickly; write it with --out elsewhere than results/)")
    parser.add_argument("--merge-peer", type=Path, nargs=2, metavar=("LAYER_JSON", "PEER_JSON"),
                        help="add a peer kit's rows (DeepGEMM SM90) to a layer result and exit (no GPU needed)")
    args = parser.parse_args(argv)
    if args.tokens is not None and args.suite not in LAYER_SUITES:
        parser.error(f"--tokens applies to the layer suites {LAYER_SUITES}, not --suite {args.suite}")
    if args.merge_peer:
        merge_peer_rows(*args.merge_peer)
        return
    if not torch.cuda.is_available():
        sys.exit("megamoe.bench needs a CUDA GPU (timings under the Triton interpreter are meaningless)")
    command = "python -m megamoe.bench " + " ".join(argv if argv is not None else sys.argv[1:])
    for kind in ([k for k in SUITES if k not in NOT_IN_ALL] if args.suite == "all" else [args.suite]):
        print(f"[bench] {kind}", flush=True)
        if args.tokens is not None:
            result = bench_layer(args.quick, LAYER_SUITES[kind], tokens=args.tokens)
        else:
            result = SUITES[kind](args.quick)
        path = write_result(kind, result, command, args.out)
        print(f"[bench] wrote {path}", flush=True)


if __name__ == "__main__":
    main()
