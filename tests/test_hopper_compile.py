"""The Gluon GEMM phases compile for sm_90a on a CPU machine, with the keywords the host passes, within their
budgets (``megamoe.hopper_compile``): CI cannot run them, but it can see a change that no longer compiles, no
longer fits in shared memory, ignores the host's register split, or spills inside a K loop."""
import pytest

from megamoe import fused as mf
from megamoe.hopper_compile import SM90_MAX_SHARED_PER_BLOCK, compile_gluon_phase
from megamoe.layout import Layout

#: Spill-store bytes allowed per (kind, pool block), a little above the compiles of this checkout (Triton 3.6):
#: fp4_ws 20 / 8 (block 64: the scale-word prefetch; block 128: 184 until session 30, all in the decode partition's
#: per-tile row maxima over the scale words, since read from ``megamoe.fused._fp4_row_maxima``), fp8_ws 4 / 24 (52
#: at block 128 with the 2-CTA multicast, ``FP8_WS_MULTICAST``: its pair schedule's words, in the math partitions'
#: tile loops; 32 since the staged L2 epilogue, ``FP8_WS_BULK``), none of them inside a K loop (the math and decode
#: partitions' loops, checked below).
SPILL_BUDGET = {("fp4_ws", 64): 32, ("fp4_ws", 128): 40, ("fp8_ws", 64): 16, ("fp8_ws", 128): 64,
                ("fp4_ws_predecoded", 64): 32, ("fp4_ws_predecoded", 128): 40}

#: Spill stores (``STL``, one 4-byte register each) allowed inside a decode partition's K loop: none. (Block 128's
#: stage loop stored one register a stage from session 26's register-order FP4 words until its decoded stage became
#: two halves, ``megamoe.fused.FP4_WS_DECODE_HALVES``; with the halves off it still does.)
DECODE_LOOP_SPILLS: dict = {}
#: ``bar.sync`` allowed in a decode partition's stage loop (``BAR`` in the SASS), per block: the loop's top, the L2 A
#: fold's load-then-store on one buffer, and the one before the arrive on ``decoded[s]``. Each 64-row chunk stored
#: into one shared buffer adds one (block 128 had 8 before ``FP4_WS_DECODE_HALVES``).
DECODE_LOOP_BARRIERS = {64: 3, 128: 3}
#: ... counted in the SASS, so with ``IDLE_DECODE`` (``megamoe.fused.FP4_WS_IDLE_DECODE``: block 128, "hopper"
#: numerics, per-block decode) one more: the loop holds the L2 A fold twice (all 128 rows, or warpgroup 0's 64 in an
#: idle tile), each with its barrier, and a stage passes one of them (3 a stage; the offline SASS at 5996cc5).
IDLE_FOLD_BARRIERS = 1


def _innermost(loops):
    """The loops (``CompileReport.loops``: the range between a backward branch's target and the branch) that contain
    no other: the K loops of each partition. A range that partially overlaps a smaller one is dropped: real loops nest,
    but an out-of-line retry stub (an mbarrier ``TRYWAIT`` that failed jumps past the kernel's end and branches back
    into the K loop) spans from inside one loop to past the others, covering code that never runs in it."""
    def partial(a, b):
        return a[0] < b[0] <= a[1] < b[1] or b[0] < a[0] <= b[1] < a[1]

    real = [lp for lp in loops if not any(partial(lp, o) and o[1] - o[0] < lp[1] - lp[0] for o in loops)]
    return [lp for lp in real if not any(o is not lp and lp[0] <= o[0] and o[1] <= lp[1] for o in real)]


@pytest.mark.slow
@pytest.mark.parametrize("kind,block_m,numerics", [
    ("fp4_ws", 64, "hopper"), ("fp4_ws", 128, "hopper"), ("fp8_ws", 64, "exact"), ("fp8_ws", 128, "exact"),
    ("fp4_ws_predecoded", 64, "hopper"), ("fp4_ws_predecoded", 128, "hopper"),
    ("fp4_ws", 64, "hopper_l2_per_block"), ("fp4_ws", 128, "hopper_l2_per_block"),
    ("fp4_ws_predecoded", 128, "hopper_l2_per_block")])
