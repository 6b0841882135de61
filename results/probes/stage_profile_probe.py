"""Where each partition of the FP8 x FP4 Gluon GEMM phase (tile kind "fp4_ws") spends its cycles, per ring stage,
on one EP8 rank's 48 experts of V4-Pro (world size 1, H 7168, I 3072, top-6, uniform routing).

A text-patched copy of ``megamoe.kernels.gemm_fp4_ws`` (``ws_variants_probe.kernel_module``'s mechanism) reads the
SM's ``%clock64`` around each wait and each piece of work of its three roles and stores, per CTA, the sums into an
int64 tensor whose address is patched into the copy as a constant (timing only: the clock reads cost a few cycles
each; the outputs are not checked). Counters per CTA (``SLOTS``):

* decode partition: total, ``mbarrier.wait(ready)`` (the TMA stage not landed yet), the per-tile preamble (the
  ``rfree`` wait, row maxima, L2's arrival-mask wait), the L2 A fold, the W decode, the fence + partition barrier +
  arrive, stages, tiles (the partition of weight rows from 0; the second one, at block 64, as ``dec2_*``);
* each math warpgroup: total, ``ready`` + ``decoded`` waits, the two wgmma chains and adds, the epilogue, stages;
  and the epilogue's stores and arrival bits alone per L1 tile and per L2 tile (``math*_epil1`` / ``_epil2``,
  summarized per tile: how long the tile's decoders can run ahead of it matters against that);
* loader: total, ``empty`` waits (the math has not released the slot: the ring is full), L2 arrival-mask waits;
* math warpgroup 1's stages of idle tiles (``FP4_WS_IDLE_DECODE``: its rows of the pool block empty, it decodes the
  high half): ``ready`` waits, the decode + fence + barrier + arrives, stages (its ``math1_*`` counters then count
  only the tiles it multiplies).

One row per (T, config): per-stage means over CTAs of every counter, in cycles, and the call's µs (an unpatched
call, ``_median_ms`` as the bench). Reading: if the decode partition's ``ready`` wait is a large part of its stage,
the TMA stage lands late (ring too shallow for the load latency); if its decode is, the decode's own instruction
latency / issue bounds the phase; the math's wait says how long the tensor cores idle per stage.

    python results/probes/stage_profile_probe.py [T1,T2,..] >> stage_profile_probe_h200.jsonl
    python results/probes/stage_profile_probe.py compile      # offline sm_90a compile of the patched copy (CPU)

The same for the FP8 Gluon phase ("fp8_ws", pool block 128, as the host runs it; session 48): per math warpgroup the
cycles of each L1 / L2 tile, its ring stages' ``ready`` waits (the first stage's apart) and its epilogue, the rest
per stage (MMAs, promotion, release); the L1 epilogue in three parts and the staged L2 epilogue in four (with
``FP8_WS_COPIER`` three: conversion, wait for free staging rows, staging; the copier's own waits, issue and
read-waits apart); the loader's group-sync, pull, arrival-mask and free-slot waits (``FP8_SLOTS``;
``fp8_ws_probe.py``'s patching and one-rank calls):

    python results/probes/stage_profile_probe.py fp8 [T1,T2,..] ['{"FP8_WS_MULTICAST": false}'] >> fp8_profile.jsonl
    python results/probes/stage_profile_probe.py compile fp8  # offline compile beside the kernel as it is (CPU)
"""
import functools
import importlib.util
import json
import os
import pathlib
import sys

_spec = importlib.util.spec_from_file_location("ws_variants_probe", pathlib.Path(__file__).with_name(
    "ws_variants_probe.py"))
wv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(wv)

#: Counter slots per CTA (int64 each): decode partition, math warpgroup 0 / 1, loader.
SLOTS = {"dec_total": 0, "dec_ready": 1, "dec_tile": 2, "dec_fold": 3, "dec_decode": 4, "dec_sync": 5,
         "dec_stages": 6, "dec_tiles": 7,
         "math0_total": 8, "math0_wait": 9, "math0_mma": 10, "math0_epi": 11, "math0_stages": 12,
         "math1_total": 16, "math1_wait": 17, "math1_mma": 18, "math1_epi": 19, "math1_stages": 20,
         "load_total": 24, "load_empty": 25, "load_mask": 26, "load_stages": 27,
         "idle_ready": 13, "idle_decode": 14, "idle_stages": 15,
         "dec2_total": 32, "dec2_ready": 33, "dec2_tile": 34, "dec2_fold": 35, "dec2_decode": 36, "dec2_sync": 37,
         "dec2_stages": 38, "dec2_tiles": 39,
         "math0_epil1": 40, "math0_epil2": 41, "math0_l1tiles": 42, "math0_l2tiles": 43,
         "math1_epil1": 44, "math1_epil2": 45, "math1_l1tiles": 46, "math1_l2tiles": 47}
PER_CTA = 64
#: Counters summarized per tile (of their role's L1 or L2 tiles), not per stage.
PER_TILE = {"epil1": "l1tiles", "epil2": "l2tiles"}
ADDR = "__PROF_ADDR__"

_CLK = '''

@gluon.jit
def _clk():
    """The SM's cycle counter (probe)."""
    return gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)


@gluon.jit
def _prof(k: gl.constexpr, v):
    """Store counter ``k`` of this CTA (probe; every thread stores the same value)."""
    p = gl.to_tensor(_PROF_ADDR).to(gl.pointer_type(gl.int64))
    gl.store(p + gl.program_id(0) * __PER_CTA__ + k, v)


@gluon.jit
def _prof_add(k: gl.constexpr, v):
    """Add ``v`` to counter ``k`` of this CTA (probe; one partition's threads load and store the same values)."""
    p = gl.to_tensor(_PROF_ADDR).to(gl.pointer_type(gl.int64)) + gl.program_id(0) * __PER_CTA__ + k
    gl.store(p, gl.load(p) + v)


_PROF_ADDR: gl.constexpr = gl.constexpr(__PROF_ADDR__)


@gluon.jit
def _full_mask('''.replace("__PER_CTA__", str(PER_CTA))

