"""The probes of ``results/probes/`` that patch kernel text still apply to the kernels of this checkout (they run only
on a GPU, where a stale patch would cost a device call to find out)."""
import ast
import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

PROBES = pathlib.Path(__file__).resolve().parents[1] / "results" / "probes"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"probe_{name}", PROBES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_ws_variants_patches_apply_once_and_compile():
    probe = _load("ws_variants_probe")
    assert set(probe.PATCHES) >= {"nodecode", "nopromote", "nodecode+nopromote"}
    original = pathlib.Path(probe.AS_IS.__file__).read_text()
    for variant in probe.PATCHES:
        src = probe.patched_source(variant)  # asserts each old text occurs exactly once
        assert src != original
        ast.parse(src)


def test_ws_variants_patch_check_can_fail(monkeypatch):
    probe = _load("ws_variants_probe")
    monkeypatch.setitem(probe.PATCHES, "stale", [("text that is not in the kernel\n", "")])
    with pytest.raises(AssertionError):
        probe.patched_source("stale")


def test_fp8_ws_probe_patches_apply_once_and_parse():
    probe = _load("fp8_ws_probe")
    assert set(probe.PATCHES) >= {"noskip", "nomma", "nopromote", "noepi", "noa", "now", "halfw", "swcvt",
                                  "uncoalesced", "dupw", "dupa", "samew", "nopull"}
    original = pathlib.Path(probe.AS_IS.__file__).read_text()
    for variant in probe.PATCHES:
        src = probe.patched_source(variant)  # asserts each old text occurs exactly once
        assert src != original
        ast.parse(src)
    import megamoe.fused as mf  # the variants' settings are constants of megamoe.fused, on variants that exist

    assert set(probe.PATCH_SETTINGS) <= set(probe.PATCHES) and not set(probe.SETTING_VARIANTS) & set(probe.PATCHES)
    for variant in (*probe.SETTING_VARIANTS, *probe.PATCH_SETTINGS):
        assert probe.variant_settings(variant) and set(probe.variant_settings(variant)) <= set(vars(mf)), variant


def test_multicast_probe_pass_rewrites_only_its_multicast_kernel(tmp_path):
    """The multicast probe's PTX pass (``megamoe.multicast``'s) still finds what it rewrites in Triton's PTX for
    sm_90a: with ``MC`` the TMA loads (W's two halves and A, in the prologue's two stages and the loop) become
    ``.multicast::cluster``
    and the one count-2 arrive a local + peer arrive, and ptxas accepts the result; without ``MC`` nothing changes.
    (A Triton whose PTX no longer matches would otherwise be found on the GPU, as a hang.) Run as the probe runs
    without CUDA, in a child process whose Triton does not interpret (this one may: ``megamoe.env``), with its own
    cache directory."""
    # no GPU in the child either: the probe then compiles offline (on a GPU machine too)
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path), CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, str(PROBES / "multicast_probe.py")], capture_output=True, text=True,
                         env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {r["MC"]: r for r in (json.loads(ln) for ln in out.stdout.splitlines() if ln.startswith("{"))}
    assert rows[0]["compiled"] and rows[0]["rewritten"] == {} and rows[0]["lines"] == [], rows[0]
    assert rows[1]["compiled"], rows[1].get("error")
    # every 2-D TMA load (W's halves and A) in its multicast form, the mask picked by descriptor at run time
    assert rows[1]["rewritten"] == {"multicast": 9, "peer_arrive": 1, "entry_arrive": 0}
    assert any("mapa.shared::cluster" in ln for ln in rows[1]["lines"])


def test_fold_decode_variants_fit_the_real_shapes():
    """Every variant of the probe's ``fold_decode`` list names known knobs and divides both V4-Pro weights (L1: N =
    6144, K = 7168; L2: N = 7168, K = 3072), so none fails at launch on the GPU; the module's default is one of them
    (the GPU run measured it)."""
    import megamoe.fold_decode as fd

    probe = _load("ws_variants_probe")
    defaults = {key: getattr(fd, name) for key, name in probe.FOLD_DECODE_KNOBS.items()}
    seen = []
    for variant in probe.FOLD_DECODE_VARIANTS:
        with probe.fold_decode_variant(variant) as knobs:
            seen.append(knobs)
            for N, K in ((6144, 7168), (7168, 3072)):
                fd.launch_keywords(N, K)
    assert defaults in seen
    assert {key: getattr(fd, name) for key, name in probe.FOLD_DECODE_KNOBS.items()} == defaults  # restored


