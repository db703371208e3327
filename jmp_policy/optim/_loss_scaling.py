"""Loss scaling as an optax transformation that skips non-finite steps.

``loss_scaling(inner)`` wraps any optax optimizer. Each ``update``:

1. unscales the gradients of the scaled loss;
2. checks that every unscaled gradient is finite (on every device, and over
   ``axis_name`` when given);
3. runs ``inner`` on a finite step; on a non-finite step it returns zero
   updates (``-0.0``, the exact identity of addition, so that
   ``optax.apply_updates`` leaves every parameter as it was, bit for bit) and
   passes ``inner``'s state through unchanged;
4. adjusts the loss scale.

The skip is a ``lax.cond`` whose skip branch passes the state through, so a
train step that donates params and optimizer state updates them in place.

>>> import jax, jax.numpy as jnp, optax
>>> import jmp_policy
>>> params = {"w": jnp.ones(3)}
>>> tx = jmp_policy.loss_scaling(optax.sgd(0.1))
>>> state = tx.init(params)
>>> loss_fn = lambda p: jnp.sum(p["w"] ** 2)
>>> scale = jmp_policy.get_loss_scale(state)
>>> loss, grads = jmp_policy.scaled_value_and_grad(loss_fn)(scale, params)
>>> updates, state = tx.update(grads, state, params)
>>> params = optax.apply_updates(params, updates)
>>> params["w"]
Array([0.8, 0.8, 0.8], dtype=float32)
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections import OrderedDict
from typing import Any, Callable, NamedTuple, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.extend.core import jaxpr_as_fun

from jmp_policy.loss_scale import (
    DynamicLossScale,
    LossScale,
    StaticLossScale,
    is_inexact,
    scale_leaves,
    unscaled_all_finite,
)
from jmp_policy.policy import LossScaleLike, as_loss_scale
from jmp_policy.sharding import varying

AxisName = Union[None, str, Sequence[str]]


class LossScalingState(NamedTuple):
    """State of `loss_scaling`.

    Attributes:
      loss_scale: the current loss scale (scale the next step's loss with it).
      inner_state: the wrapped optimizer's state.
      grads_finite: bool scalar, whether the last step's unscaled gradients
        were all finite.
      skipped_steps: int32 scalar, how many steps were skipped (saturates at
        the int32 maximum).
    """

    loss_scale: LossScale
    inner_state: optax.OptState
    grads_finite: jax.Array
    skipped_steps: jax.Array


class LossScaling(optax.GradientTransformationExtraArgs):  # type: ignore[misc]
    """What `loss_scaling` returns: an optax transformation whose state type is known.

    It adds nothing at run time; it only tells type checkers that ``init`` and
    ``update`` give a `LossScalingState`, so that ``opt_state.skipped_steps``
    type-checks in user code.
    """

    init: Callable[[optax.Params], LossScalingState]
    update: Callable[..., Tuple[optax.Updates, LossScalingState]]


# The update functions `loss_scaling` made, so that nesting it can be refused
# (``_replace``, ``chain`` and friends keep the function, not a subclass).
_UPDATES: weakref.WeakSet[Callable[..., Any]] = weakref.WeakSet()


def loss_scaling(
    inner: optax.GradientTransformation,
    loss_scale: LossScaleLike = "dynamic",
    *,
    axis_name: AxisName = None,
) -> LossScaling:
    """Wraps ``inner`` so that it sees unscaled gradients and skips non-finite steps.

    Args:
      inner: the optimizer to run on finite steps (any optax transformation;
        extra keyword arguments of ``update`` are passed on to it).
      loss_scale: ``"dynamic"`` (a `DynamicLossScale` with default settings),
        a number (a static scale), ``None`` (no scaling; non-finite steps are
        still skipped), a loss-scale object, or a `jmp_policy.Policy` (its
        loss scale).
      axis_name: the name, or names, of mapped axes (``shard_map``, ``pmap``)
        over which devices hold different gradients: a non-finite gradient on
        any of them makes all of them skip. Not needed under plain ``jit``
        with sharded arrays, where the check already spans every device.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      `LossScalingState`. Apply its updates with ``optax.apply_updates``.
      (Its type, `LossScaling`, only tells type checkers the state's type.)

    >>> import jax.numpy as jnp, optax
    >>> import jmp_policy
    >>> tx = jmp_policy.loss_scaling(optax.adam(1e-3), 2.0**10)
    >>> state = tx.init({"w": jnp.zeros(2)})
    >>> updates, state = tx.update({"w": jnp.array([1.0, jnp.nan])}, state)
    >>> bool(state.grads_finite), int(state.skipped_steps), bool((updates["w"] == 0).all())
    (False, 1, True)
    """
    initial_scale = _initial_scale(loss_scale)
    if getattr(inner, "update", None) in _UPDATES:
        raise ValueError(_NESTED)
    axes = _axis_names(axis_name)
    inner = optax.with_extra_args_support(inner)

    def init_fn(params: optax.Params) -> LossScalingState:
        return _init(inner, initial_scale, params)

    def update_fn(
        grads: optax.Updates,
        state: LossScalingState,
        params: Optional[optax.Params] = None,
        **extra_args: Any,
    ) -> Tuple[optax.Updates, LossScalingState]:
        return _update(inner, axes, grads, state, params, extra_args)

    _UPDATES.add(update_fn)
    return LossScaling(init_fn, update_fn)


def _initial_scale(loss_scale: LossScaleLike) -> LossScale:
    scale = as_loss_scale(loss_scale)
    if isinstance(scale, StaticLossScale) and _is_zero(scale.loss_scale):
        raise ValueError(
            "loss_scaling: a static loss scale of 0 zeroes every gradient, so every step would "
            "be skipped; use a positive scale, 'dynamic', or None for no scaling.")
    return scale


def _is_zero(value: Any) -> bool:
    return not isinstance(value, jax.core.Tracer) and bool(value == 0)


def _axis_names(axis_name: AxisName) -> Tuple[str, ...]:
    if axis_name is None:
        return ()
    names = (axis_name,) if isinstance(axis_name, str) else axis_name
    if not isinstance(names, (tuple, list)) or not all(isinstance(n, str) for n in names):
        raise TypeError(
            f"loss_scaling: axis_name must be a mapped axis name (a string, e.g. 'batch') or a "
            f"sequence of them, got {axis_name!r} of type {type(axis_name).__name__}.")
    return tuple(names)


_NESTED = (
    "loss_scaling: the inner optimizer already contains a loss_scaling transformation, so "
    "the gradients would be unscaled twice; wrap the optimizer in loss_scaling once.")


def _init(inner: optax.GradientTransformationExtraArgs, initial_scale: LossScale,
          params: optax.Params) -> LossScalingState:
    _check_sees_every_parameter(params)
    inner_state = inner.init(params)
    if _loss_scaling_states(inner_state):
        raise ValueError(_NESTED)
    return LossScalingState(
        # A copy per init: states from one transformation must not share
        # buffers, or donating one state would delete the others' scale.
        loss_scale=jax.tree_util.tree_map(jnp.array, initial_scale),
        inner_state=inner_state,
        grads_finite=jnp.asarray(True),
        skipped_steps=jnp.zeros((), jnp.int32),
    )


def _update(
    inner: optax.GradientTransformationExtraArgs,
    axes: Tuple[str, ...],
    grads: optax.Updates,
    state: LossScalingState,
    params: Optional[optax.Params],
    extra_args: dict[str, Any],
) -> Tuple[optax.Updates, LossScalingState]:
    """One step: steps 1 to 4 of the module's docstring."""
    _check_update_args(grads, state)
    scale = state.loss_scale
    # One inverse for the check and the unscaling, computed once outside
    # the cond rather than in front of every kernel of the taken branch.
    inverse = 1 / jnp.asarray(scale.loss_scale, jnp.float32)
    finite = _all_finite(grads, scale, inverse, axes)
    apply = functools.partial(_inner_update, inner, inverse, extra_args)
    updates, inner_state = _run_if(finite, apply, _skip, grads, state.inner_state, params)
    return updates, LossScalingState(
        loss_scale=scale.adjust(finite),
        inner_state=inner_state,
        grads_finite=finite,
        skipped_steps=jnp.where(finite, state.skipped_steps,
                                optax.safe_increment(state.skipped_steps)),
    )


def _check_sees_every_parameter(tree: Any) -> None:
    """Refuses a tree in which ``optax.masked`` or ``optax.multi_transform`` left some
    parameters out: their gradients would reach another optimizer still scaled."""
    is_masked: Callable[[Any], bool] = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731
    leaves = jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_masked)
    left_out = [jax.tree_util.keystr(path) for path, x in leaves if is_masked(x)]
    if left_out:
        raise ValueError(
            f"loss_scaling is inside optax.masked or optax.multi_transform, which hand it "
            f"only some parameters ({len(left_out)} left out, e.g. {left_out[0]!r}): their "
            "gradients would reach their optimizer still multiplied by the loss scale, and "
            "a non-finite step would be skipped for some parameters only. Put loss_scaling "
            "outermost: jmp_policy.loss_scaling(optax.multi_transform(...), loss_scale).")


def _check_update_args(grads: Any, state: Any) -> None:
    _check_sees_every_parameter(grads)
    if not isinstance(state, LossScalingState):
        raise TypeError(
            f"loss_scaling.update expected the LossScalingState made by this transformation's "
            f"init, got {type(state).__name__}.")
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        dtype = getattr(g, "dtype", None)
        if dtype is not None and dtype != jax.dtypes.float0 and not is_inexact(g):
            raise TypeError(
                f"loss_scaling.update: the gradient at {jax.tree_util.keystr(path)!r} has dtype "
                f"{dtype}; gradients must be floating (or float0, which jax.grad gives for integer "
                "inputs with allow_int=True), since only floating values can be unscaled.")


def _all_finite(grads: optax.Updates, scale: LossScale, inverse: jax.Array,
                axes: Tuple[str, ...]) -> jax.Array:
    """Whether every unscaled gradient is finite, on every device of ``axes`` too."""
    finite = unscaled_all_finite(grads, inverse if _unscaling_can_overflow(scale) else None)
    if not axes:
        return finite
    skipping = jnp.logical_not(finite).astype(jnp.int32)
    agreed: jax.Array = jax.lax.psum(skipping, axes) == 0  # type: ignore[no-untyped-call]
    return agreed


def _unscaling_can_overflow(scale: LossScale) -> bool:
    """Whether ``scale`` can be below 1, so that unscaling can overflow a finite gradient."""
    if isinstance(scale, DynamicLossScale):
        return bool(scale.min_loss_scale < 1)
    if isinstance(scale, StaticLossScale):
        return isinstance(scale.loss_scale, jax.core.Tracer) or bool(scale.loss_scale < 1)
    return False


def _inner_update(
    inner: optax.GradientTransformationExtraArgs,
    inverse: jax.Array,
    extra_args: dict[str, Any],
    grads: optax.Updates,
    inner_state: optax.OptState,
    params: Optional[optax.Params],
) -> Tuple[optax.Updates, optax.OptState]:
    """A finite step: ``inner``'s update of the unscaled gradients."""
    # Unscaled inside the branch, so that XLA fuses the multiply into
    # the optimizer's first elementwise kernel instead of writing it out.
    unscaled = scale_leaves(grads, inverse)
    try:
        out: Tuple[optax.Updates, optax.OptState] = inner.update(
            unscaled, inner_state, params, **extra_args)
        return out
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        _raise_if_integer_params(grads, params, e)
        _raise_if_foreign(inner, grads, inner_state, e)
        raise


def _raise_if_integer_params(grads: Any, params: Any, error: Exception) -> None:
    """Raises a clear error if a gradient is None where ``params`` holds an
    integer array, which no optax optimizer can update."""
    if params is None:
        return
    gradients = dict(jax.tree_util.tree_flatten_with_path(grads, is_leaf=lambda x: x is None)[0])
    for path, p in jax.tree_util.tree_leaves_with_path(params):
        dtype = getattr(p, "dtype", None)
        if dtype is not None and not jnp.issubdtype(dtype, jnp.inexact) and (
                path in gradients and gradients[path] is None):
            raise TypeError(
                f"loss_scaling.update: the gradient at {jax.tree_util.keystr(path)!r} is None and "
                f"the parameter there is {dtype}: gradients are taken of floating-point leaves "
                "only (scaled_value_and_grad and eqx.filter_grad give None elsewhere), and the "
                "optimizer cannot update an integer parameter. Give the optimizer's init and "
                "update the floating-point parameters only (for an Equinox module, "
                "eqx.filter(model, eqx.is_inexact_array)), and keep integer values out of them.") from error


def _raise_if_foreign(inner: optax.GradientTransformation, grads: Any, inner_state: Any,
                      error: Exception) -> None:
    """Raises a clear error if ``inner_state`` is not a state of ``inner``."""
    expected: Any = jax.tree_util.tree_structure(jax.eval_shape(inner.init, grads))
    got: Any = jax.tree_util.tree_structure(inner_state)
    if expected != got:
        raise ValueError(
            "loss_scaling.update: the optimizer state does not belong to this optimizer (was it "
            "made by another optimizer's init?). Its inner state has the structure\n"
            f"  {got}\nwhere this optimizer's init makes\n  {expected}.") from error


# ---------------------------------------------------------------------------
# The skip: one lax.cond, both branches of one type.


def _run_if(
    pred: jax.Array,
    apply: Callable[..., Any],
    skip: Callable[..., Any],
    *operands: Any,
) -> Any:
    """``lax.cond(pred, apply, skip, *operands)``, tracing ``apply`` only once.

    ``skip(out_shapes, *operands)`` gets the shapes and dtypes of ``apply``'s
    outputs, so it can return values of the same types. Both branches' outputs
    are made to vary over the same ``shard_map`` axes.
    """
    closed, out_shapes = jax.make_jaxpr(apply, return_shape=True)(*operands)
    out_tree = jax.tree_util.tree_structure(out_shapes)
    skipped_shapes = jax.eval_shape(lambda *ops: skip(out_shapes, *ops), *operands)
    axes = jax.tree_util.tree_map(
        lambda a, b: varying(a) | varying(b), out_shapes, skipped_shapes)

    def taken(*ops: Any) -> Any:
        outs = jaxpr_as_fun(closed)(*jax.tree_util.tree_leaves(ops))
        return _vary(jax.tree_util.tree_unflatten(out_tree, outs), axes)

    return jax.lax.cond(pred, taken, lambda *ops: _vary(skip(out_shapes, *ops), axes),
                        *operands)


def _skip(out_shapes: Any, grads: Any, inner_state: Any, params: Any) -> Any:
    """A skipped step: zero updates, and ``inner_state`` as it was."""
    del grads, params
    updates_shapes, state_shapes = out_shapes
    # -0.0: p + (-0.0) is p for every p, the zero of either sign included.
    zeros = jax.tree_util.tree_map(lambda s: jnp.full_like(s, -0.0), updates_shapes)
    return zeros, _keep(inner_state, state_shapes)


def _keep(inner_state: Any, state_shapes: Any) -> Any:
    """``inner_state`` unchanged, in the dtypes a finite step gives it.

    Some optimizers widen a state leaf on their first update (with bfloat16
    params, ``inject_hyperparams(adam)``'s moments become float32); both
    branches must agree. Widening keeps every value.
    """
    try:
        return jax.tree_util.tree_map(
            lambda old, new: jnp.asarray(old, new.dtype), inner_state, state_shapes)
    except ValueError as e:
        raise ValueError(
            "loss_scaling: the inner optimizer's update returns a state whose structure differs "
            "from the state it was given, so a skipped step cannot keep the old state. Make "
            f"the inner transformation's state structure constant. ({e})") from None


def _vary(tree: Any, axes: Any) -> Any:
    """Marks each leaf of ``tree`` as varying over its entry in ``axes``."""

    def cast(x: Any, axes: frozenset[str]) -> Any:
        missing = tuple(sorted(axes - varying(x)))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree_util.tree_map(cast, tree, axes)


# ---------------------------------------------------------------------------
# Finding the state: get_loss_scale.


def loss_scaling_state(opt_state: Any) -> LossScalingState:
    """The one `LossScalingState` inside ``opt_state``, wherever it is nested.

    It refuses, with a ``ValueError`` naming the right composition, a state whose
    position shows that gradients reach `loss_scaling` already transformed: inside
    ``optax.MultiSteps`` (it would accumulate scaled, possibly non-finite,
    gradients), inside ``optax.apply_if_finite`` (it would skip overflowing steps
    before the loss scale could shrink), or after another transformation in
    ``optax.chain`` / ``optax.named_chain`` (it would see scaled gradients).
    """
    found = _find_states(opt_state)
    if not found:
        raise ValueError(
            "No LossScalingState found in the optimizer state; build the optimizer with "
            "jmp_policy.loss_scaling(inner, loss_scale) and pass its state.")
    if len(found) > 1:
        raise ValueError(
            f"The optimizer state holds {len(found)} LossScalingStates, so the loss scale is "
            "ambiguous; pass the sub-state of the one you mean.")
    if found[0].misplaced is not None:
        raise ValueError(
            f"The loss_scaling transformation whose state is at opt_state{found[0].path} is "
            f"composed in an order that gives it the wrong gradients: {found[0].misplaced}")
    return found[0].state


def get_loss_scale(opt_state: Any) -> LossScale:
    """The loss scale of the `LossScalingState` inside ``opt_state``.

    The state may be nested anywhere: ``optax.chain``, ``named_chain``,
    ``inject_hyperparams``, ``MultiSteps``, dicts, tuples... A composition that
    gives `loss_scaling` the wrong gradients is a ``ValueError`` naming the right
    one: ``optax.MultiSteps(loss_scaling(inner), k)`` (use
    ``loss_scaling(optax.MultiSteps(inner, k))``), ``optax.apply_if_finite(
    loss_scaling(inner), n)`` (use ``loss_scaling(inner)``, which skips non-finite
    steps itself) and a transformation before `loss_scaling` in a chain, such as
    ``optax.chain(optax.clip(1.0), loss_scaling(inner))`` (use
    ``loss_scaling(optax.chain(optax.clip(1.0), inner))``). `loss_scaling` first in
    a chain is right: the transformations after it see its updates.

    >>> import jax.numpy as jnp, optax
    >>> import jmp_policy
    >>> tx = jmp_policy.loss_scaling(optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2))
    >>> float(jmp_policy.get_loss_scale(tx.init(jnp.zeros(2))).loss_scale)
    32768.0
    >>> wrong = optax.MultiSteps(jmp_policy.loss_scaling(optax.sgd(0.1)), every_k_schedule=2)
    >>> jmp_policy.get_loss_scale(wrong.init(jnp.zeros(2)))
    Traceback (most recent call last):
    ...
    ValueError: The loss_scaling transformation whose state is at opt_state.inner_opt_state is composed in an order that gives it the wrong gradients: it is inside optax.MultiSteps, ...
    """
    return loss_scaling_state(opt_state).loss_scale


def _loss_scaling_states(tree: Any) -> list[LossScalingState]:
    """Every `LossScalingState` inside ``tree``, nested ones included."""
    return [found.state for found in _find_states(tree)]


class _Found(NamedTuple):
    """A `LossScalingState` found in an optimizer state, and where."""

    state: LossScalingState
    path: str  # as jax.tree_util.keystr writes it, from the root of the state
    misplaced: Optional[str]  # why gradients reach it already transformed, if they do


def _find_states(tree: Any, path: Tuple[Any, ...] = (),
                 misplaced: Optional[str] = None) -> list[_Found]:
    """Every `LossScalingState` in ``tree``, with its path and what, if anything,
    transforms the gradients before it.

    Read from the layout optax gives states: ``MultiSteps``' is a
    ``MultiStepsState`` whose ``inner_opt_state`` sees accumulated gradients;
    ``chain``'s is a tuple and ``named_chain``'s an ``OrderedDict``, one entry per
    transformation in order, so every entry after the first sees gradients the
    earlier transformations made. Wrappers that pass the gradients on as they
    are (``inject_hyperparams``, ``masked``, ``nnx.Optimizer``'s variables) nest
    the state under another name, which changes nothing.
    """
    def is_state(x: Any) -> bool:
        return isinstance(x, LossScalingState)

    out: list[_Found] = []
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_state)[0]:
        if isinstance(leaf, LossScalingState):
            reason = misplaced or _misplaced(tree, path, key_path)
            full = (*path, *key_path)
            out += [_Found(leaf, jax.tree_util.keystr(full), reason), *_find_states(
                leaf.inner_state, (*full, jax.tree_util.GetAttrKey("inner_state")), reason)]
    return out


