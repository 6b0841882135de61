"""megamoe.process_ranks: the notebooks' process stories run one process per rank and say where."""
from megamoe import process_ranks


def test_process_backend_and_provenance():
    assert [process_ranks.process_backend(b) for b in ("cuda", "local", "cpu")] == ["cuda", "cpu", "cpu"]
    line = process_ranks.provenance([{"pid": 11, "device": "cpu"}, {"pid": 12, "device": "cpu"}], "cpu", "local")
    assert "2 ranks in 2 processes (pids 11, 12)" in line and "'local' ranks" in line and "interpreter" in line
    assert "rest of this notebook" not in process_ranks.provenance([{"pid": 1}], "cpu", "cpu")
