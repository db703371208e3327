"""bfloat16 parameters and optimizer states that train like float32.

Storing weights in bfloat16 halves their memory, but a plain bfloat16 update
rounds to nearest: an update smaller than half a unit in the last place of a
weight (about ``2**-9`` of it) is lost, so small learning rates stall.
`low_precision_params` wraps any optax optimizer so that it does not:

* ``"kahan"`` keeps, per parameter, a compensation buffer in the parameter
  dtype holding what rounding took away; the next step adds it back.
* ``"stochastic"`` rounds each new weight up or down at random, with
  probabilities that make its mean the exact float32 result. The PRNG key is
  part of the optimizer state.
* ``"split"`` keeps the low 16 bits of a float32 weight whose high 16 bits
  are the bfloat16 parameter: the float32 weight is rebuilt, updated in
  float32 and split again, exactly as float32 master weights would be.

`cast_state` stores an optimizer's state (Adam's two moments, momentum...) in
bfloat16, widening it to float32 for each update and rounding it back
stochastically, so that a slow moving average such as Adam's second moment
still moves. `master_params` returns the float32 weights that training tracks.

The wrapped optimizer always computes in float32: it sees float32 gradients,
float32 parameters (the compensated, or rebuilt, weights) and keeps a float32
state unless `cast_state` says otherwise. Apply the updates with
``optax.apply_updates``; they are float32 and place every weight exactly on
its new bfloat16 value.

>>> import jax.numpy as jnp, optax
>>> import jmp_policy
>>> params = {"w": jnp.ones(2, jnp.bfloat16)}
>>> tx = jmp_policy.low_precision_params(optax.sgd(1e-3), "kahan")
>>> state = tx.init(params)
>>> for _ in range(8):
...     updates, state = tx.update({"w": jnp.ones(2)}, state, params)
...     params = optax.apply_updates(params, updates)
>>> params["w"]  # 1 - 8e-3, in bfloat16; plain bfloat16 steps of 1e-3 stay at 1
Array([0.992188, 0.992188], dtype=bfloat16)
>>> jmp_policy.master_params(params, state)["w"].round(4)  # the weights training tracks
Array([0.992, 0.992], dtype=float32)
"""

from __future__ import annotations

import difflib
import functools
import warnings
from typing import Any, Callable, NamedTuple, Optional, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_policy import formats
from jmp_policy.optim._loss_scaling import _loss_scaling_states

Seed = Union[int, jax.Array]

METHODS = ("kahan", "stochastic", "split")
ROUNDINGS = ("stochastic", "nearest")

class KahanState(NamedTuple):
    """State of ``low_precision_params(inner, "kahan")``.

    Attributes:
      inner_state: the wrapped optimizer's state.
      compensation: per low-precision parameter, in its dtype, what rounding
        the weight took away (``optax.MaskedNode()`` for float32 parameters).
      landed: a float32 array of 16 weights of each low-precision parameter
        (strided over it flattened; all of a smaller one), in the order of the
        leaves, as the last update left them: the next update compares its
        parameters with them.
    """

    inner_state: optax.OptState
    compensation: optax.Params
    landed: jax.Array


class StochasticRoundingState(NamedTuple):
    """State of ``low_precision_params(inner, "stochastic")``.

    Attributes:
      inner_state: the wrapped optimizer's state.
      key: the raw data (``jax.random.key_data``) of the PRNG key of the next
        step; each step splits it, so no two steps round alike.
      dtypes: per low-precision parameter, a zero of its dtype
        (``optax.MaskedNode()`` for float32 parameters): what the next update
        checks the parameters against.
      landed: the sampled weights the last update left, as in `KahanState`.
    """

    inner_state: optax.OptState
    key: jax.Array
    dtypes: optax.Params
    landed: jax.Array


class SplitState(NamedTuple):
    """State of ``low_precision_params(inner, "split")``.

    Attributes:
      inner_state: the wrapped optimizer's state.
      low_bits: per bfloat16 parameter, a uint16 array of the low 16 bits of
        the float32 weight whose high 16 bits are the parameter
        (``optax.MaskedNode()`` for float32 parameters).
      landed: the sampled weights the last update left, as in `KahanState`.
    """

    inner_state: optax.OptState
    low_bits: optax.Params
    landed: jax.Array


class CastState(NamedTuple):
    """State of `cast_state`.

    Attributes:
      inner_state: the wrapped optimizer's state, its floating arrays stored
        in the narrow dtype.
      key: the raw data of the PRNG key of the next stochastic rounding
        (``None`` when rounding to nearest).
    """

    inner_state: optax.OptState
    key: Optional[jax.Array]