_DEC_LOOP_END = ("            fence_async_shared()  # generic-proxy stores to shared memory, then wgmma (async proxy) reads"
                 " them\n            gl.thread_barrier()  # every warp has stored and fenced before the one arrive\n"
                 "            mbarrier.arrive(decoded.index(s), count=1)\n            it += 1\n        j += 1\n")
_MATH_EPI = "        slot = j % 2\n        if is_l2:\n            if L2_FOLDED:\n"
#: the epilogues' stores and arrival bits (after the scales and the slot's release): timed apart, per L1 / L2 tile
_MATH_STORES = "        if is_l2:\n            row0 = b * BM + wg * WM\n"
_MATH_END = ("                _l1_fold_once(old, buf, arrival, b, nt, valid, wg, NWG, BM, OFF_L2, OFF_L2_SF, I, SP)\n"
             "        j += 1\n")
_LOAD_START = ("    full = _full_mask(I // 128)\n    it = 0\n    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):\n"
               "        gl.atomic_add(progress, 1, sem=\"relaxed\", scope=\"gpu\")")
_LOAD_MASK = ("            if FOLD_ONCE:\n                _wait_folded(arrival + b, BM // WM, state, timeout_ns)\n"
              "            else:\n                _wait_mask(l2_mask + b, full, state, timeout_ns)\n")
_LOAD_END = "            it += 1\n\n\n@gluon.jit\ndef _fold_table("
_ZERO = "_clk() * 0"
_IDLE_WAIT = "        mbarrier.wait(ready.index(s), (it // STAGES) & 1)\n"
_IDLE_END = "        mbarrier.arrive(empty.index(s), count=1)\n        it += 1\n    return it\n"

PATCHES = [
    ("\n\n@gluon.jit\ndef _full_mask(", _CLK),
    # decode partition
    ("    l2_sf = (buf + OFF_L2_SF).to(gl.pointer_type(gl.int32))\n    full = _full_mask(I // 128)\n",
     "    l2_sf = (buf + OFF_L2_SF).to(gl.pointer_type(gl.int32))\n    full = _full_mask(I // 128)\n"
     f"    c0 = _clk()\n    c_ready = {_ZERO}\n    c_tile = {_ZERO}\n    c_fold = {_ZERO}\n    c_dec = {_ZERO}\n"
     f"    c_sync = {_ZERO}\n    n_st = 0\n    n_t = 0\n"),
    ("        slot = j % 2\n        mbarrier.wait(rfree.index(slot), ((j // 2) & 1) ^ 1)",
     "        t_tile = _clk()\n        slot = j % 2\n        mbarrier.wait(rfree.index(slot), ((j // 2) & 1) ^ 1)"),
    ("        gl.thread_barrier()  # every warp's row maxima are in shared memory before any warp reads them back\n",
     "        gl.thread_barrier()  # every warp's row maxima are in shared memory before any warp reads them back\n"
     "        c_tile += _clk() - t_tile\n        n_t += 1\n"),
    ("            mbarrier.wait(ready.index(s), ph)\n            if PREFETCH:\n",
     "            t0 = _clk()\n            mbarrier.wait(ready.index(s), ph)\n            t1 = _clk()\n"
     "            c_ready += t1 - t0\n            t2 = t1\n            if PREFETCH:\n"),
    ("                if not PREDECODED:  # (predecoded weights came decoded: only the L2 A stage's fold was left)\n",
     "                t2 = _clk()\n                c_fold += t2 - t1\n"
     "                if not PREDECODED:  # (predecoded weights came decoded: only the L2 A stage's fold was left)\n"),
    (_DEC_LOOP_END,
     "            t3 = _clk()\n            c_dec += t3 - t2\n" + _DEC_LOOP_END.replace(
         "            it += 1\n", "            c_sync += _clk() - t3\n            n_st += 1\n            it += 1\n")
     + "    DB: gl.constexpr = 32 * (R0 > 0)  # (the second decode partition's own slots)\n"
       "    _prof(DB + 0, _clk() - c0)\n    _prof(DB + 1, c_ready)\n    _prof(DB + 2, c_tile)\n"
       "    _prof(DB + 3, c_fold)\n    _prof(DB + 4, c_dec)\n    _prof(DB + 5, c_sync)\n"
       "    _prof(DB + 6, n_st.to(gl.int64))\n    _prof(DB + 7, n_t.to(gl.int64))\n"),
    # math warpgroups
    ("    l1_sf = (buf + OFF_L1_SF).to(gl.pointer_type(gl.int32))\n    l2_sf = ",
     f"    c0 = _clk()\n    c_wait = {_ZERO}\n    c_mma = {_ZERO}\n    c_epi = {_ZERO}\n    n_st = 0\n"
     f"    c_e1 = {_ZERO}\n    c_e2 = {_ZERO}\n    n_l1 = 0\n    n_l2 = 0\n"
     "    l1_sf = (buf + OFF_L1_SF).to(gl.pointer_type(gl.int32))\n    l2_sf = "),
    ("            mbarrier.wait(ready.index(s), ph)\n            mbarrier.wait(decoded.index(s), ph)\n",
     "            t0 = _clk()\n            mbarrier.wait(ready.index(s), ph)\n"
     "            mbarrier.wait(decoded.index(s), ph)\n            t1 = _clk()\n            c_wait += t1 - t0\n"),
    ("            spare = d_hi\n            it += 1\n",
     "            spare = d_hi\n            c_mma += _clk() - t1\n            n_st += 1\n            it += 1\n"),
    (_MATH_EPI, "        t4 = _clk()\n" + _MATH_EPI),
    (_MATH_STORES, "        t5 = _clk()\n" + _MATH_STORES),
    (_MATH_END, _MATH_END.replace("        j += 1\n", "        c_epi += _clk() - t4\n"
                                  "        if is_l2:\n            c_e2 += _clk() - t5\n            n_l2 += 1\n"
                                  "        else:\n            c_e1 += _clk() - t5\n            n_l1 += 1\n"
                                  "        j += 1\n")
     + "    _prof(8 + 8 * wg, _clk() - c0)\n    _prof(9 + 8 * wg, c_wait)\n    _prof(10 + 8 * wg, c_mma)\n"
       "    _prof(11 + 8 * wg, c_epi)\n    _prof(12 + 8 * wg, n_st.to(gl.int64))\n"
       "    _prof(40 + 4 * wg, c_e1)\n    _prof(41 + 4 * wg, c_e2)\n    _prof(42 + 4 * wg, n_l1.to(gl.int64))\n"
       "    _prof(43 + 4 * wg, n_l2.to(gl.int64))\n"),
    # math warpgroup 1's idle-tile decode (its sums added to the CTA's slots: every thread loads and stores the same)
    (_IDLE_WAIT, f"        t0 = _clk()\n{_IDLE_WAIT}        t1 = _clk()\n        c_iw += t1 - t0\n"),
    ("    HR: gl.constexpr = TILE_N // 2\n    for kb in range(KB):\n",
     f"    HR: gl.constexpr = TILE_N // 2\n    c_iw = {_ZERO}\n    c_id = {_ZERO}\n    for kb in range(KB):\n"),
    (_IDLE_END, "        mbarrier.arrive(empty.index(s), count=1)\n        c_id += _clk() - t1\n        it += 1\n"
                "    _prof_add(13, c_iw)\n    _prof_add(14, c_id)\n    _prof_add(15, KB.to(gl.int64))\n    return it\n"),
    # loader
    (_LOAD_START, f"    c0 = _clk()\n    c_empty = {_ZERO}\n    c_mask = {_ZERO}\n    n_st = 0\n" + _LOAD_START),
    (_LOAD_MASK, "            t0 = _clk()\n" + _LOAD_MASK + "            c_mask += _clk() - t0\n"),
    ("            mbarrier.wait(empty.index(s), ph ^ 1)  # a fresh mbarrier passes the wait for the phase before 0\n",
     "            t0 = _clk()\n"
     "            mbarrier.wait(empty.index(s), ph ^ 1)  # a fresh mbarrier passes the wait for the phase before 0\n"
     "            c_empty += _clk() - t0\n            n_st += 1\n"),
    (_LOAD_END, "            it += 1\n    _prof(24, _clk() - c0)\n    _prof(25, c_empty)\n    _prof(26, c_mask)\n"
                "    _prof(27, n_st.to(gl.int64))\n\n\n@gluon.jit\ndef _fold_table("),
]
wv.PATCHES["profile"] = PATCHES


