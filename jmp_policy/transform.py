"""Loss scaling as an optax transformation that skips non-finite steps.

``loss_scaling(inner)`` wraps any optax optimizer. Each ``update``:

1. unscales the gradients of the scaled loss;
2. checks that every unscaled gradient is finite (one fused reduction, plus
   one collective over ``axis_name`` when given);
3. runs ``inner`` on finite steps only; a non-finite step returns zero updates
   and leaves ``inner``'s state bit-for-bit unchanged;
4. adjusts the loss scale.

The skip is a ``lax.cond``, not a ``select`` over every leaf: with donated
params and optimizer state, XLA then updates buffers in place, and the
unscale multiply fuses into the optimizer's first elementwise op. Without
donation, ``donated=False`` makes the skip branch return fresh buffers, so
XLA need not copy the inputs on every step. ``update_and_apply`` also moves
``optax.apply_updates`` inside the taken branch.

>>> import jax, jax.numpy as jnp, optax
>>> import jmp_policy
>>> params = {"w": jnp.ones(3)}
>>> tx = jmp_policy.loss_scaling(optax.sgd(0.1), "dynamic")
>>> state = tx.init(params)
>>> loss_fn = lambda p: jnp.sum(p["w"] ** 2)
>>> loss, grads = jmp_policy.scaled_value_and_grad(loss_fn)(jmp_policy.get_loss_scale(state), params)
>>> updates, state = tx.update(grads, state, params)
>>> updates["w"]
Array([-0.2, -0.2, -0.2], dtype=float32)
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_policy._dtypes import is_floating_dtype
from jmp_policy.loss_scale import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
    _nonfinite_sum,
    _scale_leaves,
    as_loss_scale,
)
from jmp_policy.policy import Policy


class LossScalingState(NamedTuple):
    """State of `loss_scaling`.

    Attributes:
      loss_scale: the current loss-scale object (use it to scale the next loss).
      inner_state: the wrapped optimizer's state.
      grads_finite: bool scalar, whether the last step's unscaled grads were finite.
      skipped_steps: int32 scalar, how many steps were skipped (saturates at int32 max).
    """

    loss_scale: LossScale
    inner_state: optax.OptState
    grads_finite: jax.Array
    skipped_steps: jax.Array


def _as_loss_scale(loss_scale: Any) -> LossScale:
    """Turns `loss_scaling`'s ``loss_scale`` argument into a loss-scale object."""
    if isinstance(loss_scale, Policy):
        return loss_scale.loss_scale
    if not isinstance(loss_scale, str) and all(
        hasattr(loss_scale, a) for a in ("loss_scale", "scale", "unscale", "adjust")
    ):
        return loss_scale  # ours, or a user-defined loss scale with the same interface
    return as_loss_scale(loss_scale, also=" or a jmp_policy.Policy")