LowPrecisionState = Union[KahanState, StochasticRoundingState, SplitState]


def low_precision_params(inner: optax.GradientTransformation, method: str = "kahan", *,
                         seed: Seed = 0) -> optax.GradientTransformationExtraArgs:
    """Wraps ``inner`` so that bfloat16 (or float16) parameters train like float32 ones.

    Args:
      inner: the optimizer (any optax transformation). It runs in float32 on
        float32 gradients and sees float32 parameters: the compensated weights
        (``"kahan"``), the weights (``"stochastic"``) or the rebuilt float32
        weights (``"split"``). Its state is float32; wrap it in `cast_state` to
        store that state in bfloat16.
      method: ``"kahan"`` (a compensation buffer per parameter, in its dtype:
        2 bytes per bfloat16 parameter), ``"stochastic"`` (stochastic
        rounding; no buffer) or ``"split"`` (the low 16 bits of each float32
        weight: 2 bytes; bfloat16 parameters only).
      seed: for ``"stochastic"``, an int or a PRNG key. The state holds the
        key; each step splits it and rounds with random bits hashed from a seed
        drawn from the new key, each element's index and value
        (``jmp_policy.formats.random_bits``), so training is reproducible from
        the seed and no two steps round alike.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose ``update`` needs
      ``params``. Its state is a `KahanState`, `StochasticRoundingState` or
      `SplitState`. Apply its (float32) updates with ``optax.apply_updates``
      and nothing after it: each update takes its weight exactly to the new
      low-precision value. Only `jmp_policy.loss_scaling` and
      ``optax.MultiSteps`` may wrap it, and ``loss_scaling`` must wrap it rather
      than be wrapped, so that a skipped step changes nothing. The next update
      compares a few sampled weights with those the last one produced: a
      transformation chained after it (a learning rate, a clip) or weights
      changed between steps is a ``ValueError`` where ``update`` runs on
      concrete values, and a warning, once, from a jitted program.

    Parameters in float32 or wider are updated as ``inner`` says, with no
    buffer; integer parameters are an error.

    >>> import jax, jax.numpy as jnp, optax
    >>> import jmp_policy
    >>> params = {"w": jnp.full(4, 1.0, jnp.bfloat16)}
    >>> tx = jmp_policy.low_precision_params(optax.sgd(1e-3), "stochastic", seed=0)
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.ones(4)}, state, params)
    >>> new = optax.apply_updates(params, updates)["w"]
    >>> new.dtype, bool(jnp.all((new == 1) | (new == 1 - 2.0**-8)))
    (dtype(bfloat16), True)
    """
    method = _check_choice("low_precision_params", "method", method, METHODS)
    key, impl = _key_data(seed, formats.SEED_STREAMS.low_precision_params,
                          "low_precision_params")
    inner = optax.with_extra_args_support(inner)
    warn_once = _WarnOnce(_misuse_message(method))

    def init_fn(params: optax.Params) -> LowPrecisionState:
        return _initial_state(inner, method, key, params)

    def update_fn(grads: optax.Updates, state: LowPrecisionState,
                  params: Optional[optax.Params] = None,
                  **extra_args: Any) -> Tuple[optax.Updates, LowPrecisionState]:
        _check_update_args(method, state, params)
        return _updated(inner, method, impl, warn_once, grads, state, params, extra_args)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _updated(inner: optax.GradientTransformationExtraArgs, method: str, impl: Any,
             warn_once: "_WarnOnce", grads: optax.Updates, state: LowPrecisionState,
             params: optax.Params,
             extra_args: dict[str, Any]) -> Tuple[optax.Updates, LowPrecisionState]:
    """`low_precision_params`' update: checks, the inner update in float32, the method's
    step, and the sampled weights of the next check."""
    handled = _handled_leaves(params, method)
    _check_still_narrow(method, state, handled)
    zero = _check_landed(state.landed, params, handled, warn_once)
    grads = _after(zero, _widened(grads, handled), handled)
    seen = _params_seen_by_inner(params, state, handled)
    updates, inner_state = inner.update(grads, state.inner_state, seen, **extra_args)
    updates, new_state = _stepped(state, inner_state, handled, params, seen, updates, impl)
    return updates, new_state._replace(landed=_landed(params, updates, handled))


