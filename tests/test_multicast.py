"""``megamoe.multicast``: the PTX pass on a small hand-written module (what it rewrites, what it leaves), the
cluster launch's guard against a compile without it, and the pass among ``megamoe.compile_hooks``' PTX passes. The
pass on the real kernels' PTX: ``tests/test_hopper_compile.py`` (the fused FP8 phase) and ``tests/test_probes.py``
(the toy)."""
from types import SimpleNamespace

import pytest

from megamoe import multicast

PTX = """//
.visible .entry {name}(
	.param .align 64 .b8 {name}_param_0[128],
	.param .align 64 .b8 {name}_param_1[128],
	.param .u64 {name}_param_2
)
.reqntid 256
{{
	.reg .pred 	%p<4>;
	.reg .b32 	%r<9>;
	.reg .b64 	%rd<6>;

	mov.b64 	%rd1, {name}_param_0;
	cvta.param.u64 	%rd2, %rd1;
	mov.b64 	%rd3, {name}_param_1;
	cvta.param.u64 	%rd4, %rd3;
	@%p1 cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%r1], [%rd2, {{%r2, %r3}}], [%r4];
	@%p2 cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%r5], [%rd4, {{%r2, %r3}}], [%r4];
	@%p2 cp.async.bulk.tensor.1d.shared::cluster.global.mbarrier::complete_tx::bytes [%r6], [%rd4, {{%r2}}], [%r4];
	@%p3 mbarrier.arrive.shared::cta.b64 _, [%r7], {count};
	ret;
}}
"""


@pytest.fixture
def spec():
    multicast._SPECS["mc_unit_kernel"] = multicast.Spec(multicast_descs=(1,), default_threads=128)
    yield multicast._SPECS["mc_unit_kernel"]
    multicast._SPECS.pop("mc_unit_kernel", None)


def test_pass_rewrites_a_registered_kernel_with_the_marker(spec):
    """2-D loads: multicast, mask 0b11 where the descriptor register holds the registered parameter's address (the
    comparison as the kernel derives it), this CTA's bit otherwise; the 1-D load untouched; the count-2 arrive one
    local and one on the peer's barrier (``mapa``); the workers' cluster arrive first in the body."""
    new, counts = multicast.rewrite_ptx(PTX.format(name="mc_unit_kernel", count=2))
    assert counts == {"multicast": 2, "peer_arrive": 1, "entry_arrive": 1}
    lines = new.splitlines()
    tma = [ln for ln in lines if "cp.async.bulk.tensor.2d" in ln]
    assert len(tma) == 2 and all(".multicast::cluster" in ln and "%mcmask;" in ln for ln in tma)
    for ln in tma:  # both select by the registered descriptor (param_1) only; the default mask is this CTA's bit
        assert "mov.b64 %mcd, mc_unit_kernel_param_1; cvta.param.u64 %mcd, %mcd;" in ln
        assert "param_0" not in ln and "shl.b32 %mcm, 1, %mcr;" in ln
    assert "setp.eq.u64 %mcp, %rd2, %mcd;" in tma[0] and "setp.eq.u64 %mcp, %rd4, %mcd;" in tma[1]
    assert tma[0].split("cp.async")[0].endswith("@%p1 ")  # the load's own predicate is kept
    one_d = [ln for ln in lines if "tensor.1d" in ln]
    assert one_d == ["\t@%p2 cp.async.bulk.tensor.1d.shared::cluster.global.mbarrier::complete_tx::bytes [%r6], "
                     "[%rd4, {%r2}], [%r4];"]
    arrive = next(ln for ln in lines if "mapa" in ln)
    assert "@%p3 mbarrier.arrive.shared::cta.b64 _, [%r7];" in arrive
    assert "@%p3 mbarrier.arrive.shared::cluster.b64 _, [%mcra];" in arrive and ", 2;" not in arrive
    body = lines.index("{") + 1
    while lines[body].strip().startswith(".reg") or not lines[body].strip():
        body += 1
    assert "setp.ge.u32 %mcw, %mctid, 128; @%mcw barrier.cluster.arrive.relaxed;" in lines[body]
    assert multicast.LAST_COUNTS["mc_unit_kernel"] == counts


def test_pass_leaves_other_kernels_and_unmarked_ones(spec):
    """A kernel not registered, or registered but without a count-2 arrive (compiled without ``MC``): unchanged."""
    for ptx in (PTX.format(name="other_kernel", count=2), PTX.format(name="mc_unit_kernel", count=1)):
        assert multicast.rewrite_ptx(ptx) == (ptx, {})


def test_pass_refuses_a_kernel_with_too_few_descriptors():
    multicast._SPECS["mc_unit_kernel"] = multicast.Spec(multicast_descs=(2,))
    try:
        with pytest.raises(RuntimeError, match="at least 3 TMA descriptor"):
            multicast.rewrite_ptx(PTX.format(name="mc_unit_kernel", count=2))
    finally:
        multicast._SPECS.pop("mc_unit_kernel", None)


def test_as_cluster_sets_the_cluster_and_refuses_a_compile_without_the_pass():
    rewritten = SimpleNamespace(name="k", asm={"ptx": "... .multicast::cluster ..."}, packed_metadata=(4, 1, 1024))
    assert multicast.as_cluster(rewritten).packed_metadata == (4, 2, 1024)
    plain = SimpleNamespace(name="k", asm={"ptx": "cp.async.bulk.tensor.2d ..."}, packed_metadata=(4, 1, 1024))
    with pytest.raises(RuntimeError, match="lacks megamoe.multicast's PTX pass"):
        multicast.as_cluster(plain)
    assert plain.packed_metadata == (4, 1, 1024)


def test_install_adds_the_pass_to_the_compile_hooks():
    """The pass runs as ``megamoe.compile_hooks``' "multicast" PTX pass (the hook itself: ``test_compile_hooks.py``)."""
    from megamoe import compile_hooks

    multicast.install()
    assert compile_hooks._PTX_PASSES["multicast"] is multicast._ptx_pass