def test_gluon_phase_compiles_for_sm90_within_its_budgets(kind, block_m, numerics):
    """Also with ``numerics="hopper_l2_per_block"`` (``L2_FOLDED`` off: no L2 A fold in the decode partitions, the
    per-K-block token scales in the math's adds)."""
    predecode = kind == "fp4_ws_predecoded"
    kind, budget = ("fp4_ws" if predecode else kind), SPILL_BUDGET[kind, block_m]
    layout = Layout(1, 48, 8192, 6, 7168, 3072, 128, format="fp8_fp4" if kind == "fp4_ws" else "fp8")
    r = compile_gluon_phase(kind, layout, block_m, predecode=predecode, numerics=numerics)
    assert 0 < r.shared <= SM90_MAX_SHARED_PER_BLOCK, r.shared
    math, load, worker, maxnreg = mf.FP4_WS_REGS[block_m] if kind == "fp4_ws" else mf.FP8_WS_REGS
    assert r.registers <= maxnreg
    values = {v for _, v in r.setmaxnreg}
    # the host's split reaches the PTX (fp4_ws at block 64: the math warpgroup is the default partition and keeps what
    # the workers leave, 512 - loader - two decode partitions, so MATH_REGS is not used there)
    want = {load, worker} | ({512 - load - 2 * worker} if (kind, block_m) == ("fp4_ws", 64) else {math})
    assert want <= values, (want, r.setmaxnreg)
    assert r.spill_stores <= budget, r.spill_stores
    assert r.directory is None  # nothing left behind (keep=False)
    inner = _innermost(r.loops)
    mma_loops = [lp for lp in inner if lp[3].get("QGMMA")]
    # (a decode partition's stage: 32 values a thread per 64 weight rows of BM 64's two partitions, one prmt per four)
    decode_loops = [lp for lp in inner if lp[3].get("PRMT", 0) >= 32 and not lp[3].get("QGMMA")]
    assert mma_loops, "no K loop issues wgmma"
    assert bool(decode_loops) == (kind == "fp4_ws" and not predecode), "the FP4 decode partitions' K loops (prmt)"
    # (fp8_ws's pull partition spills 8 B a pulled row in its copy loop at 40 registers: known, not a K loop)
    for first, last, n, ops in mma_loops:
        assert not ops.get("STL") and not ops.get("LDL"), f"spill in the K loop {first:#x}-{last:#x}"
    for first, last, n, ops in decode_loops:
        allowed = DECODE_LOOP_SPILLS.get((kind, block_m), 0)
        assert ops.get("STL", 0) <= allowed and ops.get("LDL", 0) <= allowed, \
            f"spill in the K loop {first:#x}-{last:#x}"
        idle_fold = (kind, block_m, numerics, predecode) == ("fp4_ws", 128, "hopper", False) \
            and mf.FP4_WS_IDLE_DECODE[128]
        assert ops.get("BAR", 0) <= DECODE_LOOP_BARRIERS[block_m] + IDLE_FOLD_BARRIERS * idle_fold, \
            f"{ops.get('BAR')} bar.sync in the decode loop {first:#x}-{last:#x}"


@pytest.mark.slow
def test_fp8_phase_multicast_is_in_the_sass_only_with_mc():
    """``FP8_WS_MULTICAST`` (``MC``, block 128; off by default since session 48) reaches the machine code through
    ``megamoe.multicast``'s pass: every 2-D TMA load is a multicast one (the A and W loads of both GEMMs and pair
    kinds), the math partitions' stage releases arrive on the peer CTA's barrier too, the workers' cluster arrive and
    the default partition's arrive and wait are there; compiled without ``MC``, none of it (the same kernel as before
    the pass). (A Triton whose PTX no longer matches the pass would otherwise be found on the GPU, as a hang.)"""
    import shutil

    layout = Layout(1, 48, 8192, 6, 7168, 3072, 128, format="fp8")
    sass = {}
    for mc in (True, False):
        r = compile_gluon_phase("fp8_ws", layout, 128, keep=True, overrides={"MC": mc})
        with open(f"{r.directory}/k.sass") as f:
            sass[mc] = f.read()
        with open(f"{r.directory}/k.ptx") as f:
            ptx = f.read()
        shutil.rmtree(r.directory)
        assert ptx.count("mapa.shared::cluster") == (4 if mc else 0)  # two releases in each math partition
        assert ptx.count("barrier.cluster.arrive.relaxed") == (1 if mc else 0)
    tma = [ln for ln in sass[True].splitlines() if "UTMALDG" in ln]
    assert tma and all("MULTICAST" in ln for ln in tma if ".2D" in ln), tma
    assert sum(".1D" in ln for ln in tma) == 1  # the A scales stay an ordinary load
    assert "UCGABAR_ARV" in sass[True] and "UCGABAR_WAIT" in sass[True]
    assert "MULTICAST" not in sass[False] and "UCGABAR" not in sass[False]


