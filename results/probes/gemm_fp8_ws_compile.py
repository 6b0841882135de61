"""Offline sm_90a compile of ``megamoe.kernels.gemm_fp8_ws`` (the fused FP8 path's Gluon GEMM phase) at V4-Pro size,
on a machine without a GPU, through ``megamoe.hopper_compile``: shared memory, ptxas registers / stack / spills,
setmaxnreg values, a SASS op histogram, the K loops' bodies.

    python results/probes/gemm_fp8_ws_compile.py [STAGES]   (env: BM=128|64, MATH, MAXNREG, PW, PR, LR, PC)

Every keyword not set here is the host's (``megamoe.fused.fp8_ws_keywords``). The TTGIR / PTX / SASS are in the
printed directory.
"""
import os
import sys

from megamoe.hopper_compile import compile_gluon_phase
from megamoe.layout import Layout

BM = int(os.environ.get("BM", 128))
names = (("MATH_REGS", "MATH"), ("maxnreg", "MAXNREG"), ("PULL_WARPS", "PW"), ("PULL_REGS", "PR"),
         ("LOAD_REGS", "LR"), ("PULL_CHUNK", "PC"))
overrides = {k: int(os.environ[e]) for k, e in names if e in os.environ}
if len(sys.argv) > 1:
    overrides["STAGES"] = int(sys.argv[1])
r = compile_gluon_phase("fp8_ws", Layout(1, 48, 8192, 6, 7168, 3072, 128, format="fp8"), BM, overrides=overrides,
                        keep=True)
keep = ("QGMMA", "UTMALDG", "STL", "LDL", "BAR", "SYNCS", "USETMAXREG", "WARPGROUP", "MEMBAR", "FENCE", "ATOM",
        "ATOMG", "RED", "STG", "FSEL", "FFMA")
print("BM", BM, "overrides", overrides)
print(r.summary(keep))
