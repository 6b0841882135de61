"""Offline sm_90a compile of ``megamoe.kernels.gemm_fp4_ws`` (the fused FP8 x FP4 path's Gluon GEMM phase, tile kind
"fp4_ws") at V4-Pro size on a machine without a GPU: shared memory, ptxas registers / stack / spills, setmaxnreg
values, a SASS op histogram (the sibling of ``gemm_fp8_ws_compile.py``).

    python results/probes/gemm_fp4_ws_compile.py [STAGES]      (env: BM=128, MATH, LR, DR, MAXNREG, PREFETCH, SF_TMA, H=7168, I=3072)

``BM`` = 128 (two math warpgroups, one decode partition) or 64 (one math warpgroup, two decode partitions); the
register split defaults to the host's ``FP4_WS_REGS[BM]`` and the stages (no argument) to ``FP4_WS_STAGES[BM]``.

Writes the TTGIR / PTX / SASS into a temporary directory, printed first.
"""
import collections
import os
import re
import subprocess
import sys
import tempfile

os.environ["TRITON_INTERPRET"] = "0"
import megamoe  # noqa: E402,F401
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

from megamoe.fused import FP4_WS_PREFETCH, FP4_WS_REGS, FP4_WS_SF_TMA, FP4_WS_STAGES  # noqa: E402
from megamoe.kernels import gemm_fp4_ws as ws  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")

BM = int(os.environ.get("BM", 128))
STAGES = int(sys.argv[1]) if len(sys.argv) > 1 else FP4_WS_STAGES[BM]
H, I = int(os.environ.get("H", 7168)), int(os.environ.get("I", 3072))
PREFETCH = bool(int(os.environ.get("PREFETCH", FP4_WS_PREFETCH[BM])))
SF_TMA = bool(int(os.environ.get("SF_TMA", FP4_WS_SF_TMA[BM])))
MATH, LR, DR, MAXNREG = (int(os.environ.get(k, v)) for k, v in zip(("MATH", "LR", "DR", "MAXNREG"), FP4_WS_REGS[BM]))
fp8 = gl.NVMMASharedLayout.get_default_for([BM, 128], gl.float8e4nv)
wp = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)
s32 = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)


def td(dt, blk, lay):
    return f"tensordesc<{dt}{list(blk)},{lay!r}>"


sig = dict(a1_desc=td("fp8e4nv", [BM, 128], fp8), a2_desc=td("fp8e4nv", [BM, 128], fp8),
           w1_desc=td("u8", [256, 64], wp), w2_desc=td("u8", [256, 64], wp), ws1_desc=td("i32", [256], s32),
           ws2_desc=td("i32", [256], s32), as1_desc=td("i32", [BM], s32), as2_desc=td("i32", [BM], s32), buf="*u8",
           w1_sf="*i32",
           w2_sf="*i32", lut="*i32", tiles="*i32", buffer_ptrs="*i64", me="i32", clamp="fp32", timeout_ns="i64")
consts = dict(OFF_GRID=0, OFF_STATE=64, OFF_L2_MASK=1024, OFF_L1_SF=1 << 26, OFF_L1_W=4096, OFF_L2=1 << 20,
              OFF_L2_SF=1 << 21, OFF_META=8192, OFF_COMBINE=1 << 22, T=8192, H=H, I=I, SP=49920, HAS_CLAMP=False,
              STAGES=STAGES, MATH_REGS=MATH, LOAD_REGS=LR, DECODE_REGS=DR, KW1_PAD=triton.next_power_of_2(H // 128),
              KW2_PAD=triton.next_power_of_2(I // 128), PREFETCH=PREFETCH, SF_TMA=SF_TMA)
fn = ws.fp4_gemm_phase_kernel
for k in consts:
    sig[k] = "constexpr"
names = fn.arg_names
attrs = {(names.index(p),): [["tt.divisibility", 16]] for p in ("buf", "w1_sf", "w2_sf", "lut", "tiles", "buffer_ptrs")}
k = triton.compile(GluonASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": 4, "maxnreg": MAXNREG})
d = tempfile.mkdtemp()
open(f"{d}/k.ptx", "w").write(k.asm["ptx"])
open(f"{d}/k.ttgir", "w").write(k.asm["ttgir"])
open(f"{d}/k.cubin", "wb").write(k.asm["cubin"])
pv = subprocess.run([f"{BIN}/ptxas", "-arch=sm_90a", "-v", f"{d}/k.ptx", "-o", f"{d}/k2.cubin"], capture_output=True,
                    text=True)
pv = pv.stdout + pv.stderr
sass = subprocess.run([f"{BIN}/cuobjdump", "-sass", f"{d}/k.cubin"], capture_output=True, text=True).stdout
open(f"{d}/k.sass", "w").write(sass)
ops = collections.Counter(re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]+)", sass, re.M))
print("BM", BM, "stages", STAGES, "regs (math, loader, decode, maxnreg)", (MATH, LR, DR, MAXNREG))
print("dir", d, "shared", k.metadata.shared)
print([line for line in pv.splitlines() if "spill" in line or "Used" in line])
keep = ("QGMMA", "UTMALDG", "STL", "LDL", "BAR", "SYNCS", "USETMAXREG", "WARPGROUP", "MEMBAR", "FENCE", "ATOMG",
        "STG", "PRMT", "LDS", "STS", "HMUL2", "F2FP")
print({o: n for o, n in sorted(ops.items()) if o.split('.')[0] in keep})
print(sorted(set(re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", k.asm["ptx"]))))
