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
    assert set(probe.PATCHES) >= {"noskip", "nomma", "nopromote", "noepi", "noa", "now"}
    original = pathlib.Path(probe.AS_IS.__file__).read_text()
    for variant in probe.PATCHES:
        src = probe.patched_source(variant)  # asserts each old text occurs exactly once
        assert src != original
        ast.parse(src)