def _initial_state(inner: optax.GradientTransformationExtraArgs, method: str, key: jax.Array,
                   params: optax.Params) -> LowPrecisionState:
    """`low_precision_params`' state for ``params``: the inner optimizer's, and the
    method's buffers."""
    handled = _handled_leaves(params, method, warn=True)
    inner_state = inner.init(_widened(params, handled))
    _refuse_inner_loss_scaling("low_precision_params", inner_state)
    # No update has landed yet: the buffers say nothing about the weights, so
    # weights changed before the first update (pretrained ones loaded) are fine.
    landed = jnp.full_like(_samples(params, handled), _NOT_LANDED)
    if method == "kahan":
        # -0.0, the additive identity: x + (-0.0) is x for every x, -0.0 included.
        return KahanState(inner_state, _buffers(params, handled, lambda p: -jnp.zeros_like(p)),
                          landed)
    if method == "split":
        return SplitState(inner_state,
                          _buffers(params, handled, lambda p: jnp.zeros_like(p, jnp.uint16)),
                          landed)
    return StochasticRoundingState(
        inner_state, key, _buffers(params, handled, lambda p: jnp.zeros((), p.dtype)), landed)


def _stepped(state: LowPrecisionState, inner_state: optax.OptState, handled: Any,
             params: Any, seen: Any, updates: Any,
             impl: Any) -> Tuple[optax.Updates, LowPrecisionState]:
    """The method's step on every handled parameter: the updates that take each weight to
    its new value, and the new state (``landed`` as it was)."""
    if isinstance(state, KahanState):
        updates, compensation = _per_leaf(_kahan_step, handled, params, updates,
                                          state.compensation)
        return updates, KahanState(inner_state, compensation, state.landed)
    if isinstance(state, SplitState):
        updates, low_bits = _per_leaf(_split_step, handled, seen, updates, params)
        return updates, SplitState(inner_state, low_bits, state.landed)
    next_key, seed = _step_seed(state.key, impl)
    updates, _ = _per_leaf(functools.partial(_stochastic_step, seed=seed), handled,
                           params, updates)
    return updates, StochasticRoundingState(inner_state, next_key, state.dtypes, state.landed)


def cast_state(
    inner: optax.GradientTransformation, dtype: Any = jnp.bfloat16, *,
    rounding: str = "stochastic", seed: Seed = 0,
) -> optax.GradientTransformationExtraArgs:
    """Stores ``inner``'s state in ``dtype``; ``inner`` still computes in float32.

    Every floating array of the state with at least one dimension (Adam's
    ``mu`` and ``nu``, momentum...) is kept in ``dtype``. Each ``update``
    widens it to float32, runs ``inner`` and rounds the new state back.
    Scalars (step counts, injected hyperparameters) are left as they are.

    Rounding to nearest loses any change smaller than half a unit in the last
    place: with ``b2=0.999``, Adam's second moment changes by 0.1% of itself
    per step, below bfloat16's 0.2% to 0.4%, so it stops decaying. Stochastic
    rounding (the default) keeps every moving average unbiased.

    Args:
      inner: the optimizer whose state to store narrowly.
      dtype: the storage dtype, a floating dtype narrower than float32.
      rounding: ``"stochastic"`` (default) or ``"nearest"``.
      seed: an int or a PRNG key for stochastic rounding.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a `CastState`.

    >>> import jax.numpy as jnp, optax
    >>> import jmp_policy
    >>> tx = jmp_policy.cast_state(optax.adam(1e-3), jnp.bfloat16)
    >>> state = tx.init({"w": jnp.zeros(3)})
    >>> updates, state = tx.update({"w": jnp.ones(3)}, state)
    >>> state.inner_state[0].nu["w"].dtype, updates["w"].dtype
    (dtype(bfloat16), dtype('float32'))
    """
    dtype = _narrow_dtype(dtype)
    rounding = _check_choice("cast_state", "rounding", rounding, ROUNDINGS)
    data, impl = _key_data(seed, formats.SEED_STREAMS.cast_state, "cast_state")
    key = data if rounding == "stochastic" else None
    inner = optax.with_extra_args_support(inner)

    def init_fn(params: optax.Params) -> CastState:
        inner_state = inner.init(params)
        _refuse_inner_loss_scaling("cast_state", inner_state)
        return CastState(_narrowed(inner_state, dtype, None), key)

    def update_fn(
        grads: optax.Updates,
        state: CastState,
        params: Optional[optax.Params] = None,
        **extra_args: Any,
    ) -> Tuple[optax.Updates, CastState]:
        if not isinstance(state, CastState):
            raise TypeError(f"cast_state.update expected the CastState made by this "
                            f"transformation's init, got {type(state).__name__}.")
        updates, inner_state = inner.update(grads, _widened_state(state.inner_state), params,
                                            **extra_args)
        if state.key is None:
            return updates, CastState(_narrowed(inner_state, dtype, None), None)
        next_key, seed = _step_seed(state.key, impl)
        return updates, CastState(_narrowed(inner_state, dtype, seed), next_key)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def master_params(params: optax.Params, opt_state: optax.OptState) -> optax.Params:
    """The float32 weights that `low_precision_params` tracks behind ``params``.

    ``"split"``: the float32 weights, exactly; ``"kahan"``: each weight plus
    its compensation; ``"stochastic"``: the weights, widened. Parameters the
    transformation leaves alone come back as they are. The state may be
    nested anywhere in ``opt_state`` (``loss_scaling``, ``MultiSteps``...).

    >>> import jax.numpy as jnp, optax
    >>> import jmp_policy
    >>> params = {"w": jnp.array([1.0], jnp.bfloat16)}
    >>> tx = jmp_policy.low_precision_params(optax.sgd(2.0**-12), "split")
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": -jnp.ones(1)}, state, params)
    >>> params = optax.apply_updates(params, updates)
    >>> params["w"], jmp_policy.master_params(params, state)["w"]
    (Array([1], dtype=bfloat16), Array([1.0002441], dtype=float32))
    """
    state = _low_precision_state(opt_state)
    methods: dict[type, str] = {KahanState: "kahan", SplitState: "split"}
    method = methods.get(type(state), "stochastic")
    handled = _handled_leaves(params, method)
    return _params_seen_by_inner(params, state, handled)


