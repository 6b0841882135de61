"""The SM clock and board power while the fused layer runs, eager and as a CUDA-graph replay, with and without the
bench's L2 flush: whether the large-T calls are power-limited (what bounds TFLOP/s at T = 8192, issue #8's
">= 1000 TFLOP/s"), and why the bench's T = 8192 graph replays were 7-10 % slower than its eager calls
(closing notes of sessions 13-15: FP8 7848 vs 7316 us, FP8 x FP4 9042 vs 8364).

For each format (``fp8``: ``fp8_mega_moe``; ``fp8_fp4``: ``fp8_fp4_mega_moe`` with "hopper" numerics) and T, one
fresh buffer (one EP8 rank's 48 experts of V4-Pro, as ``fp8_ws_probe.rank``), then four ways of running the same
call for ``SECONDS`` each, ``nvidia-smi`` sampling every 50 ms beside it:

* ``eager_flush`` / ``graph_flush``: ``triton.testing.do_bench`` (its L2 flush before each call, median), as the
  bench's ``us`` / ``graph_us``;
* ``eager_loop`` / ``graph_loop``: calls back to back, no flush, mean over CUDA events.

A row per (format, T, way): ``us``, ``tflops``, the samples' median / min SM clock (MHz), median power (W), median
temperature, and the clock-event (throttle) reasons seen (bit mask as nvidia-smi prints it, with a count). The
first row gives the board's ``power.limit`` and ``clocks.max.sm``.

    python results/probes/clock_probe.py [T1,..] [fmt1,..] >> clock_probe_h200.jsonl     (default 2048,8192 fp8,fp8_fp4)

Without CUDA it exits with a message (no GPU clock to read).
"""
import importlib.util
import json
import pathlib
import shutil
import subprocess
import sys
import time

import torch

import megamoe  # noqa: F401  (before triton)
from megamoe.bench import _median_ms, layer_flops
from megamoe.env import provenance

SECONDS = 3.0
QUERY = "clocks.sm,power.draw,temperature.gpu"
REASONS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")  # newer / older name of one field


def _probe_module():
    path = pathlib.Path(__file__).with_name("fp8_ws_probe.py")
    spec = importlib.util.spec_from_file_location("fp8_ws_probe", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _smi(fields: str) -> subprocess.CompletedProcess:
    return subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits", "-i", "0"],
                          capture_output=True, text=True, timeout=30)


def _reason_field() -> str | None:
    for f in REASONS:
        if _smi(f).returncode == 0:
            return f
    return None


class Sampler:
    """``nvidia-smi -lms 50`` in the background; ``stop()`` returns the parsed samples."""

    def __init__(self, reason: str | None):
        self.fields = QUERY + (f",{reason}" if reason else "")
        self.proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={self.fields}", "--format=csv,noheader,nounits",
                                      "-i", "0", "-lms", "50"], stdout=subprocess.PIPE, text=True)

    def stop(self) -> dict:
        self.proc.terminate()
        out, _ = self.proc.communicate(timeout=30)
        rows = [[c.strip() for c in line.split(",")] for line in out.splitlines() if line.strip()]
        rows = [r for r in rows if len(r) >= 3 and r[0].replace(".", "").isdigit()]
        if not rows:
            return {"samples": 0}
        med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
        clk = [float(r[0]) for r in rows]
        pw = [float(r[1]) for r in rows if r[1].replace(".", "").isdigit()]
        tmp = [float(r[2]) for r in rows if r[2].isdigit()]
        reasons: dict[str, int] = {}
        for r in rows:
            if len(r) > 3:
                reasons[r[3]] = reasons.get(r[3], 0) + 1
        return {"samples": len(rows), "sm_mhz_median": med(clk), "sm_mhz_min": min(clk),
                "power_w_median": med(pw) if pw else None, "temp_c_median": med(tmp) if tmp else None,
                "reasons": reasons}


def _loop_us(fn, seconds: float) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    n, t0 = 0, time.perf_counter()
    start.record()
    while time.perf_counter() - t0 < seconds:
        fn()
        n += 1
        if n % 8 == 0:  # keep the host at most 8 calls ahead
            torch.cuda.synchronize()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / n


def main() -> None:
    if not torch.cuda.is_available() or shutil.which("nvidia-smi") is None:
        print("clock_probe: needs a CUDA device and nvidia-smi", file=sys.stderr)
        return
    tokens = [int(t) for t in sys.argv[1].split(",")] if len(sys.argv) > 1 else [2048, 8192]
    fmts = sys.argv[2].split(",") if len(sys.argv) > 2 else ["fp8", "fp8_fp4"]
    probe = _probe_module()
    reason = _reason_field()
    board = _smi("power.limit,clocks.max.sm,clocks.sm").stdout.strip()
    print(json.dumps({"board": board, "fields": "power.limit,clocks.max.sm,clocks.sm (idle)",
                      "reason_field": reason, "provenance": provenance(" ".join(["clock_probe.py", *sys.argv[1:]]))}),
          flush=True)
    for fmt in fmts:
        for T in tokens:
            _case(probe, fmt, T, reason)
            torch.cuda.empty_cache()


def _case(probe, fmt: str, T: int, reason: str | None) -> None:
    """The four ways of one (format, T) on a fresh buffer, a row each."""
    sb, problem, y, call = probe.rank(T, fmt)
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    flops = layer_flops(T * probe.SHAPE["num_topk"], probe.SHAPE["hidden"], probe.SHAPE["intermediate"])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    ways = {"eager_flush": lambda: _median_ms(call, rep_ms=SECONDS * 1e3) * 1e3,
            "eager_loop": lambda: _loop_us(call, SECONDS),
            "graph_flush": lambda: _median_ms(graph.replay, rep_ms=SECONDS * 1e3) * 1e3,
            "graph_loop": lambda: _loop_us(graph.replay, SECONDS)}
    for way, timed in ways.items():
        time.sleep(1.0)  # let the clock recover between ways
        s = Sampler(reason)
        us = timed()
        row = {"fmt": fmt, "T": T, "way": way, "us": round(us, 1),
               "tflops": round(flops / (us * 1e-6) / 1e12, 1), **s.stop()}
        print(json.dumps(row), flush=True)

if __name__ == "__main__":
    main()
