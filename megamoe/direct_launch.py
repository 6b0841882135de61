"""Launching the fused path's Triton / Gluon kernels without ``JITFunction.run``'s per-launch work.

Why: an eager fused call is 3-4 launches (front, the GEMM phase -- after the weight-row maxima on the
register-operand tile -- and back) of kernels with 11-17 runtime arguments and 20-70 constexprs. On every launch
Triton's ``JITFunction.run`` binds them all, builds and hashes a specialisation key with the options, and re-checks
the kernel's globals: ~60 us a launch on the H200 machine's host. The probe that measured it
(``results/probes/fp8_ws_probe.py host``, rows ``"probe": "host"`` of ``results/probes/fp8_ws_probe_h200.jsonl``)
launched every kernel through its first ``CompiledKernel`` instead: host time of an FP8 x FP4 call at T = 128
393 -> 204 us, at T = 512 355 -> 247, the outputs bitwise equal. At T <= 32 a call's GPU time is 400-700 us, so the
host's enqueue time decides whether an eager call waits on the host (``megamoe.bench``'s ``host_us``).

How: :func:`launch` keys a launch by (kernel, current device, grid, constexpr and option keywords, one *fact* per
runtime argument). The first launch of a key goes through ``JITFunction.run`` (compile or disk cache, every check
of Triton's) and keeps the ``CompiledKernel`` it returns; later launches of the key call that kernel's launcher with
the arguments in signature order, as ``JITFunction.run`` does. The facts are at least what Triton specialises on,
so a hit runs the binary Triton would have picked: a tensor's dtype and 16-byte alignment; an int or bool by value
(Triton: ``== 1``, ``% 16``, its width); a float by type (Triton does not specialise floats); a tensor descriptor's
dtype, block shape, layout, shape, strides and base alignment; anything else by type and value.

Not re-checked on a hit: the kernel's globals (Triton refuses a launch after a global it reads changed; a module
constant patched after the first launch is not seen here -- call :func:`clear`). Under Triton's interpreter every
launch goes through ``JITFunction`` (there is no compiled kernel). ``ENABLED = False`` sends every launch through
``JITFunction.run`` (``results/probes/fp8_ws_probe.py host`` compares both).
"""
from __future__ import annotations

import weakref

import torch

#: Launch through the cached ``CompiledKernel`` (False: every launch through ``JITFunction.run``).
ENABLED = True
_CACHE: dict = {}
_KW_KEYS: dict = {}  # id(keyword dict) -> (the dict, (its snapshot, its values' types, its key))
#: id(descriptor) -> (a weak reference to it, its fact): descriptors are not changed after they are made, and the
#: memo must not keep one -- nor the weights or pool it points into -- alive after its owner dropped it.
_DESC_FACTS: dict = {}
#: Most distinct keys kept (each a compiled kernel's runner and the constexpr tail of its arguments).
MAX_ENTRIES = 256


def clear() -> None:
    """Forget every cached launch (after patching a kernel's module constant, or to measure the first launch)."""
    _CACHE.clear()
    _KW_KEYS.clear()
    _DESC_FACTS.clear()


def _fact(a):
    """What of runtime argument ``a`` the key holds (module docstring)."""
    t = type(a)
    if t is int or t is bool:
        return (t, a)
    if t is float:
        return float
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    base = getattr(a, "base", None)
    if isinstance(base, torch.Tensor) and hasattr(a, "block_shape"):  # a TMA tensor descriptor (tl / Gluon)
        memo = _DESC_FACTS.get(id(a))
        if memo is None or memo[0]() is not a:
            fact = (t, base.dtype, base.data_ptr() % 16 == 0, tuple(a.block_shape), tuple(a.shape),
                    tuple(a.strides), getattr(a, "layout", None), getattr(a, "padding", None))
            if len(_DESC_FACTS) >= MAX_ENTRIES:
                _DESC_FACTS.clear()
            memo = _DESC_FACTS[id(a)] = (weakref.ref(a), fact)
        return memo[1]
    return (t, a)


def _kw_key(kwargs: dict):
    """The constexpr and option keywords as a key: by value and type, made once per keyword dict (the fused path
    passes the same cached dicts on every call) and made again when the dict no longer equals its snapshot, value
    and type (``True == 1`` in Python, not to Triton)."""
    memo = _KW_KEYS.get(id(kwargs))
    types = tuple(map(type, kwargs.values()))
    if memo is None or memo[0] is not kwargs or memo[1][0] != kwargs or memo[1][1] != types:
        key = tuple(sorted((k, type(v), v if isinstance(v, (bool, int, float, str, type(None))) else repr(v))
                           for k, v in kwargs.items()))
        memo = _remember(_KW_KEYS, kwargs, (dict(kwargs), types, key))
    return memo[1][2]


def _remember(memo: dict, obj, value):
    """``memo[id(obj)] = (obj, value)``: the entry holds ``obj``, so its id is not reused while the entry lives."""
    if len(memo) >= MAX_ENTRIES:
        memo.clear()
    memo[id(obj)] = entry = (obj, value)
    return entry


def launch(fn, grid: tuple, args: tuple, kwargs: dict) -> None:
    """``fn[grid](*args, **kwargs)`` (``fn`` a ``triton.jit`` / ``gluon.jit`` kernel; ``args`` its leading runtime
    arguments, positional; ``kwargs`` the constexprs and launch options), through the cached compiled kernel of
    an earlier launch with the same key (module docstring)."""
    from megamoe.env import interpreting

    if not ENABLED or interpreting():
        fn[grid](*args, **kwargs)
        return
    grid3 = tuple(grid) + (1,) * (3 - len(grid))
    key = (fn, torch.cuda.current_device(), grid3, _kw_key(kwargs), tuple(map(_fact, args)))
    hit = _CACHE.get(key)
    if hit is None:
        kernel = fn[grid](*args, **kwargs)  # JITFunction.run: compiles or finds the binary, launches it
        if hasattr(kernel, "result"):  # (an asynchronous compile's future)
            kernel = kernel.result()
        names = fn.arg_names
        values = {**_defaults(fn), **kwargs}
        missing = [n for n in names[len(args):] if n not in values]
        if missing:  # (JITFunction.run would have raised first)
            raise TypeError(f"{fn.__name__}: no value for {missing}")
        if len(_CACHE) >= MAX_ENTRIES:
            _CACHE.clear()
        _CACHE[key] = (kernel[grid3], tuple(values[n] for n in names[len(args):]))
        return
    runner, tail = hit
    runner(*args, *tail)


def _defaults(fn) -> dict:
    """The defaults of ``fn``'s parameters (``inspect``: what ``JITFunction``'s binder applies)."""
    import inspect

    return {n: p.default for n, p in inspect.signature(fn.fn).parameters.items()
            if p.default is not inspect.Parameter.empty}
