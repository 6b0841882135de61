"""Can a Gluon kernel on Triton 3.6 multicast a weight tile to a 2-CTA cluster? The lever session 43 measured for
issue #8 (``fp8_ws_probe.py``'s ``halfw``: each CTA loading only half of every weight stage, as a CTA pair with a
multicast W would, took the FP8 call at T = 8192 from 6716 / 6860 to 5867 / 5931 µs on an H100 at the same 700 W,
the SM clock 1440 -> 1665 MHz; ``knockout_runs/fp8_phase8192_80c9104_h100.jsonl``). Triton 3.6 has no multicast
form (its TMA lowering says "NYI: Support multicast"), and compiling a Gluon kernel with ``num_ctas=2`` makes its
layouts one tensor over the cluster: a broadcast ``cga_layout`` compiles but its stores are predicated on
``%cluster_ctarank == 0`` (one CTA stores), and mbarriers with a ``cga_layout`` abort the compiler. So this probe
takes another way, all of it checkable here:

* compile with ``num_ctas=1`` (every CTA its own program, as the fused kernel is) and **launch** with a cluster of
  two: Triton's C launcher takes the cluster size from the compiled kernel's ``packed_metadata`` (``num_warps,
  num_ctas, shared``; grid x ``num_ctas`` CTAs, ``CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION``), so the probe sets
  ``num_ctas`` there to 2 after an offline ``warmup``;
* a PTX pass (``triton.knobs.runtime.add_stages_inspection_hook`` wrapping the ``ptx`` stage, for the entry
  named ``mc_gemm_kernel``; since session 44 ``megamoe.multicast``'s, which the fused FP8 phase uses) rewrites (1)
  every 2-D TMA load into its ``.multicast::cluster`` form, with CTA mask 0b11 for those from the W descriptor (the
  kernel's second 128-byte descriptor parameter) and this CTA alone for the others (A), and (2) every
  ``mbarrier.arrive ... , 2`` (an arrive of count 2: the marker, nothing else in the kernel arrives twice) into an
  arrive of 1 on the local barrier and one on the peer CTA's barrier at the same offset (``mapa``), so that a ring
  stage is free only when both CTAs' consumers released it;
* cluster barriers (``barrier.cluster.arrive/wait``) after the mbarriers' init and before the exit, and the CTA's
  rank in the cluster, by inline PTX.

The kernel (``mc_gemm_kernel``): CTA ``p`` computes ``out[64 p : 64 p + 64, :128] = A[64 p :, :K] @ W[:128, :K]^T``
(e4m3 in, fp32 out) over a 2-stage ring of K blocks of 128; with ``MC`` each CTA of a pair loads its own A rows and
one 64-row half of each W stage, multicast to both. Checked against torch on the GPU (``python
results/probes/multicast_probe.py [K] [clusters]``: rows with the max abs error of MC = 0 / 1 against torch's fp32
product -- the wgmma's own accumulation, no promotion here --, whether MC = 1's output is MC = 0's bit for bit, and
their times: this toy's synchronous 2-stage ring is no measure of speed);
without CUDA it compiles both for sm_90a and prints the rewritten PTX lines and ptxas's verdict.
"""
import json
import os
import sys
import tempfile

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
)

from megamoe import multicast

BM, BN, BK = 64, 128, 128
#: The pass (``megamoe.multicast``, where the fused FP8 phase's pass now lives; this probe's own copy of it until
#: session 44): the W descriptor is the kernel's second TMA descriptor; no warp specialisation, so the cluster barriers
#: are plain inline PTX in the kernel (no entry arrive).
multicast.register("mc_gemm_kernel", multicast.Spec(multicast_descs=(1,), handshake=False))


def install_pass() -> None:
    """A private cache directory for this process: the pass is not in Triton's cache key, and this toy kernel does
    not read ``megamoe.multicast.PASS_VERSION`` (the fused kernel does), so a shared cache could hand a compile made
    without it (or with an older pass) to a launch that needs it. (The pass itself was installed by ``register``.)"""
    if "TRITON_CACHE_DIR" not in os.environ:
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="mc_probe_cache_")


def _counts() -> dict:
    return dict(multicast.LAST_COUNTS.pop("mc_gemm_kernel", {}))


@gluon.jit
def _cluster_rank():
    return gl.inline_asm_elementwise("mov.u32 $0, %cluster_ctarank;", "=r", [], dtype=gl.int32, is_pure=True,
                                     pack=1)


