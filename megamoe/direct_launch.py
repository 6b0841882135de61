"""Launching the fused path's Triton / Gluon kernels without ``JITFunction.run``'s per-launch work.

Why: an eager fused call is 3-4 launches (front, the GEMM phase -- after the weight-row maxima on the
register-operand tile -- and back) of kernels with 11-17 runtime arguments and 20-70 constexprs. On every launch
Triton's ``JITFunction.run`` binds them all, builds and hashes a specialisation key with the options, and re-checks
the kernel's globals: ~60 us a launch on the H200 machine's host. The probe that measured it
(``results/probes/fp8_ws_probe.py host``, rows ``"probe": "host"`` of ``results/probes/fp8_ws_probe_h200.jsonl``)
launched every kernel through its first ``CompiledKernel`` instead: host time of an FP8 x FP4 call at T = 128
393 -> 204 us, at T = 512 355 -> 247, the outputs bitwise equal. At T <= 32 a call's GPU time is 400-700 us, so the
host's enqueue time decides whether an eager call waits on the host (``megamoe.bench``'s ``host_us``: the layer run
of ``results/layer_h200.json`` took 552 us to enqueue the T = 8 call whose GPU time is 388).

How: :func:`launch` keys a launch by (kernel, current device, grid, constexpr and option keywords, one *fact* per
runtime argument). The first launch of a key goes through ``JITFunction.run`` (compile or disk cache, every check
of Triton's) and keeps the ``CompiledKernel`` it returns; later launches of the key call that kernel's C launcher
(:class:`_Raw`) with the arguments in signature order, as the compiled kernel's runner would. The facts are at least
what Triton specialises on, so a hit runs the binary Triton would have picked: a tensor's dtype and 16-byte
alignment; an int or bool by value (Triton: ``== 1``, ``% 16``, its width); a float by type (Triton does not
specialise floats); a tensor descriptor's dtype, block shape, layout, shape, strides and base alignment; anything
else by type and value.

What a hit skips besides ``JITFunction.run`` (Triton 3.6's CUDA launcher, ``triton.backends.nvidia.driver``): the
runner's and ``CudaLauncher``'s Python per launch, and the re-encoding of every TMA descriptor argument
(``make_tensordesc_arg``: a ``cuTensorMapEncodeTiled`` per descriptor and launch; six a call on the FP8 x FP4
register-operand tile). A descriptor's encoded arguments are kept on the descriptor object itself, per kernel
metadata, so they live exactly as long as it: the fused path's descriptors are cached over tensors that never
move (``megamoe.fused._weights_cache``). A hit takes the runner instead where the compiled kernel's launcher is not
that shape, needs scratch memory, or a launch hook is set (a profiler). ``RAW = False`` takes the runner always.

Not re-checked on a hit: the kernel's globals (Triton refuses a launch after a global it reads changed; a module
constant patched after the first launch is not seen here -- call :func:`clear`). Under Triton's interpreter every
launch goes through ``JITFunction`` (there is no compiled kernel). ``ENABLED = False`` sends every launch through
``JITFunction.run`` (``results/probes/fp8_ws_probe.py host`` compares the three ways).

Keyword dicts: a plain dict's key is made once per dict and made again when the dict no longer equals its
snapshot (value and type); a :class:`FrozenKeywords` (what the fused path caches) cannot change, so its key is made
once and never compared again.
"""
from __future__ import annotations

import os

import torch

#: Launch through the cached ``CompiledKernel`` (False: every launch through ``JITFunction.run``).
ENABLED = True
#: A hit calls the compiled kernel's C launcher itself (False: through the compiled kernel's runner; the environment
#: variable ``MEGAMOE_DIRECT_LAUNCH_RAW=0`` sets it off at import, without an edit, e.g. on a device machine).
RAW = os.environ.get("MEGAMOE_DIRECT_LAUNCH_RAW", "1") != "0"
_CACHE: dict = {}
_KW_KEYS: dict = {}  # id(keyword dict) -> (the dict, (its snapshot, its values' types, its token))
#: keyword key (sorted items) -> small int: the launch key hashes an int, not 60 pairs. Kept for the process (one
#: entry per distinct keyword set launched: tens).
_KW_TOKENS: dict = {}
_DESC_TOKENS: dict = {}  # descriptor fact -> small int (its layout objects hash in Python)
#: Most distinct keys kept (each a compiled kernel's runner and the constexpr tail of its arguments).
MAX_ENTRIES = 256
#: The attribute of a tensor descriptor object that holds what launches made of it once: ``"fact"`` (its key entry)
#: and, per kernel metadata token, its encoded launch arguments. On the object, so it lives exactly as long as the
#: descriptor and keeps nothing alive after it (neither it nor the weights or pool it points into).
DESC_ATTR = "_megamoe_launch"