def _misplaced(tree: Any, path: Tuple[Any, ...], key_path: Tuple[Any, ...]) -> Optional[str]:
    """Why the gradients reach the state at ``key_path`` in ``tree`` already
    transformed, or None: the containers along the way decide."""
    node = tree
    for depth, key in enumerate(key_path):
        children = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)[0]
        position = next(i for i, (k, _) in enumerate(children) if k == (key,))
        for state_type, field, reason in _WRAPPERS_BEFORE:
            if isinstance(node, state_type) and key == jax.tree_util.GetAttrKey(field):
                return reason
        if position > 0 and type(node) in (tuple, OrderedDict):
            here = (*path, *key_path[:depth])
            return _AFTER_IN_CHAIN.format(
                n=position, s="s" if position > 1 else "",
                kind="optax.chain" if type(node) is tuple else "optax.named_chain",
                before=", ".join("opt_state" + jax.tree_util.keystr((*here, *k))
                                 for k, _ in children[:position]))
        node = children[position][1]
    return None


_INSIDE_MULTISTEPS = (
    "it is inside optax.MultiSteps, which accumulates the scaled gradients before "
    "loss_scaling sees them: one non-finite micro-step stays in MultiSteps' accumulator "
    "(0 * nan is nan) and every later step is skipped. Put MultiSteps inside instead: "
    "jmp_policy.loss_scaling(optax.MultiSteps(inner, every_k_schedule=k)), which unscales "
    "and checks every micro-step and skips a non-finite one before it reaches the "
    "accumulator.")

