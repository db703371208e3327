"""`dot_general`: autocast's product as a drop-in ``jax.lax.dot_general``.

Libraries that take a ``dot_general`` (Flax's ``nn.Dense(dot_general=...)``,
``nnx.Linear(dot_general=...)``, ``jnp.einsum(..., _dot_general=...)``, MaxText,
qwix and AQT's injected products) get the product that autocast would run for
that ``dot_general``, by the same rule and the same derivative: the rule is not
copied here. Each call traces ``lax.dot_general`` on its operands to one
equation and evaluates it with autocast's interpreter (``interpreter``), under
the matmul rule autocast itself uses for the policy and recipe
(``interpreter.matmul``, ``_float8.float8_matmul``), at the ``jax.named_scope``
path of the call, so a product autocast would keep out of float8 stays out here too.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import warnings
from typing import Any, Optional, Sequence

import jax
import numpy as np
from jax import lax
from jax.extend import source_info_util

from jmp_policy.autocast import _eager
from jmp_policy.autocast._api import _Settings
from jmp_policy.float8 import (
    SCALINGS,
    Float8Like,
    Float8Recipe,
    as_recipe,
    eligible,
    why_not_float8,
)
from jmp_policy.autocast._float8 import FLOAT8_PRODUCTS, float8_matmul
from jmp_policy.autocast.interpreter import Context, MatmulRule, eval_jaxpr
from jmp_policy.dtypes import convert, is_floating
from jmp_policy.jaxprs import bind
from jmp_policy.autocast.interpreter import matmul
from jmp_policy.autocast.rules import AutocastWarning, parse_rules
from jmp_policy.policy import Policy, PolicyLike, as_policy

_RULES = parse_rules(None)


def dot_general(policy: PolicyLike = None, *, fp8: Float8Like = None) -> DotGeneral:
    """Returns a ``jax.lax.dot_general`` that runs as autocast runs a product, for layers
    that take a ``dot_general`` argument.

    The returned function has ``lax.dot_general``'s signature, ``(lhs, rhs,
    dimension_numbers, precision=None, preferred_element_type=None, **kwargs)``,
    and gives what ``jmp_policy.autocast(fn, policy, fp8=fp8)`` gives for that
    product inside ``fn``, values and derivatives:

    * Floating operands are cast to the policy's compute dtype and the product
      accumulates in float32; the result is in the compute dtype, as autocast's
      matmul class returns it. Its backward products run in the compute dtype
      too. Gradients come back in each operand's dtype.
    * With ``fp8``, the product runs on float8 (or block-scaled) operands,
      forward and backward, where autocast's recipe would: a product with a
      dimension below the recipe's ``min_size``, with batch dimensions under
      ``batched=False``, or called under a ``jax.named_scope`` path that the
      recipe excludes (``logits``, ``lm_head``, ``head``) runs in the compute
      dtype instead, with an ``AutocastWarning`` naming the reason.
    * ``preferred_element_type``, if given, is the result's dtype, as in
      ``lax.dot_general``: a product in the compute dtype returns its float32
      accumulation in it (``float32``: the unrounded sum, eagerly and under
      ``jit``); a float8 product's result, in the compute dtype, is converted to it.
    * ``precision`` is passed to products in the compute dtype (float32
      policies: JAX's own). A float8 product has no precision to choose: a
      ``precision`` other than ``None`` or ``DEFAULT`` warns there. Other keyword
      arguments (``out_sharding``) are ``lax.dot_general``'s, passed on.
    * Operands with no floating one among them, and every product under a
      float32 policy without ``fp8``, are ``lax.dot_general``'s own.

    It composes with ``jit``, ``grad`` and ``vmap`` (under ``vmap`` each
    example gets its own float8 scales, as ``vmap`` of an autocast function
    gives), and the object is hashable and compares by policy and recipe, so a
    model rebuilt with an equal one is not traced again.

    Args:
      policy: a policy name or `jmp_policy.Policy`; ``None`` means the global
        policy in force now (at construction).
      fp8: ``None``, ``"tensorwise"``, ``"rowwise"``, ``"mxfp8"``, ``"nvfp4"``
        or a `jmp_policy.Float8Recipe`, as for `jmp_policy.autocast`.

    >>> import jax, jax.numpy as jnp, jmp_policy
    >>> dot = jmp_policy.dot_general("mixed_bfloat16", fp8="tensorwise")
    >>> x, w = jnp.ones((32, 64)), jnp.ones((64, 16))
    >>> dot(x, w, (((1,), (0,)), ((), ()))).dtype
    dtype(bfloat16)
    >>> same = jmp_policy.autocast(lambda x, w: x @ w, "mixed_bfloat16", fp8="tensorwise")
    >>> bool((dot(x, w, (((1,), (0,)), ((), ()))) == same(x, w)).all())
    True
    """
    if isinstance(policy, (jax.Array, np.ndarray)):
        raise TypeError(
            "jmp_policy.dot_general(policy, fp8=...) builds a dot_general function; it "
            "does not multiply arrays itself. Call what it returns: "
            "jmp_policy.dot_general('mixed_bfloat16')(lhs, rhs, dimension_numbers).")
    return DotGeneral(as_policy(policy), _current_recipe(fp8))


def _current_recipe(fp8: Float8Like) -> Optional[Float8Recipe]:
    """``fp8`` as a recipe, which must scale currently: a ``dot_general`` has no state."""
    if isinstance(fp8, str) and fp8 not in SCALINGS:
        raise ValueError(
            f"jmp_policy.dot_general fp8 must be None, {', '.join(map(repr, SCALINGS))} or "
            f"a jmp_policy.Float8Recipe; got {fp8!r}.")
    recipe = as_recipe(fp8)
    if recipe is not None and any(recipe.high_precision_layers):
        raise ValueError(
            f"jmp_policy.dot_general cannot take Float8Recipe high_precision_layers="
            f"{recipe.high_precision_layers}: each call sees one product, not the stack of "
            "layers whose first and last it would keep. Wrap the loss in "
            "jmp_policy.autocast(loss, policy, fp8=recipe), which sees the whole model, or "
            "keep those layers' scopes out with Float8Recipe(exclude=...).")
    if recipe is not None and recipe.delayed:
        raise ValueError(
            "jmp_policy.dot_general cannot take a delayed-scaling Float8Recipe: its scales "
            "come from amax histories, state that a dot_general has no argument for. In a "
            "Flax layer, use the layer that keeps them: jmp_policy.flax.LinenFloat8DotGeneral "
            "(dot_general_cls=) or jmp_policy.flax.NNXFloat8DotGeneral (dot_general=); or "
            "wrap the loss in jmp_policy.autocast(loss, policy, fp8=Float8Recipe('delayed')) "
            "with a jmp_policy.float8_state; or use a current scaling here "
            "(fp8='tensorwise').")
    return recipe


# Eager products compiled whole, per dot_general function and scope (see ``_eager``).
_PROGRAMS: collections.defaultdict[tuple[Any, str], _eager.Programs] = \
    collections.defaultdict(_eager.Programs)


@dataclasses.dataclass(frozen=True)
class DotGeneral:
    """A ``lax.dot_general`` running as autocast runs a product (see `dot_general`)."""

    policy: Policy
    recipe: Optional[Float8Recipe]

    def __repr__(self) -> str:
        fp8 = "" if self.recipe is None else f", fp8={self.recipe!r}"
        return f"jmp_policy.dot_general({self.policy.name!r}{fp8})"

    def __call__(self, lhs: Any, rhs: Any, dimension_numbers: Any, precision: Any = None,
                 preferred_element_type: Any = None, **kwargs: Any) -> Any:
        settings = _Settings(self.policy, _RULES, self.recipe, "jmp_policy.dot_general")
        if settings.is_identity():
            return lax.dot_general(lhs, rhs, dimension_numbers, precision,
                                   preferred_element_type, **kwargs)

        def product(a: Any, b: Any) -> Any:
            return lax.dot_general(a, b, dimension_numbers, precision, preferred_element_type,
                                   **kwargs)

        lhs, rhs = jax.numpy.asarray(lhs), jax.numpy.asarray(rhs)
        if not (is_floating(lhs) or is_floating(rhs)):  # integer products: JAX's own
            return product(lhs, rhs)
        closed = jax.make_jaxpr(product)(lhs, rhs)  # JAX's own errors for bad arguments
        scope = str(source_info_util.current_name_stack())
        if self.recipe is not None:
            self._check_precision(closed, scope, precision)
        evaluate = functools.partial(self._evaluate, scope=scope,
                                     accumulate=preferred_element_type is not None)
        if _eager.compilable([lhs, rhs]):
            out = _PROGRAMS[self, scope].run(evaluate, closed, [lhs, rhs])[0]
        else:
            out = evaluate(closed, [lhs, rhs])[0]
        if preferred_element_type is not None:
            out = convert(out, np.dtype(preferred_element_type))
        return out

    def _evaluate(self, closed: Any, values: Sequence[Any], scope: str,
                  accumulate: bool) -> list[Any]:
        compute, _ = _Settings(self.policy, _RULES, self.recipe, "").dtypes(values)
        rule = matmul if self.recipe is None else float8_matmul(self.recipe)
        if accumulate:
            rule = _accumulating(rule, self.recipe)
        ctx = Context(compute, _RULES, rule, scope=scope)
        out = eval_jaxpr(ctx, closed.jaxpr, closed.consts, values)
        if self.recipe is not None and not ctx.tallied(FLOAT8_PRODUCTS):
            self._warn_compute_dtype(closed, scope, compute)
        out_list: list[Any] = out
        return out_list

    def _check_precision(self, closed: Any, scope: str, precision: Any) -> None:
        """A ``precision`` that a float8 product cannot honour warns: it is not silently dropped."""
        assert self.recipe is not None
        if _is_default(precision) or not eligible(self.recipe, closed.jaxpr.eqns[0], scope):
            return  # a product in the compute dtype takes it
        warnings.warn(
            f"{self!r}: precision={precision!r} has no effect on a float8 product (its "
            "operands are float8 or block-scaled, accumulated in float32); it is ignored.",
            AutocastWarning, stacklevel=3)

    def _warn_compute_dtype(self, closed: Any, scope: str, compute: Any) -> None:
        assert self.recipe is not None
        eqn = closed.jaxpr.eqns[0]
        lhs, rhs = (v.aval for v in eqn.invars)
        why = why_not_float8(self.recipe, eqn, scope) or "it is not a floating product"
        warnings.warn(
            f"{self!r}: the product of {_shape(lhs)} and {_shape(rhs)} runs in "
            f"{np.dtype(compute).name}, not float8: {why}.", AutocastWarning, stacklevel=3)


def _accumulating(rule: MatmulRule, recipe: Optional[Float8Recipe]) -> MatmulRule:
    """``rule``, except that a product in the compute dtype keeps its equation's
    ``preferred_element_type``: asked for explicitly, it means the accumulation in that
    dtype (the matmul class would round it to the compute dtype)."""

    def keeping(ctx: Context, eqn: Any, invals: list[Any]) -> Any:
        if recipe is not None and eligible(recipe, eqn, ctx.scope):
            return rule(ctx, eqn, invals)
        return bind(eqn, [ctx.cast(x, ctx.compute) for x in invals])

    return keeping


def _is_default(precision: Any) -> bool:
    pair = precision if isinstance(precision, tuple) else (precision,)
    return all(p is None or p == lax.Precision.DEFAULT or str(p).lower() == "default"
               for p in pair)


def _shape(aval: Any) -> str:
    return f"{np.dtype(aval.dtype).name}{list(aval.shape)}"
