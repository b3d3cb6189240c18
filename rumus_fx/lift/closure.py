"""What a lifted function reads without receiving it: closure cells, globals,
default arguments and the attributes of a bound object.

Note [Closures of a lifted function]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``rf.lift(fun)`` caches one compiled program per signature. A function also reads
values it was not given: a module-level target array, a NumPy constant, a Python
scale factor, ``self.w`` of a callable object. Before each call ``scan`` walks what
``fun`` can reach:

- the cells of its closure, the globals its code names (``co_names``, nested code
  objects included), its default and keyword-default arguments;
- for a bound method or a callable object, the attributes of the object that the
  code names (``self.w``), the methods and properties of its class it names, and the
  values its classes hold under those names (a class-level ``scale = 2.0`` read as
  ``self.scale``, unless the object's own attribute hides it);
- functions reached that way (the helpers a loss calls), objects and modules
  (``mod.Y``), and the elements of lists, tuples and dicts held there.

Arrays found (jax and NumPy arrays, Tensors tracked or not) become extra inputs of
the program: their current values are passed on every call, so a rebound global, a
NumPy array written in place or a swapped attribute is always seen, and a hit of the
cache needs only the same shapes and dtypes. Everything else found is static and
part of the cache key: the code objects, Python scalars by value (a function may
branch on one, so a changed scalar means a new trace), other objects by identity.
While the function is traced, each array at its place (cell, global, default,
attribute, class attribute, list or dict item; a tuple is rebuilt) is replaced by the trace's input
and put back afterwards; a Tensor stays in place and its reads are redirected.

Repeated calls. The walk is kept (``_Plan``, per function, holding a function
weakly: it goes with the function) with the reads that decided it: each place it
looked at (a cell, a global or its absence, a default, an attribute, a list's
length and items, a dict's keys and items, a function's code and defaults, an
object's class, bases and ``__dict__``, and the attributes of the names its code
reads that its classes and ``__dict__`` hold or lack). The next call reads those
places again and compares: the same object (an array: the same type; a Python
scalar: the same value), else the function is walked afresh. So a repeated call
costs a few reads, no walk, and the cache key's static part is the kept one
(hashed once). Not read again: a function's, class's or module's ``__module__``
and ``__name__`` (they decide only whether it is looked into). A NumPy array is
compared byte for byte with the copy made at its last call (so -0.0 written over
0.0 is seen) and that copy's device array reused when equal.

Untracked Tensors read this way are live: each call reads the Tensor's value at that
moment (a Tensor rebound or written in place between calls is seen by the next call).
Within one call they are snapshotted: writing one in place between that call and its
backward raises ``rf.VersionMismatch``, as for a tracked input.

Reads the walk cannot see. Some reads are not walked: an attribute or a global
named by a computed string (``getattr``, ``vars``, ``globals()``, ``eval``,
``attrgetter``), a module imported inside the function, an object's or a module's
``__getattr__``, ``__slots__``, a descriptor of the user's own (not a function or
property), a user's function held by a library's wrapper (``jax.jit(f)``,
``jax.vmap(f)``), a function or object more than ``DEPTH`` steps away, a walk over
``MAX_NODES`` values. Whatever such a read finds is baked into the trace (an
array as a constant, a Python value as a literal), and a cached program would
keep it: a wrong gradient with no error once the value changes. So when the walk
meets one of them in the user's own code (installed packages' functions are taken
to read their own, fixed, state that way), or when the traced program holds a
device array it was not given, the function is *volatile*: it is traced on every
call, as ``jax.grad`` runs it, and its compiled program is reused only while the
trace is the same (its text, literals included, and its constants:
``tracing._fingerprint``). A user's class read as a value (``Config.scale``)
is walked: its values under the names the code reads are read again each call.
A Tensor read where the walk does not reach is captured and the call traced
afresh each time (correct, not cached). While a trace runs (the first call, or after a
static change) the closure's places hold the trace's inputs: another thread reading
the same global at that moment sees them (traces of lifted functions themselves take
turns). A function that needs a closed-over array's value
while tracing (``if float(y[0]) > 0``, NumPy functions on it) cannot take it as an
input: it is traced per call with the value baked in, as ``jax.jit`` would bake it.
"""

from __future__ import annotations

import dis
import operator
import sys
import threading
import types
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial as functools_partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..tensor import Tensor

DEPTH = 6  # functions / objects followed this many steps from the lifted function
MAX_NODES = 512  # values looked at per walk; beyond, the closure is not taken apart (traced per call)