def _dry_run_probe(monkeypatch, tokens: int, intermediate: int):
    """``fp8_ws_probe`` set up for a dry run of its modes on one CPU rank: a small shape (H 256, ``intermediate``,
    4 experts, top-2), every mode at T = ``tokens``, each alternating sequence once, no timing (the bench's timers
    stubbed, two host-timed calls a row), no CUDA sync, and the Gluon kinds' GEMM phase run by its torch model (the
    CPU stand-in)."""
    import torch

    import megamoe.bench as bench
    import megamoe.fused as mf

    probe = _load("fp8_ws_probe")
    monkeypatch.setattr(probe, "SHAPE", dict(num_ranks=1, hidden=256, intermediate=intermediate, num_experts=4,
                                             num_topk=2, block_m=128))
    monkeypatch.setattr(probe, "_tokens", lambda default: [tokens])
    monkeypatch.setattr(probe, "_median_ms", lambda fn: 0.0)
    monkeypatch.setattr(bench, "_graph_us", lambda fn: 0.0)
    monkeypatch.setattr(bench, "HOST_TIMING_CALLS", 2)
    monkeypatch.setattr(probe, "ALTERNATIONS", 1)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(mf, "ws_unsupported_reason", lambda *a: None)  # the Gluon kinds' CPU stand-in
    return probe


@pytest.mark.slow
def test_fp8_ws_probe_threshold_and_host_modes_dry_run(monkeypatch, capsys):
    """The probe's ``threshold``, ``fp4_threshold``, ``host`` and ``pdl`` modes end to end on a CPU rank at a
    small shape (the fused kernel under the interpreter, the Gluon kinds' GEMM phase as its torch model; no CUDA
    graph, timings meaningless): every choice runs the tile kind it names, the result matches the reference within
    the FP8 MMA tolerance of the bench, the constants it overrides are restored, and each row carries the bench's
    timing fields -- so a bug in them costs no device call."""
    import json

    import megamoe.fused as mf

    probe = _dry_run_probe(monkeypatch, tokens=16, intermediate=128)
    monkeypatch.setattr(probe, "HOST_PROFILE_CALLS", 2)
    saved = {n: getattr(mf, n) for n in ("FP8_WS_MIN_EXPECTED", "FP8_SWAP_MAX_EXPECTED", "FP4_WS_MIN_EXPECTED",
                                         "FP4_BLOCK64_MAX_EXPECTED", "FP4_PREDECODE_MIN_EXPECTED")}
    probe.probe_threshold()
    probe.probe_fp4_threshold()
    monkeypatch.setattr(probe, "PREDECODE_FROM_T", 16)  # its predecode branch, at the same small T
    probe.probe_fp4_threshold()
    probe.probe_host()
    pdl = mf.WS_PDL
    probe.probe_pdl()
    assert {n: getattr(mf, n) for n in saved} == saved
    assert mf.WS_PDL == pdl
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    pdl_rows = [r for r in rows if r["probe"] == "pdl"]
    assert sorted((r["T"], r["kind"], r["choice"]) for r in pdl_rows) == sorted(
        (T, kind, c) for T, kind in ((16, "fp8_ws"), (16, "fp4_ws"), (8, "fp4_ws")) for c in ("pdl off", "pdl on"))
    by = {(r["probe"], r.get("choice", r.get("format"))): r for r in rows}
    assert [by["threshold", c]["kind"] for c in ("fp8_ws 64", "fp8_ws 128")] == ["fp8_ws", "fp8_ws"]
    assert [by["threshold", c]["block_m"] for c in ("fp8_ws 64", "fp8_ws 128")] == [64, 128]
    assert [(by["fp4_threshold", c]["kind"], by["fp4_threshold", c]["block_m"]) for c in ("fp4_ws 64", "fp4_ws 128")] \
        == [("fp4_ws", 64), ("fp4_ws", 128)]
    assert [by["fp4_threshold", c]["predecode"] for c in ("per-block decode", "predecoded")] == [False, True]
    for r in rows:
        if r["probe"] in ("threshold", "fp4_threshold"):
            assert r["rel_fro"] < 2e-2 and {"us", "graph_us", "host_us"} <= set(r), r
    hosts = [r for r in rows if r["probe"] == "host"]
    assert [r["format"] for r in hosts] == ["fp8", "fp8_fp4"] and all(r["host_us"] > 0 and r["top"] for r in hosts)


