"""Offline sm_90a compiles of the two Gluon GEMM phases, on any machine (no GPU): what ptxas and the SASS say about
the kernel a launch of this checkout would run.

``compile_gluon_phase(kind, layout, block_m)`` compiles ``megamoe.kernels.gemm_fp4_ws.fp4_gemm_phase_kernel``
(``kind="fp4_ws"``) or ``megamoe.kernels.gemm_fp8_ws.fp8_gemm_phase_kernel`` (``"fp8_ws"``) with exactly the
keywords the host passes (``megamoe.fused.fp4_ws_keywords`` / ``fp8_ws_keywords``: buffer offsets, shapes, ring
stages, register split, ``maxnreg``) and the argument types of its TMA descriptors, for ``GPUTarget("cuda", 90,
32)``, then runs the bundled ``ptxas -v`` and ``cuobjdump -sass``. The report carries the dynamic shared memory,
registers, stack and spill bytes, the ``setmaxnreg`` values, a SASS opcode histogram and the K loops' bodies.

Used by ``tests/test_hopper_compile.py`` (CI compiles the kernels it cannot run: shared memory within sm_90's
limit, the register split the host asks for, spills within the budgets below) and by the compile probes of
``results/probes/``. Nothing here launches anything.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

#: sm_90's largest dynamic shared memory per block (H100 / H200: 227 KiB).
SM90_MAX_SHARED_PER_BLOCK = 232448
#: Pointer arguments the host passes 16-byte aligned (buffer bases, torch allocations), per kind.
_ALIGNED = {"fp4_ws": ("buf", "w1_sf", "w2_sf", "rmax1", "rmax2", "lut", "tiles", "buffer_ptrs"),
            "fp4_rs": ("buf", "rmax1", "rmax2", "lut", "tiles", "sched", "buffer_ptrs"),
            "fp8_ws": ("buf", "w1_sf", "w2_sf", "tiles", "buffer_ptrs")}


@dataclasses.dataclass
class CompileReport:
    """One offline compile. ``setmaxnreg``: sorted ``(inc|dec, registers)`` pairs of the PTX; ``loops``: per
    backward branch spanning more than 64 instructions, ``(first address, last address, instructions, {opcode:
    count})`` of the SASS between them (a K loop's body); ``directory``: where the PTX / TTGIR / SASS were written."""
    kind: str
    block_m: int
    shared: int
    registers: int
    stack: int
    spill_stores: int
    spill_loads: int
    setmaxnreg: list
    sass_ops: dict
    loops: list
    directory: str | None

    def summary(self, ops: tuple[str, ...]) -> str:
        """Lines for a reader: where the files are, shared memory, registers and spills, the ``ops`` of the SASS
        histogram, the ``setmaxnreg`` values, and each loop's size and most frequent opcodes."""
        lines = [f"dir {self.directory} shared {self.shared}",
                 f"{self.registers} registers, {self.stack} bytes stack, {self.spill_stores} / {self.spill_loads} "
                 "bytes spill stores / loads",
                 str({o: n for o, n in sorted(self.sass_ops.items()) if o in ops}), str(self.setmaxnreg)]
        for first, last, n, loop_ops in self.loops:
            top = dict(sorted(loop_ops.items(), key=lambda x: -x[1])[:8])
            lines.append(f"loop {first:#x}-{last:#x}: {n} instructions {top}")
        return "\n".join(lines)


def _signature(kind: str, bm: int, predecode: bool = False, block_n: int = 0) -> dict:
    """The kernel's argument types: its TMA descriptors as the launch builds them (``ws_descriptor_specs``), then
    the pointers and scalars."""
    from megamoe.fused import ws_descriptor_specs

    specs = ws_descriptor_specs(kind, bm, predecode, block_n)
    sig = {k: f"tensordesc<{dt}{list(box)},{lay!r}>" for k, (dt, box, lay) in specs.items()}
    if kind == "fp4_rs":
        return dict(sig, buf="*u8", rmax1="*u8", rmax2="*u8", lut="*i32", tiles="*i32", sched="*i32",
                    buffer_ptrs="*i64", me="i32", clamp="fp32", timeout_ns="i64")
    if kind == "fp4_ws":
        return dict(sig, buf="*u8", w1_sf="*i32", w2_sf="*i32", rmax1="*u8", rmax2="*u8", lut="*i32", tiles="*i32",
                    buffer_ptrs="*i64", me="i32", clamp="fp32", timeout_ns="i64")
    return dict(sig, buf="*u8", w1_sf="*fp32", w2_sf="*fp32", tiles="*i32", buffer_ptrs="*i64", me="i32",
                clamp="fp32", timeout_ns="i64")


def _loops(sass: str, min_instructions: int = 64) -> list:
    ins = [(int(m.group(1), 16), m.group(2).strip())
           for m in re.finditer(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", sass, re.M)]
    out = []
    for ad, text in ins:
        m = re.search(r"\bBRA (?:U?!?P\w+, )?(0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < ad:
            body = [t for a, t in ins if int(m.group(1), 16) <= a <= ad]
            if len(body) > min_instructions:
                ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)
                out.append((int(m.group(1), 16), ad, len(body), dict(ops)))
    return out


def compile_gluon_phase(kind: str, layout, block_m: int, has_clamp: bool = False, predecode: bool = False,
                        overrides: dict | None = None, keep: bool = False, block_n: int = 16,
                        settings: dict | None = None, numerics: str = "hopper") -> CompileReport:
    """Compile ``kind``'s Gluon GEMM phase ("fp4_ws", "fp4_rs" -- the register-operand tile at token chunk
    ``block_n`` -- or "fp8_ws") for sm_90a at ``layout``'s shapes and pool block
    ``block_m`` with the host's keywords (``predecode``: "fp4_ws" on ``megamoe.fused._predecode``'s e4m3 weights;
    ``overrides``: keywords to compile instead of the host's, e.g. ``{"STAGES": 4, "DECODE_REGS": 80}`` for a sweep
    in ``results/probes/``); see the module docstring. ``keep``: leave the PTX / TTGIR / cubin / SASS in the
    report's ``directory`` (a probe's reader opens them; a test leaves nothing behind). ``settings``: constants of
    ``megamoe.fused`` to compile under (name -> value, e.g. ``fp4_rs_variant(...)``'s dicts, whose integer keys
    survive the trip to the child), set for the compile and put back. ``numerics``: the FP8 x FP4 tiles' (``"hopper"``
    or ``"hopper_l2_per_block"``: their ``L2_FOLDED``). In a process whose Triton
    runs its interpreter (a CPU machine: ``megamoe.env``) the kernels are interpreter functions, so the compile runs
    in a child process with ``TRITON_INTERPRET=0`` (``python -m megamoe.hopper_compile``), its report read back as
    JSON."""
    from megamoe import fused as mf
    from megamoe.env import interpreting

    unknown = sorted(set(settings or {}) - set(vars(mf)))
    if unknown:
        raise ValueError(f"settings: {unknown} are not constants of megamoe.fused")
    if interpreting():
        L = layout
        args = [kind, str(block_m), str(int(has_clamp)), str(int(predecode)), json.dumps(overrides or {}),
                str(int(keep)), str(block_n), json.dumps(settings or {}), str(L.num_ranks), str(L.num_experts),
                str(L.num_max_tokens_per_rank), str(L.num_topk), str(L.hidden), str(L.intermediate_hidden),
                str(L.block_m), L.format, numerics]
        out = subprocess.run([sys.executable, "-m", "megamoe.hopper_compile", *args], capture_output=True, text=True,
                             env=dict(os.environ, TRITON_INTERPRET="0"))
        if out.returncode != 0:
            raise RuntimeError(f"offline compile of {kind} at block_m={block_m} failed:\n{out.stderr[-4000:]}")
        return CompileReport(**json.loads(out.stdout.strip().splitlines()[-1]))
    saved = {n: getattr(mf, n) for n in settings or {}}
    try:
        for n, v in (settings or {}).items():
            setattr(mf, n, v)
        return _compile_here(kind, layout, block_m, has_clamp, predecode, overrides, keep, block_n, numerics)
    finally:
        for n, v in saved.items():
            setattr(mf, n, v)


def _compile_here(kind, layout, block_m, has_clamp, predecode, overrides, keep, block_n,
                  numerics="hopper") -> CompileReport:
    """:func:`compile_gluon_phase` in a process whose Triton does not interpret, under the current constants."""
    from megamoe import fused as mf
    if kind == "fp4_ws":
        from megamoe.kernels.gemm_fp4_ws import fp4_gemm_phase_kernel as fn
        kw = mf.fp4_ws_keywords(layout, block_m, has_clamp, predecode, numerics)
    elif kind == "fp4_rs":
        from megamoe.kernels.gemm_fp4_rs import fp4_rs_gemm_phase_kernel as fn
        kw = mf.fp4_rs_keywords(layout, block_m, block_n, has_clamp, numerics)
    elif kind == "fp8_ws":
        from megamoe.kernels.gemm_fp8_ws import fp8_gemm_phase_kernel as fn
        kw = mf.fp8_ws_keywords(layout, block_m, has_clamp)
    else:
        raise ValueError(f"kind must be 'fp4_ws', 'fp4_rs' or 'fp8_ws', got {kind!r}")
    unknown = set(overrides or {}) - set(kw)
    if unknown:
        raise ValueError(f"overrides: {sorted(unknown)} are not keywords of the {kind} launch ({sorted(kw)})")
    kw.update(overrides or {})
    options = {k: kw.pop(k) for k in ("num_warps", "maxnreg", "launch_pdl") if k in kw}
    sig = _signature(kind, block_m, predecode, block_n)
    attrs = {(fn.arg_names.index(p),): [["tt.divisibility", 16]] for p in _ALIGNED[kind]}
    return compile_report(fn, sig, kw, attrs, options, kind, block_m, keep)


def compile_report(fn, signature: dict, constexprs: dict, attrs: dict, options: dict, kind: str, block_m: int,
                   keep: bool = False) -> CompileReport:
    """Compile Gluon kernel ``fn`` for sm_90a (``signature``: argument types, Triton's strings; ``constexprs``: the
    constexpr arguments' values; ``attrs``: argument attributes, e.g. 16-byte divisibility; ``options``: compile
    options such as ``num_warps`` / ``maxnreg``), run the bundled ``ptxas -v`` and ``cuobjdump -sass`` and return
    the report (``kind`` / ``block_m`` only label it). The one home of what :func:`compile_gluon_phase` and the
    compile probes of ``results/probes/`` read from a compile; call it in a process whose Triton does not
    interpret."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sig = dict(signature)
    sig.update({k: "constexpr" for k in constexprs})
    k = triton.compile(GluonASTSource(fn, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32), options=options)
    d = tempfile.mkdtemp(prefix=f"megamoe_{kind}_{block_m}_")
    for name, key, mode in (("k.ptx", "ptx", "w"), ("k.ttgir", "ttgir", "w"), ("k.cubin", "cubin", "wb")):
        with open(os.path.join(d, name), mode) as f:
            f.write(k.asm[key])
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    pv = subprocess.run([os.path.join(tools, "ptxas"), "-arch=sm_90a", "-v", os.path.join(d, "k.ptx"), "-o",
                         os.path.join(d, "k2.cubin")], capture_output=True, text=True, check=True)
    info = pv.stdout + pv.stderr
    sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", os.path.join(d, "k.cubin")],
                          capture_output=True, text=True, check=True).stdout
    with open(os.path.join(d, "k.sass"), "w") as f:
        f.write(sass)

    def num(pattern):
        m = re.search(pattern, info)
        return int(m.group(1)) if m else 0

    ops = collections.Counter(re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]+)", sass, re.M))
    if not keep:
        shutil.rmtree(d)
    return CompileReport(
        kind=kind, block_m=block_m, shared=k.metadata.shared, registers=num(r"Used (\d+) registers"),
        stack=num(r"(\d+) bytes stack frame"), spill_stores=num(r"(\d+) bytes spill stores"),
        spill_loads=num(r"(\d+) bytes spill loads"),
        setmaxnreg=sorted({(m.group(1), int(m.group(2))) for m in
                           re.finditer(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", k.asm["ptx"])}),
        sass_ops=dict(ops), loops=_loops(sass), directory=d if keep else None)


def main(argv: list[str]) -> None:
    """``python -m megamoe.hopper_compile KIND BLOCK_M HAS_CLAMP PREDECODE OVERRIDES_JSON KEEP BLOCK_N SETTINGS_JSON
    R E T K H I LAYOUT_BLOCK_M FORMAT NUMERICS``: one report as a JSON line (what ``compile_gluon_phase`` reads back
    from its child; the settings' dicts get their integer keys back)."""
    from megamoe.layout import Layout

    kind, bm, clamp, predecode, overrides, keep, block_n, settings, *dims, fmt, numerics = argv
    L = Layout(*(int(v) for v in dims), format=fmt)
    settings = {n: ({int(k) if k.lstrip("-").isdigit() else k: x for k, x in v.items()} if isinstance(v, dict) else v)
                for n, v in json.loads(settings).items()}
    report = compile_gluon_phase(kind, L, int(bm), bool(int(clamp)), bool(int(predecode)), json.loads(overrides),
                                 bool(int(keep)), int(block_n), settings, numerics)
    print(json.dumps(dataclasses.asdict(report)))


if __name__ == "__main__":
    main(sys.argv[1:])
