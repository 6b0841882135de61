"""Offline sm_90a compile of ``megamoe.kernels.gemm_fp4_ws`` (the fused FP8 x FP4 path's Gluon GEMM phase, tile kind
"fp4_ws") at V4-Pro size on a machine without a GPU, through ``megamoe.hopper_compile``: shared memory, ptxas
registers / stack / spills, setmaxnreg values, a SASS op histogram, the K loops' bodies.

    python results/probes/gemm_fp4_ws_compile.py [STAGES]   (env: BM=128, MATH, LR, DR, MAXNREG, PREFETCH, SF_TMA,
                                                             PREDECODE=0, H=7168, I=3072)

``BM`` = 128 (two math warpgroups, one decode partition) or 64 (one math warpgroup, two decode partitions); every
keyword not set here is the host's (``megamoe.fused.fp4_ws_keywords``). The TTGIR / PTX / SASS are in the printed
directory.
"""
import os
import sys

from megamoe.hopper_compile import compile_gluon_phase
from megamoe.layout import Layout

BM = int(os.environ.get("BM", 128))
H, I = int(os.environ.get("H", 7168)), int(os.environ.get("I", 3072))
overrides = {k: int(os.environ[e]) for k, e in (("MATH_REGS", "MATH"), ("LOAD_REGS", "LR"), ("DECODE_REGS", "DR"),
                                                ("maxnreg", "MAXNREG")) if e in os.environ}
overrides.update({k: bool(int(os.environ[k])) for k in ("PREFETCH", "SF_TMA") if k in os.environ})
if len(sys.argv) > 1:
    overrides["STAGES"] = int(sys.argv[1])
r = compile_gluon_phase("fp4_ws", Layout(1, 48, 8192, 6, H, I, 128), BM, predecode=bool(int(os.environ.get(
    "PREDECODE", 0))), overrides=overrides, keep=True)
keep = ("QGMMA", "UTMALDG", "STL", "LDL", "BAR", "SYNCS", "USETMAXREG", "WARPGROUP", "MEMBAR", "FENCE", "ATOMG",
        "STG", "PRMT", "LDS", "STS", "HMUL2", "F2FP")
print("BM", BM, "overrides", overrides)
print(r.summary(keep))