def _with_address(addr: int) -> str:
    """Register the variant ``profile@<addr>``: the clock patches, then the counters' address for the placeholder."""
    name = f"profile@{int(addr)}"
    wv.PATCHES[name] = PATCHES + [(ADDR, str(int(addr)))]
    return name


def patched_source(addr: int) -> str:
    """The kernel's text with the clock reads, counters stored at ``addr`` (int64 ``[grid, PER_CTA]``)."""
    return wv.patched_source(_with_address(addr))


def kernel_module(addr: int):
    """The patched copy imported from a temporary file (``ws_variants_probe.kernel_module``)."""
    return wv.kernel_module(_with_address(addr))


def summarize(prof, grid: int) -> dict:
    """Per-stage means over the CTAs that ran a stage (cycles): each counter divided by its role's stages."""
    import torch
    p = prof.view(-1, PER_CTA)[:grid].double()
    out = {}
    for name, k in SLOTS.items():
        role, what = name.split("_", 1)
        if what in PER_TILE:  # (cycles of one L1 / L2 tile's epilogue stores, over the CTAs that ran one)
            tiles = p[:, SLOTS[f"{role}_{PER_TILE[what]}"]]
            live = tiles > 0
            out[name + "_per_tile"] = float((p[live, k] / tiles[live]).mean()) if live.any() else 0.0
            continue
        stages = p[:, SLOTS[f"{role}_stages"]]
        live = stages > 0
        if name.endswith("_stages") or name.endswith("_tiles") or what in PER_TILE.values():
            out[name] = float(p[live, k].mean()) if live.any() else 0.0
        else:
            out[name + "_per_stage"] = float((p[live, k] / stages[live]).mean()) if live.any() else 0.0
    out["dec_total_max_cta"] = float(p[:, SLOTS["dec_total"]].max())
    out["dec_total_min_cta"] = float(p[:, SLOTS["dec_total"]].min())
    return {k: round(v, 1) for k, v in out.items()} | {"ctas": int((p[:, SLOTS["dec_stages"]] > 0).sum())}


CONFIGS = {  # name -> megamoe.fused constants to run under
    "host": {},
    "ws128": {"FP4_RS_MAX_EXPECTED": -1, "FP4_BLOCK64_MAX_EXPECTED": -1, "FP4_PREDECODE_MIN_EXPECTED": 1 << 30},
    "ws64": {"FP4_RS_MAX_EXPECTED": -1, "FP4_BLOCK64_MAX_EXPECTED": 1 << 30, "FP4_PREDECODE_MIN_EXPECTED": 1 << 30},
}
#: ``ws128_idle``: ws128 with math warpgroup 1 decoding the high halves of tiles without rows of its own
#: (``FP4_WS_IDLE_DECODE``; its warpgroup-1 counters then count only the tiles it multiplies)
CONFIGS["ws128"]["FP4_WS_IDLE_DECODE"] = {128: False, 64: False}  # (as it was measured before the option)
CONFIGS["ws128_idle"] = dict(CONFIGS["ws128"], FP4_WS_IDLE_DECODE={128: True, 64: False},
                             FP4_WS_IDLE_MAX_EXPECTED=float("inf"))
#: ``<config>_pb``: that config in ``numerics="hopper_l2_per_block"`` (no L2 A fold: its ``dec_fold`` slot then
#: times nothing); every other config in "hopper".
CONFIGS.update({f"{name}_pb": dict(settings) for name, settings in list(CONFIGS.items())})


def numerics_of(config: str) -> str:
    """The FP8 x FP4 numerics a config name runs (``CONFIGS``)."""
    return "hopper_l2_per_block" if config.endswith("_pb") else "hopper"


