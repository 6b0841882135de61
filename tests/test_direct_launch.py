"""``megamoe.direct_launch``: a launch key's first launch goes through ``JITFunction.run``, later ones through the
compiled kernel's launcher with every parameter in signature order; anything Triton specialises on makes a new key.
(A fake JIT function stands in for Triton's: the real one needs a GPU, where every fused GPU test launches through
this path.)"""
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
    """The descriptor facts are remembered through a weak reference: a dropped descriptor (and the tensor it points
    into: weights, a pool) is freed, and a new object at the same address is not taken for it."""
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
