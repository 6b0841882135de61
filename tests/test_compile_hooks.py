"""``megamoe.compile_hooks``: one stages hook a process, chained after an earlier one, wrapping the ``llir`` stage
with the TTGIR inspections and the ``ptx`` stage with the PTX passes, each stage once."""
from megamoe import compile_hooks


def test_one_hook_wraps_each_stage_once_and_keeps_an_earlier_hook(monkeypatch):
    from triton import knobs

    seen = []
    monkeypatch.setattr(knobs.runtime, "add_stages_inspection_hook", lambda *a: seen.append(a))
    monkeypatch.setattr(compile_hooks, "_PTX_PASSES", {})
    monkeypatch.setattr(compile_hooks, "_TTGIR_INSPECTIONS", {})
    inspected = []
    compile_hooks.add_ttgir_inspection("look", lambda mod, md, opts, cap: inspected.append((mod, cap)))
    compile_hooks.add_ptx_pass("first", lambda ptx, md: ptx + " +first")
    compile_hooks.add_ptx_pass("second", lambda ptx, md: ptx + " +second")
    compile_hooks.install()
    hook = knobs.runtime.add_stages_inspection_hook
    calls = []
    stages = {"llir": lambda src, md: calls.append(("llir", src)) or "llvm",
              "ptx": lambda src, md: calls.append(("ptx", src)) or "ptx"}
    hook("backend", stages, "options", "language", 90)
    llir, ptx = stages["llir"], stages["ptx"]
    hook("backend", stages, "options", "language", 90)
    assert stages["llir"] is llir and stages["ptx"] is ptx and len(seen) == 2  # once; the earlier hook each time
    assert llir("ttgir module", {}) == "llvm" and inspected == [("ttgir module", 90)]
    assert ptx("llvm", {}) == "ptx +first +second"  # the passes in the order they were added
    assert calls == [("llir", "ttgir module"), ("ptx", "llvm")]
    compile_hooks.add_ptx_pass("first", lambda ptx, md: ptx + " +again")  # a name again: replaced in place
    assert ptx("llvm", {}) == "ptx +again +second"
