"""``megamoe.direct_launch``: a launch key's first launch goes through ``JITFunction.run``, later ones through the
compiled kernel's launcher with every parameter in signature order; anything Triton specialises on makes a new key.
(A fake JIT function stands in for Triton's: the real one needs a GPU, where every fused GPU test launches through
this path.)"""
from types import SimpleNamespace

import pytest
import torch

import megamoe.direct_launch as dl
import megamoe.env


def _kernel(buf, n, x, desc, BLOCK: "constexpr", FLAG: "constexpr" = 7):  # noqa: F821 (annotations: not read)
    pass


class _FakeCompiled:
    def __init__(self, log):
        self.log = log

    def __getitem__(self, grid):
        return lambda *args: self.log.append(("direct", grid, args))


class _FakeJit:
    """What ``launch`` uses of a ``JITFunction``: ``fn[grid](*args, **kwargs)``, ``arg_names``, ``fn``."""
    fn = staticmethod(_kernel)
    arg_names = ["buf", "n", "x", "desc", "BLOCK", "FLAG"]
    __name__ = "_kernel"

    def __init__(self):
        self.log = []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.log.append(("run", grid, args, kwargs))
            return _FakeCompiled(self.log)
        return run


class _Desc:  # the attributes of a TMA descriptor that the key reads
    def __init__(self, base, block_shape, layout="nvmma128"):
        self.base, self.block_shape, self.layout = base, block_shape, layout
        self.shape, self.strides = list(base.shape), list(base.stride())