# modules whose functions and objects are not looked into (their globals are the
# library's own); rumus_fx's functions are looked into only as the lifted function
_LIBRARY = (
    "jax",
    "jaxlib",
    "numpy",
    "scipy",
    "ml_dtypes",
    "builtins",
    "functools",
    "operator",
    "math",
    "typing",
    "abc",
    "collections",
    "weakref",
    "contextlib",
    "threading",
)
_OWN = "rumus_fx"
_SKIPPED = (*_LIBRARY, _OWN)
_SCALARS = (type(None), bool, int, str, bytes, type(Ellipsis))
_INEXACT = (float, complex, np.generic)

_TRACES = 0
_WALKS = 0
_SUBSTITUTING = threading.RLock()  # one substituted trace at a time (a nested lift re-enters)


def traces() -> int:
    """How many times ``rf.lift`` has traced a function in this process (a
    cache hit does not trace)."""
    return _TRACES


def walks() -> int:
    """How many times ``rf.lift`` has walked what a function reads in full (a
    repeated call whose reads compare as before does not: ``_Plan``)."""
    return _WALKS


def count_trace() -> None:
    global _TRACES
    _TRACES += 1


class _Ident:
    """A key part that compares by identity (and keeps the object alive, so its
    id is not reused while the key is held)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Ident) and other.obj is self.obj


# -- places a value is read from -------------------------------------------------


class _Cell:
    __slots__ = ("cell",)

    def __init__(self, cell: Any):
        self.cell = cell

    def get(self) -> Any:
        return self.cell.cell_contents

    def set(self, v: Any) -> None:
        self.cell.cell_contents = v


class _Item:
    __slots__ = ("d", "k")

    def __init__(self, d: Any, k: Any):
        self.d, self.k = d, k

    def get(self) -> Any:
        return self.d[self.k]

    def set(self, v: Any) -> None:
        self.d[self.k] = v


class _ClassItem:
    __slots__ = ("cls", "name")

    def __init__(self, cls: type, name: str):
        self.cls, self.name = cls, name

    def get(self) -> Any:
        return self.cls.__dict__[self.name]

    def set(self, v: Any) -> None:
        type.__setattr__(self.cls, self.name, v)


class _Default:
    __slots__ = ("f", "i")

    def __init__(self, f: Any, i: int):
        self.f, self.i = weakref.ref(f), i  # (a kept plan does not keep the function alive)

    def get(self) -> Any:
        return self.f().__defaults__[self.i]

    def set(self, v: Any) -> None:
        f = self.f()
        d = list(f.__defaults__)
        d[self.i] = v
        f.__defaults__ = tuple(d)


# what a value is, by its type (looked up once per type: isinstance against
# jax.Array, an ABC, costs more than the rest of a value's visit)
_ARRAY, _NUMPY_ARRAY, _SCALAR, _INEXACT_SCALAR, _CONTAINER, _PARTIAL, _FUNCTION, _METHOD, _MODULE, _OTHER = range(10)
_KINDS: dict[type, int] = {}


def _kind_of(t: type) -> int:
    k = _KINDS.get(t)
    if k is None:
        if issubclass(t, (Tensor, jax.Array)):
            k = _ARRAY
        elif issubclass(t, np.ndarray):
            k = _NUMPY_ARRAY
        elif t in _SCALARS:
            k = _SCALAR
        elif issubclass(t, _INEXACT):
            k = _INEXACT_SCALAR
        elif t is list or t is dict or t is tuple or (issubclass(t, tuple) and hasattr(t, "_fields")):
            k = _CONTAINER
        elif issubclass(t, functools_partial):
            k = _PARTIAL
        elif t is types.FunctionType:
            k = _FUNCTION
        elif t is types.MethodType:
            k = _METHOD
        elif issubclass(t, types.ModuleType):
            k = _MODULE
        else:
            k = _OTHER
        _KINDS[t] = k
    return k


def _is_array(v: Any) -> bool:
    k = _kind_of(type(v))
    return k == _ARRAY or (k == _NUMPY_ARRAY and v.dtype.kind in "biufc")


def _container(v: Any) -> bool:
    return _kind_of(type(v)) == _CONTAINER


_NAMES: dict[Any, tuple[str, ...]] = {}


def _code_names(code: types.CodeType) -> tuple[str, ...]:
    """The names a code object (and the code objects nested in it) reads, and
    the identifiers among its string constants."""
    names = _NAMES.get(code)
    if names is None:
        out: dict[str, None] = {}
        todo = [code]
        while todo:
            c = todo.pop()
            out.update(dict.fromkeys(c.co_names))
            # names given as strings (``self.__dict__["w"]``, ``hasattr(self, "w")``)
            out.update(dict.fromkeys(x for x in c.co_consts if type(x) is str and x.isidentifier()))
            todo.extend(x for x in c.co_consts if isinstance(x, types.CodeType))
        names = tuple(out)
        if len(_NAMES) > 4096:
            _NAMES.clear()
        _NAMES[code] = names
    return names


# names through which a function reads what no walk can follow (an attribute
# or a global named by a string, a module imported inside it)
_DYNAMIC = frozenset(
    {"getattr", "vars", "globals", "locals", "eval", "exec", "__import__", "import_module", "attrgetter",
     "methodcaller", "__getattribute__"}
)  # fmt: skip
_IMPORTS = frozenset(dis.opmap[n] for n in ("IMPORT_NAME", "IMPORT_FROM") if n in dis.opmap)
_OPAQUE_CODE: dict[Any, bool] = {}


def _code_opaque(code: types.CodeType) -> bool:
    """Whether a code object (or one nested in it) reads state by a computed
    name or imports a module: what it reads that way is not walked."""
    found = _OPAQUE_CODE.get(code)
    if found is None:
        found = bool(_DYNAMIC.intersection(_code_names(code)))
        todo = [code]
        while todo and not found:
            c = todo.pop()
            found = any(op in _IMPORTS for op in c.co_code[::2])
            todo.extend(x for x in c.co_consts if isinstance(x, types.CodeType))
        if len(_OPAQUE_CODE) > 4096:
            _OPAQUE_CODE.clear()
        _OPAQUE_CODE[code] = found
    return found


_TRUSTED: dict[str, bool] = {}


def _installed(module: str) -> bool:
    """Whether ``module`` is an installed package's (site-packages, the standard
    library, rumus_fx): its computed reads are taken to be of its own state,
    which does not change between a user's calls. A user's own modules
    (``__main__``, a project's files, a notebook) are not."""
    found = _TRUSTED.get(module)
    if found is None:
        root = module.partition(".")[0]
        try:
            path = getattr(sys.modules.get(root), "__file__", None) or ""
        except Exception:  # (a module's own __getattr__ refusing)
            path = ""
        found = (
            root in sys.stdlib_module_names
            or root == _OWN
            or any(d in path for d in ("site-packages", "dist-packages"))
        )
        _TRUSTED[module] = found
    return found


def _wraps_user_code(v: Any) -> bool:
    """Whether a library's function or object calls a user's function it holds
    (``__wrapped__``, or a closure cell as in ``jax.vmap(f)``), which the walk
    does not follow."""
    try:
        held = [v.__wrapped__]
    except Exception:
        held = []
    if type(v) is types.FunctionType:
        for c in v.__closure__ or ():
            try:
                held.append(c.cell_contents)
            except ValueError:
                pass
    return any(callable(h) and not isinstance(h, type) and not _installed(_module(h)) for h in held if h is not None)


def _module(v: Any) -> str:
    if isinstance(v, types.ModuleType):
        return v.__name__
    m = getattr(v, "__module__", None)
    return m if isinstance(m, str) else ""


class Closure:
    """What one call of a function reads: ``arrays`` (the objects found, in the
    walk's order), ``values`` (the jax arrays passed for them), ``tracked``
    (which are tracked Tensors), the static ``key`` (hashes once; None when a
    part of it does not hash) and the places to put the trace's inputs
    (``substituted``)."""

    __slots__ = ("arrays", "key", "plan", "tracked", "values")

    def __init__(self, plan: _Plan, arrays: list, values: list, tracked: tuple[bool, ...]):
        self.plan, self.key, self.arrays, self.values, self.tracked = plan, plan.key, arrays, values, tracked

    def signature(self, of: Callable[[Any], Any]) -> tuple:
        """``of(value)`` for each value (its type, for the cache key); the last
        call's when the values are the same objects (jax arrays do not change)."""
        values = self.values
        last = self.plan.last
        if last is not None and len(last[0]) == len(values) and all(r() is v for r, v in zip(last[0], values)):
            return last[1]
        sig = tuple(of(v) for v in values)
        try:
            self.plan.last = ([weakref.ref(v) for v in values], sig)
        except TypeError:  # (a value that cannot be weakly referenced)
            pass
        return sig

    @contextmanager
    def substituted(self, inputs: Sequence[Any], bind: dict[int, Any]) -> Iterator[None]:
        """Each array at its place replaced by its input (Tensors: their reads
        redirected through ``bind``), put back on exit."""
        undo: list[Callable[[], None]] = []
        seen: set[int] = set()
        _SUBSTITUTING.acquire()
        try:
            for site, start, stop in self.plan.sites:
                old = site.get()
                new = _put(old, iter(inputs[start:stop]), bind, undo, seen)
                if new is not old:
                    site.set(new)
                    undo.append(functools_partial(site.set, old))
            yield
        finally:
            for u in reversed(undo):
                u()
            _SUBSTITUTING.release()


# -- reads: how each place the walk looked at is looked at again ----------------
#
# A read is ``(fn, a, b, check, want)``: ``fn(a, b)`` gives the value now, ``check``
# says how it must compare with ``want``, the walk's value (Note [Closures of a
# lifted function], "Repeated calls").
_SAME, _ARRAY_OF, _EQUAL, _NUMPY_OF, _SCALAR_OF, _INEXACT_OF, _METHOD_OF = range(7)
_MISSING = object()  # an empty closure cell


def _cell_value(cell: Any, _: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:
        return _MISSING


_KNOWN_DESCRIPTORS = (types.FunctionType, property, staticmethod, classmethod)


def _class_value(cls: type, name: str) -> Any:
    return cls.__dict__.get(name, _MISSING)


def _keys(d: dict, _: Any) -> tuple:
    return tuple(d)


def _len(v: Any, _: Any) -> int:
    return len(v)


def _function_same(f: Any, state: tuple) -> bool:
    code, defaults, kwdefaults = state
    return f.__code__ is code and f.__defaults__ is defaults and f.__kwdefaults__ is kwdefaults


def _absent(g: dict, names: tuple[str, ...]) -> bool:
    return g.keys().isdisjoint(names)


def _object_same(obj: Any, state: tuple) -> bool:
    """Whether what ``_Walk._object`` read of ``obj`` is as it was: its class
    and that class's bases, its ``__dict__`` object, each class's attributes of
    the names its code reads (the same objects, and no new one) and none of
    those names newly in its ``__dict__`` (those it held are read next)."""
    cls, mro, attrs, classes, absent = state
    if type(obj) is not cls or cls.__mro__ is not mro or getattr(obj, "__dict__", None) is not attrs:
        return False
    for keys, proxy, missing, values in classes:
        if not keys.isdisjoint(missing):
            return False
        for n, a in values:
            if proxy[n] is not a:
                return False
    return absent is None or attrs.keys().isdisjoint(absent)


def _class_names(classes: tuple[type, ...], names: frozenset[str]) -> set[str]:
    """The names among ``names`` that the classes' own dictionaries hold."""
    found: set[str] = set()
    for c in classes:
        found |= names & c.__dict__.keys()
    return found


class _Static(tuple):
    """The static key of a closure: hashed once (a repeated call passes the same
    object, which the program cache compares by identity first)."""

    __slots__ = ()

    def __new__(cls, parts: tuple) -> _Static:
        return tuple.__new__(cls, (hash(parts), parts))

    def __hash__(self) -> int:
        return self[0]

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, _Static) and self[0] == other[0] and self[1] == other[1])

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)