@pytest.mark.slow
@pytest.mark.parametrize("copier", [False, True])
def test_fp8_phase_bulk_epilogue_copies_from_its_staging_buffer(copier):
    """``FP8_WS_BULK`` (the L2 epilogue through shared memory and ``cp.async.bulk``, on a 3-stage ring) compiles within
    the FP8 budgets, and ``megamoe.shared_address`` resolved its copies' source to the staging buffer: in each math
    partition the 64 bf16 stores of its staging rows (between the wait for the previous copies and the copy itself;
    with ``FP8_WS_COPIER`` between the wait on ``freed`` and the arrive on ``staged``) all land in ``[offset,
    offset + 128 x 528)``, the resolved offset, and no token is left in the PTX. Two copy sites either way: one a
    math partition, or the copier's two (one a warpgroup), the copier's read-waits then one per warpgroup."""
    import re
    import shutil

    layout = Layout(1, 48, 8192, 6, 7168, 3072, 128, format="fp8")
    r = compile_gluon_phase("fp8_ws", layout, 128, keep=True, settings={"FP8_WS_BULK": True, "FP8_WS_COPIER": copier})
    with open(f"{r.directory}/k.ptx") as f:
        ptx = f.read()
    with open(f"{r.directory}/k.sass") as f:
        sass = f.read()
    shutil.rmtree(r.directory)
    assert 0 < r.shared <= SM90_MAX_SHARED_PER_BLOCK and r.spill_stores <= SPILL_BUDGET["fp8_ws", 128], r
    assert "MEGAMOE_SMEM_OFFSET" not in ptx
    copies = re.findall(r"add\.u32 %bks, %bks, (\d+);.*?cp\.async\.bulk\.global\.shared::cta", ptx)
    assert len(copies) == 2 and len(set(copies)) == 1, copies  # two copy sites, one buffer
    offset, size = int(copies[0]), 2 * 64 * (2 * 128 + 8) * 2
    if copier:
        bodies = re.findall(r"mbarrier\.try_wait\.parity[^\n]*\n(.*?)mbarrier\.arrive", ptx, re.S)
        bodies = [b for b in bodies if "st.shared.b32" in b and "wgmma" not in b]
        assert ptx.count("cp.async.bulk.wait_group.read 1;") == 1 and ptx.count("cp.async.bulk.wait_group.read 0;") == 1
    else:
        bodies = re.findall(r"cp\.async\.bulk\.wait_group\.read 0;(.*?)cp\.async\.bulk\.global", ptx, re.S)
    assert len(bodies) == 2, len(bodies)
    for body in bodies:
        stores = [int(m) for m in re.findall(r"st\.shared\.b32 \t?\[%r\d+\+(\d+)\]", body)]
        assert len(stores) == 64 and all(offset <= a < offset + size for a in stores), stores
    assert "UBLKCP" in sass and sass.count("UBLKCP") == 2


@pytest.mark.slow
@pytest.mark.parametrize("block_n", [8, 16, 32, 64, 128])
def test_fp4_rs_phase_compiles_for_its_ctas_an_sm(block_n):
    """The register-operand FP4 tile (``megamoe.kernels.gemm_fp4_rs``) at each token chunk, with the host's
    keywords: within ``maxnreg`` ``fp4_rs_maxnreg(block_n)`` and a share of an SM's shared memory
    (``FP4_RS_CTAS_PER_SM[block_n]`` CTAs an SM, 4 up to chunk 16, 2 at 32 / 64, 1 at 128, is what the launch's grid
    assumes for its speed; a CTA that is not resident takes no tile, so it cannot dead-lock the L2 tiles' waits), wgmma
    in its K loops, no spill inside them (at 128 -- two math warpgroups on 128-row chains, pool block 128 -- 516 B
    spilled in the chain epilogues; Triton 3.6)."""
    layout = Layout(1, 48, 8192, 6, 7168, 3072, 128)
    r = compile_gluon_phase("fp4_rs", layout, mf.fp4_rs_block_m(block_n), block_n=block_n, has_clamp=True)
    _assert_rs_within_budgets(r, block_n, 600 if block_n == 128 else 120)  # (chunk 32: 108 B since the register-
    # order FP4 words of session 26, 88 before; none in a K loop)