@pytest.mark.slow
def test_fp8_ws_probe_rs_ctas_dry_run(monkeypatch, capsys):
    """The probe's ``rs_ctas`` mode on a CPU rank at a small shape (as the test above): at each T it runs the tile as
    is and every candidate of the chunk that T takes (``megamoe.fused.FP4_RS_CANDIDATES``), ``ALTERNATIONS`` times,
    each row on the register-operand tile at that chunk and its candidate's pool block, within the bench's tolerance,
    and the constants it overrides are put back."""
    import json

    import megamoe.fused as mf

    probe = _dry_run_probe(monkeypatch, tokens=32, intermediate=128)  # 16 expected: chunk 32
    names = ("FP4_RS_ROWS", "FP4_RS_CTAS_PER_SM", "FP4_RS_PAIR", "FP4_RS_LOAD_REGS")
    saved = {n: dict(getattr(mf, n)) for n in names}
    probe.probe_rs_ctas()
    assert {n: getattr(mf, n) for n in names} == saved
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    want = [(32, label) for _ in range(probe.ALTERNATIONS) for label in ("as is", *mf.FP4_RS_CANDIDATES[32])]
    assert [(r["T"], r["choice"]) for r in rows] == want
    for r in rows:
        chunk = 32
        rows_ = mf.FP4_RS_CANDIDATES[chunk][r["choice"]][0] if r["choice"] != "as is" else mf.FP4_RS_ROWS[chunk]
        assert (r["kind"], r["rs_block_n"], r["block_m"]) == ("fp4_ws", chunk, 128 if rows_ == 128 else 64), r
        assert r["rel_fro"] < 2e-2, r


@pytest.mark.slow
def test_fp8_ws_probe_l2_per_block_dry_run(monkeypatch, capsys):
    """The probe's ``l2_per_block`` mode on a CPU rank at a small shape (as the tests above): both Hopper numerics
    alternating (``ALTERNATIONS`` times) at each T, plus the decode-partition tile at ``L2PB_FORCED_T``; each row on
    its tile and within the bench's tolerance of its own numerics' model, the overridden constant put back."""
    import json

    import megamoe.fused as mf

    probe = _dry_run_probe(monkeypatch, tokens=16, intermediate=256)  # 8 expected: the host's register-operand tile
    monkeypatch.setattr(probe, "L2PB_FORCED_T", 16)
    limit = mf.FP4_RS_MAX_EXPECTED
    probe.probe_l2_per_block()
    assert mf.FP4_RS_MAX_EXPECTED == limit
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    modes = ("hopper", "hopper_l2_per_block")
    passes = range(probe.ALTERNATIONS)
    want = [f"{n} host" for _ in passes for n in modes] + [f"{n} decode-partition" for _ in passes for n in modes]
    assert [r["choice"] for r in rows] == want
    for r in rows:
        assert r["numerics"] == r["choice"].split()[0] and r["kind"] == "fp4_ws" and r["rel_fro"] < 2e-2, r
        assert bool(r["rs_block_n"]) == r["choice"].endswith("host"), r