class FrozenKeywords(dict):
    """A keyword dict that cannot be changed (the fused path's cached constexprs and options): :func:`launch` makes
    its key once. Copy it to change a value: ``dict(kw, NAME=value)``."""

    __slots__ = ("token",)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.token = None

    def _refuse(self, *args, **kwargs):
        raise TypeError("FrozenKeywords cannot be changed (a cached launch's keywords); copy it: dict(kw, NAME=value)")

    __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = __ior__ = _refuse


def clear() -> None:
    """Forget every cached launch (after patching a kernel's module constant, or to measure the first launch)."""
    _CACHE.clear()
    _KW_KEYS.clear()


def _intern(table: dict, key) -> int:
    """A small int standing for ``key`` (equal keys, equal ints) for as long as the process runs."""
    token = table.get(key)
    if token is None:
        token = table[key] = len(table)
    return token


def _facts(args: tuple) -> tuple:
    """What of the runtime arguments ``args`` the key holds (module docstring): two entries an argument, a tensor's
    dtype and alignment inline (most arguments; one loop, no call per argument), anything else ``_fact``'s."""
    out = []
    for a in args:
        if type(a) is _TENSOR:
            out.append(a.dtype)
            out.append(a.data_ptr() % 16 == 0)
        else:
            out.append(_MARK)
            out.append(_fact(a))
    return tuple(out)


_TENSOR = torch.Tensor
_MARK = object()  # (the first entry of an argument that is not a plain tensor)


def _fact(a):
    """What of runtime argument ``a`` the key holds (module docstring). A tensor descriptor's fact is made once and
    kept on the descriptor object (``DESC_ATTR``): descriptors are not changed after they are made."""
    t = type(a)
    if t is int or t is bool:
        return (t, a)
    if t is float:
        return float
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    d = getattr(a, "__dict__", None)
    if d is not None:
        memo = d.get(DESC_ATTR)
        if memo is not None:
            return memo["fact"]
        base = d.get("base")
        if isinstance(base, torch.Tensor) and "block_shape" in d:  # a TMA tensor descriptor (tl / Gluon)
            fact = (t, base.dtype, base.data_ptr() % 16 == 0, tuple(a.block_shape), tuple(a.shape),
                    tuple(a.strides), getattr(a, "layout", None), getattr(a, "padding", None))
            d[DESC_ATTR] = {"fact": ("desc", _intern(_DESC_TOKENS, fact))}
            return d[DESC_ATTR]["fact"]
    return (t, a)


def keywords_token(kwargs: dict) -> int:
    """A small int that stands for the constexpr and option keywords ``kwargs`` by key, value and type (``True == 1``
    in Python, not to Triton; equal dicts, equal ints): what the launch key holds, and a cheap key for other
    per-configuration memos. Made once per :class:`FrozenKeywords`; for a plain dict once per dict and again when it
    no longer equals its snapshot."""
    if type(kwargs) is FrozenKeywords:
        token = kwargs.token
        if token is None:
            token = kwargs.token = _intern(_KW_TOKENS, _kw_items(kwargs))
        return token
    memo = _KW_KEYS.get(id(kwargs))
    types = tuple(map(type, kwargs.values()))
    if memo is None or memo[0] is not kwargs or memo[1][0] != kwargs or memo[1][1] != types:
        memo = _remember(_KW_KEYS, kwargs, (dict(kwargs), types, _intern(_KW_TOKENS, _kw_items(kwargs))))
    return memo[1][2]


def _kw_items(kwargs: dict) -> tuple:
    return tuple(sorted((k, type(v), v if isinstance(v, (bool, int, float, str, type(None))) else repr(v))
                        for k, v in kwargs.items()))


