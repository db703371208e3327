"""Delayed-scaling float8 products as Flax layers' ``dot_general``, their amax histories
held by the layer (re-exported by ``jmp_policy.flax``).

`jmp_policy.dot_general` is stateless, so it cannot take delayed scaling, whose scales
come from amax histories kept across steps. A layer can keep them: `LinenFloat8DotGeneral`
is a linen ``dot_general_cls`` (``nn.Dense(dot_general_cls=...)``) with its histories in
the `FLOAT8_HISTORIES` collection, and `NNXFloat8DotGeneral` an NNX ``dot_general``
(``nnx.Linear(dot_general=...)``) with its histories in a `Float8Histories` variable.
Each runs the product as ``autocast(..., fp8=Float8Recipe("delayed"))`` runs it: the
gradient of the loss with respect to the histories holds what the step observed (each
operand's absolute maximum, the incoming gradient's from the backward pass), and
`record_float8_histories` writes that into them for the next step, as
``Float8State.record`` does for an autocast function (Flax's own float8 layers return
their new histories as a gradient the same way).
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
from flax import nnx
from jax import lax

import jmp_policy
from jmp_policy.float8 import Float8State, empty_history
from jmp_policy.float8 import Float8Like, Float8Recipe, as_recipe
from jmp_policy.policy import Policy, PolicyLike, as_policy

FLOAT8_HISTORIES = "float8_histories"
"""The linen collection of `LinenFloat8DotGeneral`'s amax histories."""


class Float8Histories(nnx.Variable[Float8State]):
    """The amax histories of an `NNXFloat8DotGeneral` (differentiate with respect to them
    to observe: ``nnx.DiffState(0, (nnx.Param, Float8Histories))``)."""


def record_float8_histories(histories: Any, observed: Any) -> Any:
    """``histories`` (a pytree holding `Float8State` s: linen's `FLOAT8_HISTORIES`
    collection, or ``nnx.state(model, Float8Histories)``) with this step's ``observed``
    maxima (the gradient with respect to them) recorded, as ``Float8State.record``."""
    return jax.tree.map(lambda state, seen: state.record(seen), histories, observed,
                        is_leaf=lambda x: isinstance(x, Float8State))


def _delayed(fp8: Float8Like, api: str) -> Float8Recipe:
    recipe = as_recipe("delayed" if fp8 is None else fp8)
    if recipe is None or not recipe.delayed:
        raise ValueError(
            f"{api} runs delayed float8 scaling (fp8='delayed' or Float8Recipe('delayed', "
            f"...)); got fp8={fp8!r}. For current scaling, which keeps no state, pass "
            "dot_general=jmp_policy.dot_general(policy, fp8=...) to the layer instead.")
    # The layer's product is an autocast function of its own, traced without the model's
    # scopes: no stack to find, no module path for a pattern to match.
    user = [p for p in recipe.exclude if p not in Float8Recipe.DEFAULT_EXCLUDE]
    if any(recipe.high_precision_layers) or user:
        raise ValueError(
            f"{api} runs one product, traced without the model's scopes, so a Float8Recipe "
            f"with high_precision_layers={recipe.high_precision_layers} or exclude entries "
            f"{user} has no stack of layers or scope path to apply them to. Keep a layer "
            "out of float8 by giving it no float8 dot_general, or wrap the loss in "
            "jmp_policy.autocast(loss, policy, fp8=recipe) instead of these layers.")
    return recipe


def _product(policy: Policy, recipe: Float8Recipe, dimension_numbers: Any, precision: Any,
             kwargs: dict[str, Any]) -> Callable[..., Any]:
    """The autocast function ``(state, lhs, rhs) -> lhs . rhs`` of one delayed product."""
    def product(lhs: Any, rhs: Any) -> Any:
        return lax.dot_general(lhs, rhs, dimension_numbers, precision, **kwargs)
    return jmp_policy.autocast(product, policy, fp8=recipe)


def _result(out: Any, policy: Policy, preferred_element_type: Any) -> Any:
    # The compute dtype, as jmp_policy.dot_general returns it; or what the layer asked for.
    return out.astype(policy.compute_dtype if preferred_element_type is None
                      else preferred_element_type)


