"""Delayed float8 scaling: the amax histories of a function's products, as explicit state.

With ``Float8Recipe("delayed")`` each float8 product scales its operands by the
largest absolute values they had in earlier steps, kept in a `Float8State`: per
product, an `AmaxHistory` of its left operand, right operand and incoming
gradient. The autocast function takes the state as its first argument; its
gradient with respect to the state holds what this step observed (each
operand's absolute maximum, the gradient's from the backward pass), and
`Float8State.record` writes that into the histories for the next step:

>>> import jax, jax.numpy as jnp, jmp_policy
>>> def loss(w, x):
...     return jnp.mean(jnp.tanh(x @ w) ** 2)
>>> f = jmp_policy.autocast(loss, "mixed_bfloat16", fp8=jmp_policy.Float8Recipe("delayed"))
>>> w, x = jnp.full((32, 32), 0.1), jnp.ones((16, 32))
>>> state = jmp_policy.float8_state(f, w, x)          # empty histories: scale 1
>>> observed, grad_w = jax.grad(f, argnums=(0, 1))(state, w, x)
>>> state = state.record(observed)
>>> [float(state.histories[0].lhs[0]), float(state.histories[0].rhs[0])]
[1.0, 0.10000000149011612]

Why the gradient: a product's backward pass is the only place its incoming
gradient exists, and a cotangent is the only value that leaves a backward pass
(Flax's float8 ops return new histories the same way). Observations rather than
new histories: a product that did not run (an untaken ``lax.cond`` branch) or a
function that was not differentiated gives zeros, and `Float8State.record`
leaves a history alone where it observed nothing, or something not finite.

The histories are handed to the products as the interpreter meets them
(`Slots`): in the order of the trace, one per product, and for products inside
``lax.scan`` one per iteration, stacked along a leading axis (a scanned stack
of layers gets a history per layer), which the scan handler passes in as a
scanned operand.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jmp_policy.paths import display_scope
from jmp_policy.sharding import varying

_F32 = np.dtype(np.float32)


class AmaxHistory(NamedTuple):
    """The absolute maxima of one product's operands in recent steps, latest first.

    Each is float32 of shape ``(*stack, length)``: ``stack`` the lengths of the
    ``lax.scan`` loops around the product (empty outside loops).
    """

    lhs: jax.Array
    rhs: jax.Array
    grad: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Float8State:
    """The amax histories of every product a delayed-scaling autocast function runs in
    float8, in the order it runs them (a pytree: ``jit``, checkpoints and shardings
    treat it as any state).

    Attributes:
      histories: one `AmaxHistory` per product.
      scopes: each product's ``jax.named_scope`` path (static: for reading, and for
        the error when a state meets a function it was not made for).
    """

    histories: tuple[AmaxHistory, ...]
    scopes: tuple[str, ...] = dataclasses.field(metadata=dict(static=True))

    def record(self, observed: Float8State) -> Float8State:
        """The histories with this step's observations written in front.

        ``observed`` is the gradient of the autocast function with respect to
        this state (it holds each operand's absolute maximum this step). A
        history whose observation is zero (the product did not run, or was not
        differentiated) or not finite (an overflowing step, which loss scaling
        skips) is left as it was.
        """
        if not isinstance(observed, Float8State) or observed.scopes != self.scopes:
            raise TypeError(
                "Float8State.record expects the gradient of the autocast function with "
                "respect to this state (jax.grad(f, argnums=...) including the state's "
                f"position), a Float8State with the same products; got {type(observed).__name__}.")
        recorded: Float8State = jax.tree.map(_recorded, self, observed)
        return recorded


def _recorded(history: jax.Array, observed: jax.Array) -> jax.Array:
    latest = observed[..., :1]
    valid = jnp.isfinite(latest) & (latest > 0)
    shifted = jnp.concatenate([latest, history[..., :-1]], axis=-1)
    return jnp.where(valid, shifted, history)


def observation(amax: jax.Array, history: jax.Array) -> jax.Array:
    """A cotangent for ``history`` holding ``amax`` as this step's entry.

    Inside ``shard_map``, ``amax`` is a device's own where ``history`` is the same
    on every device: it becomes the largest over those devices (a history is one
    value per mesh axis it does not vary along, as a cotangent must be).
    """
    axes = varying(amax) - varying(history)
    if axes:
        amax = lax.pmax(amax, tuple(sorted(axes)))  # type: ignore[no-untyped-call]
    return jnp.zeros(jnp.shape(history), _F32).at[0].set(amax.astype(_F32))



# --- Handing histories to products ----------------------------------------------------------

class Slots:
    """Hands out the histories of the products of one (sub)trace, in trace order.

    Recording (``given=None``): every request gets a new empty history of
    ``(*stack, length)`` and is remembered (to make a state, or to count the
    products of a loop body before it runs). Given histories: each request takes
    the next one, which must have the requested shape.
    """

    def __init__(self, length: int, given: Optional[Sequence[AmaxHistory]] = None,
                 what: str = "autocast function") -> None:
        self.length = length
        self.given = None if given is None else list(given)
        self.requests: list[tuple[str, tuple[int, ...]]] = []
        self.what = what

    @property
    def taken(self) -> int:
        """How many histories have been handed out."""
        return len(self.requests)

    def take(self, scope: str, stack: tuple[int, ...] = ()) -> AmaxHistory:
        """The history of the next product, found under ``scope`` inside ``lax.scan`` loops
        of lengths ``stack`` (one history per iteration, stacked)."""
        shape = (*stack, self.length)
        index = self.taken
        self.requests.append((scope, stack))
        if self.given is None:
            return empty_history(shape)
        if index >= len(self.given):
            raise ValueError(
                f"This Float8State has {len(self.given)} product histories, but the "
                f"{self.what} runs more float8 products (the next under {scope!r}): the "
                "state was made for another function or other argument shapes. Make it "
                "with jmp_policy.float8_state(f, *args) for the arguments f is called with.")
        history = self.given[index]
        got = tuple(jnp.shape(history.lhs))
        if got != shape:
            raise ValueError(
                f"The Float8State history {index} (for the product under {scope!r}) has "
                f"shape {got}, expected {shape}: the state was made for another function "
                "or other argument shapes (a history per loop iteration follows the "
                "lax.scan lengths). Make it with jmp_policy.float8_state(f, *args).")
        return history

    def check_all_taken(self) -> None:
        """Raises if a given state holds more histories than the function ran products."""
        if self.given is not None and self.taken != len(self.given):
            raise ValueError(
                f"This Float8State has {len(self.given)} product histories, but the "
                f"{self.what} ran {self.taken} float8 products: the state was made for "
                "another function or other argument shapes. Make it with "
                "jmp_policy.float8_state(f, *args).")


class Refused:
    """Slots inside a primitive that cannot pass histories in (``while_loop``, a custom
    derivative's function): a delayed-scaling product there is an error saying what to do."""

    def __init__(self, where: str) -> None:
        self.where = where

    def take(self, scope: str, stack: tuple[int, ...] = ()) -> AmaxHistory:
        raise NotImplementedError(
            f"autocast's delayed float8 scaling cannot run the product under {scope!r}: it "
            f"is inside {self.where}, which cannot take its amax history as an operand. "
            "Keep it out of float8 (Float8Recipe(exclude=...) matching its scope), use "
            "lax.scan or a Python loop instead, or a current scaling (fp8='tensorwise').")


def stacked(slots: Union[Slots, Refused], requests: Sequence[tuple[str, tuple[int, ...]]],
            length: int) -> list[AmaxHistory]:
    """The histories for the products of a loop body of ``length`` iterations that
    recorded ``requests``, taken from ``slots``, one per iteration each."""
    return [slots.take(scope, (length, *stack)) for scope, stack in requests]


def make_state(slots: Slots) -> Float8State:
    """A state of empty histories for what ``slots`` recorded."""
    histories = tuple(empty_history((*stack, slots.length)) for _, stack in slots.requests)
    return Float8State(histories, tuple(display_scope(scope) for scope, _ in slots.requests))


def empty_history(shape: tuple[int, ...]) -> AmaxHistory:
    """Empty histories (all zeros: nothing observed yet) of ``shape``."""
    zeros = jnp.zeros(shape, _F32)
    return AmaxHistory(zeros, zeros, zeros)