_INSIDE_APPLY_IF_FINITE = (
    "it is inside optax.apply_if_finite, which checks the scaled gradients and skips a "
    "non-finite step before loss_scaling sees it: the loss scale does not shrink after an "
    "overflow (not until apply_if_finite's max_consecutive_errors is exceeded), so the "
    "following steps overflow too. loss_scaling already skips non-finite steps: drop "
    "apply_if_finite, or put it inside: "
    "jmp_policy.loss_scaling(optax.apply_if_finite(inner, max_consecutive_errors)).")

# Optax wrappers whose state holds the wrapped transformation's state in ``field`` and
# that transform or check the gradients before handing them on.
_WRAPPERS_BEFORE = (
    (optax.MultiStepsState, "inner_opt_state", _INSIDE_MULTISTEPS),
    (optax.ApplyIfFiniteState, "inner_state", _INSIDE_APPLY_IF_FINITE),
)

_AFTER_IN_CHAIN = (
    "it comes after {n} other transformation{s} in an {kind} (state{s} {before}), which "
    "therefore see the scaled gradients, non-finite ones included: a clip would clip the "
    "gradients times the loss scale. Put them inside instead: "
    "jmp_policy.loss_scaling(optax.chain(<the transformations before it>, inner)), with "
    "loss_scaling first in the chain. (If the tuple or OrderedDict holding this state is "
    "not an optax chain's state, pass the LossScalingState's own sub-state.)")


