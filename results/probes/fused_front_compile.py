"""Offline sm_90a compile of the fused kernel's front / back launches (``fused_mega_moe_kernel`` with ``PHASE=1`` /
``2``) around a Gluon GEMM phase, on a machine without a GPU: registers, spills and shared memory for the residency
check (``megamoe.fused.PROGRAMS_PER_SM``, ``tests/test_fused.py::test_residency_limits_every_programs_per_sm_choice``).

    python results/probes/fused_front_compile.py [KIND] [PHASE]      (KIND fp4_ws | fp8_ws, default fp4_ws; PHASE 1)

V4-Pro shapes of one EP8 rank (384 experts, top-6, H = 7168, I = 3072, T = 8192), the configuration
``fused_config`` gives the kind (8 warps, 2 stages, block 128).
"""
import os
import subprocess
import sys
import tempfile

os.environ["TRITON_INTERPRET"] = "0"
import megamoe  # noqa: E402,F401
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from megamoe.fused import WARPS_STAGES, FusedConfig, kernel_meta, phase_meta  # noqa: E402
from megamoe.kernels import fused as kf  # noqa: E402
from megamoe.layout import Layout  # noqa: E402

KIND = sys.argv[1] if len(sys.argv) > 1 else "fp4_ws"
PHASE = int(sys.argv[2]) if len(sys.argv) > 2 else 1
fmt = "fp8" if KIND == "fp8_ws" else "fp8_fp4"
L = Layout(8, 384, 8192, 6, 7168, 3072, 128, fmt)
warps, stages = WARPS_STAGES[KIND]
cfg = FusedConfig(block_m=128, programs_per_rank=132, numerics="hopper" if KIND == "fp4_ws" else "exact",
                  num_warps=warps, num_stages=stages, kind=KIND)
meta = dict(phase_meta(kernel_meta(L, cfg, has_clamp=False, has_stats=True, timeline=False), PHASE, L))
options = {k: meta.pop(k) for k in ("num_warps", "num_stages", "maxnreg") if k in meta}
fn = kf.fused_mega_moe_kernel
sig = dict(buf0="*u8", y0="*i16", w1_0="*u8", w1_sf0="*i32", w2_0="*u8", w2_sf0="*i32", stats0="*i32",
           timeline0="*i64", tiles0="*i32", args="*i64", buffer_ptrs="*i64", fold_lut="*i32", rank0="i32", G="i32",
           clamp="fp32", timeout_ns="i64", max_polls="i32")
for k in meta:
    sig[k] = "constexpr"
attrs = {(fn.arg_names.index(p),): [["tt.divisibility", 16]] for p in ("buf0", "y0", "w1_0", "w1_sf0", "w2_0",
                                                                       "w2_sf0", "stats0", "tiles0", "args")}
k = triton.compile(ASTSource(fn, sig, meta, attrs), target=GPUTarget("cuda", 90, 32), options=options)
d = tempfile.mkdtemp()
open(f"{d}/k.cubin", "wb").write(k.asm["cubin"])
BIN = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
usage = subprocess.run([f"{BIN}/cuobjdump", "--dump-resource-usage", f"{d}/k.cubin"], capture_output=True,
                       text=True).stdout  # the cubin Triton built (its own ptxas options)
print(KIND, "PHASE", PHASE, "warps", options["num_warps"], "shared", k.metadata.shared)
print([line.strip() for line in usage.splitlines() if "REG" in line])
