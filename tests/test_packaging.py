"""pyproject.toml is the one list of dependencies: environment.yml installs the package with its extras, the extras
cover what the package, the tests and the notebooks import; kernels/ is installed as megamoe.kernels."""
import ast
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parent.parent
EXTRAS = ("test", "notebook")  # what `make setup` and environment.yml install (plus "gpu" where there is a GPU)
#: Imported modules that no installed distribution provides on a CPU machine, by the distribution that does.
NOT_INSTALLED_HERE = {"cupy": "cupy-cuda13x"}
LOCAL_MODULES = {"megamoe", "rank_fns", "conftest"}


def _name(req: str) -> str:
    return re.split(r"[<>=!~\[ ;]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _declared(*extras: str) -> set[str]:
    meta = _project()
    reqs = list(meta["dependencies"]) + [r for e in extras for r in meta["optional-dependencies"][e]]
    return {_name(r) for r in reqs}


def _imported_modules(paths) -> set[str]:
    """Top-level names of every absolute import in ``paths`` (.py files and notebooks' code cells)."""
    mods = set()
    for p in paths:
        if p.suffix == ".ipynb":
            cells = [c for c in json.loads(p.read_text())["cells"] if c["cell_type"] == "code"]
            sources = ["\n".join(line for line in "".join(c["source"]).splitlines()
                                 if not line.lstrip().startswith(("%", "!"))) for c in cells]
        else:
            sources = [p.read_text()]
        for src in sources:
            for node in ast.walk(ast.parse(src)):
                if isinstance(node, ast.Import):
                    mods |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    mods.add(node.module.split(".")[0])
    return mods - set(sys.stdlib_module_names) - LOCAL_MODULES


def _undeclared(paths, declared: set[str]) -> dict[str, list[str]]:
    providers = importlib.metadata.packages_distributions()
    missing = {}
    for mod in sorted(_imported_modules(paths)):
        dists = [_name(d) for d in providers.get(mod, [])] or [NOT_INSTALLED_HERE.get(mod, f"<unknown: {mod}>")]
        if not declared & set(dists):
            missing[mod] = dists
    return missing


def test_environment_yml_installs_the_package_with_its_extras():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    conda = [d for d in env["dependencies"] if isinstance(d, str)]
    pip = [d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d]
    assert "pip" in conda
    python = [d for d in conda if re.fullmatch(r"python([<>=!~].*)?", d)]
    assert len(python) == 1, conda
    major_minor = tuple(map(int, re.search(r"(\d+)\.(\d+)", python[0]).groups()))
    assert major_minor >= tuple(map(int, re.search(r"(\d+)\.(\d+)", _project()["requires-python"]).groups()))
    assert pip == [[f'-e ".[{",".join(EXTRAS)}]"']]  # no second list of dependencies to keep in agreement
    assert f"-e '.[{','.join(EXTRAS)}" in (ROOT / "Makefile").read_text()  # `make setup` installs the same extras


def test_tests_and_notebooks_import_only_declared_distributions():
    declared = _declared(*EXTRAS)
    assert _undeclared(ROOT.glob("tests/**/*.py"), declared) == {}
    notebooks = sorted(ROOT.glob("notebooks/*.ipynb"))
    assert notebooks
    assert _undeclared(notebooks, declared) == {}


def test_package_imports_only_declared_distributions():
    """megamoe and megamoe.kernels: the core dependencies, plus the extras' packages they import lazily (cupy: gpu;
    papermill, nbformat, IPython: notebook)."""
    sources = [*ROOT.glob("megamoe/**/*.py"), *ROOT.glob("kernels/*.py")]
    assert _undeclared(sources, _declared(*EXTRAS, "gpu")) == {}


def test_gpu_extra_is_cupy_only_and_never_imported_on_cpu_paths():
    assert [_name(r) for r in _project()["optional-dependencies"]["gpu"]] == ["cupy-cuda13x"]
    import megamoe.bench  # noqa: F401
    import megamoe.kernels.cupy_prims  # noqa: F401
    import megamoe.ops  # noqa: F401
    assert "cupy" not in sys.modules


def test_kernels_installed_as_subpackage():
    import megamoe.kernels
    assert Path(megamoe.kernels.__file__).resolve().parent == ROOT / "kernels"
    cuh = sorted(p.name for p in (ROOT / "kernels" / "cuda").glob("*.cuh"))
    assert cuh == ["barrier.cuh", "sym_buffer.cuh", "tma_pull.cuh"]


def test_every_subpackage_is_installed():
    """pyproject lists its packages by hand: every folder of megamoe with an ``__init__.py`` must be among them."""
    found = {"megamoe", "megamoe.kernels"} | {
        "megamoe." + ".".join(p.parent.relative_to(ROOT / "megamoe").parts)
        for p in (ROOT / "megamoe").glob("*/**/__init__.py")}
    assert set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]) == found