# --------------------------------------------------------------------------- #
# The three methods, one parameter at a time. Each returns the float32 update
# for ``optax.apply_updates`` and the parameter's new buffer.
# --------------------------------------------------------------------------- #

def _kahan_step(p: jax.Array, update: jax.Array, c: jax.Array) -> Tuple[jax.Array, jax.Array]:
    # The small terms first, so that an update far below the weight's
    # precision still adds to the compensation.
    total = p.astype(jnp.float32) + (c.astype(jnp.float32) + update)
    to_new = _update_to(p, formats.encode(total, p.dtype))
    new = _applied(p, to_new)
    # ``total - new`` is exact in float32 (the two are within a rounding of
    # each other); it is measured against the weight apply_updates gives, so
    # the compensation is right even where that is not the nearest value.
    rest = total - new.astype(jnp.float32)
    rest = jnp.where(jnp.isfinite(new) & (rest != 0), rest, -0.0)
    return to_new, rest.astype(p.dtype)


def _stochastic_step(p: jax.Array, update: jax.Array, *, seed: jax.Array) -> Tuple[jax.Array, None]:
    return _update_to(p, formats.encode(p.astype(jnp.float32) + update, p.dtype, seed)), None


def _split_step(weight: jax.Array, update: jax.Array, p: jax.Array) -> Tuple[jax.Array, jax.Array]:
    # The same float32 addition optax.apply_updates makes on float32 weights.
    high, low = formats.split_float32(jnp.asarray(weight + update).astype(jnp.float32))
    return _update_to(p, high), low


class _Pair:
    """An update and a buffer: not a pytree, so a leaf of the tree `_per_leaf` builds."""

    def __init__(self, update: Any, buffer: Any):
        self.update, self.buffer = update, buffer


def _per_leaf(step: Callable[..., Tuple[Any, Any]], handled: Any, *trees: Any) -> Tuple[Any, Any]:
    """``step`` on every handled leaf: (updates, buffers); other leaves pass through.

    ``trees[1]`` holds the inner updates, which unhandled leaves take as they are;
    their buffer is ``optax.MaskedNode()``.
    """
    def leaf(is_handled: bool, *args: Any) -> _Pair:
        return _Pair(*step(*args)) if is_handled else _Pair(args[1], optax.MaskedNode())

    pairs = jax.tree_util.tree_map(leaf, handled, *trees)
    return (jax.tree_util.tree_map(lambda pair: pair.update, pairs),
            jax.tree_util.tree_map(lambda pair: pair.buffer, pairs))


