"""Triton's interpreter, with its ``tl.reduce`` folded by halves (the CPU tests only).

[Note: the interpreter's reductions by halves]
Triton's interpreter runs ``tl.reduce(x, axis, combine)`` one element at a
time: for each element it builds interpreter tensors and calls the combine
function, a few ``tl`` operations of a few numpy calls each. The raw-Triton
renderer reduces every float max and min with such a combine (``_max_nan``:
``tl.max`` drops NaN on a GPU), so one softmax over rows of 8193 made 74,000
combine calls, 20 s of its test's 21 s. Here the combine runs on the two
halves of the reduced axis at once, then on the halves of what it returned,
log2(n) calls over arrays: the same combine function on the same values,
folded as a tree, as a GPU folds a reduction (its lanes' shuffles) and not as
the interpreter's left-to-right loop. For max, min and the argmax / argmin
picks (which break ties by index) the order changes nothing; a product or a
sum rounds as some tree order does. ``install`` patches the interpreter when
triton is first imported; the tests' conftest installs it on the CPU.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

import numpy as np

_MODULE = "triton.runtime.interpreter"


def _reduce_by_halves(self, input):
    """``ReduceOps.generic_reduce`` of Triton 3.6's interpreter, the combine on halves."""
    import triton.language as tl

    original_axis = self.axis
    input, axis = self.unravel(input, self.axis)
    datas = [np.moveaxis(arg.handle.data, axis, 0) for arg in input]
    if datas[0].shape[0] == 0:
        return _plain_reduce(self, input, original_axis)
    dtypes = [arg.dtype for arg in input]
    while datas[0].shape[0] > 1:
        n = datas[0].shape[0]
        half = n // 2
        left = [self.to_tensor(d[:half], dt) for d, dt in zip(datas, dtypes)]
        right = [self.to_tensor(d[half:2 * half], dt) for d, dt in zip(datas, dtypes)]
        out = self.combine_fn.fn(*left, *right)
        out = out if isinstance(out, tuple) else (out,)
        folded = []
        for d, o in zip(datas, out):
            value = o.handle.data if isinstance(o, tl.core.tensor) else np.asarray(o)
            value = np.broadcast_to(value, d[:half].shape).astype(d.dtype)
            folded.append(np.concatenate([value, d[2 * half:]]) if n % 2 else value)
        datas = folded
    ret = []
    for d, arg in zip(datas, input):
        data = d[0]
        if self.keep_dims:
            if original_axis is not None:
                data = np.expand_dims(data, axis)
            else:
                for _ in range(arg.handle.data.ndim):
                    data = np.expand_dims(data, 0)
        elif original_axis is None:
            data = data.item()
        ret.append(self.to_tensor(data, arg.dtype))
    return ret


_plain_reduce = None


class _Finder(importlib.abc.MetaPathFinder):
    """Patches the interpreter module right after it first runs."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


def _patch(module) -> None:
    global _plain_reduce
    ops = getattr(module, "ReduceOps", None)
    if ops is None or not hasattr(ops, "generic_reduce") or ops.generic_reduce is _reduce_by_halves:
        return
    _plain_reduce = ops.generic_reduce
    ops.generic_reduce = _reduce_by_halves


def install() -> None:
    """Fold the interpreter's reductions by halves, now or when triton is imported."""
    if _MODULE in sys.modules:
        _patch(sys.modules[_MODULE])
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