def loss_scaling(
    inner: optax.GradientTransformation,
    loss_scale: Any = "dynamic",
    *,
    axis_name: Union[None, str, Sequence[str]] = None,
    donated: bool = True,
) -> optax.GradientTransformationExtraArgs:
    """Wraps ``inner`` so that it sees unscaled gradients and skips non-finite steps.

    Args:
      inner: the optimizer to apply on finite steps (any optax transformation;
        extra ``update`` keyword arguments are passed through to it).
      loss_scale: ``"dynamic"`` (a `DynamicLossScale` with default settings), a
        number (static scale), ``None`` (no scaling, non-finite steps are still
        skipped), a loss-scale object, or a `jmp_policy.Policy` (its loss scale).
      axis_name: name(s) of mapped axes (``shard_map``/``pmap``) whose devices
        hold different gradients: a non-finite gradient on any of them makes all
        of them skip. Not needed under plain ``jit`` with sharded arrays, where
        the finiteness reduction is already global.
      donated: whether the jitted step that calls ``update`` donates the
        optimizer state (and params) with ``donate_argnums``, as train loops
        should. Results are identical either way; only memory traffic differs.
        XLA updates donated buffers in place only if a skipped step passes them
        through, and it writes fresh output buffers without first copying its
        inputs only if a skipped step makes fresh values too; so ``True``
        passes them through and ``False`` makes fresh copies (measured on
        XLA:CPU, 8M params: 1.70x plain adam's bytes with the wrong setting,
        1.10x-1.30x with the right one).

    Returns:
      An ``optax.GradientTransformationExtraArgs``; its state is a `LossScalingState`.

    >>> import jax.numpy as jnp, optax
    >>> import jmp_policy
    >>> tx = jmp_policy.loss_scaling(optax.adam(1e-3), 2.0**10)
    >>> state = tx.init({"w": jnp.zeros(2)})
    >>> updates, state = tx.update({"w": jnp.array([1.0, jnp.nan])}, state)
    >>> bool(state.grads_finite), int(state.skipped_steps), updates["w"]
    (False, 1, Array([0., 0.], dtype=float32))
    """
    if not isinstance(donated, bool):
        raise TypeError(
            f"loss_scaling: donated must be True (the step donates params and optimizer "
            f"state) or False (it does not), got {donated!r}.")
    initial_scale = _as_loss_scale(loss_scale)
    inner = optax.with_extra_args_support(inner)

    def init_fn(params):
        return LossScalingState(
            # A copy per init: otherwise every state this transformation makes
            # shares the closed-over scale's buffers, and donating one state
            # deletes the loss scale of all the others.
            loss_scale=jax.tree_util.tree_map(jnp.array, initial_scale),
            inner_state=inner.init(params),
            grads_finite=jnp.asarray(True),
            skipped_steps=jnp.zeros((), jnp.int32),
        )

    def step(grads, state, params, extra_args, apply_to_params):
        if not isinstance(state, LossScalingState):
            raise TypeError(
                f"loss_scaling.update expected a LossScalingState (from this "
                f"transformation's init), got {type(state).__name__}."
            )
        scale = state.loss_scale
        # A traced scale's `1 / scale`, computed here rather than in the taken
        # branch: there it is a scalar kernel that every optimizer kernel waits
        # for (XLA:CPU, donated 8M-param Adam: 1.23x instead of 1.15x its wall).
        inverse = 1 / scale.loss_scale if isinstance(scale, DynamicLossScale) else None
        # Finiteness of the *unscaled* grads from one read of each scaled
        # gradient (see `_nonfinite_sum`); nothing gradient-sized is written.
        nonfinite = _nonfinite_sum(jax.tree_util.tree_leaves(grads),
                                   _unscale_multiplier(scale, inverse))
        if axis_name is not None:
            # NaN propagates through the sum: one scalar collective.
            nonfinite = jax.lax.psum(nonfinite, axis_name)
        grads_finite = jnp.isfinite(nonfinite)

        # Array-valued extra arguments are cond operands; anything else (Python
        # numbers, strings, callables) is closed over, as optax.MultiSteps does.
        array_args = {k: v for k, v in extra_args.items() if isinstance(v, jax.Array)}
        static_args = {k: v for k, v in extra_args.items() if k not in array_args}

        # The predicate's only consumer is the cond: the bookkeeping happens
        # inside the branches, where the predicate is a constant, so XLA does
        # not copy the finiteness computation into several fusions.
        def apply_inner(grads, state, params, array_args, inverse):
            # Unscaling here (not before the cond) lets XLA fuse the multiply
            # into the optimizer's first elementwise op instead of writing it out.
            # `_scale_leaves` by `inverse` is `DynamicLossScale.unscale`.
            unscaled = (state.loss_scale.unscale(grads) if inverse is None
                        else _scale_leaves(grads, inverse))
            updates, inner_state = inner.update(
                unscaled, state.inner_state, params, **array_args, **static_args)
            return updates, LossScalingState(
                loss_scale=state.loss_scale.adjust(jnp.asarray(True)),
                inner_state=inner_state,
                grads_finite=jnp.asarray(True),
                skipped_steps=state.skipped_steps,
            )

        operands = (grads, state, params, array_args, inverse)
        applied = jax.eval_shape(apply_inner, *operands)

        def skip(grads, state, params, array_args, inverse):
            updates_shape, state_shape = applied
            # zeros_like of the ShapeDtypeStructs keeps explicit shardings too.
            zeros = jax.tree_util.tree_map(jnp.zeros_like, updates_shape)
            inner_state = _keep(state.inner_state, state_shape.inner_state)
            return zeros, LossScalingState(
                loss_scale=state.loss_scale.adjust(jnp.asarray(False)),
                inner_state=inner_state if donated else _fresh(inner_state),
                grads_finite=jnp.asarray(False),
                # optax's own saturating increment: the same kernel as the inner
                # optimizer's step count, which XLA compiles once.
                skipped_steps=optax.safe_increment(state.skipped_steps),
            )

        # Under shard_map both branches must also agree on which values vary
        # across devices (e.g. zeros vs. updates computed from sharded grads).
        target = _union_varying(applied, jax.eval_shape(skip, *operands))
        if apply_to_params:
            # The parameter update happens inside the taken branch, so XLA
            # fuses it with the optimizer's last elementwise op and the
            # updates are never written out; the skip branch passes params
            # through (in place when donated).
            def finite_branch(*args):
                updates, new_state = _make_varying(apply_inner(*args), target)
                return optax.apply_updates(args[2], updates), new_state

            def skip_branch(*args):
                params = args[2] if donated else _fresh(args[2])
                return params, _make_varying(skip(*args), target)[1]

            # As for update: both branches must agree on varying axes (shard_map).
            fused_target = _union_varying(
                jax.eval_shape(finite_branch, *operands), jax.eval_shape(skip_branch, *operands))
            return jax.lax.cond(
                grads_finite,
                lambda *args: _make_varying(finite_branch(*args), fused_target),
                lambda *args: _make_varying(skip_branch(*args), fused_target),
                *operands,
            )
        return jax.lax.cond(
            grads_finite,
            lambda *args: _make_varying(apply_inner(*args), target),
            lambda *args: _make_varying(skip(*args), target),
            *operands,
        )

    def update_fn(grads, state, params=None, **extra_args):
        return step(grads, state, params, extra_args, apply_to_params=False)

    def update_and_apply(grads, state, params, **extra_args):
        """``(optax.apply_updates(params, updates), new_state)`` in one skip.

        Same result, bit for bit, as ``update`` followed by
        ``optax.apply_updates``; the parameter update happens inside the
        taken branch, fused with the optimizer's last kernel, so no updates
        tree is written out (8M-param Adam step on XLA:CPU: 1.10x plain
        adam's bytes, against 1.30x for ``update`` + ``apply_updates``).
        """
        return step(grads, state, params, extra_args, apply_to_params=True)

    tx = _LossScaling(init_fn, update_fn)
    tx.update_and_apply = update_and_apply
    return tx


