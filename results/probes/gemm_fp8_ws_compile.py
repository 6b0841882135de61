"""Offline sm_90a compile of ``megamoe.kernels.gemm_fp8_ws`` (the fused FP8 path's Gluon GEMM phase) at V4-Pro size,
on a machine without a GPU: shared memory, ptxas registers / stack / spills, setmaxnreg values, a SASS op histogram.

    python results/probes/gemm_fp8_ws_compile.py [STAGES]      (env: BM=128|64, MATH=232, MAXNREG=168, PW=4, PR=40, LR=40, PC=1024)

Constexprs the kernel of this checkout does not take are dropped (the branches differ in them). Writes the TTGIR /
PTX / SASS into a temporary directory, printed first.
"""
import os, sys, re, subprocess, collections, tempfile
os.environ["TRITON_INTERPRET"] = "0"
import megamoe  # noqa
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon import language as gl
from megamoe.kernels import gemm_fp8_ws as ws
BIN = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
STAGES = int(sys.argv[1]) if len(sys.argv) > 1 else 3
BMT = int(os.environ.get("BM", 128))
fp8 = gl.NVMMASharedLayout.get_default_for([BMT, 128], gl.float8e4nv)
fp8w = gl.NVMMASharedLayout.get_default_for([256, 128], gl.float8e4nv)
sa = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
td = lambda dt, blk, lay: f"tensordesc<{dt}{list(blk)},{lay!r}>"
sig = dict(a1_desc=td("fp8e4nv", [BMT, 128], fp8), a2_desc=td("fp8e4nv", [BMT, 128], fp8),
           w1_desc=td("fp8e4nv", [256, 128], fp8w), w2_desc=td("fp8e4nv", [256, 128], fp8w),
           sa1_desc=td("fp32", [BMT], sa), sa2_desc=td("fp32", [BMT], sa), buf="*u8", w1_sf="*fp32", w2_sf="*fp32",
           tiles="*i32", buffer_ptrs="*i64", me="i32", clamp="fp32", timeout_ns="i64")
consts = dict(OFF_GRID=0, OFF_STATE=64, OFF_L2_MASK=1024, OFF_ARRIVAL=2048, OFF_X=1 << 23, OFF_X_SF=1 << 24, OFF_L1=1 << 25,
              OFF_L1_SF=1 << 26, OFF_L1_W=4096, OFF_L2=1 << 20, OFF_L2_SF=1 << 21, OFF_META=8192,
              OFF_COMBINE=1 << 22, T=8192, H=7168, I=3072, SP=49920, HAS_CLAMP=False, STAGES=STAGES, MATH_REGS=int(os.environ.get("MATH", 232)),
              LOAD_REGS=int(os.environ.get("LR", 40)), PULL_WARPS=int(os.environ.get("PW", 4)), PULL_REGS=int(os.environ.get("PR", 40)),
              PULL_CHUNK=int(os.environ.get("PC", 1024)))
fn = ws.fp8_gemm_phase_kernel
consts = {k: v for k, v in consts.items() if k in fn.arg_names}
for k in consts: sig[k] = "constexpr"
names = fn.arg_names
attrs = {(names.index(p),): [["tt.divisibility", 16]] for p in ("buf", "w1_sf", "w2_sf", "tiles", "buffer_ptrs")}
k = triton.compile(GluonASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": 4, "maxnreg": int(os.environ.get("MAXNREG", 168))})
d = tempfile.mkdtemp()
open(f"{d}/k.ptx", "w").write(k.asm["ptx"]); open(f"{d}/k.ttgir", "w").write(k.asm["ttgir"])
open(f"{d}/k.cubin", "wb").write(k.asm["cubin"])
pv = subprocess.run([f"{BIN}/ptxas", "-arch=sm_90a", "-v", f"{d}/k.ptx", "-o", f"{d}/k2.cubin"], capture_output=True, text=True)
pv = pv.stdout + pv.stderr
sass = subprocess.run([f"{BIN}/cuobjdump", "-sass", f"{d}/k.cubin"], capture_output=True, text=True).stdout
open(f"{d}/k.sass", "w").write(sass)
ops = collections.Counter(re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]+)", sass, re.M))
print("dir", d, "shared", k.metadata.shared)
print([l for l in pv.splitlines() if "spill" in l or "Used" in l or "C75" in l])
print({o: n for o, n in ops.items() if o.split('.')[0] in ("QGMMA", "UTMALDG", "STL", "LDL", "BAR", "SYNCS", "USETMAXREG", "WARPGROUP", "MEMBAR", "FENCE", "ATOM", "ATOMG", "RED", "STG", "FSEL", "FFMA")})
print(sorted(set(re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", k.asm["ptx"]))))