# --------------------------------------------------------------------------- #
# Exact updates.
#
# optax.apply_updates computes ``(p + u).astype(p.dtype)``: for a bfloat16 p and
# a float32 u, p is widened (exactly), added to u in float32 and the sum rounded
# to nearest. ``_update_to(p, new)`` returns ``u = float32(new) - float32(p)``.
# That difference is exact in float32 whenever new's exponent is within 16 of
# p's (at most 8 + 16 significant bits); then p + u is new exactly and the
# rounding keeps it. When new is far larger than p, p + u is within 2**-22 of
# new, far inside half a bfloat16 ulp, so it still rounds to new. When new is
# far smaller than p, it came from a cancellation p + v that is exact, so it
# lies on p's float32 grid and the difference is exact again. What cannot be
# reached is a -0.0 from any other value (x + y is -0.0 only for two -0.0s), a
# difference beyond float32's range, and, where the hardware flushes
# subnormals, a subnormal result or difference; ``_applied`` says what the
# weight then becomes, and the Kahan buffer accounts for it.
# --------------------------------------------------------------------------- #

def _update_to(p: jax.Array, new: jax.Array) -> jax.Array:
    """The float32 update with which ``optax.apply_updates`` moves ``p`` to ``new``."""
    unchanged = formats.bits_of(p) == formats.bits_of(new)
    # -0.0: p + (-0.0) is p for every p, signed zeros, infinities and NaNs included.
    return jnp.where(unchanged, -0.0, new.astype(jnp.float32) - p.astype(jnp.float32))


def _applied(p: jax.Array, update: jax.Array) -> jax.Array:
    """What ``optax.apply_updates`` makes of ``p`` and a float32 ``update``."""
    return formats.encode(p.astype(jnp.float32) + update, p.dtype)


# --------------------------------------------------------------------------- #
# Misuse: parameters other than the weights the last update produced.
#
# Each update stores a few sampled weights as optax.apply_updates will make
# them; the next update compares its parameters at the same elements. A
# transformation chained after low_precision_params (a learning rate, a scale,
# a clip) or weights changed between steps show as a difference.
# --------------------------------------------------------------------------- #

# Weights sampled per low-precision parameter: a scaled update shows at an
# element the update moves (by half of the moved ones, for a move of one ulp
# halved), so several per parameter, over every parameter, catch it at once.
_SAMPLES = 16
# On no bfloat16 or float16 grid, so no weight equals it: "no update has landed yet".
_NOT_LANDED = np.float32(1 + 2**-20)