class _Walk:
    """One walk of what a function reads: the static ``key``, the ``arrays``
    (in order), the ``sites`` holding them and the ``reads`` that decide all
    of it."""

    def __init__(self) -> None:
        self.key: list[Any] = []
        self.arrays: list[Any] = []
        self.sites: list[tuple[Any, int, int]] = []
        self.reads: list[tuple[Any, Any, Any, int, Any]] = []
        self.names: set[str] = set()
        self.seen: dict[int, Any] = {}
        self.containers: dict[int, int] = {}
        self.todo: list[tuple[Any, int, bool]] = []
        self.nodes = 0
        self.complete = True
        # something fun may read was not walked (Note [Closures of a lifted
        # function], "Reads the walk cannot see"): its program is traced on every call
        self.opaque = False
        self.classes: list[type] = []  # the user's classes reached as values
        self.instance_classes: set[type] = set()  # the user's classes of the objects walked

    def _read(self, fn: Callable[[Any, Any], Any], a: Any, b: Any, depth: int) -> Any:
        """The key of ``fn(a, b)``, a value held at a place that may change
        (noted, to be read again by the next call)."""
        return self._value(fn(a, b), depth, (fn, a, b))

    def _value(self, v: Any, depth: int, read: tuple | None = None) -> Any:
        """The key of ``v``; arrays in it are collected (in order), functions and
        objects are queued to be looked into. ``read``: where ``v`` was read
        (None: a value fixed by what holds it, as a tuple's item)."""
        self.nodes += 1
        if self.nodes > MAX_NODES:
            self.complete = False
            return _Ident(v)
        t = type(v)
        kind = _kind_of(t)
        note = self.reads.append
        if kind == _ARRAY or (kind == _NUMPY_ARRAY and v.dtype.kind in "biufc"):
            # (a fixed array is noted too: the next call collects it at its turn)
            note((*(read or (_const, v, None)), _NUMPY_OF if kind == _NUMPY_ARRAY else _ARRAY_OF, t))
            self.arrays.append(v)
            return "A"
        if kind == _SCALAR:
            if read is not None:
                note((*read, _SCALAR_OF, v))
            return (t, v)
        if kind == _INEXACT_SCALAR:
            if read is not None:
                note((*read, _INEXACT_OF, v))
            return (t, repr(v))  # 0.0 vs -0.0, nan
        if read is not None:
            note((*read, _METHOD_OF, (v.__func__, v.__self__)) if kind == _METHOD else (*read, _SAME, v))
        if kind == _CONTAINER:
            k = self.containers.get(id(v))
            if k is not None:  # the same list or dict again: substituted once
                return ("alias", k)
            self.containers[id(v)] = len(self.containers)
            self.seen.setdefault(id(v), v)
            if t is dict:
                note((_keys, v, None, _EQUAL, tuple(v)))
                return (t, tuple((k, self._read(operator.getitem, v, k, depth)) for k in list(v)))
            if t is list:
                note((_len, v, None, _EQUAL, len(v)))
                return (t, tuple(self._read(operator.getitem, v, i, depth) for i in range(len(v))))
            return (t, tuple(self._value(x, depth) for x in v))  # a tuple's items are fixed
        if kind == _PARTIAL:
            self.todo.append((v, depth, True))
            return ("partial", v.func if isinstance(v.func, types.FunctionType) else _Ident(v.func))
        if kind == _FUNCTION:
            mod = v.__module__ or ""
            if depth > 0 and not mod.startswith(_SKIPPED):
                self.todo.append((v, depth - 1, True))
                return ("f", v.__code__)
            if mod.startswith(_OWN):  # not looked into, but the attributes it names count
                self.names.update(_code_names(v.__code__))
            elif not _installed(mod) or _wraps_user_code(v):
                # a function too far away to be walked, or a library's wrapper of a
                # user's function (``jax.vmap(f)``): f is not walked
                self.opaque = True
            return _Ident(v)
        if kind == _METHOD:  # a new object at each attribute read
            self.todo.append((v, depth - 1, True))
            return "m"
        if kind == _MODULE:
            if not v.__name__.startswith(_SKIPPED):
                if depth > 0:
                    self.todo.append((v, depth - 1, True))
                elif not _installed(v.__name__):
                    self.opaque = True
            return _Ident(v)
        if isinstance(v, type):
            if not _installed(_module(v)) and v not in self.classes:
                self.classes.append(v)  # its values are read at the end (``read_classes``)
        elif not _module(t).startswith(_LIBRARY):
            if depth > 0 and hasattr(v, "__dict__"):
                self.todo.append((v, depth - 1, True))
            elif not _installed(_module(t)):
                self.opaque = True  # an object too far away, or without a __dict__ (slots)
        elif _wraps_user_code(v):
            self.opaque = True  # a library wrapper of a user's function (jax.jit(f)): f is not walked
        return _Ident(v)

    def _site(self, site: Any, read: tuple | None, v: Any, tag: Any, depth: int) -> None:
        start = len(self.arrays)
        self.key.append((tag, self._value(v, depth, read)))
        if len(self.arrays) > start:
            self.sites.append((site, start, len(self.arrays)))

    def _function(self, f: types.FunctionType, depth: int) -> None:
        code = f.__code__
        names = _code_names(code)
        if _code_opaque(code) and not _installed(f.__module__ or ""):
            self.opaque = True
        self.names.update(names)
        self.key.append(("fn", code))
        defaults, kwdefaults = f.__defaults__, f.__kwdefaults__
        self.reads.append((_function_same, f, (code, defaults, kwdefaults), _SAME, True))
        for i, c in enumerate(f.__closure__ or ()):
            self._site(_Cell(c), (_cell_value, c, None), _cell_value(c, None), ("cell", i), depth)
        g = f.__globals__
        absent = []
        for n in names:
            if n in g:
                self._site(_Item(g, n), (operator.getitem, g, n), g[n], ("g", n), depth)
            else:
                absent.append(n)
        if absent:  # (defined later, it is read instead of a builtin)
            self.reads.append((_absent, g, tuple(absent), _SAME, True))
        for i, v in enumerate(defaults or ()):
            self._site(_Default(f, i), None, v, ("d", i), depth)
        if kwdefaults:
            self.reads.append((_keys, kwdefaults, None, _EQUAL, tuple(kwdefaults)))
            for n, v in list(kwdefaults.items()):
                self._site(_Item(kwdefaults, n), (operator.getitem, kwdefaults, n), v, ("kw", n), depth)

    def _object(self, obj: Any, depth: int) -> None:
        """The attributes of ``obj`` its code names (the class's methods and
        properties it names are looked into first, their names added)."""
        self.key.append(("o", _Ident(obj)))
        cls = type(obj)
        attrs = getattr(obj, "__dict__", None)
        if not _installed(_module(cls)):
            self.instance_classes.add(cls)
        if isinstance(obj, types.ModuleType) and "__getattr__" in obj.__dict__ and not _installed(obj.__name__):
            self.opaque = True  # a module's computed attributes (PEP 562)
        if any(
            n in c.__dict__ and not _installed(_module(c))
            for c in cls.__mro__[:-1]
            for n in ("__getattr__", "__getattribute__")
        ):
            self.opaque = True  # attributes computed on access
        class_names = None
        if not isinstance(obj, types.ModuleType):
            done: set[str] = set()
            bases = cls.__mro__[:-1]
            while True:
                class_names = frozenset(self.names | {"__call__"})
                class_found = _class_names(bases, class_names)
                wanted = class_found - done
                if not wanted:
                    break
                for n in sorted(wanted):
                    done.add(n)
                    a = _class_attr(cls, n)
                    if a is None:
                        continue
                    fns = [a.fget] if isinstance(a, property) else [getattr(a, "__func__", a)]
                    for fn in fns:
                        if isinstance(fn, types.FunctionType) and id(fn) not in self.seen:
                            self.seen[id(fn)] = fn
                            if _module(fn).startswith(_LIBRARY + (_OWN,)):
                                self.names.update(_code_names(fn.__code__))
                            else:
                                self._function(fn, depth)
                self._drain()  # functions they call may name more attributes
        # each class's attributes of those names (the last round's names hold the
        # earlier rounds': one check covers them all), as ``_class_attr`` reads them
        classes = []
        if class_names is not None:
            for c in cls.__mro__[:-1]:
                proxy = c.__dict__
                keys = proxy.keys()  # (a live view of the class's own dictionary)
                defined = sorted(class_names & keys)
                missing = tuple(class_names.difference(defined))
                classes.append((keys, proxy, missing, tuple((n, proxy[n]) for n in defined)))
        # values the classes hold under those names (a class-level constant read as
        # ``self.scale``), unless the object's own ``__dict__`` hides them; methods,
        # properties and other descriptors are not values (fixed by the check above)
        taken: set[str] = set()
        for c, (*_, values) in zip(cls.__mro__, classes):
            for n, a in values:
                if n in taken:
                    continue
                taken.add(n)
                if (isinstance(attrs, dict) and n in attrs) or hasattr(type(a), "__get__"):
                    continue
                self._site(_ClassItem(c, n), None, a, ("ca", n), depth)
        if not isinstance(attrs, dict):
            self.reads.append((_object_same, obj, (cls, cls.__mro__, attrs, tuple(classes), None), _SAME, True))
            return
        found = sorted(attrs.keys() & self.names)
        absent = tuple(self.names.difference(found))
        self.reads.append((_object_same, obj, (cls, cls.__mro__, attrs, tuple(classes), absent), _SAME, True))
        for n in found:  # (written back into the dictionary: frozen dataclasses too)
            self._site(_Item(attrs, n), (operator.getitem, attrs, n), attrs[n], ("a", n), depth)

    def read_classes(self) -> None:
        """What the user's classes the walk reached hold under the names the code
        reads: a value (``Config.scale``) is read again by each call, a function
        (``Helpers.f``: a static or class method, a property) is walked; and a
        descriptor of another kind there, on a class of a walked object too,
        computes what it returns: not walked (``opaque``)."""
        done: set[tuple[int, str]] = set()
        while True:
            todo = []
            for c in self.classes:
                for k in c.__mro__[:-1]:
                    todo.extend((k, n) for n in sorted(self.names.intersection(k.__dict__)) if (id(k), n) not in done)
            if not todo:
                break
            for k, n in todo:
                done.add((id(k), n))
                v = k.__dict__[n]
                if not hasattr(type(v), "__get__"):
                    self._site(_ClassItem(k, n), (_class_value, k, n), v, ("cv", n), 0)
                    continue
                fn = v.fget if isinstance(v, property) else getattr(v, "__func__", v)
                if isinstance(fn, types.FunctionType):
                    self._push(fn, 2)
                elif not _installed(_module(type(v))):
                    self.opaque = True
            self._drain()
        for c in self.instance_classes:
            for k in c.__mro__[:-1]:
                for n in self.names.intersection(k.__dict__):
                    v = k.__dict__[n]
                    if hasattr(type(v), "__get__") and not isinstance(v, _KNOWN_DESCRIPTORS):
                        if not _installed(_module(type(v))):
                            self.opaque = True

    def _drain(self) -> None:
        while self.todo:
            v, depth, _ = self.todo.pop(0)
            if id(v) in self.seen and not _container(v):
                continue
            self.seen[id(v)] = v
            if isinstance(v, types.FunctionType):
                self._function(v, depth)
            elif isinstance(v, types.MethodType):
                self.key.append(("m",))
                self._push(v.__func__, depth + 1)
                self._drain()
                self._push(v.__self__, depth + 1)
            elif isinstance(v, functools_partial):
                start = len(self.arrays)
                self.key.append(("p", self._value(v.args, depth), self._value(v.keywords, depth)))
                if len(self.arrays) > start:  # a partial's arrays cannot be replaced in it
                    self.complete = False
                self._push(v.func, depth)
            else:
                self._object(v, depth)

    def _push(self, v: Any, depth: int) -> None:
        self.key.append(("root", self._value(v, depth)))