def _timed_and_profiled(probe_mod, call, profiled_module, words: int):
    """``call`` timed with the kernel as it is (``probe_mod``'s ``_median_ms``: ``us``), then run on the profiled
    copy ``profiled_module(address)`` twice (a warm-up, then with the counters zeroed): ``(us, counters)``, the
    counters an int64 CUDA tensor of ``words``. ``probe_mod`` (``ws_variants_probe`` or ``fp8_ws_probe``) swaps the
    kernel module in and puts the installed one back."""
    import torch

    probe_mod.use_kernel(probe_mod.AS_IS)
    call()
    torch.cuda.synchronize()
    us = probe_mod._median_ms(call) * 1e3
    prof = torch.zeros(words, dtype=torch.int64, device="cuda")
    probe_mod.use_kernel(profiled_module(prof.data_ptr()))
    try:
        call()
        torch.cuda.synchronize()
        prof.zero_()
        call()
        torch.cuda.synchronize()
    finally:
        probe_mod.use_kernel(probe_mod.AS_IS)
    return us, prof


def probe(tokens=(512, 2048, 8192), configs=("ws128",)):
    import torch

    import megamoe.fused as mf
    for T in tokens:
        for name in configs:
            saved = {k: getattr(mf, k) for k in CONFIGS[name]}
            try:
                for k, v in CONFIGS[name].items():
                    setattr(mf, k, v)
                sb, _, y, call = wv.rank("fp8_fp4", T, numerics_of(name))
                cfg = mf.fused_config(sb.layout, T, 1, sb.buffer.device, numerics_of(name))
                if cfg.kind != "fp4_ws" or cfg.rs_block_n:
                    wv.emit(probe="stage_profile", T=T, config=name, skipped=f"{cfg.kind} rs {cfg.rs_block_n}")
                    sb.destroy()
                    continue
                grid = torch.cuda.get_device_properties(0).multi_processor_count
                us, prof = _timed_and_profiled(wv, call, kernel_module, grid * PER_CTA * 2)
                wv.emit(probe="stage_profile", T=T, config=name, numerics=numerics_of(name), kind=cfg.kind,
                        block_m=cfg.block_m,
                        predecode=cfg.predecode, us=us, clock_mhz=torch.cuda.clock_rate(0) if hasattr(
                            torch.cuda, "clock_rate") else None, **summarize(prof, grid),
                        commit=os.environ.get("MEGAMOE_GIT_COMMIT"))
                sb.destroy()
            finally:
                for k, v in saved.items():
                    setattr(mf, k, v)


def compile_offline():
    """Offline sm_90a compile of the patched copy at BM 128 and 64, and at BM 128 in "hopper_l2_per_block" (a CPU
    machine: ``TRITON_INTERPRET=0``)."""
    from megamoe.hopper_compile import _compile_here
    from megamoe.layout import Layout
    mod = kernel_module(1 << 40)
    sys.modules["megamoe.kernels.gemm_fp4_ws"] = mod
    L = Layout(1, 48, 8192, 6, 7168, 3072, 128)
    for bm, numerics in ((128, "hopper"), (64, "hopper"), (128, "hopper_l2_per_block")):
        r = _compile_here("fp4_ws", L, bm, False, False, None, False, 16, numerics)
        print(json.dumps(dict(block_m=bm, numerics=numerics, shared=r.shared, registers=r.registers,
                              spill=r.spill_stores, setmaxnreg=r.setmaxnreg)), flush=True)


# ---- the FP8 Gluon phase ("fp8_ws", pool block 128: megamoe.kernels.gemm_fp8_ws._math_partition / _load_partition)
#: Counter slots per CTA (int64 each) of the FP8 phase's profile: each math warpgroup (``m<wg>_``, 16 slots apart)
#: and the loader. ``tiles1`` / ``tiles2``: L1 / L2 tiles; ``stages1`` / ``stages2``: their ring stages with MMAs;
#: ``tile1`` / ``tile2``: cycles from a tile's start to its epilogue's end; ``wait1`` / ``wait2``: of those, in the
#: K loop's ``ready`` waits (``first1`` / ``first2``: of those, the tile's first stage's); ``epi1`` / ``epi2``: in the
#: epilogue; ``pass``: stages passed through without MMAs (a warpgroup whose 64 rows are all padding). Loader:
#: ``gsync`` the group sync before each tile, ``land`` the wait for an L1 block's pulled rows, ``mask`` the L2 tiles'
#: arrival-mask waits, ``empty`` the waits for a free slot.
#: The staged L2 epilogue (``_l2_epilogue_bulk``) in four parts, cycles summed over the L2 tiles: ``epi2_cvt`` the bf16
#: conversion and the rows' destinations (their loads issued), ``epi2_wait`` the wait for the previous copies to have
#: read the staging rows and the barrier, ``epi2_stage`` the stores into the staging rows, fence and barrier,
#: ``epi2_copy`` the copies' issue (where the destinations' loads are waited for).
_L2_EPI_PARTS = ("epi2_cvt", "epi2_wait", "epi2_stage", "epi2_copy")
_L2_EPI_SLOT = 40  #: warpgroup wg's ``_L2_EPI_PARTS`` from slot ``_L2_EPI_SLOT + 4 wg``
#: The L1 epilogue (``_l1_epilogue``) in three parts, cycles summed over the L1 tiles: ``epi1_quant`` SwiGLU, top-k
#: weight (its load waited for), row maxima and the e4m3 conversion; ``epi1_store`` the layout change and the
#: stores of the bytes and scales; ``epi1_publish`` the fence, barrier and arrival-mask OR.
_L1_EPI_PARTS = ("epi1_quant", "epi1_store", "epi1_publish")
_L1_EPI_SLOT = 48  #: warpgroup wg's ``_L1_EPI_PARTS`` from slot ``_L1_EPI_SLOT + 3 wg``
#: ``FP8_WS_COPIER``: the math side's staged L2 epilogue (``_l2_epilogue_staged``) lands in the same four slots
#: (``epi2_cvt`` the conversion, ``epi2_wait`` the wait for the copier to have read the staging rows, ``epi2_stage``
#: the stores, fence, barrier and arrive; ``epi2_copy`` 0); the copier's own cycles (``_copy_rows``, the pull warps
#: after their pull): ``copy_total`` from its first L2 slot to its exit, ``copy_tiles`` its L2 tiles, ``copy_wait``
#: waiting for a warpgroup's staged rows, ``copy_issue`` the copies' issue (the destinations' loads waited for
#: there), ``copy_read`` the read-waits, barriers and arrives on ``freed``, ``copy_drain`` the final wait for
#: completion.
_COPY_PARTS = ("copy_total", "copy_tiles", "copy_wait", "copy_issue", "copy_read", "copy_drain")
_COPY_SLOT = 56
FP8_SLOTS = {**{f"m{wg}_{name}": 16 * wg + k for wg in (0, 1) for k, name in enumerate(
    ("total", "tiles1", "tiles2", "stages1", "stages2", "tile1", "tile2", "wait1", "wait2", "epi1", "epi2",
     "pass", "first1", "first2"))},
    "load_total": 32, "load_gsync": 33, "load_land": 34, "load_mask": 35, "load_empty": 36, "load_stages": 37,
    "load_tiles": 38,
    **{f"m{wg}_{name}": _L2_EPI_SLOT + 4 * wg + k for wg in (0, 1) for k, name in enumerate(_L2_EPI_PARTS)},
    **{f"m{wg}_{name}": _L1_EPI_SLOT + 3 * wg + k for wg in (0, 1) for k, name in enumerate(_L1_EPI_PARTS)},
    **{name: _COPY_SLOT + k for k, name in enumerate(_COPY_PARTS)}}
