"""The shared-memory address of a named Gluon allocation, for inline PTX.

Gluon (Triton 3.6) hands a kernel its shared memory only as descriptors (``gl.allocate_shared_memory``): loads,
stores, TMA and wgmma take them, but nothing yields the address an instruction that Gluon does not wrap needs --
here the per-row ``cp.async.bulk`` (shared -> global, no tensor map) of the FP8 phase's staged L2 epilogue
(:mod:`megamoe.kernels.gemm_fp8_ws`, ``BULK``). The allocator fixes every buffer's offset from ``global_smem``
(the kernel's dynamic shared memory) when the ``llir`` stage lowers the kernel. So:

* the kernel writes :func:`offset_token` ``(name)`` in its inline PTX where it needs the byte offset of the
  allocation it bound to the Python name ``name`` (``l2_stage = gl.allocate_shared_memory(...)``: Triton names the
  op's result after the variable);
* a TTGIR inspection (:mod:`megamoe.compile_hooks`) runs, on a copy of the module about to be lowered, the passes the
  ``llir`` stage runs up to and including the shared-memory allocation, and reads each such allocation's
  ``allocation.offset`` (:func:`allocation_offsets`);
* a PTX pass replaces every token with its number (:func:`resolve`).

A token whose allocation is not found fails the compile with a ``RuntimeError`` that names it; a token left in a
PTX compiled without the hook fails in ptxas. Both steps are deterministic functions of the module, so a compile
that Triton caches holds the right offsets for any later process. The kernel reads :data:`PASS_VERSION` (an edit
of this module compiles it anew, as :mod:`megamoe.multicast`'s).
"""
from __future__ import annotations

import hashlib
import pathlib
import re
import tempfile

from megamoe import compile_hooks

#: A digest of this module's text (module docstring): the kernels that use a token carry it in their inline PTX.
PASS_VERSION = hashlib.sha256(pathlib.Path(__file__).read_bytes()).hexdigest()[:16]
#: What :func:`offset_token` prefixes to an allocation's name.
TOKEN = "MEGAMOE_SMEM_OFFSET_"
_TOKEN_RE = re.compile(TOKEN + r"(\w+)")
#: ``%name = ttg.local_alloc ... {allocation.offset = N : i32}`` (the name possibly with Triton's ``_<n>`` suffix).
_ALLOC_RE = re.compile(r"%(\w+) = ttg\.local_alloc\b[^\n]*?allocation\.offset = (\d+) : i32")
#: id(metadata) of a compile in flight -> its tokens' offsets (the inspection's result, which the PTX pass takes).
_PENDING: dict = {}


def offset_token(name: str) -> str:
    """The text that stands, in a kernel's inline PTX, for the byte offset from ``global_smem`` of the shared
    allocation bound to the Python name ``name`` (a 32-bit immediate once resolved)."""
    if not re.fullmatch(r"\w+", name):
        raise ValueError(f"offset_token: name {name!r} must be a Python identifier")
    return TOKEN + name


def allocation_offsets(ttgir: str) -> dict:
    """``{name: offset}`` of every named ``ttg.local_alloc`` in ``ttgir`` (TritonGPU text after the shared-memory
    allocation). A name Triton suffixed (``l2_stage_3``) is entered under both spellings; a name bound to two
    allocations at different offsets is dropped (ambiguous)."""
    found: dict = {}
    for name, offset in _ALLOC_RE.findall(ttgir):
        for key in {name, re.sub(r"_\d+$", "", name)}:
            found.setdefault(key, set()).add(int(offset))
    return {k: v.pop() for k, v in found.items() if len(v) == 1}


def _allocate_copy(src, options, capability) -> str:
    """The TritonGPU text of a copy of ``src`` after the passes the ``llir`` stage runs up to and including the
    shared-memory allocation (``triton.backends.nvidia.compiler.CUDABackend.make_llir``'s first five)."""
    from triton._C.libtriton import ir, nvidia, passes
    from triton.backends.nvidia.compiler import get_ptx_version_from_options

    with tempfile.NamedTemporaryFile("w", suffix=".ttgir") as f:
        f.write(str(src))
        f.flush()
        mod = ir.parse_mlir_module(f.name, src.context)
    pm = ir.pass_manager(src.context)
    passes.ttgpuir.add_combine_tensor_select_and_if(pm)
    passes.ttgpuir.add_allocate_warp_groups(pm)
    passes.convert.add_scf_to_cf(pm)
    passes.gluon.add_inliner(pm)
    nvidia.passes.ttgpuir.add_allocate_shared_memory_nv(pm, capability,
                                                        get_ptx_version_from_options(options, capability))
    pm.run(mod, "megamoe.shared_address")
    return str(mod)


def _inspect(src, metadata, options, capability) -> None:
    _PENDING.pop(id(metadata), None)  # (an entry a failed compile left under a recycled id)
    text = str(src)
    names = set(_TOKEN_RE.findall(text))
    if not names:
        return
    offsets = allocation_offsets(_allocate_copy(src, options, capability))
    missing = sorted(names - set(offsets))
    if missing:
        raise RuntimeError(f"megamoe.shared_address: no single shared allocation named {missing} in the kernel "
                           "(bind each to a Python name: name = gl.allocate_shared_memory(...))")
    _PENDING[id(metadata)] = {n: offsets[n] for n in names}


def resolve(ptx: str, offsets: dict) -> str:
    """``ptx`` with every :func:`offset_token` replaced by its allocation's offset from ``offsets``; a token
    without one raises ``RuntimeError``."""
    def sub(m):
        if m.group(1) not in offsets:
            raise RuntimeError(f"megamoe.shared_address: no offset for shared allocation {m.group(1)!r}")
        return str(offsets[m.group(1)])
    return _TOKEN_RE.sub(sub, ptx)


def _ptx_pass(ptx: str, metadata) -> str:
    offsets = _PENDING.pop(id(metadata), None)
    if offsets is None:
        if TOKEN in ptx:
            raise RuntimeError("megamoe.shared_address: a token in PTX whose module was not inspected")
        return ptx
    return resolve(ptx, offsets)


def install() -> None:
    """Add the inspection and the PTX pass to Triton's compile pipeline (:mod:`megamoe.compile_hooks`)."""
    compile_hooks.add_ttgir_inspection("shared_address", _inspect)
    compile_hooks.add_ptx_pass("shared_address", _ptx_pass)


install()
