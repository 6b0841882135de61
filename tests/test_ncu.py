"""``megamoe.ncu``: the Nsight Compute text reports of ``results/probes/ncu_h200/`` read back as rows, and
``results/probes/ncu_h200.json`` being exactly what ``python -m megamoe.ncu`` makes from them; the same for the
SASS source pages (PC sampling) and ``results/probes/ncu_source_h200.json``."""
import gzip
import json
from pathlib import Path

import pytest

from megamoe.env import RESULTS_DIR
from megamoe.ncu import case_of, main, parse_details, parse_source, source_summary, summary

REPORTS = sorted((Path(RESULTS_DIR) / "probes" / "ncu_h200").glob("*.txt"))
SOURCES = sorted((Path(RESULTS_DIR) / "probes" / "ncu_h200").glob("*.sass.csv.gz"))


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


#: A source page's shape (two header lines, then one line an instruction; two reasons of the 18 kept): a partition
#: done early waiting at the join (the NOP of the TRY_ALLOC loop), a wgmma wait, and an mbarrier wait loop.
SOURCE_PAGE = """"Kernel Name","k",
"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",\
"Instructions Executed","stall_barrier","stall_long_sb","stall_barrier (Not Issued)"
"0x100","BAR.SYNC.DEFER_BLOCKING 0x1","1","1","10","1","0","1"
"0x110","NOP","60","60","10","60","0","60"
"0x120","USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0x50","","","10","","",""
"0x130","WARPGROUP.DEPBAR.LE gsb0, 0x0","30","25","99","30","0","25"
"0x140","SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [R2+UR4+0x34800], R3","1","1","99","0","1","0"
"0x150","@!P1  BRA 0x190","8","8","99","0","8","0"
"""


def test_a_source_page_reads_as_a_stall_ledger():
    """Every instruction with its samples and reasons (the "(Not Issued)" columns not double-counted); the
    partitions' join wait set apart; the rest by reason and opcode; a wait loop's branch named by its mbarrier."""
    rows = parse_source(SOURCE_PAGE)
    assert [r["address"] for r in rows] == [0x100, 0x110, 0x120, 0x130, 0x140, 0x150]
    assert rows[1]["reasons"] == {"barrier": 60.0, "long_sb": 0.0} and rows[2]["samples"] == 0.0
    s = source_summary(rows, top=3)
    assert s["samples"] == 100 and s["join_wait_pct"] == 60.0
    assert s["reasons_pct"] == {"barrier": 77.5, "long_sb": 22.5}
    assert s["opcodes_pct"] == {"WARPGROUP": 75.0, "BRA": 20.0, "BAR": 2.5, "SYNCS": 2.5}
    assert [(t["address"], t["pct"], t["reason"]) for t in s["top"]] == [("0x30", 75.0, "barrier"),
                                                                       ("0x50", 20.0, "long_sb"),
                                                                       ("0x0", 2.5, "barrier")]
    assert s["top"][1]["mbarrier"] == "R2+UR4+0x34800" and "mbarrier" not in s["top"][0]
    with pytest.raises(ValueError, match="Address"):
        parse_source("not a page")


def test_the_source_results_file_is_made_from_the_source_pages(tmp_path):
    committed = json.loads((Path(RESULTS_DIR) / "probes" / "ncu_source_h200.json").read_text())
    names = [Path(a).name for a in committed["provenance"]["command"].split()[4:]]
    assert sorted(names) == [p.name for p in SOURCES]
    out = tmp_path / "ncu_source.json"
    main([str(out)] + [str(Path(RESULTS_DIR) / "probes" / "ncu_h200" / n) for n in names])
    assert json.loads(out.read_text())["rows"] == committed["rows"]
    mixed = [str(REPORTS[0]), str(SOURCES[0])]
    with pytest.raises(SystemExit):
        main([str(tmp_path / "x.json"), *mixed])
    assert gzip.decompress(SOURCES[0].read_bytes()).startswith(b'"Kernel Name"')