def _const(v: Any, _: Any) -> Any:
    return v


class _Plan:
    """A walk kept for the next calls of the same function: its ``reads`` are
    read again and, when each compares as before, the walk's key and sites hold
    and the arrays read are the call's arrays."""

    __slots__ = (
        "calls", "complete", "fun", "key", "last", "opaque", "plain", "reads", "sites", "tensors", "untracked"
    )  # fmt: skip

    def __init__(self, fun: Any, calls: tuple, walk: _Walk):
        # a function (or bound method) weakly: a lifted lambda made at each step
        # is dropped with its plan, and what it closes over is not kept alive by
        # the plan. (A callable object is named in the key, by identity, as in
        # the program cache's keys: kept.)
        self.fun: Callable[[], Any] = Strong(fun)
        self.reads = walk.reads
        if isinstance(fun, (types.FunctionType, types.MethodType)):
            self.fun = weakref.ref(fun, functools_partial(_forget, id(fun)))
            self.reads = [_weakly(r, fun, self.fun) for r in walk.reads]
        self.calls, self.sites = calls, walk.sites
        self.complete = walk.complete
        self.opaque = walk.opaque
        self.last: tuple[list, tuple] | None = None  # the last call's values (weakly) and their signature
        try:
            self.key: _Static | None = _Static(tuple(walk.key))
        except TypeError:  # a static part that does not hash: not cached
            self.key = None
        types_ = [r[4] for r in walk.reads if r[3] in (_ARRAY_OF, _NUMPY_OF)]
        # jax arrays only: they are their own values, and none is tracked
        self.plain = all(_kind_of(t) == _ARRAY and not issubclass(t, Tensor) for t in types_)
        self.tensors = any(issubclass(t, Tensor) for t in types_)
        self.untracked = (False,) * len(types_)

    def replay(self) -> list[Any] | None:
        """The arrays read now, or None when a read differs (walk again)."""
        arrays: list[Any] = []
        try:
            for fn, a, b, check, want in self.reads:
                v = fn(a, b)
                if check == _SAME:
                    if v is not want:
                        return None
                elif check == _ARRAY_OF:
                    if type(v) is not want:
                        return None
                    arrays.append(v)
                elif check == _EQUAL:
                    if v != want:
                        return None
                elif check == _NUMPY_OF:
                    if type(v) is not want or v.dtype.kind not in "biufc":
                        return None
                    arrays.append(v)
                elif check == _SCALAR_OF:
                    if v is not want and (type(v) is not type(want) or v != want):
                        return None
                elif check == _INEXACT_OF:
                    if v is not want and (type(v) is not type(want) or repr(v) != repr(want)):
                        return None
                elif type(v) is not types.MethodType or v.__func__ is not want[0] or v.__self__ is not want[1]:
                    return None  # (_METHOD_OF)
        except Exception:  # a place gone (a deleted name, a shorter list): walk again
            return None
        return arrays

    def closure(self, arrays: list[Any]) -> Closure | None:
        if not self.complete:
            return None
        if self.plain:
            return Closure(self, arrays, arrays, self.untracked)
        values = [_current(v) for v in arrays]
        if not self.tensors:
            return Closure(self, arrays, values, self.untracked)
        tracked = tuple(isinstance(v, Tensor) and v.grad_id is not None for v in arrays)
        return Closure(self, arrays, values, tracked)


