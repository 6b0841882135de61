"""The notebooks: every one executes on CPU ranks without error, and the committed files are in order.

Execution: papermill runs each notebook into a temporary directory (the committed files are never touched) with
``world_size=2`` on CPU ranks, and once more with a parameter set of its own that changes what it shows
(:data:`STORY_PARAMETERS`: other rank counts, routings, masking, sizes -- so every parameter path is proven to run);
one of those sets (:data:`FOUR_RANKS`) runs four processes. Figures go to a temporary directory
through ``MEGAMOE_FIGURES_DIR``. The static checks read the committed notebooks: outputs present, no error outputs,
a ``parameters`` cell, a provenance line, no kernel code (see ``megamoe.notebooks.check_notebook``).
"""
import pytest

from megamoe import notebooks as nbs

# nbformat is imported inside the tests that use it: importing it takes ~4 s here (jsonschema's format checkers
# build their grammars), which every pytest process would otherwise pay while collecting, `make test`'s serial
# `-m alone` part included.

NOTEBOOKS = nbs.notebook_paths()
NAMES = [p.stem for p in NOTEBOOKS]
EXPECTED = ["00_overview", "01_symmetric_memory", "02_symbuffer_map", "03_pool_sizing", "04_dispatch_pull",
            "05_gemm_swiglu", "06_combine", "07_end_to_end", "08_fused_kernel"]
#: The notebook whose story parameter set runs four CPU ranks (one process per rank: launch, shm mapping, barriers,
#: e2e); its execution must report all four.
FOUR_RANKS = "06_combine"
#: Per notebook, a non-default parameter set that changes its story, executed once on CPU ranks (CI otherwise only
#: injects world_size and backend). Sized to cost about what the default run costs.
STORY_PARAMETERS = {
    "00_overview": {"world_size": 3, "num_experts": 12, "num_topk": 3},               # odd rank count, top-3
    "01_symmetric_memory": {"world_size": 1, "num_tokens": 16},                       # one rank: demos use a peer
    "02_symbuffer_map": {"world_size": 3, "num_experts": 6},                          # three processes, odd deltas
    "03_pool_sizing": {"world_size": 4, "block_m": 64},
    "04_dispatch_pull": {"routing": "one_expert", "num_tokens": 16},                  # worst-case pool on rank 0
    "05_gemm_swiglu": {"hidden": 512, "intermediate": 256, "num_topk": 4},            # two scale words per K row
    "06_combine": {"world_size": 4, "masked_ratio": 0.5, "num_topk": 4},              # 4 processes, half masked
    "07_end_to_end": {"grid_ranks": [2], "grid_topk": [3], "grid_tokens": 8},         # a different grid
    "08_fused_kernel": {"routing": "one_expert", "num_tokens": 16},                   # skew at its worst
}


def test_the_nine_notebooks_exist():
    assert NAMES == EXPECTED


@pytest.fixture
def figures_tmp(tmp_path, monkeypatch):
    """Figures written while a notebook runs go to a temporary folder (the kernel inherits the environment)."""
    out = tmp_path / "figures"
    monkeypatch.setenv("MEGAMOE_FIGURES_DIR", str(out))
    return out


def _execute(name: str, tmp_path, world_size: int = 2, **params):
    import nbformat
    src = nbs.NOTEBOOK_DIR / f"{name}.ipynb"
    before = src.read_bytes()
    out = tmp_path / f"{name}_ws{world_size}.ipynb"
    nbs.execute(src, out, parameters={"world_size": world_size, "backend": "cpu", **params}, cwd=tmp_path,
                timeout_s=600)
    assert src.read_bytes() == before, "executing must not modify the committed notebook"
    return nbformat.read(out, as_version=4)


def _errors(nb) -> list[str]:
    return [f"{o.get('ename')}: {o.get('evalue')}" for c in nb.cells if c.cell_type == "code"
            for o in c.get("outputs", []) if o.get("output_type") == "error"]


