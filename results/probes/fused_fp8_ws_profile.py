"""Per-launch GPU time of one fused call whose GEMMs run as a Gluon phase (front launch / Gluon GEMM phase / back
launch), and the gaps between them, at V4-Pro (one EP8 rank's 48 experts, world size 1, uniform routing), from the
torch profiler's kernel records of 5 calls after 3 warm-up calls (median per launch position):

    python results/probes/fused_fp8_ws_profile.py T[,T...] [fp8 | fp8_fp4] >> fused_fp8_ws_profile_<commit>_h200.jsonl

Environment (each a one-run override of ``megamoe.fused``, recorded in the row):
  FRONT_PROGRAMS           the front launch's programs (``FusedConfig.programs_per_rank``; default one an SM)
  BACK_PROGRAMS_PER_SM     ``WS_BACK_PROGRAMS_PER_SM`` (a fraction gives that share of the SMs one program each)
  PLACE_BLOCK_PAIRS        pairs per placement task of the FP8 format's front launch (``PLACE_BLOCK_PAIRS``)
  FP8_WS_MIN_EXPECTED, FP8_WS_BLOCK64_MAX_EXPECTED, FP4_BLOCK64_MAX_EXPECTED, FP4_RS_MAX_EXPECTED   the tile
                           thresholds (FP4_RS_MAX_EXPECTED=-1: the decode-partition tile at block 64)
  FP4_RS_BLOCK_N           the register-operand tile's token chunk (8, 16, 32, 64) whatever the expectation
  FP4_WS_REGS              the decode-partition tile's (math, loader, decode, maxnreg) registers at one pool block,
                           e.g. ``128:200,24,88,128`` (``FP4_WS_REGS``)
  WS_GROUP_SYNC            1 / 0: the Gluon phase's programs sharing a weight tile start it together or not
  FP4_RS_PAIR              weight chains a token stage of that tile by chunk, e.g. ``8:2,16:2`` (``FP4_RS_PAIR``)
  NCU                      set: no torch profiler and no row; after the warm-up one call runs between
                           ``cudaProfilerStart`` / ``Stop``, for ``ncu --profile-from-start off`` (``device_run.sh ncu``)
  FP4_RS_WIDE              chunks (e.g. ``64``) run on 128-row chains: two math warpgroups, one CTA an SM, block 128
  FP4_RS_VARIANT           candidates of ``megamoe.fused.FP4_RS_CANDIDATES`` by chunk, e.g. ``32:c2p4``
                           (``fp4_rs_variant``)

A row: ``launches`` [(kernel name, median us)] in call order, ``gaps_us`` between consecutive launches' end and
start, ``span_us`` from the first launch's start to the last's end (median), ``kernels_us`` as the earlier rows of
this probe (per kernel name, summed over a call)."""
import dataclasses
import json
import os
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import megamoe.fused as mf
from megamoe.cases import MoECase, prepare_rank
from megamoe.ops import fp8_fp4_mega_moe
from megamoe.ops_fp8 import fp8_mega_moe
from megamoe.symm import SymmBuffer

CALLS, WARMUP = 5, 3


def launch_split(kernels: list, calls: int) -> dict:
    """``kernels``: ``(start us, end us, name)`` of every GPU kernel of ``calls`` consecutive calls (any order) ->
    ``launches`` [(name, median us)] by position in a call, ``gaps_us`` (median, end of one launch to the start of
    the next), ``span_us`` (median, first start to last end) and ``kernels_us`` (per name, summed over a call)."""
    kernels = sorted(kernels, key=lambda k: k[0])
    per_call, rest = divmod(len(kernels), calls)
    if per_call == 0 or rest:
        raise ValueError(f"{len(kernels)} kernels do not split into {calls} calls of the same launches")
    by_call = [kernels[i * per_call:(i + 1) * per_call] for i in range(calls)]
    names = [k[2][:60] for k in by_call[0]]
    if any([k[2][:60] for k in c] != names for c in by_call):
        raise ValueError(f"the calls' launches differ: {[[k[2][:60] for k in c] for c in by_call]}")
    med = statistics.median
    agg = dict.fromkeys(names, 0.0)
    for start, end, name in kernels:
        agg[name[:60]] += (end - start) / calls
    return {"launches": [(names[j], round(med(c[j][1] - c[j][0] for c in by_call), 1)) for j in range(per_call)],
            "gaps_us": [round(med(c[j + 1][0] - c[j][1] for c in by_call), 1) for j in range(per_call - 1)],
            "span_us": round(med(c[-1][1] - c[0][0] for c in by_call), 1),
            "kernels_us": {k: round(v, 1) for k, v in agg.items()}}