def _put(v: Any, it: Iterator[Any], bind: dict[int, Any], undo: list, seen: set[int]) -> Any:
    """``v`` with its arrays replaced by the next inputs (the walk's order);
    lists and dicts are changed in place (recorded in ``undo``)."""
    if _is_array(v):
        x = next(it)
        if isinstance(v, Tensor):
            bind[id(v)] = x
            return v
        return x
    if not _container(v):
        return v
    if id(v) in seen:
        return v
    seen.add(id(v))
    t = type(v)
    if t is list or t is dict:
        for k, e in list(v.items() if t is dict else enumerate(v)):
            n = _put(e, it, bind, undo, seen)
            if n is not e:
                v[k] = n
                undo.append(functools_partial(v.__setitem__, k, e))
        return v
    items = [_put(e, it, bind, undo, seen) for e in v]
    if all(a is b for a, b in zip(items, v)):
        return v
    return t(items) if t is tuple else t(*items)


def _class_attr(cls: type, name: str) -> Any:
    for c in cls.__mro__:
        if c is object:
            return None
        a = c.__dict__.get(name)
        if a is not None:
            return a if isinstance(a, (types.FunctionType, property, staticmethod, classmethod)) else None
    return None


def _current(v: Any) -> Any:
    """The value passed for an array of the closure. A NumPy array is read anew
    on every call (it may have been written in place): a small one is compared
    byte for byte with the copy made at the last call and that copy's device
    array reused when equal (a transfer costs more than the comparison); a large
    one is copied (a later in-place write must not reach this call's program or
    residuals) and handed to the compiled program like its other inputs."""
    if type(v) is not np.ndarray:
        if isinstance(v, Tensor):
            return v.value
        if not isinstance(v, np.ndarray):
            return v
    hit = _NUMPY.get(id(v))
    if hit is not None and hit[0]() is v and hit[1] == v.shape and hit[2] is v.dtype:
        # the same array, shape and dtype as when cached (so small enough): compare the bytes
        raw = v.tobytes()
        if raw == hit[3]:
            return hit[4]
    elif v.nbytes > _NUMPY_CACHED_BYTES:
        return np.array(v, dtype=jax.dtypes.canonicalize_dtype(v.dtype))
    else:
        raw = v.tobytes()
    dtype = jax.dtypes.canonicalize_dtype(v.dtype)
    x = jnp.asarray(np.array(v, dtype=dtype))
    if isinstance(x, jax.core.Tracer):  # made inside an enclosing trace: valid only there, never cached
        return x
    try:
        ref = weakref.ref(v)
    except TypeError:  # pragma: no cover - ndarrays are weakly referenceable
        return x
    if len(_NUMPY) >= 256:
        _NUMPY.clear()
    _NUMPY[id(v)] = (ref, v.shape, v.dtype, raw, x)
    return x