@pytest.mark.slow
def test_fp8_ws_probe_tiles_dry_run(monkeypatch, capsys):
    """The probe's ``tiles`` mode on a CPU rank at a small shape (as the tests above), its thresholds moved so that
    8 expected tokens take what T = 512 takes on V4-Pro (block 128, idle decode): each choice on its tile, both
    routings, in the default GPU numerics, within the bench's tolerance of that model, the constants put back."""
    import json

    import megamoe.fused as mf
    from megamoe.ops import AUTO_GPU_NUMERICS

    probe = _dry_run_probe(monkeypatch, tokens=16, intermediate=256)  # 8 expected tokens per expert
    monkeypatch.setattr(mf, "FP4_RS_MAX_EXPECTED", 4)
    monkeypatch.setattr(mf, "FP4_BLOCK64_MAX_EXPECTED", 4)
    idle = dict(mf.FP4_WS_IDLE_DECODE)
    probe.probe_tiles()
    assert (mf.FP4_RS_MAX_EXPECTED, mf.FP4_BLOCK64_MAX_EXPECTED, mf.FP4_WS_IDLE_DECODE) == (4, 4, idle)
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    labels = [label for label, _ in probe.TILE_CHOICES]
    assert [(r["routing"], r["choice"]) for r in rows] == [
        (routing, label) for routing in ("uniform", "skewed") for _ in range(probe.ALTERNATIONS) for label in labels]
    tile = {"as is": (128, True, 0), "idle decode off": (128, False, 0), "block 64": (64, False, 0)}
    for r in rows:
        assert r["numerics"] == AUTO_GPU_NUMERICS and r["kind"] == "fp4_ws" and r["rel_fro"] < 2e-2, r
        if r["choice"] in tile:
            assert (r["block_m"], r["idle_decode"], r["rs_block_n"]) == tile[r["choice"]], r
        else:
            assert r["rs_block_n"] > 0, r  # (its chunk from the expected count: 16 here, 64 at T = 512)


def test_device_run_script_parses_and_defines_every_step_it_lists():
    """``results/probes/device_run.sh`` (run only on the device machine): bash parses it, and every step its header
    lists has its ``step_<name>`` function (a typo would surface only after a machine start)."""
    import re
    import subprocess

    path = PROBES / "device_run.sh"
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    text = path.read_text()
    header = text.split("set -u", 1)[0]
    listed = re.findall(r"^#   (\w+) ", header, flags=re.M)
    defined = set(re.findall(r"^step_(\w+)\(\)", text, flags=re.M))
    assert {"install", "probes", "gputests", "layer_fp8", "layer"} <= set(listed)
    assert set(listed) == defined, (listed, defined)


def test_ws_profile_splits_launches_by_position_and_refuses_uneven_calls():
    """``fused_fp8_ws_profile.launch_split`` (GPU-only probe, its arithmetic checked here): two calls of three
    launches given out of order -> per position the median duration, the gaps and the span; calls whose launches
    differ, or a count that does not split, raise instead of mixing launches up."""
    probe = _load("fused_fp8_ws_profile")
    call = [(0.0, 20.0, "front"), (25.0, 785.0, "gemm"), (790.0, 808.0, "back")]
    kernels = [(s + off, e + off, n) for off in (1000.0, 0.0) for s, e, n in call]
    kernels[0] = (1000.0, 1022.0, "front")  # the second call's front 2 us longer
    out = probe.launch_split(kernels, 2)
    assert out["launches"] == [("front", 21.0), ("gemm", 760.0), ("back", 18.0)]
    assert out["gaps_us"] == [4.0, 5.0] and out["span_us"] == 808.0
    assert out["kernels_us"] == {"front": 21.0, "gemm": 760.0, "back": 18.0}
    with pytest.raises(ValueError, match="do not split"):
        probe.launch_split(kernels[:-1], 2)
    with pytest.raises(ValueError, match="differ"):
        probe.launch_split(kernels[:-1] + [(1790.0, 1808.0, "other")], 2)