class _LossScaling(optax.GradientTransformationExtraArgs):
    """`loss_scaling`'s return type: an optax transformation plus ``update_and_apply``."""


def _varying_axes(aval: Any) -> frozenset:
    """The mesh axes a value varies over inside ``shard_map`` (empty elsewhere)."""
    manual = getattr(aval, "manual_axis_type", None)  # None: not an array type
    return frozenset(manual.varying) if manual is not None else frozenset()


def _union_varying(a: Any, b: Any) -> Any:
    return jax.tree_util.tree_map(lambda x, y: _varying_axes(x) | _varying_axes(y), a, b)


def _make_varying(tree: Any, target: Any) -> Any:
    def cast(x, axes):
        missing = tuple(sorted(axes - _varying_axes(jax.typeof(x))))
        if not missing:
            return x
        return jax.lax.pcast(x, missing, to="varying")

    return jax.tree_util.tree_map(cast, tree, target)


def _unscale_multiplier(scale: Any, inverse: Any) -> Any:
    """``1 / loss_scale`` if unscaling may turn finite grads into inf, else None.

    Only a scale below 1 can: a `DynamicLossScale` with ``min_loss_scale >= 1``
    or a `StaticLossScale` >= 1 never does, and then the finiteness check of
    the scaled grads is exact for the unscaled ones, at no extra cost.
    ``inverse`` is a dynamic scale's ``1 / loss_scale``, already computed.
    """
    if isinstance(scale, NoOpLossScale):
        return None
    if isinstance(scale, DynamicLossScale):
        return None if scale.min_loss_scale >= 1 else inverse
    if isinstance(scale, StaticLossScale) and not isinstance(scale.loss_scale, jax.core.Tracer):
        if scale.loss_scale >= 1:
            return None
    return 1 / scale.loss_scale


_FRESH_DTYPES = tuple(np.dtype(d) for d in (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float64))


def _fresh(tree: Any) -> Any:
    """The same values, bit for bit, in new buffers that XLA will not elide.

    A skipped step that returns its inputs unchanged makes XLA copy every
    non-donated input before the cond on *every* step (an output may not alias
    a buffer the caller keeps); an exact identity inside the skip branch moves
    that copy into the branch, which runs only on skipped steps. Rounding to
    the dtype's own exponent and mantissa widths is such an identity.
    """

    def fresh(x):
        if getattr(x, "dtype", None) in _FRESH_DTYPES:
            info = jnp.finfo(x.dtype)
            return jax.lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)
        return x  # integer/bool leaves are small scalars in practice (step counts)

    return jax.tree_util.tree_map(fresh, tree)


def _keep(inner_state: Any, applied_shape: Any) -> Any:
    """``inner_state`` unchanged, in the dtypes a finite step would have produced.

    Some optimizers change a state leaf's dtype on their first update (e.g.
    ``inject_hyperparams(adam)`` with bfloat16 params: bfloat16 moments become
    float32); both branches of the cond must agree. Values are unchanged: such
    casts only widen.
    """
    try:
        return jax.tree_util.tree_map(
            lambda old, new: old if jnp.result_type(old) == new.dtype else jnp.asarray(old, new.dtype),
            inner_state,
            applied_shape,
        )
    except ValueError as e:
        raise ValueError(
            "loss_scaling: the inner optimizer's update returns a state whose structure "
            "differs from the state it was given, so a skipped step cannot keep the old "
            f"state. Make the inner transformation's state structure constant. ({e})"
        ) from None