@pytest.mark.slow  # two fresh interpreters importing torch
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter switch only matters without CUDA")
def test_triton_imported_before_megamoe():
    """Without CUDA: megamoe's host modules work when triton was imported first; its kernels refuse with the fix
    (``megamoe.env``); with TRITON_INTERPRET=1 set beforehand the kernels work after triton too."""
    def run(code: str, **env) -> subprocess.CompletedProcess:
        environ = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | env
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environ,
                              cwd=ROOT, timeout=120)

    host = run("import triton, megamoe, sys; from megamoe import figures, layout, quant, reference, sim, testing; "
               "assert 'megamoe.kernels' not in sys.modules; print(megamoe.describe_environment())\n"
               "try:\n    import megamoe.kernels\nexcept ImportError as e:\n    print('refused:', e)")
    assert host.returncode == 0, host.stderr
    assert "refused: " in host.stdout and "import megamoe before triton, or set TRITON_INTERPRET=1" in host.stdout
    preset = run("import triton, torch; from megamoe.kernels.pool import pool_schedule; "
                 "print(pool_schedule(torch.tensor([[3, 5]]), 4)[1].tolist())", TRITON_INTERPRET="1")
    assert preset.returncode == 0 and preset.stdout.strip() == "[1, 2]", preset.stderr


def test_cupy_kernels_source_is_the_file_next_to_the_headers():
    """The CUDA translation unit CuPy compiles is read from ``kernels/cuda/cupy_kernels.cu`` (installed as package
    data), with every ``extern "C"`` kernel the launchers look up and a hash of the headers (CuPy's cache key)."""
    from megamoe.kernels import cupy_prims

    source = cupy_prims.kernel_source()
    assert source.startswith((ROOT / "kernels" / "cuda" / "cupy_kernels.cu").read_text())
    assert all(f"\n{name}(" in source for name in cupy_prims.KERNEL_NAMES)
    assert all(f'#include "{h}"' in source for h in cupy_prims.HEADERS) and "// headers sha1 " in source
    assert "cuda/*.cu" in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "megamoe.kernels"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's patch only exists without CUDA")
def test_interpreter_patches_triton_language_once_per_launch():
    """``megamoe.env.patch_language_once_per_launch`` (installed by ``megamoe.kernels``): the layer (kernels with
    device functions) matches the reference bit for bit with it and with Triton's own re-patching, and after each
    launch ``triton.language`` is Triton's own again (the launch's patch is restored as before)."""
    import triton.language as tl
    from triton.runtime import interpreter

    from megamoe.cases import MoECase, run_case_local
    from megamoe.env import patch_language_once_per_launch

    assert patch_language_once_per_launch() and interpreter._patch_lang._megamoe_once

    def bitwise_equal_to_reference() -> bool:
        case = MoECase(num_ranks=1, num_tokens=8, num_experts=2, num_topk=1, seed=3)
        return all(r["bitwise_equal"] for r in run_case_local(case))

    def language_is_tritons_own() -> bool:
        return all(tl.core.is_builtin(f) for f in (tl.load, tl.math.exp, tl.core.tensor.__add__,
                                                   tl.core.tensor_descriptor_base.load))

    assert bitwise_equal_to_reference() and language_is_tritons_own()
    once = interpreter._patch_lang
    interpreter._patch_lang = once.__wrapped__  # Triton's own: a re-patch on every device-function call
    try:
        assert bitwise_equal_to_reference() and language_is_tritons_own()
    finally:
        interpreter._patch_lang = once