_FP8_CLK = _CLK.replace("def _full_mask(", "def _group_sync(")  # (the same helpers, before another function)
_M_LOOP = ("    for i in range(first, stop, step):\n        t, b, nt, e, valid, kind = _slot(tiles, num_tiles, i, MC)\n"
           "        is_l2 = t >= num_l1\n        if is_l2:\n            KB = I // BK\n            # weight scale rows")
_M_WAIT = "            mbarrier.wait(ready.index(s), ph)\n            a_s = a_bufs.index(s).slice(wg * WM, WM)\n"
_M_EPI = "        if valid >= 0:  # (always but for MC's padding slots)\n"
_M_END = "    if LEAD > 0 and wg == 0:\n        if it < LEAD:"
_M_EXIT = ("    if BULK:  # the rows written before the launch ends (and the staging buffer read before the CTA "
           "leaves)\n"
           "        _bulk_wait(False)\n")
_L_START = "    half = gl.program_id(0) % 2\n    it = 0\n    first, stop, step = _schedule(tiles, num_tiles, MC)\n"
_L_SLOT = ("        t, b, nt, e, valid, kind = _slot(tiles, num_tiles, i, MC)\n        is_l2 = t >= num_l1\n"
           "        if is_l2:\n            KB = I // BK\n            w_row")
_L_LAND = ('            landed = gl.atomic_add(arrival + b, 0, sem="acquire", scope="gpu")\n'
           "            if landed < valid:\n")
_L_LANDED = "            _fence_proxy_async_global()\n        for kb in range(KB):\n"
_L_MASK = ("            if is_l2:  # the L1 tile kb of this block (both warpgroups) has landed its 128 columns in the "
           "L2 pool\n")
_L_MASKED = "                _fence_proxy_async_global()\n            s = it % STAGES\n"
_L_EMPTY = "            mbarrier.wait(empty.index(s), ph ^ 1)\n            bar = ready.index(s)\n"
_L_END = "\n\n\n@gluon.jit\ndef _pull_partition"
_Z = _ZERO
#: the math partition's tile and stage counts (prefixed: the kernel's own ``n2`` counts the COPIER handshake's tiles;
#: session 50's profile under ``FP8_WS_COPIER`` hung when this patch's ``n2`` was that variable too)
_M_COUNTS = ("p_n1", "p_n2", "p_s1", "p_s2")
_M_SUMS = ("c1_tile", "c2_tile", "c1_wait", "c2_wait", "c1_epi", "c2_epi", "c_pass", "c1_first", "c2_first")
_E_SUMS = ("e_cvt", "e_wait", "e_stage", "e_copy")
_Q_SUMS = ("q_quant", "q_store", "q_publish")
_Q_ENTRY = ("    act_lo = _l1_half(acc_lo, clamp, HAS_CLAMP)\n    act_hi = _l1_half(acc_hi, clamp, HAS_CLAMP)\n"
            "    L: gl.constexpr = act_lo.type.layout\n")
_Q_STORE = "    if COALESCED:\n        q_lo = gl.convert_layout(q_lo, STORE_E4M3)\n"
_Q_PUBLISH = "    if NWG == 1:\n        old = _l1_publish("
_Q_RETURN = "        old = _l1_publish(l2_mask, b, nt, wg, 1, ACQ)\n    return old\n"
_Q_CALL = ("                _l1_epilogue(acc_lo, acc_hi, buf, clamp, b, nt, valid, l2_mask, wg, OFF_L1_W, OFF_L2, "
           "OFF_L2_SF, I,\n")
_Q_CALL_END = "                             SP, HAS_CLAMP, TILE_M, 2, False)\n"
_E_ENTRY = ("    v_lo = _to_bf16_bits(acc_lo)\n    v_hi = _to_bf16_bits(acc_hi)\n"
            "    dst, src, go = _bulk_rows(")
_E_WAIT = "    _bulk_wait(True)\n    gl.thread_barrier()\n    st = l2_stage.slice(wg * WM, WM, dim=0)\n"
_E_STAGE = "    fence_async_shared()\n    gl.thread_barrier()\n    gl.inline_asm_elementwise(BULK_STORE_ASM"
_E_COPY = ("    gl.inline_asm_elementwise(BULK_STORE_ASM, \"=r,l,r,r\", [dst, src, go], dtype=gl.int32, is_pure=False, "
           "pack=1)\n")
