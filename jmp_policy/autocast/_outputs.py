"""Which outputs of ``fn`` autocast returns in the policy's output dtype.

An output is never narrowed below the precision it was computed in. Autocast
computes matrix work in the compute dtype, so an output made by matrix work is
returned in the policy's output dtype. An
output made by a float32-class primitive (a reduction, a softmax, a norm, a
loss) or by a cast the user wrote is returned in the dtype autocast computed,
and so is an argument passed through.

`output_kinds` reads this off ``fn``'s traced jaxpr: each value is
`LITERAL` (computed from literals alone: ``jnp.zeros``, a ``-inf`` fill),
`ARGUMENT` (an input or closed-over array, or computed from those), `PRODUCT`
(last shaped by matrix work) or `KEPT` (by a float32-class primitive or a
cast); elementwise and structural primitives take the strongest kind of their
inputs, in that order.

A choice between values (``select_n``, which ``jnp.where`` traces to, and the
branches of ``lax.cond``) is not arithmetic on them: each element is one of
the alternatives, unchanged. It is `PRODUCT` only when every alternative is a
product or a literal (masked logits); an input passed through or a value kept
in float32 keeps the choice as computed, so that the elements taken from it
are not narrowed.

>>> import jax, jax.numpy as jnp
>>> from jmp_policy.autocast.rules import parse_rules
>>> closed = jax.make_jaxpr(lambda w, x: (x @ w + 1.0, jnp.mean(x @ w), x * 2))(
...     jnp.ones((2, 2)), jnp.ones((3, 2)))
>>> output_kinds(closed.jaxpr, parse_rules(None)) == [PRODUCT, KEPT, ARGUMENT]
True
>>> closed = jax.make_jaxpr(lambda w, x: (jnp.where(x > 0, x @ w, -jnp.inf),
...                                       jnp.where(x > 0, x @ w, x)))(
...     jnp.ones((2, 2)), jnp.ones((2, 2)))
>>> output_kinds(closed.jaxpr, parse_rules(None)) == [PRODUCT, ARGUMENT]
True
"""

from __future__ import annotations

from typing import Any, Sequence

from jax.extend.core import Jaxpr, JaxprEqn, Literal

from jmp_policy.dtypes import is_floating_dtype
from jmp_policy.autocast.rules import Rules, rule_of
from jmp_policy.jaxprs import scan_sizes, sub_jaxprs
from jmp_policy.paths import join_scope

__all__ = ["ARGUMENT", "KEPT", "LITERAL", "PRODUCT", "output_kinds"]

LITERAL, ARGUMENT, PRODUCT, KEPT = 0, 1, 2, 3

# Higher-order primitives that call their first jaxpr on their operands and return its
# outputs (a custom derivative's other jaxprs are not what the call computes).
_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call", "custom_jvp_call",
                    "custom_vjp_call", "custom_vjp_call_jaxpr", "remat", "checkpoint",
                    "shard_map"})


def output_kinds(jaxpr: Jaxpr, rules: Rules, scope: str = "") -> list[int]:
    """The kind of each output of ``jaxpr`` (inputs and closed-over arrays are `ARGUMENT`)."""
    return _kinds(jaxpr, [ARGUMENT] * len(jaxpr.invars), rules, scope)


def _kinds(jaxpr: Jaxpr, in_kinds: Sequence[int], rules: Rules, scope: str) -> list[int]:
    env: dict[Any, int] = dict(zip(jaxpr.invars, in_kinds))

    def kind(v: Any) -> int:
        return LITERAL if isinstance(v, Literal) else env.get(v, ARGUMENT)

    for eqn in jaxpr.eqns:
        path = join_scope(scope, str(eqn.source_info.name_stack))
        outs = _equation(eqn, [kind(v) for v in eqn.invars], rules, path)
        env.update(zip(eqn.outvars, outs))
    return [kind(v) for v in jaxpr.outvars]


def _equation(eqn: JaxprEqn, ins: list[int], rules: Rules, path: str) -> list[int]:
    name, n_out = eqn.primitive.name, len(eqn.outvars)
    if name in _CALLS and sub_jaxprs(eqn):
        return _kinds(sub_jaxprs(eqn)[0], ins, rules, path)
    if name == "scan":
        (body,) = sub_jaxprs(eqn, "jaxpr")
        return _loop(body, ins, n_out, rules, path, _scan_carry(eqn, len(ins)))
    if name == "while":
        (body,) = sub_jaxprs(eqn, "body_jaxpr")
        cn, bn = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
        return _loop(body, ins[cn:], n_out, rules, path, slice(bn, None))
    if name == "cond":
        branches = [_kinds(b, ins[1:], rules, path) for b in sub_jaxprs(eqn, "branches")]
        return [_choice(ks) for ks in zip(*branches)]
    if not any(is_floating_dtype(v.aval.dtype) for v in eqn.outvars if hasattr(v.aval, "dtype")):
        return [ARGUMENT] * n_out
    return [_first_order(eqn, ins, rules, path)] * n_out


def _first_order(eqn: JaxprEqn, ins: list[int], rules: Rules, path: str) -> int:
    """The kind of a first-order equation's floating results, as its rule's `Output` says."""
    rule = rule_of(eqn.primitive.name)
    output = "class" if rule is None else rule.output
    if output == "choice" and not rules.scopes_in(path):
        return _choice(ins[1:])
    if rules.scopes_in(path):
        return KEPT
    if output == "cast":  # a cast fn wrote, unless of a literal (jnp.where's fill)
        return LITERAL if ins == [LITERAL] else KEPT
    cls = rules.classes.get(eqn.primitive.name)
    if cls == "matmul":
        return PRODUCT
    if cls == "float32":
        return KEPT
    return max(ins, default=ARGUMENT)


def _choice(alternatives: Sequence[int]) -> int:
    """The kind of a value that is one of ``alternatives`` (a ``select_n`` or a ``cond``).

    A product stays one only if every other alternative is a product or a literal: where
    one is an input passed through or a value kept in float32, the elements taken from it
    are not narrowed (as ``fn`` computes them, they were never matrix work).
    """
    passed = [k for k in alternatives if k not in (PRODUCT, LITERAL)]
    return max(passed) if passed else max(alternatives, default=ARGUMENT)


def _scan_carry(eqn: JaxprEqn, n_in: int) -> slice:
    nc, nk = scan_sizes(eqn.params)
    return slice(nc, nc + nk)


def _loop(body: Jaxpr, ins: list[int], n_out: int, rules: Rules, path: str,
          carry: slice) -> list[int]:
    """A loop body's output kinds, its carries joined over iterations (kinds only grow)."""
    ins = list(ins)
    for _ in range(4):  # four kinds: stable after at most three joins
        outs = _kinds(body, ins, rules, path)
        joined = [max(a, b) for a, b in zip(ins[carry], outs)]
        if joined == ins[carry]:
            break
        ins[carry] = joined
    return outs[:n_out]
