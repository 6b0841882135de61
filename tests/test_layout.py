"""megamoe.layout: pool formulas (the seed's example), segment order/alignment, views, validation."""
import pytest
import torch

from megamoe.kernels.pool import pool_schedule
from megamoe.layout import SEGMENT_ALIGNMENT, Layout, get_num_max_pool_tokens, get_num_padded_sf_pool_tokens

SEED = dict(num_ranks=8, num_max_tokens_per_rank=8192, num_topk=6, num_experts_per_rank=48, block_m=192)


def test_seed_example_pool_formula():
    # DeepGEMM's formula: align(R*T*min(k, El) + El*(block_m - 1), block_m)
    assert get_num_max_pool_tokens(**SEED) == 402_432
    assert get_num_padded_sf_pool_tokens(402_432, 192) == 536_576   # 2,096 blocks of 256 (192 aligned to 128)


def _pool_rows(recv_count: list[list[int]], block_m: int) -> int:
    """Pool rows the kernels' schedule uses for ``recv_count`` [R][El]: the end of the last expert's blocks."""
    n, blocks, first = pool_schedule(torch.tensor(recv_count, dtype=torch.int64), block_m)
    return int(first[-1] + blocks[-1] * block_m)


def test_seed_stated_numbers_are_one_block_of_padding_and_too_small():
    # The seed note states 393,408 / 524,544 for the same inputs. Its SF number follows from its pool number ...
    assert get_num_padded_sf_pool_tokens(393_408, 192) == 524_544
    # ... but 393,408 rows hold R*T*k pairs plus one block: only El*(block_m-1) rows of padding are a true worst
    # case. Even perfectly uniform routing (8 ranks send 1,024 pairs to each of the 48 experts) overflows it:
    uniform_rows = _pool_rows([[1024] * 48] * 8, 192)
    assert uniform_rows > 393_408
    assert uniform_rows <= get_num_max_pool_tokens(**SEED)


@pytest.mark.parametrize("counts", [[1] * 48, [191 + 192 * 3] * 48, [8192 * 6 * 8 - 47] + [1] * 47])
def test_bound_holds_for_ragged_counts(counts):
    assert sum(counts) <= 8 * 8192 * 6
    assert _pool_rows([counts], 192) <= get_num_max_pool_tokens(**SEED)


@pytest.mark.parametrize("block_m", [16, 32, 128, 192])
def test_sf_rows_of_the_pool_are_distinct_block_major_and_in_bounds(block_m):
    L = Layout(2, 8, 64, 2, 256, 128, block_m=block_m)
    rows = torch.arange(L.num_max_pool_tokens)
    sf = L.sf_row(rows)
    assert sf.unique().numel() == rows.numel() and int(sf.max()) < L.num_padded_sf_pool_tokens
    assert [L.sf_row(int(p)) for p in rows[:3 * block_m:block_m]] == [0, L.sf_block_m, 2 * L.sf_block_m]
    assert bool((sf.diff()[rows[1:] % block_m != 0] == 1).all())   # consecutive inside a block


