"""``megamoe.shared_address``: the token, reading allocation offsets from TritonGPU text, and resolving tokens in
PTX. On the real kernel (the FP8 phase's staged L2 epilogue, ``FP8_WS_BULK``): ``tests/test_hopper_compile.py``."""
import pytest

from megamoe import compile_hooks
from megamoe import shared_address as sa

TTGIR = """
    %a_bufs = ttg.local_alloc {allocation.offset = 0 : i32} : () -> !ttg.memdesc<4x128x128xf8E4M3FN, #shared>
    %l2_stage = ttg.local_alloc {allocation.offset = 98304 : i32} : () -> !ttg.memdesc<128x256xi16, #shared3>
    %twice_3 = ttg.local_alloc {allocation.offset = 512 : i32} : () -> !ttg.memdesc<2x8xi16, #shared3>
    %twice_4 = ttg.local_alloc {allocation.offset = 1024 : i32} : () -> !ttg.memdesc<2x8xi16, #shared3>
    %st = ttg.memdesc_subslice %l2_stage[0, 0] : !ttg.memdesc<128x256xi16, #shared3>
"""


def test_offset_token_is_for_identifiers_only():
    assert sa.offset_token("l2_stage") == "MEGAMOE_SMEM_OFFSET_l2_stage"
    with pytest.raises(ValueError, match="name 'a b'"):
        sa.offset_token("a b")


def test_allocation_offsets_by_name_ambiguous_names_dropped():
    offsets = sa.allocation_offsets(TTGIR)
    assert offsets["a_bufs"] == 0 and offsets["l2_stage"] == 98304
    assert offsets["twice_3"] == 512 and offsets["twice_4"] == 1024 and "twice" not in offsets
    assert "st" not in offsets  # a view, not an allocation


def test_resolve_replaces_every_token_and_names_a_missing_one():
    ptx = f"add.u32 %r1, %r1, {sa.offset_token('l2_stage')}; // {sa.offset_token('l2_stage')}"
    assert sa.resolve(ptx, {"l2_stage": 98304}) == "add.u32 %r1, %r1, 98304; // 98304"
    with pytest.raises(RuntimeError, match="'other'"):
        sa.resolve(sa.offset_token("other"), {"l2_stage": 98304})


def test_the_ptx_pass_needs_the_inspection_and_leaves_other_kernels_alone():
    assert sa._ptx_pass("mov.u32 %r1, 0;", {}) == "mov.u32 %r1, 0;"
    with pytest.raises(RuntimeError, match="not inspected"):
        sa._ptx_pass(sa.offset_token("l2_stage"), {})
    metadata = {}
    sa._PENDING[id(metadata)] = {"l2_stage": 64}
    assert sa._ptx_pass(sa.offset_token("l2_stage"), metadata) == "64" and id(metadata) not in sa._PENDING


def test_installed_in_the_compile_hooks():
    assert compile_hooks._TTGIR_INSPECTIONS["shared_address"] is sa._inspect
    assert compile_hooks._PTX_PASSES["shared_address"] is sa._ptx_pass