def _find_states(tree: Any, found: list) -> None:
    is_state = lambda x: isinstance(x, LossScalingState)
    for leaf in jax.tree_util.tree_leaves(tree, is_leaf=is_state):
        if is_state(leaf):
            found.append(leaf)
            _find_states(leaf.inner_state, found)  # nested loss_scaling is ambiguous


def get_loss_scale(opt_state: Any) -> LossScale:
    """Returns the loss-scale object of the `LossScalingState` inside ``opt_state``.

    The state may be nested anywhere: ``optax.chain``, ``named_chain``,
    ``inject_hyperparams``, ``MultiSteps``, dicts, tuples...

    >>> import jax.numpy as jnp, optax
    >>> import jmp_policy
    >>> tx = optax.MultiSteps(jmp_policy.loss_scaling(optax.sgd(0.1)), every_k_schedule=2)
    >>> float(jmp_policy.get_loss_scale(tx.init(jnp.zeros(2))).loss_scale)
    32768.0
    """
    found: list = []
    _find_states(opt_state, found)
    if not found:
        raise ValueError(
            "get_loss_scale: no LossScalingState found in the optimizer state; build "
            "the optimizer with jmp_policy.loss_scaling(inner, loss_scale) and pass its state."
        )
    if len(found) > 1:
        raise ValueError(
            f"get_loss_scale: the optimizer state holds {len(found)} LossScalingStates, "
            "so the loss scale is ambiguous; pass the sub-state of the one you mean."
        )
    return found[0].loss_scale


def _scale_value(loss_scale: Any) -> jax.Array:
    """The float32 scalar to multiply the loss by."""
    value = getattr(loss_scale, "loss_scale", loss_scale)
    dtype = getattr(value, "dtype", None)
    try:
        if isinstance(value, (bool, str)) or dtype == np.bool_ or (
            dtype is not None and not jnp.issubdtype(dtype, jnp.number)
        ):
            raise TypeError
        value = jnp.asarray(value, dtype=jnp.float32)
    except (TypeError, ValueError):
        raise TypeError(
            "loss_scale must be a loss-scale object (e.g. jmp_policy.get_loss_scale(opt_state)) "
            f"or a number/scalar array, got {loss_scale!r} of type {type(loss_scale).__name__}."
        ) from None
    if value.ndim != 0:
        raise ValueError(f"loss_scale must be a scalar, got shape {value.shape}.")
    return value


def scaled_value_and_grad(
    fun: Callable[..., Any],
    argnums: Union[int, Sequence[int]] = 0,
    has_aux: bool = False,
) -> Callable[..., Any]:
    """Like ``jax.value_and_grad``, but differentiates ``fun``'s loss times a loss scale.

    Returns ``g(loss_scale, *args, **kwargs) -> (value, grads)`` where ``value``
    is ``fun``'s unscaled result (``(loss, aux)`` when ``has_aux``) and
    ``grads`` are the gradients of ``loss * loss_scale``, ready for a
    `loss_scaling` optimizer's ``update``. A half-precision loss is promoted to
    float32 before scaling, so ``loss * 2**15`` cannot overflow float16.

    >>> import jax.numpy as jnp
    >>> import jmp_policy
    >>> f = lambda w: jnp.sum(w.astype(jnp.float16) ** 2)
    >>> loss, grads = jmp_policy.scaled_value_and_grad(f)(1024.0, jnp.ones(2))
    >>> loss.dtype, grads
    (dtype('float16'), Array([2048., 2048.], dtype=float32))
    """

    def value_and_grad(loss_scale, *args, **kwargs):
        scale = _scale_value(loss_scale)

        def scaled_loss(*args, **kwargs):
            out = fun(*args, **kwargs)
            if has_aux:
                if not (isinstance(out, (tuple, list)) and len(out) == 2):
                    raise TypeError(
                        "scaled_value_and_grad(has_aux=True): fun must return a pair "
                        f"(loss, aux), got {type(out).__name__}."
                    )
                loss, aux = out
            else:
                loss, aux = out, None
            dtype = getattr(loss, "dtype", None)
            if dtype is None or not is_floating_dtype(dtype) or np.ndim(loss) != 0:
                raise TypeError(
                    "scaled_value_and_grad: fun must return a floating scalar loss"
                    f"{' as the first element of (loss, aux)' if has_aux else ''}, got "
                    f"{getattr(loss, 'shape', '')} "
                    f"{dtype if dtype is not None else type(loss).__name__}."
                )
            # Promote float16/bfloat16 losses: float16(loss) * 32768 overflows easily.
            wide = loss.astype(jnp.promote_types(dtype, jnp.float32))
            return wide * scale, (loss, aux)

        grads, (loss, aux) = jax.grad(scaled_loss, argnums=argnums, has_aux=True)(*args, **kwargs)
        return ((loss, aux) if has_aux else loss), grads

    return value_and_grad
