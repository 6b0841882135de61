"""Two-CTA clusters with a multicast weight stream for Gluon kernels on Triton 3.6, which has no multicast TMA.

Why: in the FP8 GEMM phase (``megamoe.kernels.gemm_fp8_ws``) every CTA streams its tile's whole weight box through
TMA, and at T = 8192 the phase runs at the board's power cap. Loading only half of each weight stage (as a pair of
CTAs sharing one weight tile would, each multicasting its half to both) raised the SM clock from 1440 to 1665 MHz at
the same 700 W and took the phase from 6716 / 6860 to 5867 / 5931 us on an H100
(``results/probes/knockout_runs/fp8_phase8192_80c9104_h100.jsonl``, ``halfw``) -- DeepGEMM SM90's 2-CTA multicast.

Triton 3.6 cannot say it: Gluon's TMA lowering has no multicast ("NYI: Support multicast"), and a ``num_ctas=2``
compile makes every layout one tensor over the cluster (stores predicated on CTA rank 0; mbarriers with a CTA layout
abort the compiler). ``results/probes/multicast_probe.py`` showed the way this module takes (a toy GEMM, bit-equal
to its unicast twin on an H100):

* the kernel is compiled for **one CTA** (every CTA its own program) and **launched in clusters of two**: Triton's
  C launcher takes the cluster size from the compiled kernel's ``packed_metadata`` (``num_warps, num_ctas,
  shared``), launching ``grid x num_ctas`` CTAs with ``CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION`` (:func:`as_cluster`);
* a **PTX pass** (:func:`rewrite_ptx`, run on the ``ptx`` stage's output by :mod:`megamoe.compile_hooks`, installed
  by :func:`install`) rewrites, in the kernels registered here (:func:`register`) and only where
  the kernel carries the marker below:

  1. every 2-D TMA load into its ``.multicast::cluster`` form, with the CTA mask ``0b11`` where it loads through
     one of the registered descriptor parameters -- the box lands at the same shared-memory offset in both CTAs
     and completes the bytes of the mbarrier at the same offset in each -- and this CTA alone otherwise (chosen at
     run time, :func:`rewrite_ptx`);
  2. every ``mbarrier.arrive`` **of count 2** (the marker: the kernel writes ``mbarrier.arrive(bar, count=2)`` where
     it means "release this ring stage in both CTAs") into an arrive of 1 on the local barrier and one on the peer
     CTA's barrier at the same offset (``mapa``, ``release.cluster``): a stage is free only when the consumers of
     both CTAs released it;
  3. with ``handshake``: at the kernel's entry, before the warp-specialised partitions branch apart, every thread
     past the default partition (``default_threads``) arrives on the cluster barrier (``barrier.cluster.arrive
     .relaxed``); the default partition arrives and waits after it initialised its mbarriers
     (:data:`CLUSTER_READY_ASM`, inline in the kernel). ``gl.warp_specialize``'s worker warps never reach the
     kernel's prologue, so a plain ``barrier.cluster`` there would wait for them forever; this way no thread of
     either CTA touches the peer's barriers before both CTAs initialised theirs.

The pass is not part of Triton's cache key: the kernel reads :data:`PASS_VERSION` (so an edit of this module is a
new key), and :func:`as_cluster` checks the compiled PTX and refuses a compile that lacks the rewrite (one cached by a
process in which another stages hook replaced this one) with a message that says what to do.
"""
from __future__ import annotations

import dataclasses
import hashlib
import pathlib
import re

from megamoe import compile_hooks

#: A digest of this module's text. Triton's cache key holds a kernel's source and the constexpr globals it reads,
#: not the stages hook, so the kernel reads it (in :data:`CLUSTER_READY_ASM`): an edit of the pass compiles anew.
PASS_VERSION = hashlib.sha256(pathlib.Path(__file__).read_bytes()).hexdigest()[:16]
#: The default partition's side of the cluster handshake (module docstring, 3.): the mbarrier inits made visible to
#: the cluster, then arrive and wait. Inline PTX in the kernel's prologue, after ``mbarrier.init`` and before
#: ``gl.warp_specialize``.
CLUSTER_READY_ASM = (f"// megamoe.multicast {PASS_VERSION}\n\tfence.mbarrier_init.release.cluster;\n\t"
                     "barrier.cluster.arrive.release;\n\tbarrier.cluster.wait.acquire;\n\tmov.u32 $0, 0;")
