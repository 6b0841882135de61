"""The fused call's host path on a CPU machine (``megamoe.host_path.hopper_host``: an sm_90 stand-in, Triton's own
launch code around a C launch that only counts): per format and T, the median host time of one repeated eager call
(``check=False``, as the bench times it) and what the call launched, compiled and encoded, with a hit through the
compiled kernel's C launcher (``RAW``, the library's default) and through its runner, alternating twice.

The shapes: ``megamoe.host_path.SMALL_SHAPE`` (V4-Pro's routing, so the same tile kinds and token chunks as one EP8
rank at the same T; the host path does not depend on H and I). Not measured here: the C launch, the CUDA
driver, torch's CUDA calls -- the GPU host's own enqueue time is ``megamoe.bench``'s ``host_us``.

Run with ``TRITON_INTERPRET=0`` (the kernels then are ``JITFunction`` objects, as on a GPU; nothing is compiled):

    TRITON_INTERPRET=0 python results/probes/host_path_probe.py [T1,..] >> results/probes/host_path_cpu.jsonl
"""
import json
import platform
import sys
import time

import megamoe  # noqa: F401  (before triton)
import megamoe.direct_launch as dl
from megamoe.env import provenance
from megamoe.host_path import hopper_host, small_rank

#: Eager calls timed per row (after two untimed ones: the first launches, the first hits).
CALLS = 2000


def median_us(call, n: int = CALLS) -> tuple[float, float]:
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        call()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return ts[n // 2] * 1e6, ts[n // 10] * 1e6


def main(tokens=(8, 128, 512, 2048)):
    import megamoe.fused as mf

    prov = provenance(" ".join(["python"] + sys.argv))
    prov["cpu"] = platform.processor() or platform.machine()
    for fmt in ("fp8_fp4", "fp8"):
        for T in tokens:
            sb, _, call = small_rank(T, fmt)
            with hopper_host() as log:
                call()
                first = dict(compiled=len(log.compiled), launches=len(log.launches), encoded=len(log.encoded))
                log.clear()
                call()
                second = dict(compiled=len(log.compiled), launches=len(log.launches), encoded=len(log.encoded))
                log.clear()
                cfg = mf.fused_config(sb.layout, T, 1, sb.buffer.device, "hopper" if fmt == "fp8_fp4" else "exact")
                for raw in (True, False, True, False):
                    dl.RAW = raw
                    try:
                        med, p10 = median_us(call)
                    finally:
                        dl.RAW = True
                    per_call = {k: len(v) / CALLS for k, v in (("launches", log.launches),
                                                               ("encoded", log.encoded),
                                                               ("compiled", log.compiled))}
                    log.clear()
                    print(json.dumps(dict(probe="host_path", format=fmt, T=T, kind=cfg.kind, rs_block_n=cfg.rs_block_n,
                                          raw=raw, host_us=med, host_us_p10=p10, per_call=per_call,
                                          first_call=first, second_call=second, **prov)), flush=True)
            sb.destroy()


if __name__ == "__main__":
    main(tuple(int(t) for t in sys.argv[1].split(",")) if len(sys.argv) > 1 else (8, 128, 512, 2048))