def test_segments_in_seed_order_aligned_and_disjoint():
    L = Layout(8, 384, 8192, 6, 7168, 3072, block_m=192)
    names = [s.name for s in L]
    assert names == ["grid_sync", "barrier_signal", "barrier_state", "progress", "call_state", "expert_send_count",
                     "expert_recv_count", "expert_recv_count_sum", "l1_arrival_count", "l2_arrival_mask",
                     "src_token_topk_idx",
                     "token_src_metadata", "x", "x_sf", "topk_idx", "topk_weights", "l1_acts", "l1_acts_sf",
                     "l1_topk_weights", "l2_acts", "l2_acts_sf", "combine"]
    segs = list(L)
    for a, b in zip(segs, segs[1:]):
        assert a.offset % SEGMENT_ALIGNMENT == 0 and a.end <= b.offset
    assert segs[-1].end <= L.num_bytes
    assert L["l1_acts"].nbytes == 402_432 * 7168
    assert L["combine"].nbytes == 6 * 8192 * 7168 * 2
    assert L["x_sf"].shape == (8192, 7168 // 128)
    assert "402,432" in L.table()


def test_views_alias_the_buffer_with_the_right_dtype_and_strides():
    L = Layout(2, 8, 64, 2, 256, 128, block_m=32)
    buf = torch.zeros(L.num_bytes, dtype=torch.uint8)
    sf = L.view(buf, "l1_acts_sf")
    assert sf.shape == (L.num_padded_sf_pool_tokens, 2) and sf.stride() == (1, L.num_padded_sf_pool_tokens)
    sf[5, 1] = 0x01020304
    word = buf[L.offset("l1_acts_sf"):].view(torch.int32)[L.num_padded_sf_pool_tokens + 5]
    assert int(word) == 0x01020304
    x = L.view(buf, "x")
    assert x.dtype == torch.float8_e4m3fn and x.shape == (64, 256)
    assert L.view(buf, "combine").shape == (2, 64, 256)
    assert sum(L.region_bytes().values()) == L.num_bytes


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_experts=7), "num_experts=7 must be divisible by num_ranks=2"),
    (dict(hidden=200), "hidden=200 must be a multiple of 128"),
    (dict(intermediate_hidden=64), "intermediate_hidden=64 must be"),
    (dict(num_topk=33), "num_topk=33"),
    (dict(num_ranks=73, num_experts=73), "num_ranks=73"),
    (dict(num_max_tokens_per_rank=0), "num_max_tokens_per_rank=0"),
])
def test_bad_arguments_are_named(kwargs, match):
    args = dict(num_ranks=2, num_experts=8, num_max_tokens_per_rank=64, num_topk=2, hidden=256,
                intermediate_hidden=128, block_m=32)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        Layout(**args)


def test_wrong_types_are_named():
    with pytest.raises(TypeError, match="hidden must be an int"):
        Layout(2, 8, 64, 2, 256.0, 128)


# ---------------------------------------------------------------------------------------------------- formats
def test_fp8_format_has_float32_scale_segments_at_the_same_offsets():
    """The SM90 ``fp8`` format: fp32 scales per 128 columns take the 4 bytes per 128 columns that 4 packed UE8M0
    bytes take, so every segment keeps its offset and size; only the three scale segments change dtype."""
    args = (8, 384, 8192, 6, 7168, 3072)
    a, b = Layout(*args, block_m=192), Layout(*args, block_m=192, format="fp8")
    assert a.format == "fp8_fp4" and b.format == "fp8"
    assert a.num_bytes == b.num_bytes and a.num_max_pool_tokens == b.num_max_pool_tokens
    scale_segments = {"x_sf", "l1_acts_sf", "l2_acts_sf"}
    for sa, sb in zip(a, b):
        assert (sa.name, sa.offset, sa.nbytes, sa.shape, sa.mn_major) == (sb.name, sb.offset, sb.nbytes, sb.shape,
                                                                           sb.mn_major)
        if sa.name in scale_segments:
            assert (sa.dtype, sb.dtype) == (torch.int32, torch.float32)
            assert "float32" in sb.doc and "UE8M0" in sa.doc
        else:
            assert sa.dtype == sb.dtype
    assert b["x_sf"].shape == (8192, 7168 // 128) and b["l2_acts_sf"].shape == (b.num_padded_sf_pool_tokens, 24)
    assert a.fingerprint() != b.fingerprint() and b.fingerprint()["format"] == "fp8"
    assert "format=fp8" in b.table() and "format='fp8'" in repr(b)


def test_fp8_format_views_are_float32_and_mn_major():
    L = Layout(2, 4, 16, 2, 256, 128, block_m=16, format="fp8")
    buf = torch.zeros(L.num_bytes, dtype=torch.uint8)
    x_sf, l1_sf = L.view(buf, "x_sf"), L.view(buf, "l1_acts_sf")
    assert x_sf.dtype == torch.float32 and x_sf.shape == (16, 2) and x_sf.is_contiguous()
    assert l1_sf.dtype == torch.float32 and l1_sf.stride() == (1, L.num_padded_sf_pool_tokens)
    l1_sf[3, 1] = 0.25
    raw = buf[L.offset("l1_acts_sf"):].view(torch.float32)
    assert raw[1 * L.num_padded_sf_pool_tokens + 3] == 0.25


def test_unknown_format_is_rejected_by_name():
    with pytest.raises(ValueError, match="format='fp4' must be one of"):
        Layout(1, 4, 16, 2, 128, 128, format="fp4")
