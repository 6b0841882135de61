"""``python -m megamoe.bench``'s command line, checked without a GPU: bad ``--tokens`` are refused by name before
anything runs."""
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