_E_CALL = "                    _l2_epilogue_bulk(acc_lo, acc_hi, l2_stage,"
_S_ENTRY = "    v_lo = _to_bf16_bits(acc_lo)\n    v_hi = _to_bf16_bits(acc_hi)\n    mbarrier.wait(freed.index(wg),"
_S_STAGE = "does not wait)\n    st = l2_stage.slice(wg * WM, WM, dim=0)\n"
_S_END = "    mbarrier.arrive(staged.index(wg), count=1)\n"
_S_CALL = "                    _l2_epilogue_staged(acc_lo, acc_hi, l2_stage, staged, freed, n2, wg)\n"
_K_SUMS = ("k_wait", "k_issue", "k_read")  #: (stored in the copy_* slots of the same names)
_K_START = "    n = 0\n    first, stop, step = _schedule(tiles, num_tiles, MC)\n"
_K_WAIT = "                mbarrier.wait(staged.index(wg), n & 1)\n"
_K_ISSUE = ("                gl.inline_asm_elementwise(BULK_STORE_ASM, \"=r,l,r,r\", [dst, src, go], dtype=gl.int32,\n"
            "                                          is_pure=False, pack=1)\n")
_K_READ = "            _bulk_wait(True, 1)  # warpgroup 0's"
_K_READ_END = "            mbarrier.arrive(freed.index(1), count=1)\n            n += 1\n"
_K_END = "            n += 1\n    _bulk_wait(False)\n"
FP8_PATCHES = [
    ("\n\n@gluon.jit\ndef _group_sync(", _FP8_CLK),
    # math warpgroups
    (_M_LOOP, "    c0 = _clk()\n" + "".join(f"    {n} = {_Z}\n" for n in _M_SUMS + _E_SUMS + _Q_SUMS)
     + "".join(f"    {n} = 0\n" for n in _M_COUNTS)
     + _M_LOOP.replace("step):\n", f"step):\n        t_tile = _clk()\n        c_wait = {_Z}\n        c_first = {_Z}\n",
                       1)),
    (_M_WAIT, "            t0 = _clk()\n" + _M_WAIT.replace(
        "ph)\n", "ph)\n            d_w = _clk() - t0\n            c_wait += d_w\n"
                  "            c_first += gl.where(kb == 0, d_w, 0)\n", 1)),
    ("        for kb in range(kb_mma, KB):\n", "        t_p = _clk()\n        for kb in range(kb_mma, KB):\n"),
    (_M_EPI, "        t_epi = _clk()\n        c_pass += t_epi - t_p\n" + _M_EPI),
    (_M_END, "        t_end = _clk()\n        if is_l2:\n            c2_tile += t_end - t_tile\n"
             "            c2_wait += c_wait\n            c2_first += c_first\n            c2_epi += t_end - t_epi\n"
             "            p_n2 += 1\n"
             "            p_s2 += kb_mma\n        else:\n            c1_tile += t_end - t_tile\n"
             "            c1_wait += c_wait\n            c1_first += c_first\n            c1_epi += t_end - t_epi\n"
             "            p_n1 += 1\n"
             "            p_s1 += kb_mma\n" + _M_END),
    (_M_EXIT, _M_EXIT + "    MB: gl.constexpr = 16 * wg\n    _prof(MB + 0, _clk() - c0)\n"
     + "".join(f"    _prof(MB + {1 + k}, {n}.to(gl.int64))\n" for k, n in enumerate(_M_COUNTS))
     + "".join(f"    _prof(MB + {5 + k}, {n})\n" for k, n in enumerate(_M_SUMS))
     + "".join(f"    _prof({_L2_EPI_SLOT} + 4 * wg + {k}, {n})\n" for k, n in enumerate(_E_SUMS))
     + "".join(f"    _prof({_L1_EPI_SLOT} + 3 * wg + {k}, {n})\n" for k, n in enumerate(_Q_SUMS))),
    # the staged L2 epilogue's parts (returned to the math partition, summed there)
    (_E_ENTRY, "    e0 = _clk()\n" + _E_ENTRY),
    (_E_WAIT, "    e1 = _clk()\n" + _E_WAIT.replace("barrier()\n", "barrier()\n    e2 = _clk()\n", 1)),
    (_E_STAGE, _E_STAGE.replace("    gl.inline_asm", "    e3 = _clk()\n    gl.inline_asm", 1)),
    (_E_COPY, _E_COPY + "    e4 = _clk()\n    return e1 - e0, e2 - e1, e3 - e2, e4 - e3\n"),
    (_E_CALL, _E_CALL.replace("_l2_epilogue_bulk(", "d_cvt, d_wait, d_stage, d_copy = _l2_epilogue_bulk(", 1)),
    ("                                      valid - wg * WM, wg, OFF_META, OFF_COMBINE, T, H)\n",
     "                                      valid - wg * WM, wg, OFF_META, OFF_COMBINE, T, H)\n"
     + "".join(f"                    {n} += d_{n[2:]}\n" for n in _E_SUMS)),
    # COPIER: the math side's staged L2 epilogue in parts (the same sums), and the copier's own counters
    (_S_ENTRY, "    s0 = _clk()\n" + _S_ENTRY.replace("    mbarrier.wait(", "    s1 = _clk()\n    mbarrier.wait(", 1)),
    (_S_STAGE, _S_STAGE.replace("    st = ", "    s2 = _clk()\n    st = ", 1)),
    (_S_END, _S_END + "    s3 = _clk()\n    return s1 - s0, s2 - s1, s3 - s2, (s3 - s2) * 0\n"),
    (_S_CALL, _S_CALL.replace("_l2_epilogue_staged(", "d_cvt, d_wait, d_stage, d_copy = _l2_epilogue_staged(", 1)
     + "".join(f"                    {n} += d_{n[2:]}\n" for n in _E_SUMS)),
    (_K_START, "    k0 = _clk()\n" + "".join(f"    {n} = {_Z}\n" for n in _K_SUMS) + "    k_n = 0\n" + _K_START),
    (_K_WAIT, "                w0 = _clk()\n" + _K_WAIT + "                k_wait += _clk() - w0\n"),
    (_K_ISSUE, "                i0 = _clk()\n" + _K_ISSUE + "                k_issue += _clk() - i0\n"),
    (_K_READ, "            r0 = _clk()\n" + _K_READ),
    (_K_READ_END, _K_READ_END.replace("            n += 1\n", "            k_read += _clk() - r0\n            k_n += 1\n"
                                                             "            n += 1\n", 1)),
    (_K_END, _K_END.replace("    _bulk_wait(False)\n", "    d0 = _clk()\n    _bulk_wait(False)\n    k1 = _clk()\n"
                            + "".join(f"    _prof({FP8_SLOTS[slot]}, {v})\n" for slot, v in (
                                ("copy_total", "k1 - k0"), ("copy_tiles", "k_n.to(gl.int64)"), ("copy_wait", "k_wait"),
                                ("copy_issue", "k_issue"), ("copy_read", "k_read"), ("copy_drain", "k1 - d0"))), 1)),
    # the L1 epilogue's parts (returned to the math partition, summed there)
    (_Q_ENTRY, "    p0 = _clk()\n" + _Q_ENTRY),
    (_Q_STORE, "    p1 = _clk()\n" + _Q_STORE),
    (_Q_PUBLISH, "    p2 = _clk()\n" + _Q_PUBLISH),
    (_Q_RETURN, _Q_RETURN.replace("    return old\n", "    p3 = _clk()\n    return old, p1 - p0, p2 - p1, p3 - p2\n")),
    (_Q_CALL, _Q_CALL.replace("_l1_epilogue(", "_, d_quant, d_store, d_publish = _l1_epilogue(", 1)),
    (_Q_CALL_END, _Q_CALL_END + "".join(f"                {n} += d_{n[2:]}\n" for n in _Q_SUMS)),
    # loader
    (_L_START, "    c0 = _clk()\n" + "".join(f"    {n} = {_Z}\n" for n in ("c_gs", "c_land", "c_mask", "c_empty"))
     + "    n_st = 0\n    n_t = 0\n" + _L_START),
    ("        if GROUP_SYNC:\n            if MC:\n",
     "        g0 = _clk()\n        if GROUP_SYNC:\n            if MC:\n"),
    (_L_SLOT, "        c_gs += _clk() - g0\n        n_t += 1\n" + _L_SLOT),
    (_L_LAND, "            l0 = _clk()\n" + _L_LAND),
    (_L_LANDED, "            c_land += _clk() - l0\n" + _L_LANDED),
    (_L_MASK, "            m0 = _clk()\n" + _L_MASK),
    (_L_MASKED, _L_MASKED.replace("            s = ", "            c_mask += _clk() - m0\n            s = ")),
    (_L_EMPTY, "            e0 = _clk()\n"
     + _L_EMPTY.replace("ph ^ 1)\n", "ph ^ 1)\n            c_empty += _clk() - e0\n            n_st += 1\n", 1)),
    (_L_END, "\n    _prof(32, _clk() - c0)\n    _prof(33, c_gs)\n    _prof(34, c_land)\n    _prof(35, c_mask)\n"
             "    _prof(36, c_empty)\n    _prof(37, n_st.to(gl.int64))\n    _prof(38, n_t.to(gl.int64))" + _L_END),
]