def test_fp4_rs_probe_model_is_the_library_fold():
    """The register-operand FP4 probe checks its kernel against its own torch decode (``decoded_weights``): that
    decode equals ``megamoe.quant.fold_scales`` of the untransformed weights, so a passing GPU row means the
    kernel computed the ``hopper`` numerics' operands."""
    import torch

    from megamoe.quant import _unrepack_nibbles, e2m1_decode, fold_lut, fold_scales, pack_ue8m0, unpack_nibbles

    probe = _load("fp4_rs_probe")
    g = torch.Generator().manual_seed(3)
    N, K = 8, 256
    packed = torch.randint(0, 256, (N, K // 2), generator=g, dtype=torch.uint8)
    sf = torch.randint(100, 131, (N, K // 32), generator=g, dtype=torch.int32)  # shifts up to 30: the table's clamp
    rmax = sf.amax(dim=1)
    got = probe.decoded_weights(packed, sf, rmax, fold_lut())
    values = e2m1_decode(unpack_nibbles(_unrepack_nibbles(packed.view(torch.int8))))
    scales = torch.pow(2.0, (sf - 127).float())
    folded, row = fold_scales(values, pack_ue8m0(scales))
    assert torch.equal(row, rmax)
    assert torch.equal(got, folded.float())
    assert not torch.equal(probe.decoded_weights(packed, sf, rmax - 1, fold_lut()), got)  # the check can fail


def test_fp4_rs_probe_model_is_the_table_asm():
    """The library's table decode (``_PRMT_LUT_ASM``, the Gluon kernels' and this probe's), run by
    ``megamoe.inline_asm`` on every word of random weights with the kernel's per-(row, 32-group) tables, gives the
    bytes of the probe's torch model -- so a GPU row is checked against the right model."""
    import numpy as np
    import torch

    from megamoe.inline_asm import run
    from megamoe.kernels.numerics import _PRMT_LUT_ASM
    from megamoe.quant import FOLD_LUT_MAX_SHIFT, fold_lut

    probe = _load("fp4_rs_probe")
    g = torch.Generator().manual_seed(5)
    N, K = 4, 256
    packed = torch.randint(0, 256, (N, K // 2), generator=g, dtype=torch.uint8)
    sf = torch.randint(110, 128, (N, K // 32), generator=g, dtype=torch.int32)
    rmax = sf.amax(dim=1)
    lut = fold_lut()
    want = probe.decoded_weights(packed, sf, rmax, lut).to(torch.float8_e4m3fn).view(torch.uint8)
    words = packed.view(torch.int32).numpy().view(np.uint32)  # [N, K/8], little-endian
    table = lut.numpy().view(np.uint32).reshape(-1, 2)
    widx = np.arange(K // 8)
    blk, c, j = widx // 16, (widx % 16) // 8, widx % 8
    gA, gB = blk * 4 + 2 * c, blk * 4 + 2 * c + 1  # the 32-groups of the word's A and B values
    shift = np.minimum(rmax.numpy()[:, None, None] - sf.numpy()[:, np.stack([gA, gB])].transpose(0, 1, 2),
                       FOLD_LUT_MAX_SHIFT).transpose(1, 0, 2)  # [2, N, K/8]
    tA, tB = table[shift[0]], table[shift[1]]
    out = run(_PRMT_LUT_ASM.value, {2: words, 3: tA[..., 0], 7: tA[..., 1], 11: tB[..., 0], 15: tB[..., 1]})
    got = np.zeros((N, K), np.uint8)
    for half, reg in ((0, out[0]), (1, out[1])):
        for i in range(4):
            got[:, blk * 128 + 64 * c + 32 * half + 4 * j + i] = (reg >> (8 * i)) & 0xFF
    assert np.array_equal(got, want.numpy())
    assert not np.array_equal(got, probe.decoded_weights(packed, sf, rmax - 1, lut).to(
        torch.float8_e4m3fn).view(torch.uint8).numpy())  # the check can fail


def test_stage_profile_patches_apply_once_and_parse():
    """The clock-profile copy of the FP8 x FP4 Gluon phase (``stage_profile_probe.py``) still patches this checkout's
    kernel: every anchor once, the result valid Python with the counters' address substituted."""
    probe = _load("stage_profile_probe")
    src = probe.patched_source(1 << 40)
    assert probe.ADDR not in src and str(1 << 40) in src
    assert src.count("_clk()") > 20
    ast.parse(src)


def test_fp8_stage_profile_patches_apply_once_and_summarize():
    """The clock-profile copy of the FP8 Gluon phase (``stage_profile_probe.py fp8``) still patches this checkout's
    kernel (every anchor once, valid Python, the counters' address substituted), and its summary divides each
    counter by the right count: a CTA's made-up counters give the shares and per-stage cycles worked out by hand,
    and a CTA that ran no tile is left out."""
    import torch

    probe = _load("stage_profile_probe")
    src = probe.fp8_patched_source(1 << 40)
    assert probe.ADDR not in src and str(1 << 40) in src and src.count("_clk()") > 20
    ast.parse(src)
    prof = torch.zeros(3, probe.PER_CTA, dtype=torch.int64)
    S = probe.FP8_SLOTS
    for wg in (0, 1):  # 2 L1 tiles of 10 stages in 600 cycles (100 waiting, 50 in epilogues), 1 L2 tile in 300
        for name, v in dict(total=1000, tiles1=2, stages1=10, tile1=600, wait1=100, epi1=50, tiles2=1, stages2=4,
                            tile2=300, wait2=20, epi2=40, pass_=0, first1=60, first2=0, epi2_copy=30,
                            epi2_wait=7, epi1_store=16).items():
            prof[:2, S[f"m{wg}_{name.rstrip('_')}"]] = v
    prof[:2, S["load_tiles"]], prof[:2, S["load_total"]], prof[:2, S["load_empty"]] = 3, 1000, 900
    prof[:2, S["copy_tiles"]], prof[:2, S["copy_issue"]], prof[:2, S["copy_drain"]] = 4, 1000, 70
    out = probe.summarize_fp8(prof)
    assert out["ctas"] == 2
    m = out["math1"]
    assert (m["l1_tile"], m["l1_wait_per_tile"], m["l1_epi_per_tile"], m["l1_mma_per_stage"]) == (300, 50, 25, 45)
    assert m["l1_first_wait_per_tile"] == 30 and (m["l2_epi_copy_per_tile"], m["l2_epi_cvt_per_tile"]) == (30, 0)
    # the staged epilogue's wait for free rows beside, not over, the tile's ready waits (one key each)
    assert (m["l2_wait_per_tile"], m["l2_epi_wait_per_tile"]) == (20, 7)
    assert (m["l1_epi_store_per_tile"], m["l1_epi_quant_per_tile"]) == (8, 0)  # (per L1 tile: 2 of them)
    assert (m["l2_mma_per_stage"], m["l1_share"], m["l2_epi_share"], m["outside_tiles_share"]) == (60, 0.6, 0.04, 0.1)
    assert out["loader"]["empty_per_tile"] == 300 and out["loader"]["empty_share"] == 0.9
    assert (out["copier"]["issue_per_tile"], out["copier"]["wait_per_tile"], out["copier"]["drain"]) == (250, 0, 70)
    assert len(set(S.values())) == len(S) and max(S.values()) < probe.PER_CTA  # (no two counters in one slot)


def _bound_names(text: str) -> set:
    """The names a piece of Python source assigns (``x = ...``, ``x += ...``, ``a, b = ...``) at a line's start."""
    names = set()
    for m in re.finditer(r"^\s*([A-Za-z_]\w*(?:\s*,\s*[A-Za-z_]\w*)*)\s*\+?=[^=]", text, re.M):
        names.update(re.split(r"\s*,\s*", m.group(1)))
    return names - {"_"}


def test_fp8_stage_profile_patches_bind_no_name_of_the_kernel():
    """Each clock patch of the FP8 profile binds only names new to the kernel function it patches: session 50's
    profile under ``FP8_WS_COPIER`` hung because its tile count ``n2`` was also the math partition's count of staged
    L2 tiles (the handshake's parity), stepped twice a tile. The check can fail: the kernel's own ``n2`` is found."""
    probe = _load("stage_profile_probe")
    src = pathlib.Path(importlib.import_module("megamoe.kernels.gemm_fp8_ws").__file__).read_text()

    def function_at(anchor: str) -> str:
        at = src.index(anchor)
        start = src.rindex("\ndef ", 0, at)
        end = src.find("\n@gluon.jit", at)
        return src[start:end if end >= 0 else len(src)]

    patched = 0
    for old, new in probe.FP8_PATCHES:
        if "def " in new:  # (the helpers' definitions)
            continue
        body = set(re.findall(r"\b[A-Za-z_]\w*\b", function_at(old)))
        clash = (_bound_names(new) - _bound_names(old)) & body
        assert not clash, (old[:60], clash)
        patched += 1
    assert patched > 10
    assert {"n2"} & _bound_names("        n2 += 1\n") & set(re.findall(r"\w+", function_at(probe._M_LOOP)))