# ---------------------------------------------------------------------------
# Gradients of the scaled loss: scaled_value_and_grad.


def scaled_loss_fn(fun: Callable[..., Any], loss_scale: LossScaleLike,
                   has_aux: bool) -> Callable[..., Tuple[jax.Array, Tuple[Any, Any]]]:
    """``fun``'s loss times ``loss_scale``, as a function returning ``(scaled, (loss, aux))``.

    The loss is widened to at least float32 before scaling: a float16 loss
    times ``2**15`` would overflow.
    """
    scale = as_loss_scale(loss_scale)

    def scaled(*args: Any, **kwargs: Any) -> Tuple[jax.Array, Tuple[Any, Any]]:
        out = fun(*args, **kwargs)
        if has_aux and not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise TypeError("scaled_value_and_grad(has_aux=True): fun must return a pair "
                            f"(loss, aux), got {type(out).__name__}.")
        loss, aux = out if has_aux else (out, None)
        dtype = getattr(loss, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating) or np.ndim(loss) != 0:
            raise TypeError(
                "scaled_value_and_grad: fun must return a floating scalar loss"
                f"{' as the first element of (loss, aux)' if has_aux else ''}, got "
                f"{getattr(loss, 'shape', '')} {dtype if dtype is not None else type(loss).__name__}.")
        wide = loss.astype(jnp.promote_types(dtype, jnp.float32))
        return scale.scale(wide), (loss, aux)

    return scaled