def main(argv: list[str]) -> None:
    tokens = [int(t) for t in argv[1].split(",")]
    fmt = argv[2] if len(argv) > 2 else "fp8"
    overrides = {}
    for name in ("FP8_WS_MIN_EXPECTED", "FP8_WS_BLOCK64_MAX_EXPECTED", "FP4_BLOCK64_MAX_EXPECTED",
                 "FP4_RS_MAX_EXPECTED"):
        if name in os.environ:
            overrides[name] = float(os.environ[name])
    if "WS_GROUP_SYNC" in os.environ:  # the Gluon phases' group sync (megamoe.fused.WS_GROUP_SYNC)
        on = os.environ["WS_GROUP_SYNC"] == "1"
        overrides["WS_GROUP_SYNC"] = {"fp8_ws": on, "fp4_ws": on}
    if "BACK_PROGRAMS_PER_SM" in os.environ:
        overrides["WS_BACK_PROGRAMS_PER_SM"] = float(os.environ["BACK_PROGRAMS_PER_SM"])
    if "PLACE_BLOCK_PAIRS" in os.environ:  # pairs per placement task of the FP8 front launch
        overrides["PLACE_BLOCK_PAIRS"] = int(os.environ["PLACE_BLOCK_PAIRS"])
    for name, value in overrides.items():
        setattr(mf, name, value)
    if "FP4_WS_REGS" in os.environ:  # the decode-partition tile's register split at one block, "128:200,24,88,128"
        bm, regs = os.environ["FP4_WS_REGS"].split(":")
        mf.FP4_WS_REGS = {**mf.FP4_WS_REGS, int(bm): tuple(int(v) for v in regs.split(","))}
        overrides["FP4_WS_REGS"] = os.environ["FP4_WS_REGS"]
    if "FP4_RS_BLOCK_N" in os.environ:  # the register-operand tile's token chunk, whatever the expectation
        block_n = overrides["FP4_RS_BLOCK_N"] = int(os.environ["FP4_RS_BLOCK_N"])
        mf.fp4_rs_block_n = lambda expected: block_n
    if "FP4_RS_PAIR" in os.environ:  # chains a token stage, per chunk
        pairs = {int(k): int(v) for k, v in (kv.split(":") for kv in os.environ["FP4_RS_PAIR"].split(","))}
        mf.FP4_RS_PAIR = {**mf.FP4_RS_PAIR, **pairs}
        overrides["FP4_RS_PAIR"] = os.environ["FP4_RS_PAIR"]
    if "FP4_RS_WIDE" in os.environ:  # chunks on 128-row chains (two math warpgroups, one CTA an SM, block 128)
        for bn in (int(v) for v in os.environ["FP4_RS_WIDE"].split(",")):
            mf.FP4_RS_ROWS = {**mf.FP4_RS_ROWS, bn: 128}
            mf.FP4_RS_CTAS_PER_SM = {**mf.FP4_RS_CTAS_PER_SM, bn: 1}
            mf.FP4_RS_PAIR = {**mf.FP4_RS_PAIR, bn: 1}
            mf.FP4_RS_LOAD_REGS = {**mf.FP4_RS_LOAD_REGS, bn: 40}
        overrides["FP4_RS_WIDE"] = os.environ["FP4_RS_WIDE"]
    if "FP4_RS_VARIANT" in os.environ:  # named candidates, per chunk
        for kv in os.environ["FP4_RS_VARIANT"].split(","):
            bn, name = kv.split(":")
            for setting, value in mf.fp4_rs_variant(int(bn), *mf.FP4_RS_CANDIDATES[int(bn)][name]).items():
                setattr(mf, setting, value)
        overrides["FP4_RS_VARIANT"] = os.environ["FP4_RS_VARIANT"]
    if "FRONT_PROGRAMS" in os.environ:
        front_programs, config = int(os.environ["FRONT_PROGRAMS"]), mf.fused_config
        mf.fused_config = lambda *a, **k: dataclasses.replace(config(*a, **k), programs_per_rank=front_programs)
    numerics = "hopper" if fmt == "fp8_fp4" else "exact"

    case = MoECase(num_ranks=1, hidden=7168, intermediate=3072, num_experts=48, num_topk=6, block_m=128, format=fmt)
    sb = SymmBuffer.local(1, 48, max(tokens), 6, 7168, 3072, block_m=128, device="cuda", format=fmt)[0]
    for n in tokens:
        case.num_tokens = n
        problem = case.problem(device="cuda")
        y, l1, l2, stats = prepare_rank(sb, problem, 0)

        def call():
            if fmt == "fp8":
                fp8_mega_moe(y, l1, l2, sb, impl="fused", check=False)
            else:
                fp8_fp4_mega_moe(y, l1, l2, sb, impl="fused", numerics=numerics, check=False)

        cfg = mf.fused_config(sb.layout, n, 1, sb.buffer.device, numerics)
        for _ in range(WARMUP):
            call()
        torch.cuda.synchronize()
        if os.environ.get("NCU"):
            torch.cuda.cudart().cudaProfilerStart()
            call()
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
            print(json.dumps({"T": n, "fmt": fmt, "kind": cfg.kind, "block_m": cfg.block_m, "ncu": True}), flush=True)
            continue
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(CALLS):
                call()
            torch.cuda.synchronize()
        kernels = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type.name == "CUDA"]
        print(json.dumps({"T": n, "fmt": fmt, "kind": cfg.kind, "block_m": cfg.block_m,
                          "front_programs": cfg.programs_per_rank, "overrides": overrides,
                          **launch_split(kernels, CALLS), "commit": os.environ.get("MEGAMOE_GIT_COMMIT")}), flush=True)
    sb.destroy()


if __name__ == "__main__":
    main(sys.argv)
