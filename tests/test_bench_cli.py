"""``python -m megamoe.bench`` without a GPU: bad ``--tokens`` are refused by name before anything runs; a peer kit's
rows merge into a layer result; the host-time and graph-capture fields of a timed row."""
import argparse

import pytest

from megamoe import bench


def test_tokens_parse_and_refuse_bad_values():
    assert bench._token_list("512,2048,8192") == [512, 2048, 8192]
    for bad in ("8,x", "0", "", "-4"):
        with pytest.raises(argparse.ArgumentTypeError, match="--tokens"):
            bench._token_list(bad)


def test_tokens_only_for_the_layer_suites(capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--suite", "tune", "--tokens", "8"])
    assert exc.value.code == 2 and "--tokens applies to the layer suites" in capsys.readouterr().err
    assert set(bench.LAYER_SUITES) <= set(bench.SUITES)


def test_merge_peer_rows_adds_the_kits_rows_with_our_roofline(tmp_path):
    """A peer kit's rows join a layer result as ``deepgemm_sm90`` rows of the same routing, with the kit's
    kernel-alone time kept and the roofline of our same-T row; the kit's provenance is filed under ``peers``."""
    import json

    layer = {"config": {"format": "fp8"}, "rows": [
        {"impl": "staged", "num_tokens_per_rank": 8, "routing": "uniform", "flops": 1e9, "roofline_us": 250.0},
        {"impl": "staged", "num_tokens_per_rank": 8, "routing": "skewed", "flops": 1e9, "roofline_us": 999.0}]}
    peer = {"config": {"routing": "uniform"}, "provenance": {"gpu": "H200"},
            "rows": [{"T": 8, "us": 500.0, "kernel_us": 490.0, "pairs": 48, "tflops": 1.0, "rel_err": 0.02},
                     {"T": 64, "us": 700.0, "pairs": 384}]}
    lj, pj = tmp_path / "layer.json", tmp_path / "peer.json"
    lj.write_text(json.dumps(layer))
    pj.write_text(json.dumps(peer))
    bench.merge_peer_rows(lj, pj)
    out = json.loads(lj.read_text())
    added = [r for r in out["rows"] if r["impl"] == "deepgemm_sm90"]
    assert [(r["num_tokens_per_rank"], r["routing"], r["us"], r["kernel_us"]) for r in added] == [
        (8, "uniform", 500.0, 490.0), (64, "uniform", 700.0, None)]
    assert added[0]["roofline_pct"] == 50.0 and "roofline_pct" not in added[1]
    assert "the same format" in added[0]["note"]
    assert out["peers"]["deepgemm_sm90"]["provenance"] == {"gpu": "H200"}


def test_timing_fields_host_median_and_a_failed_capture_reported(monkeypatch):
    """``host_us`` is the median of the eager calls' host times (an outlier does not move it); a graph capture that
    raises is reported in the row as ``graph_error`` and the row keeps its other fields."""
    import time

    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda: None)
    delays = iter([0.05] + [0.002] * (bench.HOST_TIMING_CALLS - 1))
    out = bench._timing_fields(lambda: time.sleep(next(delays)), graph=False)
    assert set(out) == {"host_us"} and 2e3 <= out["host_us"] < 2e4, out
    calls = []  # the number of calls is read when timing, so that a dry run's smaller count takes effect
    monkeypatch.setattr(bench, "HOST_TIMING_CALLS", 3)
    bench._timing_fields(lambda: calls.append(1), graph=False)
    assert len(calls) == 3

    def refuse(fn):
        raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(bench, "_graph_us", refuse)
    out = bench._timing_fields(lambda: None, graph=True)
    assert "graph_us" not in out and out["graph_error"].startswith("RuntimeError: operation not permitted"), out
