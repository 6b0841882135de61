"""``megamoe.ncu``: the Nsight Compute text reports of ``results/probes/ncu_h200/`` read back as rows, and
``results/probes/ncu_h200.json`` being exactly what ``python -m megamoe.ncu`` makes from them."""
import json
from pathlib import Path

import pytest

from megamoe.env import RESULTS_DIR
from megamoe.ncu import case_of, main, parse_details, summary

REPORTS = sorted((Path(RESULTS_DIR) / "probes" / "ncu_h200").glob("*.txt"))


def test_a_report_reads_as_its_launches_with_every_section():
    path = Path(RESULTS_DIR) / "probes" / "ncu_h200" / "fp8_fp4_128_193bd42.txt"
    launches = parse_details(path.read_text())
    assert [x["kernel"] for x in launches] == ["fused_mega_moe_kernel", "fp4_rs_gemm_phase_kernel",
                                               "fused_mega_moe_kernel"]  # front, GEMM phase, back
    phase = launches[1]
    assert phase["grid"] == [528, 1, 1] and phase["block"] == [256, 1, 1]  # 4 CTAs an SM of 132
    assert {"GPU Speed Of Light Throughput", "Memory Workload Analysis", "Warp State Statistics", "Occupancy",
            "Command line profiler metrics"} <= set(phase["sections"])
    sol = phase["sections"]["GPU Speed Of Light Throughput"]
    # thousands commas gone, units off, and a value one space from its unit ("hz 1,755,653,743.54") still read
    assert sol["Elapsed Cycles"] == 1177238 and sol["Duration"] == 668672 and round(sol["SM Frequency"]) == 1755653744
    assert phase["sections"]["Memory Workload Analysis"]["Local Memory Spilling Request Overhead"] == "no data"
    s = summary(phase)
    assert (s["us"], s["sm_mhz"], s["l2_pct"], s["dram_pct"]) == (668.672, 1756, 83.76, 55.04)
    assert list(s["stalls"])[0] == "barrier" and len(s["stalls"]) == 19  # every reason, largest first
    assert list(s["stalls"].values()) == sorted(s["stalls"].values(), reverse=True)
    assert case_of(path) == {"format": "fp8_fp4", "num_tokens_per_rank": 128, "commit": "193bd42"}


def test_the_results_file_is_made_from_the_reports(tmp_path):
    committed = json.loads((Path(RESULTS_DIR) / "probes" / "ncu_h200.json").read_text())
    names = [Path(a).name for a in committed["provenance"]["command"].split()[4:]]
    assert sorted(names) == [p.name for p in REPORTS]  # every report, nothing else
    out = tmp_path / "ncu.json"
    main([str(out)] + [str(Path(RESULTS_DIR) / "probes" / "ncu_h200" / n) for n in names])
    assert json.loads(out.read_text())["rows"] == committed["rows"]


def test_main_names_a_bad_argument_and_writes_nothing(tmp_path, capsys):
    """``--help`` prints the usage (it once became the output file's name); a missing report list or an output
    path that is not JSON is an error naming the argument, before anything is read or written."""
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0 and "usage: python -m megamoe.ncu" in capsys.readouterr().out
    for argv, name in (([str(tmp_path / "out.json")], "reports"),
                       ([str(tmp_path / "x.txt"), str(tmp_path / "fp8_8_abcdef0.txt")], "out")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and name in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
