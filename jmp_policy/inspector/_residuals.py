"""`saved_residuals` and its `ResidualReport`: what a train step keeps for its backward pass.

Between the forward and the backward pass of a gradient, every value the
backward pass needs stays in memory: the inputs of norms and activation
functions, the operands of products. ``saved_residuals(fn, *args)`` traces
``jax.vjp`` of ``fn`` as ``jax.grad`` would differentiate it and lists those
residuals, each named by the ``jax.named_scope`` (or Flax, NNX, Equinox module)
path of the operation that computed it, with its shape, dtype and bytes.
Residuals that are ``fn``'s own inputs (parameters, the batch) cost no memory
of their own and are counted apart.

>>> import jax, jax.numpy as jnp, jmp_policy
>>> def loss(w, x):
...     with jax.named_scope("hidden"):
...         return jnp.sum(jnp.sin(x @ w))
>>> report = jmp_policy.saved_residuals(loss, jnp.ones((3, 4)), jnp.ones((2, 3)))
>>> [(row.scope, row.primitive, row.shape) for row in report]
[('hidden', 'cos', (2, 4)), ('argument', '', (2, 3))]
>>> report.total_bytes      # sin's derivative cos(x @ w): 8 float32 values
32
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from typing import Any, Callable, Hashable, Optional, Sequence

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr

from jmp_policy.autocast import modules as _modules
from jmp_policy.autocast.modules import Call
from jmp_policy.inspector._report import (
    Argnums, Rows, _argnums, _differentiated, _function_name)
from jmp_policy.residuals import Kind, Origin, origins
from jmp_policy.paths import display_scope, path_str

# --- Rows and reports ----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ResidualRow:
    """One array that the forward pass keeps for the backward pass.

    Attributes:
      scope: the ``jax.named_scope`` (or module) path of the operation that
        computed it, ``/``-joined as `NumericsRow.scope` is (``""`` outside
        any scope); ``"argument"`` for an input of ``fn``, ``"constant"`` for
        an array ``fn`` closes over (or a literal).
      primitive: the primitive that computed it (``"dot_general"``,
        ``"tanh"``, ``"convert_element_type"``); ``""`` for an argument or a
        constant.
      shape: its shape; inside a ``scan``, the stacked shape (the iterations
        first).
      dtype: its dtype's name.
      bytes: ``prod(shape) * itemsize``.
      kind: ``"activation"`` (memory of its own, between the passes),
        ``"argument"`` or ``"constant"`` (in memory anyway).
      argument: for an argument, which one: the parameter's name and the
        leaf's key path (``"params/Block_0/Dense_0/kernel"``); else ``""``.
      loop: for the stacked output of a ``scan`` (layers scanned), the scope
        of the outermost ``scan`` that stacks it; ``None`` outside loops.
    """

    scope: str
    primitive: str
    shape: tuple[int, ...]
    dtype: str
    bytes: int
    kind: Kind = "activation"
    argument: str = ""
    loop: Optional[str] = None


class ResidualReport(Rows[ResidualRow]):
    """The residuals of a function's backward pass (see `saved_residuals`).

    A report is a sequence of `ResidualRow` (``jmp_policy.inspector``): the
    activations in program order, then the arguments and constants. A row's
    ``scope``, ``primitive``, ``shape``, ``dtype`` and ``bytes`` say what it
    is; its ``kind`` is ``"activation"``, ``"argument"`` or ``"constant"``,
    ``argument`` names an argument (``"params/Dense_0/kernel"``) and
    ``loop`` is the scope of the ``scan`` that stacks it (``None`` outside
    loops). `total_bytes` is what the activations cost, `by_scope` splits it
    by scope, `largest` keeps the biggest rows; ``str(report)`` is a table.

    >>> import jax, jax.numpy as jnp, jmp_policy
    >>> def loss(w, x):
    ...     with jax.named_scope("block"):
    ...         return jnp.sum(jnp.sin(x @ w))
    >>> report = jmp_policy.saved_residuals(loss, jnp.ones((3, 4)), jnp.ones((2, 3)))
    >>> report.by_scope(), report.argument_bytes
    ({'block': 32}, 24)
    """

    _meta: str  # the function's name

    @property
    def rows(self) -> list[ResidualRow]:
        """The rows: activations in program order, then arguments and constants."""
        return list(self._rows)

    @property
    def total_bytes(self) -> int:
        """The bytes of the activations: what the residuals add to memory."""
        return sum(r.bytes for r in self._rows if r.kind == "activation")

    @property
    def argument_bytes(self) -> int:
        """The bytes of the residuals that are ``fn``'s arguments or constants, which
        are in memory whether or not the backward pass keeps them."""
        return sum(r.bytes for r in self._rows if r.kind != "activation")

    def by_scope(self, depth: Optional[int] = 1) -> dict[str, int]:
        """The activations' bytes summed per scope, largest first.

        Scopes are cut to their first ``depth`` names (``Block_0/Dense_1`` is
        ``Block_0`` at depth 1); ``depth=None`` keeps them whole. Activations
        outside any scope are under ``""``. The values add up to `total_bytes`.
        """
        if depth is not None and depth < 1:
            raise ValueError(f"by_scope depth must be None or at least 1, got {depth!r}.")
        sums: dict[str, int] = {}
        for row in self._rows:
            if row.kind == "activation":
                key = row.scope if depth is None else "/".join(row.scope.split("/")[:depth])
                sums[key] = sums.get(key, 0) + row.bytes
        return dict(sorted(sums.items(), key=lambda item: -item[1]))

    def largest(self, n: int = 10) -> ResidualReport:
        """The ``n`` largest activations, largest first (program order among equals)."""
        ranked = sorted((r for r in self._rows if r.kind == "activation"), key=lambda r: -r.bytes)
        return ResidualReport(ranked[:n], self._meta)

    def __str__(self) -> str:
        """The rows as a table, with the totals: activations by top-level scope, and
        the arguments kept."""
        return _table(self._rows, self._meta, self.total_bytes, self.argument_bytes,
                      self.by_scope())

    def __repr__(self) -> str:
        return (f"<ResidualReport of {self._meta}: {len(self._rows)} rows, "
                f"{_size(self.total_bytes)} of activations>")

    def to_json(self) -> str:
        """The report as a JSON object: ``function``, the totals and ``rows``."""
        document = {
            "function": self._meta, "total_bytes": self.total_bytes,
            "argument_bytes": self.argument_bytes,
            "rows": [{**dataclasses.asdict(r), "shape": list(r.shape)} for r in self._rows],
        }
        return json.dumps(document, indent=1)


# --- saved_residuals -----------------------------------------------------------------------

def saved_residuals(fn: Callable[..., Any], *args: Any, argnums: Argnums = 0,
                    **kwargs: Any) -> ResidualReport:
    """The residuals that ``fn``'s backward pass keeps, differentiated at ``args``.

    ``fn(*args, **kwargs)`` is traced under ``jax.vjp`` with respect to the
    floating leaves of the positional arguments ``argnums`` (as ``jax.grad``
    differentiates), and nothing is computed: the report lists the arrays that
    the forward pass hands to the backward pass, one row each (an array kept
    for several uses once). ``fn`` may return a scalar loss or any pytree of
    arrays; it may be an `autocast` function, a ``jax.jit``-ed one, a Flax
    linen ``apply`` or a function that calls one, or an NNX module.

    The rows are what JAX hands to the backward pass: XLA, compiling both
    passes together, may recompute a cheap one (a broadcast, ``1 - tanh``)
    instead of keeping it. What ``jax.checkpoint`` recomputes is not kept,
    so not listed; what its policy saves is. The residuals of a ``scan`` body are kept for every
    iteration: one row holds the stacked array, named by the scope of the
    ``scan`` and, inside it, of the body's operation that computed it
    (`ResidualRow.loop` says which ``scan``).

    Args:
      fn: the function (a loss function, a model's ``apply``).
      *args: its positional arguments (arrays, pytrees of arrays, NNX modules).
      argnums: an int or a tuple of ints, as in ``jax.grad``: the positional
        arguments to differentiate.
      **kwargs: its keyword arguments, not differentiated.

    >>> import jax, jax.numpy as jnp, jmp_policy
    >>> def loss(w, x):
    ...     with jax.named_scope("hidden"):
    ...         return jnp.sum(jnp.sin(x @ w))
    >>> half = jmp_policy.saved_residuals(jmp_policy.autocast(loss, "mixed_bfloat16"),
    ...                                   jnp.ones((3, 4)), jnp.ones((2, 3)))
    >>> [(row.primitive, row.dtype) for row in half]   # x's bfloat16 copy is kept too
    [('convert_element_type', 'bfloat16'), ('cos', 'bfloat16')]
    """
    if not callable(fn):
        raise TypeError(f"saved_residuals expects a callable, got {fn!r}.")
    name = _function_name(fn)
    positions = _argnums(argnums, caller="saved_residuals", optional=False)
    call = Call.of(fn, args, kwargs)
    wrt = _differentiated(positions, args, call, name, caller="saved_residuals")
    assert wrt is not None  # argnums is not optional
    closed = jax.make_jaxpr(_kept(call, wrt))(*call.values)
    rows = _rows(closed, _argument_names(fn, args, kwargs, call))
    return ResidualReport(rows, name)


def _kept(call: Call, wrt: list[int]) -> Callable[..., list[Any]]:
    """A function of ``call``'s traced values returning the residuals of its ``jax.vjp``.

    The function ``jax.vjp`` returns is a pytree whose leaves are the residuals (the
    arguments it keeps among them), so that its jaxpr's outputs are what the forward pass
    hands to the backward pass, each traced back to the equation that computed it.
    """
    def kept(*values: Any) -> list[Any]:
        def of_wrt(*diff: Any) -> Any:
            full = list(values)
            for k, v in zip(wrt, diff):
                full[k] = v
            callee, args, kwargs, _ = call.rebuild(full)  # NNX objects: copies
            with _modules.module_scopes([callee, args, kwargs]):
                return _modules.call(callee, args, kwargs)

        _, vjp = jax.vjp(of_wrt, *[values[k] for k in wrt])
        leaves: list[Any] = jax.tree_util.tree_leaves(vjp)
        return leaves

    return kept


def _rows(closed: ClosedJaxpr, names: list[str]) -> list[ResidualRow]:
    """One row per residual (the jaxpr's outputs), activations first in program order."""
    found: dict[Hashable, tuple[Origin, Any]] = {}
    for origin, var in zip(origins(closed), closed.jaxpr.outvars):
        found.setdefault(origin.key, (origin, var.aval))
    rank = {"activation": 0, "argument": 1, "constant": 2}
    ordered = sorted(found.values(), key=lambda o: (rank[o[0].kind], o[0].order))
    return [_row(origin, aval, names) for origin, aval in ordered]


def _row(origin: Origin, aval: Any, names: list[str]) -> ResidualRow:
    shape = tuple(int(d) for d in aval.shape)
    size = int(np.prod(shape, dtype=np.int64)) * int(aval.dtype.itemsize)
    if origin.kind == "activation":
        assert origin.eqn is not None
        return ResidualRow(display_scope(origin.path), origin.eqn.primitive.name, shape,
                           str(aval.dtype), size, loop=origin.loop)
    return ResidualRow(origin.kind, "", shape, str(aval.dtype), size, kind=origin.kind,
                       argument=names[origin.argument] if origin.kind == "argument" else "")


# --- Names of the arguments ----------------------------------------------------------------

def _argument_names(fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any],
                    call: Call) -> list[str]:
    """A name for each of ``call``'s traced values: the parameter's name, then the leaf's
    key path (``params/Dense_0/kernel``); ``fn`` for leaves of ``fn`` itself."""
    parameters = _parameter_names(fn, len(args))
    leaves = jax.tree_util.tree_flatten_with_path(
        (_modules.as_data(fn), tuple(args), kwargs), is_leaf=_modules.is_nnx)[0]
    names = [_leaf_name(path, parameters) for path, _ in leaves]
    if call.nnx is not None:
        states = jax.tree_util.tree_flatten_with_path(call.nnx.state)[0]
        for path, _ in states:
            owner = names[call.nnx.positions[int(_key(path[0]))]]
            names.append(_join(owner, path_str(path[1:])))
    return [names[i] for i in call.dynamic]


def _parameter_names(fn: Callable[..., Any], n: int) -> list[str]:
    """The names of ``fn``'s first ``n`` positional parameters (``args[i]`` where unknown)."""
    found: list[str] = []
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin, a callable without a signature
        parameters = []  # type: ignore[assignment]
    for p in parameters:
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            break
        found.append(p.name)
    return [found[i] if i < len(found) else f"args[{i}]" for i in range(n)]


def _leaf_name(path: Sequence[Any], parameters: list[str]) -> str:
    part, rest = int(_key(path[0])), path[1:]
    if part == 0:
        return _join("fn", path_str(rest))
    if part == 1:
        return _join(parameters[int(_key(rest[0]))], path_str(rest[1:]))
    return path_str(rest)


def _key(entry: Any) -> Any:
    return getattr(entry, "key", getattr(entry, "idx", entry))


def _join(head: str, tail: str) -> str:
    return f"{head}/{tail}" if tail else head


# --- The table -----------------------------------------------------------------------------

_COLUMNS = ("scope", "primitive", "shape", "dtype", "bytes")


def _table(rows: Sequence[ResidualRow], name: str, total: int, arguments: int,
           scopes: dict[str, int]) -> str:
    cells = [[_scope_cell(r), r.primitive or "-", "x".join(map(str, r.shape)) or "scalar",
              r.dtype, _size(r.bytes)] for r in rows]
    widths = [max([len(c)] + [len(line[i]) for line in cells]) for i, c in enumerate(_COLUMNS)]
    text = [" | ".join(c.rjust(w) if i == len(_COLUMNS) - 1 else c.ljust(w)
                       for i, (c, w) in enumerate(zip(line, widths)))
            for line in [list(_COLUMNS)] + cells]
    activations = sum(1 for r in rows if r.kind == "activation")
    inputs = len(rows) - activations
    head = f"Residuals of {name}: {_count(activations, 'activation')}, {_size(total)}" + (
        f" (and {_count(inputs, 'input')} of its own, {_size(arguments)}, in memory anyway)"
        if inputs else "")
    split = ", ".join(f"{scope or '-'} {_size(size)}" for scope, size in scopes.items())
    rule = "-+-".join("-" * w for w in widths)
    return "\n".join([head, text[0], rule, *text[1:]] +
                     ([f"Activations by scope: {split}"] if split else []))


def _scope_cell(row: ResidualRow) -> str:
    if row.kind == "argument":
        return f"argument {row.argument}"
    return row.scope or "-"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _size(count: int) -> str:
    """A number of bytes for people: ``512 B``, ``1.5 KiB``, ``252 KiB``, ``12.3 MiB``.

    >>> _size(1000), _size(1536), _size(17830836)
    ('1000 B', '1.5 KiB', '17.0 MiB')
    """
    size, unit = float(count), "B"
    for bigger in ("KiB", "MiB", "GiB", "TiB"):
        if size < 1024:
            break
        size, unit = size / 1024, bigger
    if unit == "B":
        return f"{count} B"
    return f"{size:.1f} {unit}" if size < 100 else f"{size:.0f} {unit}"