@pytest.mark.slow
@pytest.mark.parametrize("block_n", [8, 32, 64])
def test_fp4_rs_phase_compiles_with_l2_per_block(block_n):
    """The register-operand tile with ``numerics="hopper_l2_per_block"`` (no fold in ``_l1_done``; each L2 K block's
    partial sums times the tokens' scales, read from the stash): within the same budgets, no spill in a K loop (chunk
    32 on 128-row chains: 152 B outside them, against 104 with the fold; Triton 3.6)."""
    layout = Layout(1, 48, 8192, 6, 7168, 3072, 128)
    r = compile_gluon_phase("fp4_rs", layout, mf.fp4_rs_block_m(block_n), block_n=block_n, has_clamp=True,
                            numerics="hopper_l2_per_block")
    _assert_rs_within_budgets(r, block_n, 160)


def _assert_rs_within_budgets(r, block_n: int, spill_budget: int) -> None:
    """A register-operand tile's compile (``r``) fits its ``maxnreg`` and its CTAs an SM in shared memory (as the
    constants in force say), spills at most ``spill_budget`` bytes and none inside a K loop, whose wgmmas have the
    decode beside them."""
    assert r.registers <= mf.fp4_rs_maxnreg(block_n)
    per_sm = mf._SM90_LIMITS["shared_memory_per_multiprocessor"]
    assert mf.FP4_RS_CTAS_PER_SM[block_n] * (r.shared + 1024) <= per_sm, r.shared
    assert r.spill_stores <= spill_budget, r.spill_stores
    mma_loops = [lp for lp in _innermost(r.loops) if lp[3].get("QGMMA")]
    assert mma_loops and all(lp[3].get("PRMT", 0) >= 32 for lp in mma_loops)  # the decode is in the MMA's loop
    for first, last, n, ops in mma_loops:
        assert not ops.get("STL") and not ops.get("LDL"), f"spill in the K loop {first:#x}-{last:#x}"


@pytest.mark.slow
@pytest.mark.parametrize("block_n, variant", [(bn, v) for bn in sorted(mf.FP4_RS_CANDIDATES)
                                              for v in sorted(mf.FP4_RS_CANDIDATES[bn])])
def test_fp4_rs_candidates_compile_within_their_budgets(block_n, variant, monkeypatch):
    """Each candidate of ``megamoe.fused.FP4_RS_CANDIDATES`` compiles for sm_90a as the probe and the GPU tests run it
    (its settings in the compiling process: ``compile_gluon_phase(settings=...)``): within the ``maxnreg`` and
    shared memory of its CTAs an SM, at most 96 spilled bytes, none in a K loop,
    no register of a QGMMA's A operand written before its wait."""
    import pathlib
    import shutil

    settings = mf.fp4_rs_variant(block_n, *mf.FP4_RS_CANDIDATES[block_n][variant])
    layout = Layout(1, 48, 8192, 6, 7168, 3072, 128)
    for name, value in settings.items():  # (what the assertions read, in this process)
        monkeypatch.setattr(mf, name, value)
    r = compile_gluon_phase("fp4_rs", layout, mf.fp4_rs_block_m(block_n), block_n=block_n, has_clamp=True,
                            settings=settings, keep=True)
    try:
        sass = (pathlib.Path(r.directory) / "k.sass").read_text()
    finally:
        shutil.rmtree(r.directory, ignore_errors=True)
    _assert_rs_within_budgets(r, block_n, 96)
    assert r.registers == mf.fp4_rs_maxnreg(block_n)  # (a warp-specialised kernel takes its whole budget: the
    # candidate's, not the default's)
    assert _operand_writes_before_wait(sass) == []