#: CTAs a cluster (the pairs that share a weight tile).
CLUSTER = 2


@dataclasses.dataclass(frozen=True)
class Spec:
    """What the pass does to one kernel: the positions (0-based, among its 128-byte TMA descriptor parameters) of
    the descriptors whose loads it multicasts to both CTAs (its other 2-D loads stay in their CTA), the threads of
    the default partition (the worker warps arrive on the cluster barrier at the entry) and whether to insert that
    entry arrive at all."""
    multicast_descs: tuple
    #: the compile's ``num_warps`` x 32 (a warp-specialised kernel's compiled metadata holds its total warps instead,
    #: so nothing at launch can check this: keep it in step with the launch's ``num_warps``)
    default_threads: int = 128
    handshake: bool = True


_SPECS: dict = {}
#: What the last rewrite of each kernel changed (entry name -> counts), for the compile checks.
LAST_COUNTS: dict = {}

_TMA = re.compile(r"(@%p\d+ )?cp\.async\.bulk\.tensor\.(\dd)\.shared::cluster\.global\.mbarrier::complete_tx::bytes "
                  r"\[(%r\d+)\], \[(%rd\d+), \{([^}]*)\}\], \[(%r\d+)\];")
_ARRIVE2 = re.compile(r"(@%p\d+ )?mbarrier\.arrive\.shared::cta\.b64 _, \[(%r\d+)\], 2;")


def register(entry: str, spec: Spec) -> None:
    """Have the pass rewrite kernel ``entry`` (its PTX entry name, the Python function's name) by ``spec`` wherever
    its PTX carries the count-2 arrive marker (module docstring); installs the pass (:func:`install`)."""
    _SPECS[entry] = spec
    install()


def _entry_name(ptx: str) -> str | None:
    m = re.search(r"\.entry (\w+)\(", ptx)
    return m.group(1) if m else None