@pytest.mark.slow
@pytest.mark.parametrize("name", EXPECTED)
def test_notebook_executes_on_two_cpu_ranks(name, tmp_path, figures_tmp):
    nb = _execute(name, tmp_path, world_size=2)
    assert not _errors(nb)
    assert any(nbs.PROVENANCE_RE.search(nbs._outputs_text(c)) for c in nb.cells if c.cell_type == "code")
    injected = [c for c in nb.cells if "injected-parameters" in c.get("metadata", {}).get("tags", [])]
    assert injected and "world_size = 2" in injected[0].source
    if any(".show_figure(" in c.source for c in nb.cells if c.cell_type == "code"):
        assert list(figures_tmp.glob("*.png")) and list(figures_tmp.glob("*.svg"))


@pytest.mark.slow
@pytest.mark.parametrize("name", EXPECTED)
def test_notebook_executes_with_a_story_changing_parameter_set(name, tmp_path, figures_tmp):
    nb = _execute(name, tmp_path, **STORY_PARAMETERS[name])
    assert not _errors(nb)
    injected = [c for c in nb.cells if "injected-parameters" in c.get("metadata", {}).get("tags", [])][0].source
    values: dict = {}
    exec(injected, values)  # the cell papermill wrote: plain assignments
    assert {k: values[k] for k in STORY_PARAMETERS[name]} == STORY_PARAMETERS[name], injected
    if name == FOUR_RANKS:
        assert STORY_PARAMETERS[name]["world_size"] == 4
        text = "".join(nbs._outputs_text(c) for c in nb.cells if c.cell_type == "code")
        assert "all 4 ranks" in text


def test_story_parameters_exist_in_each_notebook():
    """Every notebook has a story parameter set, and each of its keys is a parameter of that notebook."""
    import nbformat
    assert sorted(STORY_PARAMETERS) == EXPECTED
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        params = next(c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])).source
        declared = {line.split("=")[0].strip() for line in params.splitlines() if "=" in line and
                    not line.lstrip().startswith("#")}
        assert set(STORY_PARAMETERS[path.stem]) <= declared, (path.stem, set(STORY_PARAMETERS[path.stem]) - declared)
        assert STORY_PARAMETERS[path.stem] != {"world_size": 2}


def test_run_cli_parses_params_and_writes_into_an_output_dir(tmp_path, monkeypatch):
    """``run --output-dir`` leaves the committed notebooks alone; ``--param`` values are literals or strings."""
    assert nbs.parse_params(["routing=one_expert", "masked_ratio=0.5", "grid_ranks=[1, 2]"]) == \
        {"routing": "one_expert", "masked_ratio": 0.5, "grid_ranks": [1, 2]}
    calls = []
    monkeypatch.setattr(nbs, "execute", lambda path, output=None, **kw: calls.append((path, output, kw)) or 0.0)
    record = nbs.run(["01"], world_size=2, backend="cpu", output_dir=tmp_path, extra_params={"num_tokens": 16})
    assert calls[0][1] == tmp_path / "01_symmetric_memory.ipynb"
    assert calls[0][2]["parameters"] == {"world_size": 2, "backend": "cpu", "num_tokens": 16}
    assert (tmp_path / f"notebook_times_{nbs.device_tag()}.json").exists() and not record.get("failed")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=NAMES)
def test_committed_notebook_is_executed_clean_and_has_provenance(path):
    assert nbs.check_notebook(path) == []


@pytest.mark.parametrize("path", NOTEBOOKS, ids=NAMES)
def test_committed_notebook_structure(path):
    import nbformat
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    params = [c for c in code if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(params) == 1
    for key in ("backend", "world_size", "hidden", "intermediate", "num_experts", "num_tokens", "num_topk"):
        assert f"{key} =" in params[0].source, key
    assert nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith("# ")
    for c in code:
        assert "@triton.jit" not in c.source and "triton.language" not in c.source
    # megamoe is imported before anything that imports triton
    first_import = next(c for c in code if "import" in c.source)
    assert first_import.source.lstrip().startswith("import megamoe")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=NAMES)
