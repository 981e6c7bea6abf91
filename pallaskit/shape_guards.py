"""Shape equality guards of symbolic traces ([Note: shape equality guards])."""
from __future__ import annotations

import os
import sys
import threading

import jax


# [Note: shape equality guards]
# jax's symbolic dims answer ``==`` with False when they cannot decide it (its
# ``__eq__`` may not raise: hashing uses it), so a trace at symbolic shapes
# takes the user's ``if x.shape[0] == 1`` as false for every size, and the
# symbolic program would be wrong at size 1. While pallaskit traces at symbolic
# shapes, ``_DimExpr.__eq__`` also records the difference of each pair it
# called unequal without deciding it, when the comparison comes from outside
# jax (the user's code or a library's; jax's own code is written for symbolic
# dims, where "not known equal" is what it asks, e.g. broadcasting's ``d == 1``);
# a call whose sizes make any recorded difference zero compiles statically for
# those sizes instead, as torch's guards do. Ordered comparisons (<, >=, ...)
# raise when undecidable, and the trace then falls back to static compiles.
# A lookup keyed by a size (``{1: a, 4: b}.get(x.shape[0], c)``, ``x.shape[0]
# in {1, 4}``) compares nothing: the dim's hash finds no int key, and the
# symbolic program would take the miss for every size. Such a hash from
# outside jax (and outside pallaskit) is recorded too, and the trace then
# cannot serve other sizes: the signature compiles per size (the keys, which
# the guard would need, are not known). So is a dim turned into text outside
# jax (``str(x.shape[0])``, an f-string, ``print(x.shape)``): the text of a
# symbolic dim is its name, and a lookup keyed by that text (or anything else
# done with it) would take the same branch at every size. Recording is per thread.
EQ_RECORD = threading.local()
_JAX_DIR = os.path.dirname(jax.__file__) + os.sep
_OWN_DIRS = tuple(os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep + d + os.sep
                  for d in ("pallaskit", "lowering"))


def _generated(code) -> bool:
    """A dataclass's (or namedtuple's) generated ``__hash__`` / ``__eq__``: their
    caller, jax's (a vmap's ``AxisData`` hashed in a cache) or the user's, decides."""
    return code.co_filename.startswith("<") and code.co_name in ("__hash__", "__eq__", "__ne__")


def _asked_outside_jax(own_code_too: bool = False, depth: int = 2) -> bool:
    """Is the innermost frame outside jax's package (past ``__eq__``/``__ne__``
    of the dims and generated dunders) one of the user's code or another library? ``own_code_too``:
    pallaskit's own frames count as jax's. ``depth``: frames from here to the dim's dunder's caller."""
    frame = sys._getframe(depth)
    while frame is not None and (frame.f_code.co_filename.endswith("shape_poly.py") or _generated(frame.f_code)):
        frame = frame.f_back
    if frame is None:
        return False
    name = frame.f_code.co_filename
    return not name.startswith(_JAX_DIR) and not (own_code_too and name.startswith(_OWN_DIRS))


def _record_use(describe) -> None:
    """Record the first use of a dim that no guard can check (``describe()``: what
    the function did with it), made while tracing symbolically, outside jax and
    pallaskit. Called from the dim's dunders: ``_asked_outside_jax`` looks two frames up."""
    hashed = getattr(EQ_RECORD, "hashed", None)
    if hashed is not None and not hashed and _asked_outside_jax(own_code_too=True, depth=3):
        hashed.append(describe())


def install_eq_recorder() -> bool:
    """Wrap ``_DimExpr.__eq__`` once; False where this jax's class is not there."""
    try:
        from jax._src.export import shape_poly
        cls = shape_poly._DimExpr
    except (ImportError, AttributeError):
        return False
    if getattr(cls.__eq__, "_pallaskit_recorder", False):
        return True
    original = cls.__eq__
    original_hash = cls.__hash__
    original_text = {name: cls.__dict__[name] for name in ("__str__", "__repr__") if name in cls.__dict__}

    def __eq__(self, other):
        result = original(self, other)
        diffs = getattr(EQ_RECORD, "diffs", None)
        if (diffs is not None and result is False and not getattr(EQ_RECORD, "busy", False)
                and _asked_outside_jax()):
            EQ_RECORD.busy = True
            try:
                diff = self - other
                if jax.export.is_symbolic_dim(diff):
                    diffs.append(diff)
            except Exception:  # noqa: BLE001  (another scope, a non-dim operand: decided, nothing to guard)
                pass
            finally:
                EQ_RECORD.busy = False
        return result

    def __hash__(self):
        _record_use(lambda: f"hashes the dynamic size {self} (a dict or set lookup keyed by it)")
        return original_hash(self)

    def recording_text(name, original_fn):
        def text(self):
            _record_use(lambda: f"turns the dynamic size {original_fn(self)} into text")
            return original_fn(self)
        text.__name__ = name
        return text

    __eq__._pallaskit_recorder = True
    for name, fn in original_text.items():
        setattr(cls, name, recording_text(name, fn))
    cls.__hash__ = __hash__  # before __eq__: the marker on __eq__ says all are installed
    cls.__eq__ = __eq__
    return True


def hold(entry, values: dict) -> bool:
    """Does no shape guard's difference vanish at these sizes? (An expression
    that cannot be evaluated counts as broken: a static compile is always right.)"""
    for diff in entry.shape_guards:
        try:
            evaluate = getattr(diff, "_evaluate", None) or diff.evaluate
            if int(evaluate(values)) == 0:
                return False
        except Exception:  # noqa: BLE001
            return False
    return True
