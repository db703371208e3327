"""`in_float8`: a function whose backward pass keeps its residuals in float8.

The function becomes a ``jax.custom_vjp`` whose forward rule runs ``jax.vjp``
of the function, finds the arrays its residuals are made from (the roots,
``_recompute.plan``) and where each comes from (``_origins``), stores in
float8 those the `Rule` allows (``_format.store``) and keeps the rest; its
backward rule runs the function's own backward pass, loading each stored array
back into its dtype (and recomputing the residuals made from it) where that
pass first reads it. Undifferentiated, the function runs as it is.

>>> import jax, jax.numpy as jnp
>>> f = in_float8(lambda w, x: [jnp.sum(jnp.tanh(x @ w))], Float8Residuals())
>>> w = jax.random.normal(jax.random.key(0), (64, 64)) / 8
>>> x = jax.random.normal(jax.random.key(1), (8, 64))
>>> exact = jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)
>>> near = jax.grad(lambda w: f(w, x)[0])(w)
>>> error = float(jnp.linalg.norm(near - exact) / jnp.linalg.norm(exact))
>>> 0 < error < 0.05
True
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Collection, Optional, Sequence, Union

import jax
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal, jaxpr_as_fun

from jmp_policy.jaxprs import bind, in_place
from jmp_policy.paths import display_scope, scope_patterns
from jmp_policy.residuals._format import Stored, load, store
from jmp_policy.residuals._origins import Frame, Origin, Producers, origin_of, vjp_jaxpr
from jmp_policy.residuals._recompute import Plan, Recompute, plan
from jmp_policy.residuals._rule import Rule


@dataclasses.dataclass(frozen=True)
class Float8Residuals:
    """Autocast's ``residuals=``: the activations a backward pass keeps, stored in float8.

    The arrays the backward pass's residuals are made from (its roots: the outputs of
    products, reductions, loops and custom derivatives, of element-wise work on two
    large roots, and of exponentials) are stored as ``float8_e4m3fn`` values with one
    power-of-two scale per block of 32 values along their last axis (MXFP8's format, 1 +
    1/32 bytes a value); the backward pass loads each back into its dtype where it
    first reads it (a layer's, when it reaches that layer) and recomputes the
    element-wise residuals from them, as XLA does for plain residuals. A
    rule keeps some in their dtype: arguments and constants, statistics (a norm's mean
    and variance, a softmax's sum, and what is computed from them alone), max-subtracted
    logits, values already one byte wide, arrays of fewer than 32 values, and those made
    in a scope ``exclude`` names. What a ``jax.checkpoint`` policy saves is stored so;
    what it recomputes is not stored at all.

    Attributes:
      exclude: regular expressions searched (``re.search``) in the
        ``/``-joined scope path of the operation that made a root
        (``jax.named_scope`` names, Flax module paths): it stays in its dtype.
        An entry that matches no operation warns (``UnmatchedRuleWarning``).

    >>> import jax, jax.numpy as jnp, jmp_policy
    >>> def loss(w, x):
    ...     with jax.named_scope("mlp"):
    ...         h = jnp.tanh(x @ w)
    ...     with jax.named_scope("head"):
    ...         return jnp.sum(jnp.tanh(h @ w))
    >>> f = jmp_policy.autocast(loss, "mixed_bfloat16",
    ...                         residuals=jmp_policy.Float8Residuals(exclude="head"))
    >>> report = jmp_policy.saved_residuals(f, jnp.ones((64, 64)), jnp.ones((8, 64)))
    >>> [(row.scope, row.dtype, row.shape) for row in report if row.kind == "activation"]
    ... # doctest: +NORMALIZE_WHITESPACE
    [('head', 'bfloat16', (8, 64)), ('mlp', 'float8_e4m3fn', (8, 64)),
     ('mlp', 'float8_e8m0fnu', (8, 2))]
    """

    exclude: Union[str, Sequence[str]] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "exclude",
                           scope_patterns(self.exclude, "Float8Residuals exclude"))


ResidualsLike = Union[None, str, Float8Residuals]


def as_residuals(value: ResidualsLike) -> Optional[Float8Residuals]:
    """Reads autocast's ``residuals=`` argument: ``None``, ``"float8"`` or a
    `Float8Residuals`.

    >>> as_residuals("float8")
    Float8Residuals(exclude=())
    """
    if value is None or isinstance(value, Float8Residuals):
        return value
    if isinstance(value, str) and value == "float8":
        return Float8Residuals()
    raise ValueError(
        "autocast residuals must be None (residuals in the dtypes they are computed in), "
        f"'float8' or a jmp_policy.Float8Residuals; got {value!r}.")


def in_float8(fn: Callable[..., list[Any]], residuals: Float8Residuals,
              activations: Collection[int] = ()) -> Callable[..., list[Any]]:
    """``fn`` (a function of arrays returning a list of arrays), its residuals kept in
    float8 as ``residuals`` says. The arguments at ``activations`` (a loop body's carry,
    which the loop stacks) count as activations; the others are in memory anyway."""

    @jax.custom_vjp
    def wrapped(*args: Any) -> list[Any]:
        return fn(*args)

    def forward(*primals: Any) -> tuple[list[Any], _Saved]:
        # Only the differentiated arguments (``perturbed``) are ``jax.vjp``'s: the
        # backward pass keeps nothing for the gradients of the others.
        args = [p.value for p in primals]
        wrt = [i for i, p in enumerate(primals) if p.perturbed]
        closed, n_out, trees = vjp_jaxpr(fn, args, wrt)
        producers = Producers()  # each jaxpr's equations indexed once, for all three uses
        found = plan(closed.jaxpr, n_out, activations, producers)
        # The forward pass returns the roots rather than the residuals made from them.
        handing = closed.jaxpr.replace(outvars=[*closed.jaxpr.outvars[:n_out], *found.roots])
        flat = jaxpr_as_fun(ClosedJaxpr(handing, closed.consts))(*args)
        values = dict(zip([*closed.jaxpr.invars, *closed.jaxpr.constvars],
                          [*args, *closed.consts]))
        top = Frame(closed.jaxpr)
        arrays, layout = _store([origin_of(v, top, producers) for v in found.roots],
                                flat[n_out:], Rule(residuals.exclude, producers), activations)
        arrays += [values[v] for v in found.inputs]
        return flat[:n_out], _Saved(arrays, (trees[1], found, layout, tuple(wrt), len(args)))

    def backward(saved: _Saved, cotangents: list[Any]) -> tuple[Any, ...]:
        vjp_tree, found, layout, wrt, count = saved.meta
        grads = _backward_pass(vjp_tree, found, layout, saved.arrays,
                               [_instantiated(c) for c in cotangents])
        full: list[Any] = [None] * count
        for i, g in zip(wrt, grads):
            full[i] = g
        return tuple(full)

    wrapped.defvjp(forward, backward, symbolic_zeros=True)
    return wrapped


def _store(found: Sequence[Origin], roots: Sequence[Any], rule: Rule,
           activations: Collection[int]) -> tuple[list[Any], tuple[Any, ...]]:
    """The ``roots`` (made at ``found``) as the backward rule takes them: the arrays, some
    `Stored`, and for each its shape and dtype if stored (else ``None``). The arguments at
    ``activations`` count as activations."""
    arrays: list[Any] = []
    layout: list[tuple[int, Optional[tuple[tuple[int, ...], Any]]]] = []
    for origin, root in zip(found, roots):
        if origin.kind == "argument" and origin.argument in activations:
            origin = dataclasses.replace(origin, kind="activation")
        shape, dtype = tuple(np.shape(root)), np.dtype(root.dtype)
        if rule.why_kept(origin, shape, dtype) is not None:
            arrays.append(root)
            layout.append((len(layout), None))
            continue
        scope = display_scope(origin.path)  # the stored arrays are named as the root is
        with jax.named_scope(scope) if scope else contextlib.nullcontext():
            # The barrier makes XLA write the float8 arrays in the forward pass;
            # without it, fusion moves the rounding into the backward pass and
            # keeps the wide array alive until there.
            arrays.append(Stored(*lax.optimization_barrier(  # type: ignore[no-untyped-call]
                tuple(store(root)))))
        layout.append((len(layout), (shape, dtype)))
    return arrays, tuple(layout)


def _backward_pass(vjp_tree: Any, found: Plan, layout: tuple[Any, ...], arrays: list[Any],
                   cotangents: list[Any]) -> list[Any]:
    """The gradients that ``jax.vjp``'s function (``vjp_tree``'s, its leaves the plan's
    residuals) gives for ``cotangents``, each residual loaded or recomputed where the
    backward pass first reads it.

    Loaded all at once, every layer's residuals would be wide again while the last
    layer's gradient is computed, and the step's peak memory would not fall. So the
    backward pass is traced and run equation by equation (`_run_lazily`), and the
    float8 arrays that an equation needs go through an optimization barrier (on
    XLA:CPU, a conditional) with a value the backward pass computes just before: XLA
    cannot load them earlier.
    """
    loader = _Loader.of(found, layout, arrays)

    def run(kept: list[Any], cts: list[Any]) -> Any:
        return jax.tree_util.tree_unflatten(vjp_tree, kept)(cts)

    closed = jax.make_jaxpr(run)([_struct(v.aval) for v in found.residuals],
                                 [_struct(c) for c in cotangents])
    n = len(found.residuals)
    return _run_lazily(closed.jaxpr, closed.consts, [None] * n + list(cotangents),
                       [*found.residuals, *[None] * len(cotangents)],
                       [None] * n + [False] * len(cotangents), loader)


class _Loader:
    """The residuals of a `Plan` in the backward pass: `fetch` hands over the float8
    arrays that some of them are made from, `make` loads those and recomputes them."""

    def __init__(self, made: Recompute,
                 stored: dict[Any, tuple[Stored, tuple[tuple[int, ...], Any]]]) -> None:
        self.made, self.stored = made, stored  # stored: root -> (float8 arrays, shape, dtype)

    @classmethod
    def of(cls, found: Plan, layout: tuple[Any, ...], arrays: list[Any]) -> _Loader:
        """The loader of what the forward rule handed over: ``arrays`` as `_store` laid
        them out (``layout``), then the plan's inputs."""
        made = Recompute(found)
        made.env.update(zip(found.inputs, arrays[len(layout):]))
        stored = {}
        for root, (i, form) in zip(found.roots, layout):
            if form is None:
                made.env[root] = arrays[i]
            else:
                stored[root] = (arrays[i], form)
        return cls(made, stored)

    def fetch(self, wanted: Sequence[Any], after: Any) -> tuple[_Fetched, Any]:
        """The float8 arrays that ``wanted`` are made from, after ``after`` (returned as it
        is to be read from then on; ``None``: whenever XLA likes)."""
        roots = [r for r in self.made.sources(wanted) if r in self.stored]
        float8 = [self.stored[r][0] for r in roots]
        if roots and after is not None:
            float8, after = lax.platform_dependent((float8, after), cpu=_in_order_on_cpu,
                                                   default=_in_order)
        return (roots, float8), after

    def make(self, wanted: Sequence[Any], fetched: _Fetched) -> list[Any]:
        """``wanted``, the float8 arrays they are made from being ``fetched``."""
        for root, values in zip(*fetched):
            self.made.env[root] = load(values, *self.stored.pop(root)[1])
        return self.made.make(wanted)

    def inside(self, fetched: _Fetched) -> _Loader:
        """A loader for a call's body, to which ``fetched`` is passed: what it loads and
        recomputes there stays there."""
        return _Loader(self.made.fork(),
                       {r: (values, self.stored[r][1]) for r, values in zip(*fetched)})


def _in_order(values: Any) -> Any:
    """``values`` (float8 arrays, then a value of the backward pass) through an
    optimization barrier: XLA cannot read the arrays before that value is computed."""
    return lax.optimization_barrier(values)  # type: ignore[no-untyped-call]


def _in_order_on_cpu(values: Any) -> Any:
    """`_in_order` on XLA:CPU, which removes optimization barriers before it schedules
    and fuses (loads would be fused into the forward pass's stores, and kept wide):
    through a conditional on a value that XLA cannot know when compiling (a random
    number), whose operands are all computed before it runs."""
    key = lax.broadcast(np.uint32(0), (4,))  # made, not a constant (a checkpoint saves those)
    _, bits = lax.rng_bit_generator(key, (), np.uint32)  # type: ignore[no-untyped-call]
    taken = lax.ne(lax.bitwise_or(bits, np.uint32(1)), np.uint32(0))  # always
    return lax.cond(taken, lambda v: v,
                    lambda v: jax.tree_util.tree_map(lambda x: lax.full_like(x, 0), v), values)


_Fetched = tuple[list[Any], list[Stored]]
"""Roots to load, and their float8 arrays."""


_WRITTEN = frozenset({"dot_general", "ragged_dot_general", "conv_general_dilated", "remat2"})
"""Equations whose results XLA writes to memory whole: products, and a checkpointed
layer's backward pass. Before the first of them there is nothing to wait for, and a
barrier with an element-wise value (the loss's own backward pass) would make XLA write
that value whole instead of fusing it."""


def _run_lazily(jaxpr: Jaxpr, consts: Sequence[Any], inputs: Sequence[Any],
                lazy: Sequence[Any], written: Sequence[Optional[bool]],
                loader: _Loader) -> list[Any]:
    """Runs ``jaxpr`` (a backward pass, or a checkpointed layer's) on ``inputs``, but
    where ``lazy`` names a plan residual: that one is made by ``loader`` where an
    equation first reads it. ``written`` says of each input whether it is computed from
    the cotangents after a `_WRITTEN` value (``True``), before any (``False``) or not
    at all (``None``).

    An equation that reads nothing computed from the cotangents (a checkpointed layer
    recomputing its forward pass) runs where its output is first read. The residuals
    an equation needs are made after its input computed from the latest `_WRITTEN`
    value (whenever XLA likes if its inputs come from none); the outputs' after the
    latest `_WRITTEN` value. A checkpointed layer's backward pass (``remat2``) makes
    its residuals inside (`_loading_inside`).
    """
    run = _LazyRun(jaxpr, consts, inputs, lazy, written, loader)
    for step, eqn in enumerate(jaxpr.eqns):
        derived = [v for v in eqn.invars if not isinstance(v, Literal) and v in run.source]
        if not derived and not eqn.effects:
            run.deferred.update((v, step) for v in eqn.outvars)
            continue
        # The input computed from the latest written value: the loads wait for it.
        at = max(derived, key=lambda v: run.source[v][0]) if derived else run.latest[1]
        run.equation(eqn, None if derived and run.source[at][1] is None else at)
        if derived:
            made_from = (step, eqn.outvars[0]) if eqn.primitive.name in _WRITTEN \
                else max((run.source[v] for v in derived), key=lambda s: s[0])
            run.source.update((v, made_from) for v in eqn.outvars)
            if eqn.primitive.name in _WRITTEN:
                run.latest = made_from
    run.ready(jaxpr.outvars, run.latest[1])
    return [run.read(v) for v in jaxpr.outvars]


class _LazyRun:
    """The state of `_run_lazily`: the values computed, the lazy inputs, the equations
    deferred, and where each value computed from the cotangents comes from."""

    def __init__(self, jaxpr: Jaxpr, consts: Sequence[Any], inputs: Sequence[Any],
                 lazy: Sequence[Any], written: Sequence[Optional[bool]],
                 loader: _Loader) -> None:
        self.jaxpr, self.loader = jaxpr, loader
        self.of = {v: r for v, r in zip(jaxpr.invars, lazy) if r is not None}
        self.env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
        self.env.update((v, x) for v, x, r in zip(jaxpr.invars, inputs, lazy) if r is None)
        # Each value computed from the cotangents -> (the step, the var) of the last
        # written value it is computed from, (-1, None) if none.
        self.source = {v: (-1, v if w else None)
                       for v, w in zip(jaxpr.invars, written) if w is not None}
        self.latest: tuple[int, Any] = (-1, None)
        self.deferred: dict[Any, int] = {}  # var -> the step of the equation making it

    def read(self, v: Any) -> Any:
        return v.val if isinstance(v, Literal) else self.env[v]

    def ready(self, inputs: Sequence[Any], at: Any) -> None:
        """Makes ``inputs``: lazy ones after ``at``, then the deferred equations."""
        missing, steps = self._needs(inputs)
        if missing:  # together: one barrier
            made = self.loader.make([self.of[v] for v in missing], self._fetch(missing, at))
            self.env.update(zip(missing, made))
        for step in steps:
            self.equation(self.jaxpr.eqns[step])

    def equation(self, eqn: JaxprEqn, at: Any = None) -> None:
        """Runs ``eqn``, its inputs made after ``at``."""
        lazies = [self.of[v] if not isinstance(v, Literal) and v in self.of
                  and v not in self.env else None for v in eqn.invars]
        inside = eqn.primitive.name == "remat2" and any(r is not None for r in lazies)
        self.ready([v for v, r in zip(eqn.invars, lazies) if not (inside and r is not None)],
                   at)
        with in_place(eqn):
            if inside:
                direct = list(dict.fromkeys(v for v, r in zip(eqn.invars, lazies) if r is not None))
                out = _loading_inside(eqn, lazies, self._fetch(direct, at), self.loader,
                                      [None if r is not None else self.read(v)
                                       for v, r in zip(eqn.invars, lazies)],
                                      [self._written(v) for v in eqn.invars])
            else:
                out = bind(eqn, [self.read(v) for v in eqn.invars])
        self.env.update(zip(eqn.outvars, out if eqn.primitive.multiple_results else [out]))

    def _needs(self, inputs: Sequence[Any]) -> tuple[list[Any], list[int]]:
        """The lazy inputs that ``inputs`` need and the deferred steps that make them."""
        missing: list[Any] = []
        steps: set[int] = set()
        stack = [v for v in inputs if not isinstance(v, Literal)]
        while stack:
            v = stack.pop()
            if v in self.env or v in missing:
                continue
            if v in self.of:
                missing.append(v)
            elif self.deferred[v] not in steps:
                steps.add(self.deferred[v])
                stack += [u for u in self.jaxpr.eqns[self.deferred[v]].invars
                          if not isinstance(u, Literal)]
        return missing, sorted(steps)

    def _fetch(self, missing: Sequence[Any], at: Any) -> _Fetched:
        """The float8 arrays of ``missing``, after ``at`` (a var, or ``None``)."""
        fetched, after = self.loader.fetch([self.of[v] for v in missing],
                                           None if at is None else self.env[at])
        if at is not None:
            self.env[at] = after
        return fetched

    def _written(self, v: Any) -> Optional[bool]:
        """``written`` (see `_run_lazily`) of ``v`` as a body's input."""
        if isinstance(v, Literal) or v not in self.source:
            return None
        return self.source[v][1] is not None


def _loading_inside(eqn: JaxprEqn, lazies: Sequence[Any], fetched: _Fetched, loader: _Loader,
                    invals: Sequence[Any], written: Sequence[Optional[bool]]) -> Any:
    """``eqn`` (a checkpointed layer's backward pass) on ``invals``, but where ``lazies``
    names a plan residual: that one is made inside its body from ``fetched``
    (`_run_lazily`, ``written`` saying which ``invals`` come from the cotangents).

    JAX keeps a checkpointed computation from being merged with the rest of the program
    by an optimization barrier on its inputs, which XLA writes to memory whole: made
    outside, the residuals would be written wide; made inside, float8 arrays are, and
    the loads fuse into the layer's kernels, where the layer first reads them.
    """
    roots, float8 = fetched
    leaves, tree = jax.tree_util.tree_flatten(float8)
    given = [x for x, r in zip(invals, lazies) if r is None]

    def body(*args: Any) -> list[Any]:
        inner = loader.inside((roots, jax.tree_util.tree_unflatten(tree, args[:len(leaves)])))
        rest = iter(args[len(leaves):])
        return _run_lazily(eqn.params["jaxpr"], (),
                           [None if r is not None else next(rest) for r in lazies],
                           lazies, written, inner)

    closed = jax.make_jaxpr(body)(*leaves, *given)
    inner = closed.jaxpr.replace(
        constvars=[], invars=[*closed.jaxpr.constvars, *closed.jaxpr.invars],
        debug_info=closed.jaxpr.debug_info._replace(arg_names=None))
    return bind(eqn, [*closed.consts, *leaves, *given], {**eqn.params, "jaxpr": inner})


def _struct(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype)  # type: ignore[no-untyped-call]


def _instantiated(cotangent: Any) -> Any:
    """A cotangent the backward rule got, a ``SymbolicZero`` made an array of zeros."""
    if isinstance(cotangent, SymbolicZero):
        aval: Any = cotangent.aval
        return np.zeros(aval.shape, aval.dtype)
    return cotangent


@jax.tree_util.register_pytree_node_class
class _Saved:
    """What the forward rule hands to the backward rule: arrays (some `Stored`) and, as
    static data, the treedef of ``jax.vjp``'s function and how to rebuild its leaves."""

    def __init__(self, arrays: list[Union[jax.Array, Stored]], meta: Any) -> None:
        self.arrays, self.meta = arrays, meta

    def tree_flatten(self) -> tuple[tuple[list[Any]], Any]:
        return (self.arrays,), self.meta

    @classmethod
    def tree_unflatten(cls, meta: Any, children: Any) -> _Saved:
        return cls(list(children[0]), meta)
