"""`make test-gpu`: every notebook executed on the GPU(s) with world_size = number of GPUs (4 local ranks on one GPU),
into a temporary folder (committed notebooks untouched), failing on any error."""
import pytest

nbformat = pytest.importorskip(
    "nbformat", reason="the notebook run needs papermill + nbformat (carry .whl; results/probes/device_run.sh install)")

from megamoe import notebooks as nbs  # noqa: E402


@pytest.mark.parametrize("name", [p.stem for p in nbs.notebook_paths()])
def test_notebook_executes_on_gpu(name, tmp_path, monkeypatch):
    monkeypatch.setenv("MEGAMOE_FIGURES_DIR", str(tmp_path / "figures"))
    src = nbs.notebook_paths([name])[0]
    out = tmp_path / src.name
    nbs.execute(src, out, parameters={"world_size": nbs.default_world_size(), "backend": "auto"}, cwd=tmp_path)
    nb = nbformat.read(out, as_version=4)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors, errors