def test_committed_notebook_is_small(path):
    """Every committed notebook, outputs included, stays under the limit (figures embed compact PNGs)."""
    assert path.stat().st_size <= nbs.MAX_NOTEBOOK_BYTES, f"{path.name}: {path.stat().st_size:,} bytes"


def test_check_flags_problems(tmp_path):
    import nbformat
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("@triton.jit\ndef k(x):\n    pass")
    cell.outputs = [nbformat.v4.new_output("error", ename="ValueError", evalue="boom", traceback=[])]
    nb.cells = [cell]
    cell.outputs.append(nbformat.v4.new_output("display_data", data={"image/png": "A" * nbs.MAX_NOTEBOOK_BYTES}))
    path = tmp_path / "00_bad.ipynb"
    nbformat.write(nb, path)
    problems = " | ".join(nbs.check_notebook(path))
    for expected in ("parameters", "error output", "kernel code", "provenance", "never executed", "limit"):
        assert expected in problems, problems


def test_notebook_names_resolve():
    assert [p.stem for p in nbs.notebook_paths(["03", "05_gemm_swiglu.ipynb"])] == ["03_pool_sizing",
                                                                                  "05_gemm_swiglu"]
    with pytest.raises(ValueError, match="no notebook"):
        nbs.notebook_paths(["99"])


def test_freshness_check_flags_outputs_made_from_changed_results(tmp_path, monkeypatch):
    """A notebook output records ``read results/x.json sha256:<h>``; changing the file makes it stale, an output
    without any record (from a notebook whose code reads results) is stale too, and a matching one passes."""
    import nbformat

    from megamoe import figures

    monkeypatch.setenv("MEGAMOE_RESULTS_DIR", str(tmp_path))
    (tmp_path / "x.json").write_text('{"rows": []}')

    def notebook(text: str, source: str = "figures.load_results('x')"):
        nb = nbformat.v4.new_notebook()
        cell = nbformat.v4.new_code_cell(source)
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=text)]
        nb.cells = [cell]
        return nb

    line = f"read results/x.json sha256:{figures.results_sha(tmp_path / 'x.json')}\n"
    assert nbs.freshness_problems(notebook(line)) == []
    assert any("record none" in p for p in nbs.freshness_problems(notebook("no record\n")))
    (tmp_path / "x.json").write_text('{"rows": [1]}')
    assert any("changed since" in p for p in nbs.freshness_problems(notebook(line)))
    (tmp_path / "x.json").unlink()
    assert any("no longer exists" in p for p in nbs.freshness_problems(notebook(line)))
    assert nbs.freshness_problems(notebook("no record\n", source="print(1)")) == []


def test_freshness_check_covers_jsonl_results(tmp_path, monkeypatch):
    """Probe files are JSON lines (``results/probes/*.jsonl``): their read records are checked like ``.json`` ones
    (the pattern once stopped at ``.json``, so a changed probe file never made a notebook stale)."""
    import nbformat

    from megamoe import figures

    monkeypatch.setenv("MEGAMOE_RESULTS_DIR", str(tmp_path))
    (tmp_path / "probes").mkdir()
    path = tmp_path / "probes" / "p_h200.jsonl"
    path.write_text('{"probe": "a"}\n')
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("figures.load_results('probes/p_h200')")
    record = f"read results/probes/p_h200.jsonl sha256:{figures.results_sha(path)}\n"
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=record)]
    nb.cells = [cell]
    assert nbs.freshness_problems(nb) == []
    path.write_text('{"probe": "a"}\n{"probe": "b"}\n')
    assert any("p_h200.jsonl changed since" in p for p in nbs.freshness_problems(nb))
