"""The probes of ``results/probes/`` that patch kernel text still apply to the kernels of this checkout (they run only
on a GPU, where a stale patch would cost a device call to find out)."""
import ast
import importlib.util
import pathlib

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
    assert set(probe.PATCHES) >= {"noskip", "nomma", "nopromote", "noepi", "noa", "now", "swcvt", "uncoalesced"}
    original = pathlib.Path(probe.AS_IS.__file__).read_text()
    for variant in probe.PATCHES:
        src = probe.patched_source(variant)  # asserts each old text occurs exactly once
        assert src != original
        ast.parse(src)
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
