"""pyproject.toml and environment.yml list the same dependencies; kernels/ is installed as megamoe.kernels."""
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _name(req: str) -> str:
    return re.split(r"[<>=!~\[ ;]", req.strip(), maxsplit=1)[0].lower()


def _pyproject_requirements() -> dict[str, str]:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(meta["dependencies"])
    for extra in ("test", "notebook"):
        reqs += meta["optional-dependencies"][extra]
    return {_name(r): r.replace(" ", "") for r in reqs}


def _environment_pip_requirements() -> dict[str, str]:
    text = (ROOT / "environment.yml").read_text()
    pip_block = text.split("- pip:", 1)[1]
    reqs = [line.strip()[2:].strip() for line in pip_block.splitlines() if line.strip().startswith("- ")]
    return {_name(r): r.replace(" ", "") for r in reqs if not r.startswith("-e")}


def test_environment_yml_agrees_with_pyproject():
    assert _environment_pip_requirements() == _pyproject_requirements()


def test_gpu_extra_is_cupy_only_and_never_imported_on_cpu_paths():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert [_name(r) for r in meta["optional-dependencies"]["gpu"]] == ["cupy-cuda13x"]
    import megamoe.bench  # noqa: F401
    import megamoe.kernels.cupy_prims  # noqa: F401
    import megamoe.ops  # noqa: F401
    assert "cupy" not in sys.modules


def test_kernels_installed_as_subpackage():
    import megamoe.kernels
    assert Path(megamoe.kernels.__file__).resolve().parent == ROOT / "kernels"
    cuh = sorted(p.name for p in (ROOT / "kernels" / "cuda").glob("*.cuh"))
    assert cuh == ["barrier.cuh", "sym_buffer.cuh", "tma_pull.cuh"]
