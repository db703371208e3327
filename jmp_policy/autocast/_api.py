"""`autocast`: on every call, trace ``fn`` and evaluate its jaxpr under autocast.

A call goes through four steps, each a function below:

1. `Call.of` splits the arguments (and ``fn`` itself, when it is a module or a
   module's method) into array leaves, which are traced, and everything else,
   which reaches ``fn`` as it is; Flax NNX objects are split into graph and
   state (``modules``).
2. `Call.trace` runs ``fn``'s Python to a jaxpr of the array leaves, with
   module paths as scopes; nothing is cached, so closures and module
   attributes are read at call time, and under an outer ``jit`` this happens
   once per trace of that ``jit``, as for any JAX transformation.
3. `_evaluate` evaluates the jaxpr under autocast (``interpreter``).
4. `_finish` casts the outputs (``_outputs``), writes NNX state back and
   rebuilds ``fn``'s output tree.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import warnings
from typing import Any, Callable, Mapping, Optional, Sequence

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr

from jmp_policy.policy import UnmatchedRuleWarning
from jmp_policy.autocast import _eager
from jmp_policy.autocast import modules as _modules
from jmp_policy.autocast.modules import Call
from jmp_policy.float8 import Float8State, Slots, make_state
from jmp_policy.float8 import Float8Like, Float8Recipe, as_recipe
from jmp_policy.autocast._float8 import FLOAT8_PRODUCTS, float8_matmul, kept_layers
from jmp_policy.autocast.interpreter import (
    Context, MatmulRule, compute_dtype, eval_jaxpr, higher_order_names)
from jmp_policy.dtypes import F32, DType, convert, represents
from jmp_policy.autocast.interpreter import matmul
from jmp_policy.autocast._outputs import PRODUCT, output_kinds
from jmp_policy.autocast.rules import AutocastWarning, Rules, parse_rules
from jmp_policy.jaxprs import scoped_eqns
from jmp_policy.paths import unmatched_patterns
from jmp_policy.residuals import Float8Residuals, ResidualsLike, as_residuals, in_float8
from jmp_policy.policy import Policy, PolicyLike, as_policy


def autocast(fn: Callable[..., Any], policy: PolicyLike = None, *,
             rules: Optional[Mapping[str, Any]] = None,
             fp8: Float8Like = None,
             residuals: ResidualsLike = None) -> Callable[..., Any]:
    """Returns ``fn`` evaluated with per-operation mixed precision, as a JAX transformation.

    Matrix work runs in the policy's compute dtype with float32 accumulation,
    numerically sensitive primitives in float32, everything else at the widest
    dtype of its inputs (see ``jmp_policy.autocast``'s module documentation).
    Like ``jax.grad`` and ``jax.vmap``, each call runs ``fn``'s Python afresh
    (closures and module attributes are read at call time), only array leaves
    of the arguments are traced (Python numbers, strings, ``None`` and
    Equinox's integer fields reach ``fn`` as they are), and Flax NNX objects
    passed in (or ``fn`` itself, if it is an NNX module) get the state ``fn``
    writes, as with ``nnx.jit``. Under a ``float32`` policy without ``fp8``,
    the result is ``fn``'s own, bit for bit.

    Outputs are never narrowed below the precision they were computed in: an
    output made by matrix work comes back in the policy's output dtype, one
    made by float32-class primitives (a loss, normalization statistics) or by
    a cast written in ``fn`` in the dtype it was computed in.

    Args:
      fn: any function of pytrees (a loss function, a Flax linen ``apply``, an
        NNX or Equinox module or a method of one).
      policy: a policy name or `Policy`; ``None`` means the global policy in
        force now (at construction, not at call time).
      rules: optional mapping changing the defaults:
        ``{"matmul": [...], "float32": [...], "follow": [...]}`` move primitives
        (by name, or ``jax.extend.core.Primitive`` object) into that class;
        ``{"float32_scopes": ["attention", "block/softmax"]}`` runs every primitive
        under a matching scope (a contiguous run of scope names, at any depth) in
        float32, matrix work included. Scopes are ``jax.named_scope`` names, Flax
        linen module paths and, for NNX and Equinox modules, attribute paths from
        the root module (``Decoder/blocks/0/attn``): a module argument, or the
        model ``fn`` rebuilds (``nnx.merge``, ``eqx.combine``) or closes over,
        named alike. A scope that no operation of ``fn`` is in is reported with an
        ``UnmatchedRuleWarning``.
      fp8: ``None`` (no float8), ``"tensorwise"``, ``"rowwise"``, ``"mxfp8"``,
        ``"nvfp4"`` or a `jmp_policy.Float8Recipe`: every eligible ``dot_general``
        (and ``lax.ragged_dot``) of ``fn``, forward and backward, runs on float8
        operands scaled per tensor or row, or on block-scaled MXFP8 / NVFP4
        operands, accumulated in float32 (natively where the backend multiplies
        them, emulated exactly elsewhere). Products in a float32 scope, in a scope
        the recipe excludes (by default a model's output layer), in a layer its
        ``high_precision_layers`` keeps or smaller than its ``min_size`` stay in
        the compute dtype; a function with no eligible product warns, and so do
        the recipe's rules that match nothing (``UnmatchedRuleWarning``).
      residuals: ``None`` (the backward pass keeps what it needs in the dtypes it
        was computed in), ``"float8"`` or a `jmp_policy.Float8Residuals`: the
        activations that the backward pass of ``fn`` keeps are stored in float8,
        a power-of-two scale per 32 values, except statistics, max-subtracted
        logits and excluded scopes (see `jmp_policy.Float8Residuals`). With or
        without ``fp8``; inside ``lax.scan`` (layers scanned), each iteration's are
        stored as it runs.

    >>> import jax, jax.numpy as jnp, jmp_policy
    >>> def layer(w, x):
    ...     h = x @ w
    ...     return h, jnp.mean(jax.nn.softmax(h))
    >>> h, mean = jmp_policy.autocast(layer, "mixed_float16")(jnp.ones((4, 4)), jnp.ones((2, 4)))
    >>> h.dtype, mean.dtype   # a product in the output dtype, a reduction in float32
    (dtype('float16'), dtype('float32'))
    """
    if not callable(fn):
        raise TypeError(f"autocast expects a callable, got {fn!r}.")
    settings = _Settings(as_policy(policy), parse_rules(rules, higher_order_names()),
                         as_recipe(fp8), _name(fn), as_residuals(residuals))
    return _transformed(fn, settings)


def _transformed(fn: Callable[..., Any], settings: _Settings) -> Callable[..., Any]:
    """``fn`` under ``settings``: each call traced and evaluated, as the module says."""
    delayed = settings.recipe is not None and settings.recipe.delayed

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if delayed:
            return _delayed_call(fn, settings, args, kwargs)
        call = Call.of(fn, args, kwargs)
        if settings.is_identity():
            if settings.rules.float32_scopes:  # nothing to pin; unmatched scopes are reported
                paths = {path for path, _ in scoped_eqns(call.trace())}
                _warn_unmatched(settings, settings.rules.unmatched(paths))
            return fn(*args, **kwargs)
        closed = call.trace()
        return _finish(call, _evaluate(closed, settings, call.values), closed, settings)

    setattr(wrapped, _RECIPE, settings.recipe)
    if delayed:
        _take_state_first(wrapped, fn)
    return wrapped


def _take_state_first(wrapped: Callable[..., Any], fn: Callable[..., Any]) -> None:
    """Gives ``wrapped`` ``fn``'s signature with the state in front, for tools that read it
    (``nnx.grad`` binds arguments to it)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to tell (some builtins)
        return
    state = inspect.Parameter("fp8_state", inspect.Parameter.POSITIONAL_ONLY)
    setattr(wrapped, "__signature__",
            signature.replace(parameters=[state, *signature.parameters.values()]))


_RECIPE = "_jmp_policy_fp8_recipe"
"""The attribute of an autocast function holding its float8 recipe (read by `float8_state`)."""


@dataclasses.dataclass(frozen=True)
class _Settings:
    """What ``autocast(fn, policy, rules=..., fp8=...)`` was given."""

    policy: Policy
    rules: Rules
    recipe: Optional[Float8Recipe]
    name: str
    residuals: Optional[Float8Residuals] = None
    programs: _eager.Programs = dataclasses.field(
        default_factory=_eager.Programs, compare=False, repr=False)

    def dtypes(self, values: Sequence[Any]) -> tuple[DType, DType]:
        """The compute and output dtypes of a call with array leaves ``values``."""
        compute, output = compute_dtype(self.policy, values), self.policy.output_dtype
        return compute, np.dtype(compute if output is None else output)

    def is_identity(self) -> bool:
        """True when autocast changes nothing: float32 (or wider) compute and output, no float8."""
        compute, output = self.policy.compute_dtype, self.policy.output_dtype
        return (self.recipe is None and self.residuals is None and compute is not None
                and represents(np.dtype(compute), F32)
                and (output is None or represents(np.dtype(output), F32)))


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)



def _finish(call: Call, outs: list[Any], closed: ClosedJaxpr, settings: _Settings) -> Any:
    """``fn``'s output from the evaluated jaxpr's outputs; NNX state written back.

    Outputs are cast as `_output` says. NNX state keeps the dtypes ``fn``
    gave it, so that a train step sees the same types on every call.
    """
    assert call.static_outs is not None
    compute, output = settings.dtypes(call.values)
    kinds = output_kinds(closed.jaxpr, settings.rules.under(compute))
    traced = iter(zip(outs, kinds, closed.out_avals))
    n_out = len(call.static_outs) - call.n_state
    everything = []
    for i, static in enumerate(call.static_outs):
        if static is not None:
            everything.append(static)
            continue
        value, kind, aval = next(traced)
        everything.append(_output(value, kind, output) if i < n_out
                          else convert(value, aval.dtype))
    if call.nnx is not None:
        state = jax.tree_util.tree_unflatten(call.state_treedef, everything[n_out:])
        _modules.write_back([call.leaves[i] for i in call.nnx.positions], call.nnx.state,
                            state)
    return jax.tree_util.tree_unflatten(call.out_tree, everything[:n_out])


def _output(value: Any, kind: int, output: DType) -> Any:
    """An output of ``fn``: matrix work in the output dtype, anything else as computed."""
    return convert(value, output) if kind == PRODUCT else value


# --- Delayed scaling --------------------------------------------------------------------

class _Record:
    """The state argument with which `float8_state` calls a delayed-scaling autocast
    function: the call records the products it would run and returns their state."""


def _delayed_call(fn: Callable[..., Any], settings: _Settings, args: Sequence[Any],
                  kwargs: dict[str, Any]) -> Any:
    """A call of a delayed-scaling autocast function: ``args`` start with the state."""
    assert settings.recipe is not None
    if not args or not isinstance(args[0], (Float8State, _Record)):
        raise TypeError(
            f"autocast({settings.name}, fp8=Float8Recipe('delayed', ...)) takes the amax "
            "histories of its float8 products as its first argument, a jmp_policy.Float8State "
            "made by jmp_policy.float8_state(f, *args); got "
            f"{type(args[0]).__name__ if args else 'no argument'}.")
    state, args = args[0], args[1:]
    call = Call.of(fn, args, kwargs)
    closed = call.trace()
    length = settings.recipe.amax_history_length
    if isinstance(state, _Record):  # staged, not run; no NNX state written back
        slots = Slots(length)
        jax.make_jaxpr(lambda *v: _evaluate(closed, settings, v, slots))(*call.values)
        return make_state(slots)
    slots = Slots(length, state.histories, f"function {settings.name}")
    outs = _evaluate(closed, settings, call.values, slots)
    slots.check_all_taken()
    return _finish(call, outs, closed, settings)


def float8_state(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Float8State:
    """The empty amax histories of ``fn``, an autocast function with delayed float8 scaling,
    called with ``args`` and ``kwargs`` (traced, not run).

    ``fn = autocast(f, policy, fp8=Float8Recipe("delayed"))`` is called as
    ``fn(state, *args, **kwargs)``; the gradient of its result with respect to
    ``state`` holds what the step observed, which ``state.record(observed)`` keeps
    for the next step (see ``jmp_policy.Float8State``). The state holds one
    history per float8 product and operand (a history per iteration for products
    inside ``lax.scan``), of the recipe's ``amax_history_length`` float32 values.

    >>> import jax, jax.numpy as jnp, jmp_policy
    >>> f = jmp_policy.autocast(lambda w, x: jnp.sum(x @ w), "mixed_bfloat16",
    ...                         fp8=jmp_policy.Float8Recipe("delayed", amax_history_length=16))
    >>> state = jmp_policy.float8_state(f, jnp.ones((32, 32)), jnp.ones((16, 32)))
    >>> len(state.histories), state.histories[0].lhs.shape
    (1, (16,))
    """
    recipe = getattr(fn, _RECIPE, None)
    state = fn(_Record(), *args, **kwargs) if recipe is None or recipe.delayed else None
    if not isinstance(state, Float8State):
        raise TypeError(
            "jmp_policy.float8_state expects a function made by jmp_policy.autocast(f, ..., "
            f"fp8=Float8Recipe('delayed', ...)); {_name(fn)} returned {type(state).__name__}.")
    return state


# --- Evaluation -------------------------------------------------------------------------

def _evaluate(closed: ClosedJaxpr, settings: _Settings, values: Sequence[Any],
              slots: Optional[Slots] = None) -> list[Any]:
    if slots is None and _eager.compilable([*values, *closed.consts]):
        return settings.programs.run(functools.partial(_interpret, settings=settings),
                                     closed, values)
    return _interpret(closed, values, settings, slots)


def _interpret(closed: ClosedJaxpr, values: Sequence[Any], settings: _Settings,
               slots: Optional[Slots] = None) -> list[Any]:
    compute, _ = settings.dtypes(values)
    rules = settings.rules.under(compute)
    rule: MatmulRule = matmul
    if settings.recipe is not None:
        layers = kept_layers(settings.recipe, closed, rules, settings.name)
        rule = float8_matmul(settings.recipe, layers)
    ctx = Context(compute, rules, rule, float8_slots=slots, residuals=settings.residuals)
    outs = _run(ctx, closed, values, settings)
    _warn_unmatched(settings, ctx.unmatched_scopes())
    if settings.recipe is not None and not ctx.tallied(FLOAT8_PRODUCTS):
        warnings.warn(
            f"autocast(..., fp8=...) changes nothing in {settings.name}: none of its matrix "
            "products is eligible for float8 (dot_general and ragged_dot products are: "
            "convolutions stay in the compute dtype; products smaller than the recipe's "
            "min_size or in a scope it excludes, such as a model's output layer, do too).",
            AutocastWarning, stacklevel=3)
    return outs


def _run(ctx: Context, closed: ClosedJaxpr, values: Sequence[Any],
         settings: _Settings) -> list[Any]:
    """``closed`` evaluated under ``ctx``, its residuals kept as ``settings`` say."""
    residuals = settings.residuals
    if residuals is None:
        return eval_jaxpr(ctx, closed.jaxpr, closed.consts, values)
    _warn_unmatched_residuals(residuals, closed, settings.name)
    # What the evaluation reads besides its values is passed in as arguments, which a
    # custom derivative needs of anything differentiated: the consts, and the amax
    # histories of delayed scaling (their gradient holds what the step observed).
    slots = ctx.float8_slots
    given = slots.given if isinstance(slots, Slots) and slots.given is not None else None
    histories, tree = jax.tree_util.tree_flatten(given)
    h, n = len(histories), len(closed.consts)

    def run(*args: Any) -> list[Any]:
        inner = ctx
        if given is not None:
            taken = Slots(slots.length, jax.tree_util.tree_unflatten(tree, args[:h]), slots.what)
            inner = dataclasses.replace(ctx, float8_slots=taken)
        outs = eval_jaxpr(inner, closed.jaxpr, args[h:h + n], args[h + n:])
        if given is not None:
            slots.requests[:] = taken.requests  # what `Slots.check_all_taken` reads
        return outs

    return in_float8(run, residuals)(*histories, *closed.consts, *values)


def _warn_unmatched_residuals(residuals: Float8Residuals, closed: ClosedJaxpr,
                              name: str) -> None:
    patterns = residuals.exclude
    assert isinstance(patterns, tuple)
    for pattern in unmatched_patterns(patterns, [path for path, _ in scoped_eqns(closed)]):
        warnings.warn(
            f"Float8Residuals exclude entry {pattern!r} matched no operation of {name} "
            "(none is inside a jax.named_scope or module path it is found in).",
            UnmatchedRuleWarning, stacklevel=5)


def _warn_unmatched(settings: _Settings, unmatched: list[tuple[str, list[str]]]) -> None:
    for scope, near in unmatched:
        hint = f" Did you mean {' or '.join(map(repr, near))}?" if near else ""
        warnings.warn(
            f"autocast rules['float32_scopes'] entry {scope!r} matched no operation of "
            f"{settings.name} (none is inside a jax.named_scope or module path containing "
            f"{scope!r}).{hint}", UnmatchedRuleWarning, stacklevel=4)