@gluon.jit
def _cluster_sync():
    gl.inline_asm_elementwise("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;\n\t"
                              "mov.u32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _issue(a_desc, w_desc, a_bufs, w_bufs, ready, s, kb, row0, r, MC: gl.constexpr):
    HALF: gl.constexpr = 64
    bar = ready.index(s)
    if MC:
        mbarrier.expect(bar, a_desc.block_type.nbytes + 2 * w_desc.block_type.nbytes)
    else:
        mbarrier.expect(bar, a_desc.block_type.nbytes + w_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(a_desc, [row0, kb * 128], bar, a_bufs.index(s))
    if MC:  # this CTA's half of the stage's W rows, multicast to both CTAs (the PTX pass)
        if r == 0:
            tma.async_copy_global_to_shared(w_desc, [0, kb * 128], bar, w_bufs.index(s).slice(0, HALF))
        else:
            tma.async_copy_global_to_shared(w_desc, [HALF, kb * 128], bar, w_bufs.index(s).slice(HALF, HALF))
    else:
        tma.async_copy_global_to_shared(w_desc, [0, kb * 128], bar, w_bufs.index(s))


@gluon.jit
def mc_gemm_kernel(a_desc, w_desc, out_ptr, K, MC: gl.constexpr):
    pid = gl.program_id(0)
    r = _cluster_rank()
    row0 = pid * 64
    a_bufs = gl.allocate_shared_memory(gl.float8e4nv, [2, 64, 128], a_desc.layout)
    w_bufs = gl.allocate_shared_memory(gl.float8e4nv, [2, 128, 128], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2 if MC else 1)
    fence_async_shared()
    if MC:
        _cluster_sync()  # the peer's barriers are initialised before anything lands in or arrives on them
    KB = K // 128
    for i in gl.static_range(2):
        if i < KB:
            _issue(a_desc, w_desc, a_bufs, w_bufs, ready, i, i, row0, r, MC)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 32])
    acc = gl.zeros([64, 128], gl.float32, mma)
    for kb in range(KB):
        s = kb % 2
        ph = (kb // 2) & 1
        mbarrier.wait(ready.index(s), ph)
        acc = warpgroup_mma(a_bufs.index(s), w_bufs.index(s).permute((1, 0)), acc)
        if MC:
            mbarrier.arrive(empty.index(s), count=2)  # the marker: local + the peer's (the PTX pass)
        else:
            mbarrier.arrive(empty.index(s), count=1)
        if kb + 2 < KB:
            mbarrier.wait(empty.index(s), ph)
            _issue(a_desc, w_desc, a_bufs, w_bufs, ready, s, kb + 2, row0, r, MC)
    if MC:
        _cluster_sync()  # neither CTA leaves while the other may still multicast into it or arrive on it
    out_l: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
    acc = gl.convert_layout(acc, out_l)
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, out_l))
    cols = gl.arange(0, 128, layout=gl.SliceLayout(0, out_l))
    gl.store(out_ptr + (row0 + gl.expand_dims(rows, 1)) * 128 + gl.expand_dims(cols, 0), acc)


def _layout():
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)


def compile_offline() -> list[dict]:
    """Both kernels for sm_90a on this machine (the pass installed): the PTX pass's counts, the rewritten lines,
    ptxas's verdict; printed, and returned as rows."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    rows = []
    for mc in (0, 1):
        lay = _layout()
        sig = {"a_desc": f"tensordesc<fp8e4nv[64, 128],{lay!r}>",
               "w_desc": f"tensordesc<fp8e4nv[{64 if mc else 128}, 128],{lay!r}>",
               "out_ptr": "*fp32", "K": "i32", "MC": "constexpr"}
        _counts()
        try:
            k = triton.compile(GluonASTSource(mc_gemm_kernel, sig, {"MC": mc}, {}), target=GPUTarget("cuda", 90, 32),
                               options={"num_warps": 4})
            lines = [ln.strip() for ln in k.asm["ptx"].splitlines() if "multicast::cluster" in ln or "mapa." in ln]
            row = {"MC": mc, "compiled": True, "rewritten": _counts(), "cubin_bytes": len(k.asm["cubin"]),
                   "shared": k.metadata.shared, "lines": lines[:12]}
        except Exception as e:  # noqa: BLE001  (ptxas's message is the finding)
            row = {"MC": mc, "compiled": False, "error": str(e)[-800:]}
        print(json.dumps(row))
        rows.append(row)
    return rows


def run_gpu(K: int, clusters: int) -> None:
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    torch.manual_seed(0)
    M = 2 * clusters * BM
    a = (torch.randn(M, K, device="cuda") * 4).to(torch.float8_e4m3fn)
    w = (torch.randn(BN, K, device="cuda") * 4).to(torch.float8_e4m3fn)
    want = a.float() @ w.float().t()
    first = None
    for mc in (0, 1):
        a_desc = TensorDescriptor.from_tensor(a, [BM, BK], _layout())
        w_desc = TensorDescriptor.from_tensor(w, [64 if mc else BN, BK], _layout())
        out = torch.zeros(M, BN, device="cuda")
        grid = (2 * clusters,) if not mc else (clusters,)
        _counts()
        kernel = mc_gemm_kernel.warmup(a_desc, w_desc, out, K, MC=mc, grid=grid, num_warps=4)
        if mc:  # the launcher's cluster size (module docstring); a launch without it would mapa to no peer
            nw, _, shared = kernel.packed_metadata
            kernel.packed_metadata = (nw, 2, shared)
        mc_gemm_kernel[grid](a_desc, w_desc, out, K, MC=mc, num_warps=4)
        torch.cuda.synchronize()
        err = (out - want).abs().max().item()
        first = out.clone() if first is None else first
        ms = triton.testing.do_bench(
            lambda: mc_gemm_kernel[grid](a_desc, w_desc, out, K, MC=mc, num_warps=4))  # noqa: B023
        print(json.dumps({"MC": mc, "K": K, "clusters": clusters, "rewritten": _counts(),
                          "max_abs_err": err, "ref_max_abs": want.abs().max().item(),
                          "bitwise_equal_to_mc0": bool(torch.equal(out, first)), "us": ms * 1e3,
                          "gpu": torch.cuda.get_device_name()}), flush=True)


if __name__ == "__main__":
    install_pass()
    if torch.cuda.is_available():
        run_gpu(int(sys.argv[1]) if len(sys.argv) > 1 else 4096, int(sys.argv[2]) if len(sys.argv) > 2 else 66)
    else:
        compile_offline()
