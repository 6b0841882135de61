"""The fused path's host code on a machine without a Hopper GPU: what a call does between its arguments and its
launches, checked and timed on CPU.

On an H200 an eager FP8 x FP4 call at T = 8 spends longer on the host than on the GPU (``results/layer_h200.json``:
552 us to enqueue, 388 on the GPU), so the host path is part of the kernel's speed. :func:`hopper_host` lets that
path run on a CPU machine: the device is an sm_90 stand-in with ``SMS`` SMs, every launch reaches Triton's own
launch code (``CompiledKernel``'s runner, ``CudaLauncher``, ``wrap_handle_tensordesc`` and ``make_tensordesc_arg``,
Triton 3.6) with a C launch that only counts, and a kernel's first launch, which on a GPU compiles it, returns such a
compiled kernel. What is not run: compilation, the C launch itself and the CUDA driver (``cuLaunchKernelEx``,
``cuTensorMapEncodeTiled``), torch's CUDA allocator and stream calls, and the GPU work (the weight-row maxima and the
predecode pass are not computed). So it answers "what does a repeated call build, encode and launch" exactly, and
"how long does our Python take" up to the host's speed (``results/probes/host_path_probe.py``); the GPU's own
host time is ``megamoe.bench``'s ``host_us``.
"""
from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

#: SMs of the stand-in device (an H200's).
SMS = 132
#: The layout of :func:`small_rank`: V4-Pro's routing (48 experts, top-6), so the same tiles as one EP8 rank at the
#: same T; small H and I (the host path does not depend on them).
SMALL_SHAPE = dict(num_ranks=1, hidden=1024, intermediate=512, num_experts=48, num_topk=6, block_m=128)


@dataclass
class HostLog:
    """What the calls inside :func:`hopper_host` did: per launch through Triton's launcher ``(kernel name, grid)``
    in ``launches``; the kernels' first launches (a compile on a GPU) in ``compiled``; one entry per TMA descriptor
    encoding (``cuTensorMapEncodeTiled`` on a GPU) in ``encoded``."""

    launches: list = field(default_factory=list)
    compiled: list = field(default_factory=list)
    encoded: list = field(default_factory=list)

    def clear(self) -> None:
        self.launches.clear()
        self.compiled.clear()
        self.encoded.clear()


def _signature(fn, args: tuple) -> dict:
    """The parts of a kernel signature Triton's launcher reads: which leading runtime arguments are descriptors."""
    names = fn.arg_names
    sig = {}
    for i, name in enumerate(names):
        a = args[i] if i < len(args) else None
        sig[name] = ("tensordesc<u8>" if i < len(args) and hasattr(a, "block_shape") and hasattr(a, "base")
                     else "constexpr" if i >= len(args) else "*u8" if isinstance(a, torch.Tensor) else "i32")
    return sig


def _compiled_kernel(fn, grid3: tuple, args: tuple, log: HostLog):
    """A Triton 3.6 ``CompiledKernel`` as its first launch on CUDA leaves it, whose C launch appends to ``log``."""
    from triton.backends.nvidia import driver as nv
    from triton.compiler.compiler import CompiledKernel

    signature = _signature(fn, args)
    metas = [{"swizzle": 3, "elem_size": 1, "elem_type": 0, "block_size": list(a.block_shape), "fp4_padded": False}
             for a in args if hasattr(a, "block_shape") and hasattr(a, "base")]
    name = fn.__name__

    c_launch = _CLaunch(name, log)
    run = object.__new__(nv.CudaLauncher)
    run.__dict__.update(num_ctas=1, global_scratch_size=0, global_scratch_align=1, profile_scratch_size=0,
                        profile_scratch_align=1, launch_cooperative_grid=False, launch_pdl=False,
                        launch=nv.wrap_handle_tensordesc(c_launch, signature, metas))
    kernel = object.__new__(CompiledKernel)
    kernel.__dict__.update(module="stand-in", function=id(fn), packed_metadata=(4, 1, 1), _run=run, name=name,
                           src=SimpleNamespace(fn=SimpleNamespace(launch_metadata=None), signature=signature))
    return kernel


class _CLaunch:
    """The stand-in of a kernel's C launch (the compiled launcher module's ``launch``, a builtin: no ``__code__``):
    records the kernel and grid."""

    def __init__(self, name: str, log: HostLog):
        self.name, self.log = name, log

    def __call__(self, gx, gy, gz, *args):
        self.log.launches.append((self.name, (gx, gy, gz)))