_NUMPY_CACHED_BYTES = 1 << 20
_NUMPY: dict[int, tuple[Any, tuple, Any, bytes, Any]] = {}


def scan(fun: Any, statics: Sequence[Any] = ()) -> Closure | None:
    """What ``fun`` (and the functions among ``statics``) read through closures,
    globals, defaults and a bound object: None when it cannot be taken apart
    (too large, or arrays held where they cannot be replaced). A repeated call
    reads again only the places the last walk read (``_Plan``)."""
    calls = tuple(s for s in statics if callable(s)) if statics else ()
    plan = _PLANS.get(id(fun))
    if plan is not None and plan.fun() is fun and (plan.calls is calls or _same_objects(plan.calls, calls)):
        arrays = plan.replay()
        if arrays is not None:
            return plan.closure(arrays)
    global _WALKS
    _WALKS += 1
    walk = _Walk()
    if isinstance(fun, types.FunctionType) and not _module(fun).startswith(_LIBRARY):
        walk.seen[id(fun)] = fun
        walk._function(fun, DEPTH)  # the lifted function itself, rf's own included
    else:
        walk._push(fun, DEPTH + 1)
    for s in calls:
        walk._push(s, DEPTH)
    walk._drain()
    walk.read_classes()
    plan = _Plan(fun, calls, walk)
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.clear()
    _PLANS[id(fun)] = plan  # (dropped when fun is: _forget)
    return plan.closure(walk.arrays)


