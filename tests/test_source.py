"""megamoe.source: the notebooks show kernel source read from the package, cut at marker lines that must exist."""
import pytest

from megamoe import source
from megamoe.kernels import gemm, pool


def test_text_unwraps_triton_kernels_and_excerpt_cuts_at_markers():
    full = source.text(pool.interleaved_position)
    assert full.startswith("@triton.jit\ndef interleaved_position(")
    epilogue = source.excerpt(source.text(gemm.l1_tile), start="# epilogue", end="tl.store(out_sf")
    assert epilogue.startswith("# epilogue") and epilogue.rstrip().endswith("mask=mask_m[:, None])")
    assert source.location(gemm.l1_tile).startswith("kernels/gemm.py:")
    with pytest.raises(ValueError, match="not found"):
        source.excerpt(full, start="no such line")


def test_cuda_sources_and_show(capsys):
    assert "cp.async.bulk" in source.cuda_text("tma_pull.cuh")
    assert "mbarrier_wait(&full[s]" in source.cuda_text("cupy_prims")
    source.show_cuda("tma_pull.cuh", start="void tma_load_1d", end="}")
    source.show(pool.interleaved_position)
    out = capsys.readouterr().out
    assert "```cpp" in out and "kernels/cuda/tma_pull.cuh:" in out and "kernels/pool.py:" in out