def _samples(params: Any, handled: Any) -> jax.Array:
    """`_SAMPLES` elements of each handled leaf flattened, evenly strided (all of a smaller
    one), in float32, in one array.

    Replicated over an explicit mesh: XLA gathers the few elements, whatever
    the sharding (flattening a sharded array is not expressible there).
    """
    def strided(x: Any) -> jax.Array:
        if np.ndim(x) == 0:
            return jnp.reshape(x, (1,)).astype(jnp.float32)
        size = int(np.size(x))
        stride = max(1, size // _SAMPLES)
        # From the middle of each stride: a first row (a padding token's embedding)
        # may never move.
        flat = stride // 2 + stride * np.arange(min(_SAMPLES, size))
        # Indexed along each axis, not in the flattened array: a sharded array's
        # flattening gathers all of it on every device (XLA partitions a reshape
        # that way), while indices reach the few elements where they lie.
        sample: jax.Array = x[np.unravel_index(flat, np.shape(x))].astype(jnp.float32)
        return sample

    def concatenated(leaves: list[Any]) -> jax.Array:
        # XLA:CPU reads the slices of at most 8 arrays in one kernel, and merges
        # nested concatenations: the barrier keeps the groups of 8 apart, so a
        # model of many parameters costs a kernel per 8 rather than one each.
        groups = [jnp.concatenate([jnp.zeros(0, jnp.float32)] + [
            strided(x) for x in leaves[i:i + 8]]) for i in range(0, len(leaves), 8)]
        apart = jax.lax.optimization_barrier(groups)  # type: ignore[no-untyped-call]
        return jnp.concatenate([jnp.zeros(0, jnp.float32)] + list(apart))

    leaves = [p for h, p in zip(jax.tree_util.tree_leaves(handled),
                                jax.tree_util.tree_leaves(params)) if h]
    if jax.sharding.get_abstract_mesh().explicit_axes:
        replicated = jax.sharding.PartitionSpec()  # type: ignore[no-untyped-call]
        sample: jax.Array = jax.sharding.auto_axes(concatenated, out_sharding=replicated)(leaves)
        return sample
    return concatenated(leaves)


def _landed(params: Any, updates: Any, handled: Any) -> jax.Array:
    """`_samples` of the weights ``optax.apply_updates(params, updates)`` makes."""
    # optax.apply_updates' own expression: where the caller applies the updates in the
    # same program, XLA computes the new weights once, as the step's outputs, and the
    # slices read a few elements of them.
    new = jax.tree_util.tree_map(
        lambda h, p, u: jnp.asarray(p + u).astype(jnp.asarray(p).dtype) if h else p,
        handled, params, updates)
    return _samples(new, handled)


def _check_landed(landed: jax.Array, params: Any, handled: Any,
                  report: "_WarnOnce") -> Optional[jax.Array]:
    """Whether ``params`` differ from the weights the last update produced, at the sampled
    elements: a ``ValueError`` where the values are concrete, else a warning from the program.

    Returns, where traced, a -0.0 that the check computes (`_after`), else ``None``.
    """
    if not any(jax.tree_util.tree_leaves(handled)):
        return None
    seen = _samples(params, handled)
    # Values, not bits: a zero update turns a weight of -0.0 into +0.0
    # (optax.MultiSteps' mini-steps), and NaN weights stay NaN.
    same = (seen == landed) | (jnp.isnan(seen) & jnp.isnan(landed))
    changed = jnp.any(~same & (landed != _NOT_LANDED))
    if not isinstance(changed, jax.core.Tracer):
        if changed:
            raise ValueError(report.message)
        return None
    # The host is called only on a step with a difference. A pure callback whose
    # result is used, not jax.debug.callback: a program with effects leaves JAX's
    # fast dispatch path, which costs every step.
    scalar = jax.ShapeDtypeStruct((), jnp.float32)  # type: ignore[no-untyped-call]
    host = functools.partial(jax.pure_callback, report.on_host, scalar, vmap_method="expand_dims")
    zero: jax.Array = jax.lax.cond(changed, lambda: host(changed),
                                   lambda: jnp.asarray(-0.0, jnp.float32))
    return zero


def _after(zero: Optional[jax.Array], grads: Any, handled: Any) -> Any:
    """``grads`` unchanged, but computed from the check's ``zero``, so after the check.

    The step then writes the new weights after the check has read the old
    ones, and XLA updates donated weights in place; otherwise it copies them
    first (an optimization barrier does not order them: XLA:CPU removes
    barriers before it fuses and schedules). And the check is not dead code.
    """
    if zero is None:
        return grads
    # x + (-0.0) is x for every x (-0.0, infinities and NaNs included).
    return jax.tree_util.tree_map(lambda h, g: g + zero if h else g, handled, grads)


class _WarnOnce:
    """A warning given once: the program that detects the misuse runs every step."""

    def __init__(self, message: str):
        self.message, self.given = message, False

    def on_host(self, changed: np.ndarray) -> np.ndarray:
        """Warns if ``changed`` (under ``jax.vmap``, for any batch element); returns -0.0."""
        if np.any(changed) and not self.given:
            self.given = True
            warnings.warn(self.message, UserWarning, stacklevel=1)
        return np.full(np.shape(changed), -0.0, np.float32)


def _misuse_message(method: str) -> str:
    return (
        f"low_precision_params({method!r}).update: the parameters are not the weights its "
        "last update produced, so they train no better than with plain bfloat16 rounding. "
        "Either a transformation after low_precision_params changed its updates (a learning "
        "rate, optax.scale or a clip chained after it), or the weights were changed between "
        "steps. Put every transformation inside it, as in low_precision_params(optax.chain("
        "optax.clip_by_global_norm(1.0), optax.adam(learning_rate)), ...), and apply its "
        "updates with optax.apply_updates and nothing else (jmp_policy.loss_scaling and "
        "optax.MultiSteps may wrap it). To change the weights on purpose, make a new state "
        "with init.")


# --------------------------------------------------------------------------- #
# Trees.
# --------------------------------------------------------------------------- #

_NARROW = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _handled_leaves(params: Any, method: str, warn: bool = False) -> Any:
    """Per leaf of ``params``: whether the method applies (a narrow float) or not (float32+).

    Raises for leaves no method can update; warns when no leaf is narrow.
    """
    def handled(path: Any, p: Any) -> bool:
        dtype = jnp.dtype(p.dtype if hasattr(p, "dtype") else np.result_type(p))
        where = jax.tree_util.keystr(path) or "params"
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(
                f"low_precision_params: the parameter at {where} has dtype {dtype}; "
                "parameters must be floating (bfloat16, float16, or float32 and wider, which "
                "are updated as the inner optimizer says).")
        if dtype not in _NARROW:
            if dtype.itemsize < 2:
                raise TypeError(
                    f"low_precision_params: the parameter at {where} has dtype {dtype}; "
                    "supported are bfloat16 and float16 (and float32 or wider, left as they are).")
            return False
        if method == "split" and dtype != jnp.bfloat16:
            raise TypeError(
                f"low_precision_params: method 'split' needs bfloat16 parameters (the high half "
                f"of a float32), but the parameter at {where} is {dtype}; use 'kahan' or "
                "'stochastic' for float16.")
        return True

    flags = jax.tree_util.tree_map_with_path(handled, params)
    leaves = jax.tree_util.tree_leaves(flags)
    if warn and leaves and not any(leaves):
        warnings.warn(
            f"low_precision_params: no parameter is bfloat16 or float16 (all are float32 or "
            f"wider), so method {method!r} changes nothing. Store the parameters in bfloat16, "
            "e.g. with jmp_policy.Policy('params=bfloat16,compute=bfloat16').cast_to_param(params).",
            UserWarning, stacklevel=3)
    return flags


def _check_still_narrow(method: str, state: Any, handled: Any) -> None:
    """Every parameter that was low-precision at ``init`` still is: a float32 one means the
    updates were added with a sum that promotes, which drops its buffer and rounding."""
    field = {"kahan": "compensation", "split": "low_bits", "stochastic": "dtypes"}[method]
    is_masked: Callable[[Any], bool] = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731
    marks = jax.tree_util.tree_leaves(getattr(state, field), is_leaf=is_masked)
    # MaskedNodes counted in both: optax.masked and optax.multi_transform hand over the
    # parameters of other optimizers as MaskedNodes, in the same places at init and update.
    flags = jax.tree_util.tree_leaves(handled, is_leaf=is_masked)
    if len(marks) != len(flags):
        raise ValueError(f"low_precision_params({method!r}).update: the parameters have "
                         f"{len(flags)} leaves, but init saw {len(marks)}.")
    if any(not h and not is_masked(m) for h, m in zip(flags, marks)):
        raise TypeError(
            f"low_precision_params({method!r}).update: a parameter that was bfloat16 (or "
            "float16) at init is now float32 or wider, so the updates were added with a sum "
            "that promotes (jax.tree.map(lambda p, u: p + u, params, updates) makes a bfloat16 "
            "weight plus a float32 update float32), which drops what keeps it accurate. Apply "
            "the updates with optax.apply_updates, which keeps every parameter's dtype.")


def _widened(tree: Any, handled: Any) -> Any:
    """The handled leaves of ``tree`` in float32; the others as they are."""
    return jax.tree_util.tree_map(
        lambda h, x: jnp.asarray(x, jnp.float32) if h else x, handled, tree)


def _buffers(params: Any, handled: Any, make: Callable[[jax.Array], jax.Array]) -> Any:
    # zeros_like keeps each parameter's sharding (explicit meshes) in the buffer.
    return jax.tree_util.tree_map(
        lambda h, p: make(p) if h else optax.MaskedNode(), handled, params)


def _params_seen_by_inner(params: Any, state: LowPrecisionState, handled: Any) -> Any:
    """The float32 weights: compensated (Kahan), rebuilt (split) or widened (stochastic)."""
    if isinstance(state, KahanState):
        return jax.tree_util.tree_map(
            lambda h, p, c: p.astype(jnp.float32) + c.astype(jnp.float32) if h else p,
            handled, params, state.compensation)
    if isinstance(state, SplitState):
        return jax.tree_util.tree_map(
            lambda h, p, low: formats.join_float32(p, low) if h else p, handled, params,
            state.low_bits)
    return _widened(params, handled)


def _is_stored_narrow(x: Any) -> bool:
    """Whether a state leaf is one `cast_state` stores narrowly: a floating array, not a scalar."""
    dtype = getattr(x, "dtype", None)
    return (dtype is not None and jnp.ndim(x) > 0
            and jnp.issubdtype(dtype, jnp.floating))


def _narrowed(state: Any, dtype: Any, seed: Optional[jax.Array]) -> Any:
    """``state`` with its stored-narrow leaves in ``dtype``: rounded stochastically with
    ``seed`` (two uint32 words, or their ``formats.stream_key``), or to nearest for
    ``None``."""
    def narrow(x: Any) -> Any:
        if not _is_stored_narrow(x):
            return x
        if seed is None:
            return jnp.asarray(x).astype(dtype)
        return formats.encode(jnp.asarray(x, jnp.float32), dtype, seed)

    return jax.tree_util.tree_map(narrow, state)


def _widened_state(state: Any) -> Any:
    return jax.tree_util.tree_map(
        lambda x: jnp.asarray(x, jnp.float32) if _is_stored_narrow(x) else x, state)


# --------------------------------------------------------------------------- #
# Keys and argument checks.
# --------------------------------------------------------------------------- #

def _key_data(seed: Seed, stream: int, name: str) -> Tuple[jax.Array, Any]:
    """The raw data of the first key of ``stream`` from ``seed``, and the key's implementation.

    The state holds raw uint32 data, which every checkpointer and tree utility
    handles; the implementation (threefry, rbg...) is kept to rewrap it.
    """
    if isinstance(seed, (int, np.integer)) and not isinstance(seed, bool):
        key = jax.random.key(int(seed))
    elif isinstance(seed, jax.Array) and jnp.issubdtype(seed.dtype, jax.dtypes.prng_key):
        key = seed
    elif isinstance(seed, (jax.Array, np.ndarray)) and seed.dtype == jnp.uint32:
        key = jax.random.wrap_key_data(seed)
    else:
        raise TypeError(f"{name}: seed must be an int or a PRNG key (jax.random.key(0)), got "
                        f"{type(seed).__name__}.")
    key = jax.random.fold_in(key, stream)
    return jax.random.key_data(key), jax.random.key_impl(key)


def _step_seed(data: jax.Array, impl: Any) -> Tuple[jax.Array, jax.Array]:
    """(the next step's key data, this step's seed): uint32 words drawn from the key,
    those of a key and one more, a uniform uint32 scalar that is the stream key
    (``formats.stream_key``) of every array the step rounds (``formats.random_bits``).

    One draw from the PRNG, as ``jax.random.split`` is one (its keys are the PRNG's
    output too), rather than a split and a draw: each is a kernel of a few hundred
    operations in the step, whose compile time counts them.
    """
    words = jax.random.bits(jax.random.wrap_key_data(data, impl=impl), (data.size + 1,),
                            jnp.uint32)
    # Behind a barrier, computed once: XLA:GPU would otherwise compute the PRNG in the
    # kernel of each of its two uses. The seed is a scalar behind a barrier too, so that
    # a kernel that rounds reads a scalar: XLA:GPU merges kernels that read one
    # non-scalar array (the words) into one kernel per shape, with an output per array,
    # distinct for every count of arrays.
    words = jax.lax.optimization_barrier(words)  # type: ignore[no-untyped-call]
    key: jax.Array = jax.lax.optimization_barrier(words[-1])  # type: ignore[no-untyped-call]
    return words[:-1].reshape(data.shape), key


def _check_choice(name: str, arg: str, value: Any, choices: Tuple[str, ...]) -> str:
    if value in choices:
        return str(value)
    close = difflib.get_close_matches(str(value), choices, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else "."
    raise ValueError(f"{name}: {arg} must be one of {', '.join(map(repr, choices))}, got "
                     f"{value!r}{hint}")


def _narrow_dtype(dtype: Any) -> Any:
    try:
        dtype = jnp.dtype(dtype)
    except TypeError:
        dtype = None
    if dtype not in _NARROW:
        raise ValueError(f"cast_state: dtype must be bfloat16 or float16 (narrower than the "
                         f"float32 the optimizer computes in), got {dtype}.")
    return dtype


def _refuse_inner_loss_scaling(name: str, inner_state: Any) -> None:
    if _loss_scaling_states(inner_state):
        raise ValueError(
            f"{name}: the inner optimizer contains loss_scaling. Put loss_scaling outside, "
            f"loss_scaling({name}(inner, ...)), so that a skipped step leaves the weights and "
            f"every buffer and key of {name} unchanged, bit for bit.")


def _check_update_args(method: str, state: Any, params: Any) -> None:
    expected = {"kahan": KahanState, "stochastic": StochasticRoundingState,
                "split": SplitState}[method]
    if not isinstance(state, expected):
        raise TypeError(f"low_precision_params({method!r}).update expected the "
                        f"{expected.__name__} made by this transformation's init, got "
                        f"{type(state).__name__}.")
    if params is None:
        raise ValueError(
            f"low_precision_params({method!r}).update needs the parameters: call "
            "tx.update(grads, opt_state, params), since each update is computed from the "
            "weight it is applied to.")


def _low_precision_state(opt_state: Any) -> LowPrecisionState:
    kinds = (KahanState, StochasticRoundingState, SplitState)
    is_state: Callable[[Any], bool] = lambda x: isinstance(x, kinds)  # noqa: E731
    found = [x for x in jax.tree_util.tree_leaves(opt_state, is_leaf=is_state) if is_state(x)]
    if len(found) != 1:
        raise ValueError(
            f"master_params: the optimizer state holds {len(found)} states of "
            "low_precision_params; pass the state of an optimizer that contains exactly one.")
    state: LowPrecisionState = found[0]
    return state
