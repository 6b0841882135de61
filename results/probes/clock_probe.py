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

Two more "formats" are the board's ceiling for the same work, not the layer: ``dense`` is cuBLAS's FP8 GEMM
(``torch._scaled_mm``, per-tensor scales, bf16 out) on the layer's two GEMMs as dense matrices (L1: ``[T * topk, H]
x [H, 2I]``, L2: ``[T * topk, I] x [I, H]``, the same FLOPs as the layer, no routing, no dispatch, no SwiGLU, no
combine), and ``dense_block`` the same with DeepGEMM's scales (fp32 per 1 x 128 of the rows, per 128 x 128 of the
weights), where this torch has them on sm_90 (the first scale layout cuBLAS accepts; on an H100 in session 43 it
ran ``nvjet_..._Ablk128_Bvec128``, i.e. the weights' scales as 128-element vectors, a finer grid than DeepGEMM's,
promoted every 128 of K as DeepGEMM is; the row ``cuda_kernels`` names the kernel). Operands are randn quantised
to span e4m3's range, as the layer's are (what the multipliers toggle sets the power drawn). Whether ~1000 TFLOP/s
at T = 8192 is in reach of any FP8 kernel under the board's power cap is then read off its ``graph_loop`` /
``eager_loop`` rows.

A row per (format, T, way): ``us``, ``tflops``, the samples' median / min SM clock (MHz), median power (W), median
temperature, and the clock-event (throttle) reasons seen (bit mask as nvidia-smi prints it, with a count). The
first row gives the board's ``power.limit`` and ``clocks.max.sm``.

    python results/probes/clock_probe.py [T1,..] [fmt1,..] >> clock_probe_h200.jsonl     (default 2048,8192 fp8,fp8_fp4)
    python results/probes/clock_probe.py 8192 dense,dense_block,fp8                       (the ceiling beside the layer)

Without CUDA it exits with a message (no GPU clock to read).
"""
import functools
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


@functools.cache
def _reason_field() -> str | None:
    """The board's throttle-reason field (its name differs by driver), asked once a process."""
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

    @classmethod
    def now(cls) -> "Sampler":
        """A sampler of this board's fields (its throttle-reason field included), started now."""
        return cls(_reason_field())

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


def _e4m3_spanning(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """randn ``[rows, cols]`` quantised to e4m3 with one fp32 scale per tensor that maps its amax to 448:
    ``(q [rows, cols] float8_e4m3fn, scale [] fp32)``."""
    x = torch.randn(rows, cols, device="cuda")
    scale = x.abs().amax() / 448.0
    return (x / scale).to(torch.float8_e4m3fn), scale


def _dense_call(T: int, fmt: str, shape: dict):
    """The layer's two GEMMs as dense cuBLAS FP8 GEMMs (module docstring): a zero-argument callable, or a string
    saying why this torch cannot run ``fmt``."""
    m, H, I = T * shape["num_topk"], shape["hidden"], shape["intermediate"]
    a1, s_a1 = _e4m3_spanning(m, H)
    w1, s_w1 = _e4m3_spanning(2 * I, H)
    a2, s_a2 = _e4m3_spanning(m, I)
    w2, s_w2 = _e4m3_spanning(H, I)
    scales = [(s_a1, s_w1, s_a2, s_w2)]
    if fmt == "dense_block":  # 1 x 128 activation scales, 128 x 128 weight scales: the layouts cuBLAS may want
        def full(rows, cols, v):
            return torch.full((rows, cols), float(v), device="cuda")
        a_major = (full(H // 128, m, s_a1).t(), full(I // 128, m, s_a2).t())  # [M, K/128], M-major
        a_row = (full(m, H // 128, s_a1), full(m, I // 128, s_a2))
        w_kn = (full(H // 128, 2 * I // 128, s_w1), full(I // 128, H // 128, s_w2))  # [K/128, N/128]
        w_nk = (full(2 * I // 128, H // 128, s_w1).t(), full(H // 128, I // 128, s_w2).t())
        scales = [(a[0], w[0], a[1], w[1]) for a in (a_major, a_row) for w in (w_kn, w_nk)]
    errors = []
    for layout, (sa1, sw1, sa2, sw2) in enumerate(scales):
        def call(sa1=sa1, sw1=sw1, sa2=sa2, sw2=sw2):
            torch._scaled_mm(a1, w1.t(), scale_a=sa1, scale_b=sw1, out_dtype=torch.bfloat16)
            torch._scaled_mm(a2, w2.t(), scale_a=sa2, scale_b=sw2, out_dtype=torch.bfloat16)
        try:
            call()
            torch.cuda.synchronize()
            call.scale_layout = layout  # index into ``scales``: which layout this torch took
            return call
        except (RuntimeError, ValueError, NotImplementedError) as e:
            errors.append(f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
    return " | ".join(errors)


def _kernel_names(fn) -> list[str]:
    """The CUDA kernels one ``fn()`` launches (torch.profiler), by name: which cuBLAS kernel (tile, cluster) ran."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})


def _case(probe, fmt: str, T: int, reason: str | None) -> None:
    """The four ways of one (format, T) on a fresh buffer (``dense*``: fresh operands), a row each."""
    if fmt.startswith("dense"):
        call = _dense_call(T, fmt, probe.SHAPE)
        if isinstance(call, str):
            print(json.dumps({"fmt": fmt, "T": T, "error": call}), flush=True)
            return
        print(json.dumps({"fmt": fmt, "T": T, "cuda_kernels": _kernel_names(call)}), flush=True)
    else:
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
               **({"scale_layout": call.scale_layout} if hasattr(call, "scale_layout") else {}),
               "tflops": round(flops / (us * 1e-6) / 1e12, 1), **s.stop()}
        print(json.dumps(row), flush=True)

if __name__ == "__main__":
    main()