def rewrite_ptx(ptx: str) -> tuple[str, dict]:
    """The pass on one module's PTX: ``(new PTX, counts)`` where ``counts`` has ``multicast`` (2-D TMA loads
    rewritten), ``peer_arrive`` (count-2 arrives split) and ``entry_arrive`` (1 with the handshake); ``(ptx, {})``
    unchanged for a kernel not registered or without the marker (a launch that does not multicast).

    Every 2-D TMA load becomes a ``.multicast::cluster`` load whose CTA mask is chosen when it runs: ``0b11`` where
    its descriptor register holds one of the registered descriptor parameters, else ``1 << %cluster_ctarank`` (this
    CTA alone: an ordinary load). At run time, because LLVM merges the loads of different branches into one
    instruction on a register set from either branch's descriptor (the L1 and L2 loads of the FP8 phase are one
    instruction); the comparison is with each parameter's address, derived as the kernel derives it."""
    name = _entry_name(ptx)
    spec = _SPECS.get(name)
    if spec is None or not _ARRIVE2.search(ptx):
        return ptx, {}
    descs = re.findall(r"\.param \.align 64 \.b8 (\w+)\[128\]", ptx)
    if len(descs) <= max(spec.multicast_descs):
        raise RuntimeError(f"{name}: expected at least {max(spec.multicast_descs) + 1} TMA descriptor parameters, "
                           f"found {len(descs)}")
    shared = [descs[i] for i in spec.multicast_descs]
    counts = {"multicast": 0, "peer_arrive": 0, "entry_arrive": 0}

    def tma_sub(m):
        pred, dim, dst, desc, coords, bar = m.groups()
        if dim != "2d":
            return m.group(0)
        counts["multicast"] += 1
        pick = "".join(f"mov.b64 %mcd, {d}; cvta.param.u64 %mcd, %mcd; setp.eq.u64 %mcp, {desc}, %mcd; "
                       "@%mcp mov.b32 %mcm, 3; " for d in shared)
        return ("{ .reg .b64 %mcd; .reg .pred %mcp; .reg .b32 %mcr, %mcm; .reg .b16 %mcmask; "
                "mov.u32 %mcr, %cluster_ctarank; shl.b32 %mcm, 1, %mcr; " + pick + "cvt.u16.u32 %mcmask, %mcm; "
                + (pred or "")
                + f"cp.async.bulk.tensor.{dim}.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster "
                + f"[{dst}], [{desc}, {{{coords}}}], [{bar}], %mcmask; }}")

    def arrive_sub(m):
        pred, bar = m.groups()
        counts["peer_arrive"] += 1
        p = pred or ""
        return ("{ .reg .b32 %mcpeer, %mcra; mov.u32 %mcpeer, %cluster_ctarank; xor.b32 %mcpeer, %mcpeer, 1; "
                f"mapa.shared::cluster.u32 %mcra, {bar}, %mcpeer; {p}mbarrier.arrive.shared::cta.b64 _, [{bar}]; "
                f"{p}mbarrier.arrive.shared::cluster.b64 _, [%mcra]; }}")

    ptx = _TMA.sub(tma_sub, ptx)
    ptx = _ARRIVE2.sub(arrive_sub, ptx)
    if spec.handshake:
        lines = ptx.split("\n")
        start = next(i for i, ln in enumerate(lines) if ln.startswith(".visible .entry " + name + "("))
        brace = next(i for i in range(start, len(lines)) if lines[i].strip() == "{")
        at = brace + 1
        while at < len(lines) and (not lines[at].strip() or lines[at].strip().startswith((".reg", ".local", ".shared",
                                                                                         "//"))):
            at += 1
        lines.insert(at, "\t{ .reg .b32 %mctid; .reg .pred %mcw; mov.u32 %mctid, %tid.x; "
                         f"setp.ge.u32 %mcw, %mctid, {spec.default_threads}; @%mcw barrier.cluster.arrive.relaxed; }}")
        counts["entry_arrive"] = 1
        ptx = "\n".join(lines)
    LAST_COUNTS[name] = dict(counts)
    return ptx, counts


def _ptx_pass(ptx: str, metadata) -> str:
    return rewrite_ptx(ptx)[0]


def install() -> None:
    """Put the pass into Triton's compile pipeline (:mod:`megamoe.compile_hooks`: one stages hook a process, a hook
    set before it kept). Any kernel not registered, or without the marker, compiles as before."""
    compile_hooks.add_ptx_pass("multicast", _ptx_pass)


def as_cluster(kernel, cluster: int = CLUSTER):
    """Make compiled kernel ``kernel`` (a ``CompiledKernel`` of a registered kernel, compiled for one CTA with the
    pass installed) launch in clusters of ``cluster`` CTAs: its launcher then runs ``grid x cluster`` CTAs for a
    grid of ``grid``. Refuses a compile that lacks the rewrite (cached by a process without :func:`install`)."""
    name = getattr(kernel, "name", None) or _entry_name(kernel.asm["ptx"])
    if "multicast::cluster" not in kernel.asm["ptx"]:
        raise RuntimeError(f"{name}: this compile lacks megamoe.multicast's PTX pass (its disk-cache entry was made "
                           "by a process that had not installed it); empty Triton's cache (TRITON_CACHE_DIR, "
                           "~/.triton/cache) and call again")
    nw, _, shared = kernel.packed_metadata
    kernel.packed_metadata = (nw, cluster, shared)
    return kernel


def max_active_clusters(kernel, cluster: int = CLUSTER) -> int:
    """Clusters of ``cluster`` CTAs of compiled kernel ``kernel`` that the current GPU holds at once
    (``cuOccupancyMaxActiveClusters``, one CTA an SM): a persistent grid of clusters must not exceed it."""
    from triton.runtime import driver

    kernel._init_handles()
    return int(driver.active.utils.cuOccupancyMaxActiveClusters(kernel.function, kernel.metadata.shared, cluster))
