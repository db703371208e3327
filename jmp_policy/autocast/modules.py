"""Modules in autocast's arguments: Flax NNX state and module paths as scopes.

Autocast traces ``fn`` on every call with its array leaves replaced by tracers
(see ``_api``). Two kinds of module need more than a pytree flatten:

* **Flax NNX** objects (modules, optimizers, ``Rngs``) hold mutable state and
  may share submodules. They are split with ``nnx.split`` (shared references
  once), merged again inside the trace, split again after ``fn`` ran, and the
  state ``fn`` wrote (BatchNorm statistics, RNG counters, any ``Variable``) is
  written back with ``nnx.update``, as ``nnx.jit`` does.
* **Flax NNX and Equinox** modules name no ``jax.named_scope``, so that
  operations inside them could not be told apart by autocast's rules, float8
  exclusions or the inspector. While ``fn`` is traced, every method of their
  classes runs under a name stack that is its attribute path from the root
  module, with the root's class name first, as Flax linen names its modules:
  ``Decoder/blocks/0/attn/q_proj``, and ``Decoder/embedder.attend`` for a
  method other than ``__call__``.

  The root modules are those in ``fn``'s arguments (or ``fn`` itself) and, as
  ``fn`` runs, any other module whose method is called while no module method
  of the trace runs: a model that ``fn`` rebuilds (``nnx.merge(graphdef,
  params)``, ``eqx.combine(params, static)``) or reads from a closure. Such a
  module is named when its first method is called, as if it had been passed
  in, so that a loss written either way has the same scopes. A module that
  is not a submodule of a running module's root (one an ``nnx.scan`` in the
  middle of a model merges afresh) opens no scope of its own.

  >>> import jax, jax.numpy as jnp, equinox as eqx, jmp_policy
  >>> class Net(eqx.Module):
  ...     head: eqx.nn.Linear
  ...     def __call__(self, x):
  ...         return self.head(x)
  >>> params, static = eqx.partition(Net(eqx.nn.Linear(2, 2, key=jax.random.key(0))),
  ...                                eqx.is_array)
  >>> loss = lambda p, x: eqx.combine(p, static)(x).sum()   # the model rebuilt inside
  >>> report = jmp_policy.inspect_numerics(loss, "mixed_bfloat16")(params, jnp.ones(2))
  >>> sorted({row.scope for row in report.rows})
  ['Net/head/eqx.nn.Linear']

``import jmp_policy`` never imports Flax or Equinox: a module of theirs can only
be in the arguments if the user imported them, so they are looked up in
``sys.modules``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import sys
import threading
import types
import weakref
from typing import Any, Callable, Iterator, Optional, Sequence

import jax
import numpy as np
from jax.extend import source_info_util
from jax.extend.core import ClosedJaxpr

__all__ = ["Call", "NnxState", "Path", "as_callable", "as_data", "call", "is_array", "is_nnx",
           "is_tracer", "module_paths", "module_scopes", "nnx_state", "write_back"]


def _nnx() -> Any:
    return sys.modules.get("flax.nnx")


def _eqx() -> Any:
    return sys.modules.get("equinox")


def is_nnx(x: Any) -> bool:
    """True for a Flax NNX object with state (a module, an optimizer, ``Rngs``, a ``Variable``)."""
    nnx = _nnx()
    return nnx is not None and isinstance(x, (nnx.Pytree, nnx.Variable))


def _is_eqx_module(x: Any) -> bool:
    eqx = _eqx()
    return eqx is not None and isinstance(x, eqx.Module)


def _is_module(x: Any) -> bool:
    nnx = _nnx()
    return (nnx is not None and isinstance(x, nnx.Module)) or _is_eqx_module(x)


def _module_classes() -> set[type]:
    """Every NNX and Equinox module class defined now whose methods may compute a model.

    Flax's and Equinox's own wrappers and helpers (transformations, bridges,
    containers, Equinox's internals) are left out: only their layers
    (``flax.nnx.nn``, ``equinox.nn``) and ``nnx.Sequential`` are models.
    """
    bases = [m.Module for m in (_nnx(), _eqx()) if m is not None]
    found: set[type] = set()
    todo = list(bases)
    while todo:
        for sub in type.__subclasses__(todo.pop()):
            if sub not in found:
                found.add(sub)
                todo.append(sub)
    return {cls for cls in found if _is_model_class(cls)}


def _is_model_class(cls: type) -> bool:
    module = cls.__module__
    if not module.startswith(("flax.", "equinox.")):
        return True
    return module.startswith(("flax.nnx.nn.", "equinox.nn.")) or (
        module == "flax.nnx.helpers" and cls.__name__ == "Sequential")


# --- The function as data --------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Method:
    """A bound method of a module, with the module as data (so it is flattened and traced)."""

    function: Callable[..., Any]
    module: Any


jax.tree_util.register_pytree_node(
    _Method, lambda m: ((m.module,), m.function), lambda f, children: _Method(f, children[0]))


def as_data(fn: Callable[..., Any]) -> Any:
    """``fn`` as something whose module state is traced: a module stays a module,
    a module's bound method becomes a `_Method`, any other callable stays as it is."""
    if inspect.ismethod(fn) and _is_module(fn.__self__):
        return _Method(fn.__func__, fn.__self__)
    return fn


def as_callable(callee: Any) -> Callable[..., Any]:
    """What `as_data` returned (rebuilt) as a callable again: a `_Method` as a bound method."""
    if isinstance(callee, _Method):
        return types.MethodType(callee.function, callee.module)
    fn: Callable[..., Any] = callee
    return fn


def call(callee: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """Calls what `as_data` returned (rebuilt from tracers) with ``args`` and ``kwargs``."""
    if isinstance(callee, _Method):
        return callee.function(callee.module, *args, **kwargs)
    return callee(*args, **kwargs)


# --- NNX state -------------------------------------------------------------------------

@dataclasses.dataclass
class NnxState:
    """The NNX objects among a call's leaves, split into a graph and its state (arrays)."""

    positions: list[int]
    graphdef: Any
    state: Any

    @classmethod
    def split(cls, leaves: Sequence[Any]) -> Optional[NnxState]:
        positions = [i for i, leaf in enumerate(leaves) if is_nnx(leaf)]
        if not positions:
            return None
        graphdef, state = _nnx().split(tuple(leaves[i] for i in positions))
        return cls(positions, graphdef, state)

    def merged(self, leaves: list[Any], state: Any) -> tuple[Any, ...]:
        """Fresh NNX objects holding ``state``, put in their places among ``leaves``."""
        objects = _nnx().merge(self.graphdef, state)
        for i, obj in zip(self.positions, objects):
            leaves[i] = obj
        return tuple(objects)


def nnx_state(objects: tuple[Any, ...]) -> Any:
    """The state of NNX objects, as `NnxState.split` takes it (after ``fn`` wrote to it)."""
    return _nnx().split(objects)[1]


def write_back(originals: Sequence[Any], before: Any, after: Any) -> None:
    """Writes the variables of ``after`` (`nnx_state` after the call) that differ from
    ``before`` (the state the call started from) into the caller's NNX objects.

    Only what changed is written, so that a call under an outer transformation
    (``jax.jit``) that writes nothing touches no variable of an outer trace
    level, which NNX refuses.
    """
    nnx = _nnx()
    old = dict(nnx.to_flat_state(before))
    changed = [(path, var) for path, var in nnx.to_flat_state(after)
               if path not in old or _value(var) is not _value(old[path])]
    if changed:
        nnx.update(tuple(originals), nnx.from_flat_state(changed))


def _value(variable: Any) -> Any:
    return variable.get_value() if hasattr(variable, "get_value") else variable


# --- Module paths --------------------------------------------------------------------------

Path = tuple[str, ...]


def module_paths(roots: Sequence[Any]) -> dict[int, tuple[Path, type]]:
    """``id(module) -> (path, class)`` for every NNX or Equinox module in ``roots`` (pytrees).

    A root module's path is its class name; a submodule's adds its attribute
    path (``("Decoder", "blocks", "0", "attn")``). A module reachable along two
    paths keeps the first found.
    """
    paths: dict[int, tuple[Path, type]] = {}
    for root in roots:
        for module in _modules_in(root):
            _walk(module, (type(module).__name__,), paths)
    return paths


def _modules_in(tree: Any) -> list[Any]:
    leaves = jax.tree_util.tree_leaves(tree, is_leaf=lambda x: _is_module(x) or is_nnx(x))
    return [leaf for leaf in leaves if _is_module(leaf)]


def _walk(module: Any, path: Path, paths: dict[int, tuple[Path, type]]) -> None:
    if id(module) in paths:
        return
    paths[id(module)] = (path, type(module))
    for name, child in _children(module):
        # NNX containers (nnx.List, nnx.Dict) are pytrees: flattened through to the modules.
        for key_path, sub in jax.tree_util.tree_flatten_with_path(child, is_leaf=_is_module)[0]:
            if _is_module(sub):
                _walk(sub, (*path, name, *map(_key_name, key_path)), paths)


def _children(module: Any) -> Iterator[tuple[str, Any]]:
    """A module's attributes that may hold submodules, by name."""
    if _is_eqx_module(module):
        for field in dataclasses.fields(module):
            yield field.name, getattr(module, field.name, None)
        return
    for name, value in vars(module).items():
        if not name.startswith("_"):
            yield name, value


def _key_name(key: Any) -> str:
    for attr in ("name", "key", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


# --- Scopes while fn is traced ------------------------------------------------------------

@dataclasses.dataclass
class _Trace:
    """The modules of one trace: their paths, and the module methods running now."""

    paths: dict[int, tuple[Path, type]]
    base: Any  # the name stack when the trace's function was called
    running: list[Path] = dataclasses.field(default_factory=list)
    # Root modules named while fn ran, held so that no other object takes their ids.
    adopted: list[Any] = dataclasses.field(default_factory=list)

    def adopt(self, module: Any) -> tuple[Path, type]:
        """Names ``module`` (one ``fn`` built or closed over) and its submodules as a root."""
        self.adopted.append(module)
        self.paths.pop(id(module), None)  # an object of another type that had its id
        _walk(module, (type(module).__name__,), self.paths)
        return self.paths[id(module)]


class _Active(threading.local):
    """The traces this thread is in, innermost last."""

    def __init__(self) -> None:
        self.stack: list[_Trace] = []


_ACTIVE = _Active()
_LOCK = threading.Lock()
_PATCHED: dict[tuple[type, str], tuple[Any, int]] = {}  # (class, name) -> (original, users)


@contextlib.contextmanager
def module_scopes(roots: Sequence[Any]) -> Iterator[None]:
    """Runs the block with the methods of every module in ``roots`` under its path as name stack."""
    paths = module_paths(roots)
    classes = {cls for _, cls in paths.values()} | _module_classes()
    if not classes:
        yield
        return
    names = list({name for cls in classes for name in _class_methods(cls)})
    _patch(names)
    _ACTIVE.stack.append(_Trace(paths, source_info_util.current_name_stack()))
    try:
        yield
    finally:
        _ACTIVE.stack.pop()
        _unpatch(names)


_METHODS: weakref.WeakKeyDictionary[type, tuple[tuple[type, str], ...]] = \
    weakref.WeakKeyDictionary()


def _class_methods(cls: type) -> tuple[tuple[type, str], ...]:
    """`_methods` of ``cls``, looked up once per class (every trace patches them)."""
    found = _METHODS.get(cls)
    if found is None:
        found = _METHODS[cls] = tuple(_methods(cls))
    return found


def _methods(cls: type) -> Iterator[tuple[type, str]]:
    """The methods of ``cls`` and its bases that compute: ``__call__`` and the public ones.

    Flax's and Equinox's own base classes are left alone (their methods
    split, merge and iterate modules).
    """
    for klass in cls.__mro__:
        if klass.__module__.startswith(("flax.nnx.module", "flax.nnx.pytreelib", "equinox._module",
                                        "flax.nnx.reprlib", "builtins", "abc", "typing",
                                        "collections")):
            continue
        for name, value in vars(klass).items():
            if inspect.isfunction(value) and (name == "__call__" or not name.startswith("_")):
                yield klass, name


def _patch(names: list[tuple[type, str]]) -> None:
    with _LOCK:
        for klass, name in names:
            original, users = _PATCHED.get((klass, name), (vars(klass)[name], 0))
            if users == 0:
                type.__setattr__(klass, name, _scoped(original))
            _PATCHED[(klass, name)] = (original, users + 1)


def _unpatch(names: list[tuple[type, str]]) -> None:
    with _LOCK:
        for klass, name in names:
            original, users = _PATCHED[(klass, name)]
            if users == 1:
                type.__setattr__(klass, name, original)
                del _PATCHED[(klass, name)]
            else:
                _PATCHED[(klass, name)] = (original, users - 1)


def _scoped(method: Callable[..., Any]) -> Callable[..., Any]:
    suffix = "" if method.__name__ == "__call__" else f".{method.__name__}"

    @functools.wraps(method)
    def scoped(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not _ACTIVE.stack:
            return method(self, *args, **kwargs)
        trace = _ACTIVE.stack[-1]
        found = trace.paths.get(id(self))
        if found is None or found[1] is not type(self):  # not known to this trace
            if trace.running:  # inside a module's method: stays in its scope
                return method(self, *args, **kwargs)
            found = trace.adopt(self)  # built or closed over by fn: a root
        path = found[0]
        trace.running.append(path)
        try:
            with source_info_util.set_name_stack(_name_stack(trace, path, suffix)):
                return method(self, *args, **kwargs)
        finally:
            trace.running.pop()

    return scoped


def _name_stack(trace: _Trace, path: Path, suffix: str) -> Any:
    """The name stack of a module method: the current one plus the module's path relative
    to the calling module (scopes the caller opened are kept), or, for a module that is
    not a submodule of its caller (a shared one), its path from the root alone."""
    caller = trace.running[-2] if len(trace.running) > 1 else ()
    if path[:len(caller)] == caller:
        stack, parts = source_info_util.current_name_stack(), list(path[len(caller):])
    else:
        stack, parts = trace.base, list(path)
    if parts and suffix:
        parts[-1] += suffix
    elif suffix and not parts:  # a method of the calling module itself
        return stack
    for part in parts:
        stack = stack.extend(part)
    return stack


# --- One call of a function on modules and arrays ------------------------------------------

def is_array(leaf: Any) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


@dataclasses.dataclass
class Call:
    """One call of an autocast function: its leaves, which of them are traced, NNX state.

    Attributes:
      leaves: the leaves of ``(fn, args, kwargs)``, NNX objects as leaves.
      treedef: their tree.
      nnx: the NNX objects among the leaves, split (``None`` if there are none).
      dynamic: positions of the traced values among ``leaves + nnx state leaves``.
      values: the traced values, in that order.
    """

    leaves: list[Any]
    treedef: Any
    nnx: Optional[NnxState]
    state_treedef: Any
    dynamic: list[int]
    values: list[Any]
    out_tree: Any = None
    static_outs: Optional[list[Any]] = None
    n_state: int = 0

    @classmethod
    def of(cls, fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> Call:
        leaves, treedef = jax.tree_util.tree_flatten(
            (as_data(fn), tuple(args), kwargs), is_leaf=is_nnx)
        nnx = NnxState.split(leaves)
        state_leaves, state_treedef = jax.tree_util.tree_flatten(nnx.state if nnx else ())
        everything = [*leaves, *state_leaves]
        dynamic = [i for i, leaf in enumerate(everything)
                   if is_array(leaf) and not is_nnx(leaf)]
        return cls(leaves, treedef, nnx, state_treedef, dynamic, [everything[i] for i in dynamic])

    def trace(self) -> ClosedJaxpr:
        """``fn`` as a jaxpr of the traced values; outputs, then the NNX state it leaves."""
        return jax.make_jaxpr(self._flat)(*self.values)

    def rebuild(self, values: Sequence[Any]) -> tuple[Any, Any, Any, tuple[Any, ...]]:
        """``(callee, args, kwargs, NNX objects)`` with ``values`` for the traced leaves.

        NNX objects are fresh copies holding the values (see `NnxState`);
        the caller's objects are left alone.
        """
        everything = [*self.leaves, *jax.tree_util.tree_leaves(self.nnx.state if self.nnx else ())]
        for i, v in zip(self.dynamic, values):
            everything[i] = v
        leaves, state_leaves = everything[:len(self.leaves)], everything[len(self.leaves):]
        objects: tuple[Any, ...] = ()
        if self.nnx is not None:
            state = jax.tree_util.tree_unflatten(self.state_treedef, state_leaves)
            objects = self.nnx.merged(leaves, state)
        callee, args, kwargs = jax.tree_util.tree_unflatten(self.treedef, leaves)
        return callee, args, kwargs, objects

    def dynamic_in(self, position: int) -> list[int]:
        """The indices in `values` of the traced leaves inside positional argument ``position``."""
        callee, args, _ = jax.tree_util.tree_unflatten(self.treedef, self.leaves)
        count = functools.partial(_leaf_count, is_leaf=is_nnx)
        start = count(callee) + sum(count(a) for a in args[:position])
        inside = set(range(start, start + count(args[position])))
        objects = ({k for k, i in enumerate(self.nnx.positions) if i in inside}
                   if self.nnx is not None else set())
        state_paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(
            self.nnx.state if self.nnx else ())[0]]
        owners = [_first_key(path) for path in state_paths]  # which NNX object holds a leaf
        n = len(self.leaves)
        return [k for k, i in enumerate(self.dynamic)
                if i in inside or (i >= n and owners[i - n] in objects)]

    def _flat(self, *values: Any) -> list[Any]:
        callee, args, kwargs, objects = self.rebuild(values)
        with module_scopes([callee, args, kwargs]):
            out = call(callee, args, kwargs)
        out_leaves, self.out_tree = jax.tree_util.tree_flatten(out)
        new_state: list[Any] = (jax.tree_util.tree_leaves(nnx_state(objects))
                                if objects else [])
        self.n_state = len(new_state)
        everything = [*out_leaves, *new_state]
        self.static_outs = [None if is_array(x) or is_tracer(x) else x for x in everything]
        return [x for x in everything if is_array(x) or is_tracer(x)]



def is_tracer(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


def _leaf_count(tree: Any, is_leaf: Callable[[Any], bool]) -> int:
    return len(jax.tree_util.tree_leaves(tree, is_leaf=is_leaf))


def _first_key(path: Sequence[Any]) -> Any:
    key = path[0]
    return getattr(key, "key", getattr(key, "idx", key))