class LinenFloat8DotGeneral(nn.Module):
    """A linen ``dot_general_cls`` running autocast's delayed-scaling float8 product, with
    its amax histories (a `Float8State`) in the `FLOAT8_HISTORIES` collection.

    >>> import flax.linen as nn, jax, jax.numpy as jnp, jmp_policy.flax
    >>> layer = nn.Dense(16, dot_general_cls=jmp_policy.flax.LinenFloat8DotGeneral)
    >>> x = jnp.ones((32, 64))
    >>> variables = layer.init(jax.random.key(0), x)
    >>> sorted(variables)
    ['float8_histories', 'params']
    >>> def loss(params, histories):
    ...     y = layer.apply({"params": params, "float8_histories": histories}, x)
    ...     return jnp.sum(y.astype(jnp.float32) ** 2)
    >>> grads, observed = jax.grad(loss, argnums=(0, 1))(
    ...     variables["params"], variables["float8_histories"])
    >>> histories = jmp_policy.flax.record_float8_histories(
    ...     variables["float8_histories"], observed)
    >>> state = histories["LinenFloat8DotGeneral_0"]["state"]   # the Dense's product
    >>> float(state.histories[0].lhs[0])                        # max |x|, recorded
    1.0
    """

    policy: PolicyLike = "mixed_bfloat16"
    fp8: Float8Like = "delayed"

    @nn.compact
    def __call__(self, lhs: Any, rhs: Any, dimension_numbers: Any, precision: Any = None,
                 preferred_element_type: Any = None, **kwargs: Any) -> Any:
        policy = as_policy(self.policy)
        f = _product(policy, _delayed(self.fp8, "LinenFloat8DotGeneral"), dimension_numbers,
                     precision, kwargs)
        state = self.variable(FLOAT8_HISTORIES, "state", jmp_policy.float8_state, f, lhs, rhs)
        return _result(f(state.value, lhs, rhs), policy, preferred_element_type)


class NNXFloat8DotGeneral(nnx.Module):
    """An NNX ``dot_general`` (``nnx.Linear(..., dot_general=NNXFloat8DotGeneral())``)
    running autocast's delayed-scaling float8 product, with its amax histories in a
    `Float8Histories` variable. Its product must be eligible for float8 (a product the
    recipe keeps out, by ``min_size`` or ``exclude``, has no history to take: an error).

    >>> import jax, jax.numpy as jnp, jmp_policy.flax
    >>> from flax import nnx
    >>> layer = nnx.Linear(64, 16, dot_general=jmp_policy.flax.NNXFloat8DotGeneral(),
    ...                    rngs=nnx.Rngs(0))
    >>> def loss(layer, x):
    ...     return jnp.sum(layer(x).astype(jnp.float32) ** 2)
    >>> diff = nnx.DiffState(0, (nnx.Param, jmp_policy.flax.Float8Histories))
    >>> grads = nnx.grad(loss, argnums=diff)(layer, jnp.ones((32, 64)))
    >>> histories = nnx.state(layer, jmp_policy.flax.Float8Histories)
    >>> observed = nnx.filter_state(grads, jmp_policy.flax.Float8Histories)
    >>> nnx.update(layer, jmp_policy.flax.record_float8_histories(histories, observed))
    >>> float(layer.dot_general.histories.get_value().histories[0].lhs[0])
    1.0
    """

    def __init__(self, policy: PolicyLike = "mixed_bfloat16", fp8: Float8Like = "delayed"):
        self.policy = as_policy(policy)
        self.recipe = _delayed(fp8, "NNXFloat8DotGeneral")
        history = empty_history((self.recipe.amax_history_length,))
        self.histories = Float8Histories(Float8State((history,), ("",)))

    def __call__(self, lhs: Any, rhs: Any, dimension_numbers: Any, precision: Any = None,
                 preferred_element_type: Any = None, **kwargs: Any) -> Any:
        f = _product(self.policy, self.recipe, dimension_numbers, precision, kwargs)
        return _result(f(self.histories.get_value(), lhs, rhs), self.policy,
                       preferred_element_type)