@functools.cache
def _fp8_probe_module():
    """``fp8_ws_probe.py`` beside this file, loaded once (its text-patched kernels and one-rank calls; its command
    line is not this one's)."""
    argv, sys.argv = sys.argv, sys.argv[:1]
    try:
        spec = importlib.util.spec_from_file_location("fp8_ws_probe", pathlib.Path(__file__).with_name(
            "fp8_ws_probe.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.argv = argv


def _fp8_variant(addr: int) -> str:
    """Register ``fp8_ws_probe``'s variant ``profile@<addr>``: the clock patches, then the counters' address."""
    name = f"profile@{int(addr)}"
    _fp8_probe_module().PATCHES[name] = FP8_PATCHES + [(ADDR, str(int(addr)))]
    return name


def fp8_patched_source(addr: int) -> str:
    """``megamoe.kernels.gemm_fp8_ws``'s text with the clock reads, counters stored at ``addr`` (int64 ``[CTAs,
    PER_CTA]``)."""
    return _fp8_probe_module().patched_source(_fp8_variant(addr))


def fp8_kernel_module(addr: int):
    """The FP8 phase's profiled copy imported from a temporary file (``fp8_ws_probe.kernel_module``)."""
    return _fp8_probe_module().kernel_module(_fp8_variant(addr))


def _add(row: dict, more: dict) -> None:
    """``row |= more``, refusing a key already in ``row`` (a summary's keys name one counter each)."""
    clash = row.keys() & more.keys()
    if clash:
        raise KeyError(f"summary keys computed twice: {sorted(clash)}")
    row |= more


def summarize_fp8(prof) -> dict:
    """Means over the CTAs that ran a tile (cycles): per math warpgroup and tile kind, a tile's cycles, its ``ready``
    waits, its epilogue and the rest per MMA stage (MMAs, promotion, the tile's preamble); the share of the
    warpgroup's total cycles in each; the loader's waits per tile; the slowest and fastest CTA's total."""
    p = prof.view(-1, PER_CTA).double()
    live = p[:, FP8_SLOTS["load_tiles"]] > 0
    p = p[live]
    mean = {n: float(p[:, k].mean()) for n, k in FP8_SLOTS.items()}
    out = {"ctas": int(live.sum())}
    for wg in (0, 1):
        m = {n[3:]: v for n, v in mean.items() if n.startswith(f"m{wg}_")}
        row = {"total": m["total"], "pass_share": m["pass"] / m["total"]}
        for k in ("1", "2"):
            tiles, stages = max(m["tiles" + k], 1.0), max(m["stages" + k], 1.0)
            _add(row, {f"l{k}_tiles": m["tiles" + k], f"l{k}_tile": m["tile" + k] / tiles,
                    f"l{k}_wait_per_tile": m["wait" + k] / tiles, f"l{k}_first_wait_per_tile": m["first" + k] / tiles,
                    f"l{k}_epi_per_tile": m["epi" + k] / tiles,
                    f"l{k}_mma_per_stage": (m["tile" + k] - m["wait" + k] - m["epi" + k]) / stages,
                    f"l{k}_share": m["tile" + k] / m["total"], f"l{k}_wait_share": m["wait" + k] / m["total"],
                    f"l{k}_epi_share": m["epi" + k] / m["total"]})
        row["outside_tiles_share"] = 1 - (m["tile1"] + m["tile2"]) / m["total"]
        # the epilogues' parts as l2_epi_<part>_per_tile (until session 51 l2_<part>_per_tile: its "wait", the
        # staged epilogue's wait for free rows, silently overwrote l2_wait_per_tile, the tile's ready waits)
        _add(row, {f"l2_epi_{n[5:]}_per_tile": m[n] / max(m["tiles2"], 1.0) for n in _L2_EPI_PARTS})
        _add(row, {f"l1_epi_{n[5:]}_per_tile": m[n] / max(m["tiles1"], 1.0) for n in _L1_EPI_PARTS})
        out[f"math{wg}"] = {k: round(v, 4 if k.endswith("share") else 1) for k, v in row.items()}
    lt = max(mean["load_tiles"], 1.0)
    out["loader"] = {"total": round(mean["load_total"], 1), "tiles": mean["load_tiles"],
                     **{f"{n}_per_tile": round(mean[f"load_{n}"] / lt, 1) for n in ("gsync", "land", "mask", "empty")},
                     **{f"{n}_share": round(mean[f"load_{n}"] / mean["load_total"], 4)
                        for n in ("gsync", "land", "mask", "empty")}}
    ct = max(mean["copy_tiles"], 1.0)
    out["copier"] = {"total": round(mean["copy_total"], 1), "tiles": mean["copy_tiles"],
                     **{f"{n[5:]}_per_tile": round(mean[n] / ct, 1) for n in ("copy_wait", "copy_issue", "copy_read")},
                     "drain": round(mean["copy_drain"], 1)}
    totals = p[:, FP8_SLOTS["m0_total"]]
    out["math0_total_max_cta"], out["math0_total_min_cta"] = float(totals.max()), float(totals.min())
    return out


def probe_fp8(tokens=(2048, 8192), settings: dict | None = None):
    """The FP8 call as the host runs it (``fp8_mega_moe``, its tile choice; under ``megamoe.fused`` constants
    ``settings``, name -> value, put back after: ``fp8_ws_probe._under``) at each T: one call timed unpatched
    (``_median_ms``: ``us``), then one call of the profiled copy (after a warm-up call), its counters summarized."""
    import megamoe.fused as mf
    fp = _fp8_probe_module()
    settings = settings or {}
    with fp._under(settings):
        for T in tokens:
            sb, _, y, call = fp.rank(T)
            cfg = mf.fused_config(sb.layout, T, 1, sb.buffer.device)
            if cfg.kind != "fp8_ws" or cfg.block_m != 128:
                fp.emit(probe="fp8_stage_profile", T=T, skipped=f"{cfg.kind} block {cfg.block_m}")
                sb.destroy()
                continue
            us, prof = _timed_and_profiled(fp, call, fp8_kernel_module, 4096 * PER_CTA)  # (4096 CTAs at most)
            fp.emit(probe="fp8_stage_profile", T=T, settings=settings, kind=cfg.kind, block_m=cfg.block_m,
                    multicast=mf.FP8_WS_MULTICAST, bulk=mf.FP8_WS_BULK, copier_on=mf.FP8_WS_COPIER,
                    group_sync=mf.WS_GROUP_SYNC["fp8_ws"], us=us,
                    **summarize_fp8(prof), commit=os.environ.get("MEGAMOE_GIT_COMMIT"))
            sb.destroy()


def compile_offline_fp8():
    """Offline sm_90a compile of the FP8 phase's profiled copy at pool block 128 (a CPU machine:
    ``TRITON_INTERPRET=0``), beside the kernel as it is: registers, spills and each K loop's size."""
    from megamoe.hopper_compile import _compile_here
    from megamoe.layout import Layout
    fp = _fp8_probe_module()
    L = Layout(1, 48, 8192, 6, 7168, 3072, 128, format="fp8")
    for name, mod in (("as is", fp.AS_IS), ("profiled", fp8_kernel_module(1 << 40))):
        fp.use_kernel(mod)
        r = _compile_here("fp8_ws", L, 128, False, False, None, False, 16)
        loops = [(n, ops.get("STL", 0), ops.get("LDL", 0)) for _, _, n, ops in r.loops if n < 400]  # (the K loops)
        print(json.dumps(dict(kernel=name, shared=r.shared, registers=r.registers,
                              spill=[r.spill_stores, r.spill_loads], loops_instructions_stl_ldl=loops)), flush=True)
    fp.use_kernel(fp.AS_IS)


if __name__ == "__main__":
    if sys.argv[1:3] == ["compile", "fp8"]:
        compile_offline_fp8()
    elif sys.argv[1:2] == ["compile"]:
        compile_offline()
    elif sys.argv[1:2] == ["fp8"]:
        import torch
        _fp8_probe_module().emit(probe="start", torch=torch.__version__, gpu=torch.cuda.get_device_name(),
                                 which="fp8_stage_profile", commit=os.environ.get("MEGAMOE_GIT_COMMIT"))
        probe_fp8([int(t) for t in sys.argv[2].split(",")] if len(sys.argv) > 2 else (2048, 8192),
                  {n: ({int(k): x for k, x in v.items()} if isinstance(v, dict) else v)  # (JSON's keys back to int)
                   for n, v in (json.loads(sys.argv[3]) or {}).items()} if len(sys.argv) > 3 else None)
    else:
        import torch
        wv.emit(probe="start", torch=torch.__version__, gpu=torch.cuda.get_device_name(), which="stage_profile",
                commit=os.environ.get("MEGAMOE_GIT_COMMIT"))
        tokens = [int(t) for t in sys.argv[1].split(",")] if len(sys.argv) > 1 else (512, 2048, 8192)
        configs = sys.argv[2].split(",") if len(sys.argv) > 2 else ("ws128",)
        probe(tokens, configs)