@pytest.fixture
def on_gpu(monkeypatch):
    monkeypatch.setattr(megamoe.env, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    dl.clear()
    yield
    dl.clear()


def test_first_launch_runs_then_direct_in_signature_order(on_gpu):
    fn, buf = _FakeJit(), torch.zeros(64, dtype=torch.float32)
    desc = _Desc(torch.zeros(8, 32, dtype=torch.uint8), [8, 32])
    for x in (1.5, 2.5):  # a float's value is not part of the key: the same binary
        dl.launch(fn, (4,), (buf, 16, x, desc), {"BLOCK": 32, "num_warps": 4})
    assert [e[0] for e in fn.log] == ["run", "direct"]
    assert fn.log[0][2] == (buf, 16, 1.5, desc) and fn.log[0][3] == {"BLOCK": 32, "num_warps": 4}
    assert fn.log[1][1] == (4, 1, 1) and fn.log[1][2] == (buf, 16, 2.5, desc, 32, 7)  # + constexprs, default


def test_what_triton_specialises_on_makes_a_new_key(on_gpu):
    fn = _FakeJit()
    buf = torch.zeros(64, dtype=torch.float32)
    desc = _Desc(torch.zeros(8, 32, dtype=torch.uint8), [8, 32])
    base = (buf, 16, 1.0, desc)
    variants = [
        (buf, 1, 1.0, desc),  # an int's value (Triton: == 1 makes it a constant)
        (buf[1:], 16, 1.0, desc),  # a tensor's 16-byte alignment
        (buf.to(torch.float16), 16, 1.0, desc),  # a tensor's dtype
        (buf, 16, 1.0, _Desc(desc.base, [4, 32])),  # a descriptor's block shape
        (buf, 16, 1.0, _Desc(desc.base, [8, 32], "swizzle64")),  # its layout
    ]
    dl.launch(fn, (4,), base, {"BLOCK": 32})
    for args in variants:
        dl.launch(fn, (4,), args, {"BLOCK": 32})
    dl.launch(fn, (8,), base, {"BLOCK": 32})  # the grid
    dl.launch(fn, (4,), base, {"BLOCK": 64})  # a constexpr
    dl.launch(fn, (4,), base, {"BLOCK": 32, "num_warps": 8})  # an option
    assert [e[0] for e in fn.log] == ["run"] * (2 + len(variants) + 2)
    dl.launch(fn, (4,), base, {"BLOCK": 32})
    assert fn.log[-1][0] == "direct"


def test_interpreter_and_disabled_always_run(monkeypatch, on_gpu):
    fn, buf = _FakeJit(), torch.zeros(4)
    monkeypatch.setattr(dl, "ENABLED", False)
    for _ in range(2):
        dl.launch(fn, (1,), (buf, 16, 1.0, None), {"BLOCK": 32})
    monkeypatch.setattr(dl, "ENABLED", True)
    monkeypatch.setattr(megamoe.env, "interpreting", lambda: True)
    for _ in range(2):
        dl.launch(fn, (1,), (buf, 16, 1.0, None), {"BLOCK": 32})
    assert [e[0] for e in fn.log] == ["run"] * 4


def test_a_keyword_dict_changed_in_place_is_a_new_key(on_gpu):
    """The keyword key is made once per dict (the fused path passes cached dicts) and again when the dict changed."""
    fn, buf = _FakeJit(), torch.zeros(4)
    kw = {"BLOCK": 32}
    dl.launch(fn, (1,), (buf, 16, 1.0, None), kw)
    dl.launch(fn, (1,), (buf, 16, 1.0, None), kw)
    kw["BLOCK"] = 64
    dl.launch(fn, (1,), (buf, 16, 1.0, None), kw)
    kw["BLOCK"] = True  # (== 1 in Python, another constexpr to Triton)
    dl.launch(fn, (1,), (buf, 16, 1.0, None), kw)
    kw["BLOCK"] = 1
    dl.launch(fn, (1,), (buf, 16, 1.0, None), kw)
    assert [e[0] for e in fn.log] == ["run", "direct", "run", "run", "run"]
    assert fn.log[-1][3] == {"BLOCK": 1}


def test_descriptor_memo_does_not_keep_a_descriptor_alive(on_gpu):
    """A descriptor's fact is kept on the descriptor object: a dropped descriptor (and the tensor it points into:
    weights, a pool) is freed, and a new object at the same address has no fact until a launch makes it."""
    import gc
    import weakref

    fn, buf = _FakeJit(), torch.zeros(4)
    desc = _Desc(torch.zeros(8, 32, dtype=torch.uint8), [8, 32])
    gone = weakref.ref(desc.base)
    dl.launch(fn, (1,), (buf, 16, 1.0, desc), {"BLOCK": 32})
    dl.launch(fn, (1,), (buf, 16, 1.0, desc), {"BLOCK": 32})
    assert [e[0] for e in fn.log] == ["run", "direct"]
    fn.log.clear()  # (the fake's own record of the arguments)
    del desc
    gc.collect()
    assert gone() is None


def test_frozen_keywords_refuse_changes_and_share_the_plain_dicts_key(on_gpu):
    fn, buf = _FakeJit(), torch.zeros(4)
    kw = dl.FrozenKeywords(BLOCK=32, num_warps=4)
    for change in (lambda: kw.__setitem__("BLOCK", 64), lambda: kw.update(BLOCK=64), lambda: kw.pop("BLOCK"),
                   lambda: kw.setdefault("X", 1), lambda: kw.clear(), lambda: kw.popitem(),
                   lambda: kw.__delitem__("BLOCK")):
        with pytest.raises(TypeError, match="FrozenKeywords cannot be changed"):
            change()
    assert kw == {"BLOCK": 32, "num_warps": 4} and dict(kw, BLOCK=64)["BLOCK"] == 64  # (a copy may change)
    assert dl.keywords_token(kw) == dl.keywords_token({"num_warps": 4, "BLOCK": 32})
    assert dl.keywords_token(kw) != dl.keywords_token({"num_warps": 4, "BLOCK": True})
    dl.launch(fn, (1,), (buf, 16, 1.0, None), kw)
    dl.launch(fn, (1,), (buf, 16, 1.0, None), {"BLOCK": 32, "num_warps": 4})
    assert [e[0] for e in fn.log] == ["run", "direct"]


def _cuda_kernel(log, signature, tensordesc_meta, scratch=0):
    """A ``CompiledKernel`` after its first launch as Triton 3.6 builds it on CUDA, on a CPU: Triton's own class (its
    runner: ``kernel[grid]``), ``CudaLauncher`` (its ``__call__``) and ``wrap_handle_tensordesc`` around a fake C
    launch that records its arguments."""
    from triton.backends.nvidia import driver as nv
    from triton.compiler.compiler import CompiledKernel

    run = object.__new__(nv.CudaLauncher)
    run.__dict__.update(
        num_ctas=1, global_scratch_size=scratch, global_scratch_align=1, profile_scratch_size=0,
        profile_scratch_align=1, launch_cooperative_grid=False, launch_pdl=True,
        launch=nv.wrap_handle_tensordesc(lambda *a: log.append(a), signature, tensordesc_meta))
    kernel = object.__new__(CompiledKernel)
    kernel.__dict__.update(module="loaded", function=0xF00, packed_metadata=(4, 1, 1), _run=run, name="k",
                           src=SimpleNamespace(fn=SimpleNamespace(launch_metadata=None), signature=signature))
    return kernel


class _CudaJit(_FakeJit):
    """A JIT function whose first launch returns ``kernel`` (a ``_cuda_kernel``) after running it."""

    def __init__(self, kernel):
        super().__init__()
        self.kernel = kernel

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.log.append(("run", grid, args, kwargs))
            self.kernel[tuple(grid) + (1,) * (3 - len(grid))](*args, kwargs["BLOCK"], kwargs.get("FLAG", 7))
            return self.kernel
        return run


@pytest.fixture
def cuda_driver(monkeypatch):
    """Triton's active driver as a hit needs it: the current stream (77) and ``fill_tma_descriptor`` (recorded)."""
    from triton.runtime import driver

    fills = []

    class Utils:
        @staticmethod
        def fill_tma_descriptor(ptr, swizzle, elem_size, dtype, block, shape, strides, padding):
            fills.append(ptr)
            return ("tensormap", ptr, swizzle, elem_size, dtype, tuple(block), tuple(shape), tuple(strides), padding)

    monkeypatch.setattr(driver, "_active", SimpleNamespace(utils=Utils, get_current_stream=lambda device: 77,
                                                           get_current_device=lambda: 0))
    return fills


SIGNATURE = {"buf": "*fp32", "n": "i32", "x": "fp32", "desc": "tensordesc<u8[8, 32]>", "BLOCK": "constexpr",
             "FLAG": "constexpr"}
DESC_META = [{"swizzle": 3, "elem_size": 1, "elem_type": 0, "block_size": [8, 32], "fp4_padded": False}]


def _gluon_desc(base):
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor.from_tensor(base, [8, 32], gl.NVMMASharedLayout.get_default_for([8, 32], gl.uint8))


def test_a_hit_calls_the_c_launcher_as_tritons_runner_would(on_gpu, cuda_driver, monkeypatch):
    """A hit calls the kernel's C launcher itself with exactly the arguments Triton's runner and launcher pass it
    (the descriptor encoded by Triton's ``make_tensordesc_arg``), but encodes a descriptor once, not per launch."""
    from triton import knobs
    from triton.compiler.compiler import LazyDict

    c_log = []
    fn = _CudaJit(_cuda_kernel(c_log, SIGNATURE, DESC_META))
    buf, base = torch.zeros(64), torch.zeros(16, 32, dtype=torch.uint8)
    desc = _gluon_desc(base)
    args, kw = (buf, 16, 2.5, desc), {"BLOCK": 32}
    dl.launch(fn, (4,), args, kw)  # first launch: JITFunction.run (here the runner, as a compile's first launch)
    assert len(cuda_driver) == 1
    dl.launch(fn, (4,), args, kw)
    dl.launch(fn, (4,), args, kw)
    assert len(cuda_driver) == 2  # (encoded once for the hits)
    monkeypatch.setattr(dl, "RAW", False)
    dl.launch(fn, (4,), args, kw)  # the runner: Triton's launcher encodes the descriptor again
    assert len(cuda_driver) == 3 and [e[0] for e in fn.log] == ["run"]
    first, raw1, raw2, runner = c_log
    assert raw1 == raw2 and runner[:10] + runner[11:] == first[:10] + first[11:]
    # the runner passes a LazyDict of launch metadata and Triton's (empty) hook chains, which the C launcher calls;
    # the hit passes None (no call), and the same everything else
    assert isinstance(runner[10], LazyDict) and runner[11:13] == (knobs.runtime.launch_enter_hook,
                                                                  knobs.runtime.launch_exit_hook)
    assert raw1[10:13] == (None, None, None) and raw1[:10] + raw1[13:] == runner[:10] + runner[13:]
    assert runner[:10] == (4, 1, 1, 77, 0xF00, False, True, None, None, (4, 1, 1))
    assert runner[13:16] == (buf, 16, 2.5) and runner[16][0] == "tensormap" and runner[16][1] == base.data_ptr()
    assert runner[-2:] == (32, 7)  # the constexprs, default included


def test_a_launch_hook_scratch_or_another_launcher_takes_the_runner(on_gpu, cuda_driver, monkeypatch):
    """Where a hit cannot call the C launcher as the runner would -- a launch hook in Triton's chain (a profiler), a
    kernel that needs scratch memory, a launcher of another shape, another Triton release -- it takes the runner,
    which encodes the descriptor every launch."""
    from triton import knobs

    buf, desc = torch.zeros(64), _gluon_desc(torch.zeros(16, 32, dtype=torch.uint8))
    for case in ("hook", "scratch", "other", "release"):
        dl.clear()
        c_log = []
        kernel = _cuda_kernel(c_log, SIGNATURE, DESC_META, scratch=64 if case == "scratch" else 0)
        if case == "other":  # (a launcher that is not wrap_handle_tensordesc's inner)
            kernel._run.launch = _OtherLauncher(c_log)
        fn = _CudaJit(kernel)
        with monkeypatch.context() as m:
            if case == "hook":
                m.setattr(knobs.runtime, "launch_enter_hook", knobs.HookChain())
                knobs.runtime.launch_enter_hook.add(lambda metadata: None)
            if case == "release":  # (a Triton release whose launcher the hit was not checked against)
                m.setattr(dl, "RAW_TRITON", "9.9.")
            if case == "scratch":  # (the runner allocates it through Triton's allocator, here a fake)
                m.setattr("triton.runtime._allocation._allocator", SimpleNamespace(get=lambda: lambda *a: 0xA11))
            start = len(cuda_driver)
            for _ in range(3):
                dl.launch(fn, (4,), (buf, 16, 2.5, desc), {"BLOCK": 32})
            assert len(c_log) == 3, case
            if case != "other":
                assert len(cuda_driver) - start == 3, case  # (the runner's launcher encodes it every launch)
            assert all(a[:10] == c_log[0][:10] for a in c_log), case
            # (the runner hands Triton's hook chain to the C launcher, which calls it; a hit would pass None)
            assert all(a[11] is knobs.runtime.launch_enter_hook for a in c_log), case
            if case == "other":  # (the runner hands the descriptor itself to that launcher)
                assert all(a[16] is desc for a in c_log)


class _OtherLauncher:
    """A C launcher that is not ``wrap_handle_tensordesc``'s closure (no ``__code__``): taken as is by Triton's
    runner; a hit cannot tell which arguments are descriptors, so it must take the runner too."""

    def __init__(self, log):
        self.log = log

    def __call__(self, *args):
        self.log.append(args)
