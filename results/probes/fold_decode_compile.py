"""Offline sm_90a compile of ``megamoe.kernels.fold_decode.fold_decode_kernel`` (the predecode pass) at the V4-Pro
shapes, one line per variant of ``results/probes/ws_variants_probe.py``'s ``fold_decode`` list and shape: registers,
stack / spill bytes (``ptxas -v``), shared memory (Triton's metadata: the layout conversions' scratch), and the
SASS global loads / stores by width. No GPU needed (Triton 3.6, ``GPUTarget("cuda", 90, 32)``).

    python results/probes/fold_decode_compile.py        (prints one JSON line per variant and shape)

Shapes: L1 (N = 2I = 6144, K = H = 7168) and L2 (N = H = 7168, K = I = 3072); ``El`` is a runtime grid size only.
"""
import json
import os
import re
import subprocess
import sys
import tempfile

os.environ["TRITON_INTERPRET"] = "0"
import megamoe  # noqa: E402,F401  (before triton)

# isort: split
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import megamoe.fold_decode as fd  # noqa: E402
from megamoe.kernels.fold_decode import fold_decode_kernel as fn  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ws_variants_probe import FOLD_DECODE_VARIANTS, fold_decode_variant  # noqa: E402

SHAPES = {"L1": (6144, 7168), "L2": (7168, 3072)}
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def compile_variant(variant: dict, N: int, K: int) -> dict:
    """One offline compile of ``variant`` (a ``FOLD_DECODE_VARIANTS`` entry) at ``N`` x ``K``: the keywords the
    host would launch with (``megamoe.fold_decode.launch_keywords``)."""
    with fold_decode_variant(variant):
        meta = fd.launch_keywords(N, K, prmt_decode=True)
    warps = meta.pop("num_warps")
    sig = dict(w="*i8", w_sf="*i32", lut="*i32", out="*fp8e4nv", row_exp="*i32", **{k: "constexpr" for k in meta})
    attrs = {(fn.arg_names.index(p),): [["tt.divisibility", 16]] for p in ("w", "w_sf", "lut", "out", "row_exp")}
    k = triton.compile(ASTSource(fn, sig, meta, attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps})
    d = tempfile.mkdtemp(prefix="fold_decode_")
    with open(f"{d}/k.ptx", "w") as f:
        f.write(k.asm["ptx"])
    with open(f"{d}/k.cubin", "wb") as f:
        f.write(k.asm["cubin"])
    info = subprocess.run([f"{BIN}/ptxas", "-arch=sm_90a", "-v", f"{d}/k.ptx", "-o", f"{d}/k2.cubin"],
                          capture_output=True, text=True, check=True)
    info = info.stdout + info.stderr
    sass = subprocess.run([f"{BIN}/cuobjdump", "-sass", f"{d}/k.cubin"], capture_output=True, text=True,
                          check=True).stdout

    def num(pattern):
        m = re.search(pattern, info)
        return int(m.group(1)) if m else 0

    mem = {}
    for op in re.findall(r"\b((?:LDG|STG|LDS|STS)(?:\.E)?(?:\.[A-Z0-9_]+)*)\b", sass):
        mem[op] = mem.get(op, 0) + 1
    return dict(registers=num(r"Used (\d+) registers"), stack=num(r"(\d+) bytes stack frame"),
                spill_stores=num(r"(\d+) bytes spill stores"), spill_loads=num(r"(\d+) bytes spill loads"),
                shared=k.metadata.shared, sass_memory_ops=mem)


if __name__ == "__main__":
    for variant in FOLD_DECODE_VARIANTS:
        for layer, (N, K) in SHAPES.items():
            print(json.dumps(dict(variant, layer=layer, N=N, K=K, **compile_variant(variant, N, K))), flush=True)