_KEEP: Any = object()


def scaled_value_and_grad(
    fun: Callable[..., Any],
    argnums: Union[int, Sequence[int]] = 0,
    has_aux: bool = False,
) -> Callable[..., Tuple[Any, Any]]:
    """Like ``jax.value_and_grad``, but differentiates ``fun``'s loss times a loss scale.

    Returns ``g(loss_scale, *args, **kwargs) -> (value, grads)``: ``value`` is
    ``fun``'s unscaled result (``(loss, aux)`` with ``has_aux``) and ``grads``
    are the gradients of the scaled loss, ready for a `loss_scaling`
    optimizer's ``update``. ``loss_scale`` takes the forms `loss_scaling`
    takes; usually it is ``jmp_policy.get_loss_scale(opt_state)``.

    The floating-point array leaves of the arguments at ``argnums`` are
    differentiated. An integer or boolean leaf is a ``TypeError`` naming its
    path, as ``jax.grad`` refuses integer inputs: pass such values as an
    argument that is not in ``argnums``. Other leaves (Python objects and
    functions, and an Equinox module's integer arrays) get ``None`` gradients,
    as ``eqx.filter_grad`` gives them, so a module can be passed as it is.

    >>> import jax.numpy as jnp
    >>> import jmp_policy
    >>> f = lambda w: jnp.sum(w.astype(jnp.float16) ** 2)
    >>> loss, grads = jmp_policy.scaled_value_and_grad(f)(1024.0, jnp.ones(2))
    >>> loss.dtype, grads
    (dtype('float16'), Array([2048., 2048.], dtype=float32))
    """

    def value_and_grad(loss_scale: LossScaleLike, *args: Any, **kwargs: Any) -> Tuple[Any, Any]:
        scaled = scaled_loss_fn(fun, loss_scale, has_aux)
        positions = (argnums,) if isinstance(argnums, int) else tuple(argnums)
        split = [_Differentiable.of(args[i], i) for i in positions]

        def of_leaves(*leaves: list[Any]) -> Tuple[jax.Array, Tuple[Any, Any]]:
            full = list(args)
            for i, part, diff in zip(positions, split, leaves):
                full[i] = part.rebuild(diff)
            return scaled(*full, **kwargs)

        grads, (loss, aux) = jax.grad(of_leaves, argnums=tuple(range(len(split))), has_aux=True)(
            *[part.leaves for part in split])
        trees = [part.rebuild(g, missing=None) for part, g in zip(split, grads)]
        return ((loss, aux) if has_aux else loss), (
            trees[0] if isinstance(argnums, int) else tuple(trees))

    return value_and_grad