def _remember(memo: dict, obj, value):
    """``memo[id(obj)] = (obj, value)``: the entry holds ``obj``, so its id is not reused while the entry lives."""
    if len(memo) >= MAX_ENTRIES:
        memo.clear()
    memo[id(obj)] = entry = (obj, value)
    return entry


def launch(fn, grid: tuple, args: tuple, kwargs: dict, prepare=None) -> None:
    """``fn[grid](*args, **kwargs)`` (``fn`` a ``triton.jit`` / ``gluon.jit`` kernel; ``args`` its leading runtime
    arguments, positional; ``kwargs`` the constexprs and launch options), through the cached compiled kernel of
    an earlier launch with the same key (module docstring). ``prepare``: a function (hashable: part of the key) that
    the compiled kernel passes through once, compiled but before its first launch -- e.g.
    ``megamoe.multicast.as_cluster``, which makes it launch in clusters of two CTAs (``grid`` then counts
    clusters)."""
    from megamoe.env import interpreting

    if not ENABLED or interpreting():
        fn[grid](*args, **kwargs)
        return
    grid3 = tuple(grid) + (1,) * (3 - len(grid))
    device = torch.cuda.current_device()
    key = (id(fn), device, grid3, keywords_token(kwargs), _facts(args), prepare)
    hit = _CACHE.get(key)
    if hit is None or hit[0] is not fn:
        kernel = _first_launch(fn, grid, args, kwargs, prepare)
        names = fn.arg_names
        values = {**_defaults(fn), **kwargs}
        missing = [n for n in names[len(args):] if n not in values]
        if missing:  # (JITFunction.run would have raised first)
            raise TypeError(f"{fn.__name__}: no value for {missing}")
        if len(_CACHE) >= MAX_ENTRIES:
            _CACHE.clear()
        tail = tuple(values[n] for n in names[len(args):])
        _CACHE[key] = (fn, kernel[grid3], tail, _Raw.of(kernel, grid3, len(args)) if RAW else None)
        return
    _, runner, tail, raw = hit
    if raw is not None and RAW and raw.usable():
        raw(device, args, tail)
    else:
        runner(*args, *tail)


def _first_launch(fn, grid, args, kwargs, prepare=None):
    """A key's first launch: ``JITFunction.run`` compiles or finds the binary and launches it; returns the
    ``CompiledKernel`` (``megamoe.host_path`` stands in for it on a CPU). With ``prepare`` (:func:`launch`) the
    kernel is compiled without a launch first (``warmup``; the launch then finds the same compiled kernel in
    ``JITFunction``'s cache) and passed to ``prepare``."""
    if prepare is not None:
        compiled = fn.warmup(*args, grid=grid, **kwargs)
        prepare(compiled.result() if hasattr(compiled, "result") else compiled)
    kernel = fn[grid](*args, **kwargs)
    if hasattr(kernel, "result"):  # (an asynchronous compile's future)
        kernel = kernel.result()
    return kernel


#: The Triton release whose CUDA launcher :class:`_Raw` calls as its runner would (``tests/test_direct_launch.py``
#: checks the arguments against that release's own launcher code), and the C launch's leading arguments there:
#: grid x / y / z, stream, function, cooperative, PDL, global and profile scratch, kernel metadata, launch metadata,
#: enter and exit hooks. Another release takes the runner.
RAW_TRITON = "3.6."
RAW_BASE_FORMAT = "iiiKKppOOOOOO"