def _operand_writes_before_wait(sass: str) -> list[str]:
    """SASS lines that write a register of a register-operand ``QGMMA``'s A (4 registers from the one named) after
    the QGMMA and before the next ``WARPGROUP.DEPBAR`` (the wait): what the pipelined K loop must not contain, since
    the wgmma reads its register operand asynchronously."""
    import re

    bad, live = [], set()
    for line in sass.splitlines():
        m = re.search(r"\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)\s+([^;]*);", line)
        if not m:
            continue
        op, args = m.group(2), [a.strip() for a in m.group(3).split(",")]
        if op.startswith("QGMMA") and len(args) > 1 and re.fullmatch(r"R\d+", args[1]):
            a0 = int(args[1][1:])
            live |= {f"R{a0 + i}" for i in range(4)}
        elif op.startswith("WARPGROUP.DEPBAR"):
            live = set()
        elif live and args and args[0] in live and not op.startswith(("ST", "RED", "ATOM", "BRA", "ISETP", "FSETP")):
            bad.append(line.strip())
    return bad


@pytest.mark.slow
def test_fp4_rs_wide_decodes_under_the_mma_without_touching_its_operand():
    """The wide tile (chunk 128, 128-row chains) issues the next K block's decode between a block's register-operand
    wgmmas and their wait, without the e4m3 operands among the wait's deps (Triton 3.6 cannot: "Unexpected bitwidth
    in WGMMAWaitGroupOp: 8"): correct only while no instruction writes a QGMMA's A registers before its DEPBAR. The
    SASS says so, and that the decode (PRMT) does sit there."""
    import pathlib
    import re
    import shutil

    layout = Layout(1, 48, 8192, 6, 7168, 3072, 128)
    r = compile_gluon_phase("fp4_rs", layout, 128, block_n=128, has_clamp=True, keep=True)
    try:
        sass = (pathlib.Path(r.directory) / "k.sass").read_text()
    finally:
        shutil.rmtree(r.directory, ignore_errors=True)
    assert _operand_writes_before_wait(sass) == []
    between = re.findall(r"QGMMA[^\n]*\n((?:(?!WARPGROUP\.DEPBAR)[^\n]*\n)*?)[^\n]*WARPGROUP\.DEPBAR", sass)
    assert any(chunk.count("PRMT") >= 64 for chunk in between)  # the next block's decode under the MMA
    # the check itself: a write of the operand before the wait is found
    assert _operand_writes_before_wait(
        "/*0*/ QGMMA.64x128x32.F32.E4M3.E4M3 R24, R88, gdesc[UR16], RZ ;\n/*1*/ PRMT R90, R1, 0x7, R2 ;\n"
        "/*2*/ WARPGROUP.DEPBAR.LE gsb0, 0x0 ;\n/*3*/ PRMT R88, R1, 0x7, R2 ;") == [
        "/*1*/ PRMT R90, R1, 0x7, R2 ;"]


def test_compile_settings_name_constants_of_the_fused_module():
    """A setting that is not a constant of ``megamoe.fused`` is an error naming it, before any compile."""
    with pytest.raises(ValueError, match=r"settings: \['FP4_RS_ROW'\]"):
        compile_gluon_phase("fp4_rs", Layout(1, 48, 8192, 6, 7168, 3072, 128), 64, block_n=8,
                            settings={"FP4_RS_ROW": {8: 64}})


@pytest.mark.slow
def test_predecode_reads_the_blocked_fp4_weights_in_16_byte_loads():
    """The FP4 weights are blocked by 256 rows x 128 K (``megamoe.quant.block_fp4_weights``) and every Triton kernel
    that reads them addresses them through ``megamoe.kernels.formats.fp4_weight_offset``. Compiled offline for sm_90a
    at the L1 shape, the predecode pass (``fold_decode_kernel``: its default wide steps of 512 K, and the 32-byte
    pieces of ``_decode_chunk``, which the one-launch kernel shares) still loads them 16 bytes at a time: with ``b0 %
    64`` in the offset, Triton's alignment analysis lost the divisibility and every load fell to single bytes."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    probes = Path(__file__).resolve().parents[1] / "results" / "probes"
    code = ("import json, sys; sys.path.insert(0, %r); import fold_decode_compile as c; print(json.dumps(["
            "c.compile_variant(v, 6144, 7168)['sass_memory_ops'] for v in (c.FOLD_DECODE_VARIANTS[3], "
            "c.FOLD_DECODE_VARIANTS[0])]))" % str(probes))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    for ops in json.loads(out.stdout.strip().splitlines()[-1]):
        assert ops.get("LDG.E.128", 0) >= 3 and not any(op.startswith("LDG") and "U8" in op for op in ops), ops