class _Differentiable:
    """An argument split into its floating-point array leaves and everything else."""

    def __init__(self, leaves: list[Any], treedef: Any, where: list[int], all_leaves: list[Any]):
        self.leaves, self._treedef, self._where, self._all = leaves, treedef, where, all_leaves

    @classmethod
    def of(cls, tree: Any, position: int) -> _Differentiable:
        _refuse_integer_leaves(tree, position)
        all_leaves, treedef = jax.tree_util.tree_flatten(tree)
        where = [i for i, x in enumerate(all_leaves)
                 if isinstance(x, (jax.Array, np.ndarray, np.generic))
                 and jnp.issubdtype(x.dtype, jnp.inexact)]
        return cls([all_leaves[i] for i in where], treedef, where, all_leaves)

    def rebuild(self, leaves: list[Any], missing: Any = _KEEP) -> Any:
        """The tree with ``leaves`` at the floating positions, ``missing`` (or the
        original leaves) elsewhere."""
        full = list(self._all) if missing is _KEEP else [missing] * len(self._all)
        for i, x in zip(self._where, leaves):
            full[i] = x
        return jax.tree_util.tree_unflatten(self._treedef, full)


def _refuse_integer_leaves(tree: Any, position: int) -> None:
    """A ``TypeError`` for an integer or boolean leaf of a differentiated argument,
    as ``jax.grad`` gives, except inside an Equinox module, whose integer leaves get
    ``None`` gradients as ``eqx.filter_grad`` gives them."""
    eqx = sys.modules.get("equinox")
    module_type = getattr(eqx, "Module", None)

    def is_module(x: Any) -> bool:
        return module_type is not None and isinstance(x, module_type)

    for path, x in jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_module):
        if is_module(x):
            continue
        dtype = getattr(x, "dtype", None) if isinstance(
            x, (jax.Array, np.ndarray, np.generic)) else np.asarray(x).dtype if isinstance(
            x, (bool, int)) else None
        if dtype is not None and (jnp.issubdtype(dtype, jnp.integer) or dtype == np.bool_):
            raise TypeError(
                f"scaled_value_and_grad: fun's argument {position} has an integer or boolean leaf at "
                f"{jax.tree_util.keystr(path)!r} ({dtype}); like jax.grad, scaled_value_and_grad "
                "differentiates only floating-point values, and an optax optimizer cannot update "
                "an integer parameter. Pass integer values (step counters, token ids, masks) as "
                "an argument that is not in argnums, or keep them out of the parameters (an "
                "Equinox module may hold them: its integer leaves get None gradients, as "
                "eqx.filter_grad gives).")