@contextlib.contextmanager
def hopper_host():
    """Run the fused path's host code on CPU buffers as on an sm_90 device (module docstring); yields a
    :class:`HostLog`. Everything it changes is put back on exit, and ``megamoe.direct_launch``'s cache (which
    then holds stand-in kernels) is cleared on entry and exit. Use with ``impl="fused"`` and a
    ``SymmBuffer.local(..., device="cpu")`` of one rank; the outputs are not computed."""
    from triton.runtime import driver

    import megamoe.direct_launch as dl
    import megamoe.env as env
    import megamoe.fold_decode as fd
    import megamoe.fused as mf

    log = HostLog()
    real_interpreting, real_config = env.interpreting, mf.fused_config
    cuda = torch.device("cuda")

    def fused_config(layout, num_tokens, num_local_ranks, device, numerics="exact"):
        return real_config(layout, num_tokens, num_local_ranks, cuda, numerics)

    def first_launch(fn, grid, args, kwargs, prepare=None):  # (prepare: the stand-in has no compile to adjust)
        grid3 = tuple(grid) + (1,) * (3 - len(grid))
        kernel = _compiled_kernel(fn, grid3, args, log)
        log.compiled.append((fn.__name__, grid3))
        values = {**dl._defaults(fn), **kwargs}
        kernel[grid3](*args, *(values[n] for n in fn.arg_names[len(args):]))
        return kernel

    def fill_tma_descriptor(ptr, *rest):
        log.encoded.append(ptr)
        return ("tensormap", ptr, *map(lambda v: tuple(v) if isinstance(v, list) else v, rest))

    patches = [(m, "interpreting", lambda: False) for m in list(sys.modules.values())
               if getattr(m, "__name__", "").startswith(("megamoe", "kernels"))
               and getattr(m, "interpreting", None) is real_interpreting]
    patches += [
        (torch.cuda, "get_device_capability", lambda device=None: (9, 0)),
        (torch.cuda, "get_device_properties", lambda device=None: SimpleNamespace(
            multi_processor_count=SMS, **mf._SM90_LIMITS)),
        (torch.cuda, "current_device", lambda: 0),
        (mf, "fused_config", fused_config),
        (mf, "unsupported_reason", lambda sym_buffers, device: None),
        (mf, "_check_resident", lambda *args: None),
        (mf, "_fp8_ws_clusters", lambda args, kw, dev: SMS // 2),
        (fd, "row_maxima", lambda sf, out=None: out),
        (fd, "fold_decode", lambda weights, out=None, row_exp=None: (out, row_exp)),
        (dl, "_first_launch", first_launch),
        (driver, "_active", SimpleNamespace(utils=SimpleNamespace(fill_tma_descriptor=fill_tma_descriptor),
                                            get_current_stream=lambda device: 0, get_current_device=lambda: 0)),
    ]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    dl.clear()
    try:
        for obj, name, value in patches:
            setattr(obj, name, value)
        yield log
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)
        dl.clear()
        env._DEVICE_FACTS.clear()  # (facts read through the stand-in's torch.cuda functions)


def small_rank(num_tokens: int, fmt: str = "fp8_fp4", stats: bool = False, device: str = "cpu"):
    """One rank of :data:`SMALL_SHAPE` at ``num_tokens`` in format ``fmt`` on ``device`` (inputs loaded, weights
    transformed) and its fused call as the bench times it (``check=False``; ``numerics="hopper"`` for FP8 x FP4;
    with ``stats`` also adding to a recv-stats tensor): ``(sym_buffer, y, call)``, ``y`` the call's output. On CPU run
    ``call`` inside :func:`hopper_host`; ``sym_buffer.destroy()`` when done."""
    from megamoe.cases import MoECase, prepare_rank
    from megamoe.ops import fp8_fp4_mega_moe
    from megamoe.ops_fp8 import fp8_mega_moe
    from megamoe.symm import SymmBuffer

    case = MoECase(num_tokens=num_tokens, format=fmt, **SMALL_SHAPE)
    sb = SymmBuffer.local(1, case.num_experts, max(num_tokens, 128), case.num_topk, case.hidden, case.intermediate,
                          block_m=case.block_m, device=device, format=fmt)[0]
    y, l1, l2, recv = prepare_rank(sb, case.problem(device=device), 0)
    recv = recv if stats else None
    if fmt == "fp8_fp4":
        return sb, y, lambda: fp8_fp4_mega_moe(y, l1, l2, sb, impl="fused", numerics="hopper", check=False,
                                               cumulative_local_expert_recv_stats=recv)
    return sb, y, lambda: fp8_mega_moe(y, l1, l2, sb, impl="fused", check=False,
                                       cumulative_local_expert_recv_stats=recv)