class _Raw:
    """A compiled kernel's C launcher and what its runner would pass it (Triton 3.6's ``CompiledKernel.__getitem__``
    runner -> ``CudaLauncher.__call__`` -> ``wrap_handle_tensordesc``'s ``inner`` -> the module's ``launch``), made
    by :meth:`of` only where that is the kernel's launcher."""

    __slots__ = ("c_launch", "grid", "function", "packed", "cooperative", "pdl", "descs", "stream")

    @classmethod
    def of(cls, kernel, grid3: tuple, num_args: int):
        """For ``kernel`` (a ``CompiledKernel`` after its first launch) launched on ``grid3`` with ``num_args``
        leading runtime arguments, or None where a hit must take the runner."""
        try:
            import triton
            from triton.backends.nvidia import driver as nv

            if not triton.__version__.startswith(RAW_TRITON) or nv._BASE_ARGS_FORMAT != RAW_BASE_FORMAT:
                return None  # (a launcher this call was not checked against)
            run = kernel.run
            if (type(run).__name__ != "CudaLauncher" or run.global_scratch_size or run.profile_scratch_size
                    or getattr(kernel, "function", None) is None):
                return None
            launch_fn = run.launch
            descs = ()
            code = getattr(launch_fn, "__code__", None)
            if code is None and any(isinstance(t, str) and t.startswith("tensordesc")
                                    for t in kernel.src.signature.values()):
                return None  # (descriptor arguments, but not wrap_handle_tensordesc's closure around the C launch)
            if code is not None:  # wrap_handle_tensordesc's inner: the descriptor arguments are expanded first
                cells = dict(zip(code.co_freevars, launch_fn.__closure__ or ()))
                if not {"launcher", "tensordesc_indices", "tensordesc_meta"} <= cells.keys():
                    return None
                indices = sorted(cells["tensordesc_indices"].cell_contents)
                metas = list(cells["tensordesc_meta"].cell_contents)
                if len(indices) != len(metas) or (indices and indices[-1] >= num_args):
                    return None
                descs = tuple((i, m, _meta_token(m)) for i, m in zip(indices, metas))
                launch_fn = cells["launcher"].cell_contents
            from triton.runtime import driver

            raw = cls()
            raw.c_launch, raw.grid, raw.function, raw.packed = launch_fn, grid3, kernel.function, kernel.packed_metadata
            raw.cooperative, raw.pdl, raw.descs = run.launch_cooperative_grid, run.launch_pdl, descs
            raw.stream = driver.active.get_current_stream  # (device index -> the current stream's handle)
            return raw
        except (AttributeError, TypeError, ValueError, ImportError):
            return None

    @staticmethod
    def usable() -> bool:
        """No launch hook is set: Triton 3.6's hooks are chains (``knobs.HookChain``), empty unless a profiler added
        one; the runner passes them to the C launcher, which calls them (an empty chain does nothing), with a
        ``LazyDict`` of launch metadata made for them on every launch. With a hook in a chain, the runner."""
        hooks = _knobs().runtime
        return _no_hook(hooks.launch_enter_hook) and _no_hook(hooks.launch_exit_hook)

    def __call__(self, device: int, args: tuple, tail: tuple) -> None:
        if self.descs:
            expanded = list(args)
            for i, meta, token in reversed(self.descs):
                expanded[i:i + 1] = _desc_args(args[i], meta, token)
            args = expanded
        gx, gy, gz = self.grid
        self.c_launch(gx, gy, gz, self.stream(device), self.function, self.cooperative, self.pdl, None, None,
                      self.packed, None, None, None, *args, *tail)


def _no_hook(hook) -> bool:
    """``hook`` is None or an empty ``HookChain`` (one without ``calls`` counts as a hook)."""
    return hook is None or not getattr(hook, "calls", True)


def _knobs():
    """``triton.knobs`` (imported on the first hit: this module loads without Triton)."""
    global _KNOBS
    if _KNOBS is None:
        from triton import knobs

        _KNOBS = knobs
    return _KNOBS


_KNOBS = None


def _meta_token(meta):
    """A hashable stand-in for a descriptor argument's metadata (a dict, or None)."""
    return None if meta is None else tuple(sorted((k, tuple(v) if isinstance(v, list) else v)
                                                  for k, v in meta.items()))


def _desc_args(desc, meta, token) -> list:
    """Triton's ``make_tensordesc_arg(desc, meta)`` (the encoded ``CUtensorMap`` and the shape and strides the
    kernel reads), made once per descriptor and kernel metadata and kept on the descriptor (``DESC_ATTR``; its
    fact is there already: the key made it)."""
    memo = desc.__dict__[DESC_ATTR]
    out = memo.get(token)
    if out is None:
        from triton.backends.nvidia.driver import make_tensordesc_arg

        out = memo[token] = make_tensordesc_arg(desc, meta)
    return out


def _defaults(fn) -> dict:
    """The defaults of ``fn``'s parameters (``inspect``: what ``JITFunction``'s binder applies)."""
    import inspect

    return {n: p.default for n, p in inspect.signature(fn.fn).parameters.items()
            if p.default is not inspect.Parameter.empty}