def _forget(key: int, ref: Any) -> None:
    """The function of a kept plan is gone: the plan too."""
    if _PLANS is None:  # (at interpreter exit, this module's globals are gone)
        return
    plan = _PLANS.get(key)
    if plan is not None and plan.fun is ref:
        del _PLANS[key]


class Strong:
    """A strong reference called as a ``weakref.ref`` is: for values that cannot be
    weakly referenced or must be kept (a callable object, a Python scalar)."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __call__(self) -> Any:
        return self.value


def _weakly(read: tuple, fun: Any, ref: Callable[[], Any]) -> tuple:
    """``read`` holding the lifted function itself through ``ref`` only."""
    fn, a, b, check, want = read
    if a is fun:
        fn, a, b = (_function_same_through, ref, b) if fn is _function_same else (_through, ref, (fn, b))
    if want is fun and check == _SAME:
        fn, a, b, want = _is_referent, (fn, a, b), ref, True
    return fn, a, b, check, want


def _function_same_through(ref: Callable[[], Any], state: tuple) -> bool:
    f = ref()
    code, defaults, kwdefaults = state
    return f.__code__ is code and f.__defaults__ is defaults and f.__kwdefaults__ is kwdefaults


def _through(ref: Callable[[], Any], read: tuple) -> Any:
    return read[0](ref(), read[1])


def _is_referent(read: tuple, ref: Callable[[], Any]) -> bool:
    return read[0](read[1], read[2]) is ref()


def _same_objects(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


_PLANS: dict[int, _Plan] = {}
_MAX_PLANS = 512
