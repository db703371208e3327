"""Per-parameter policies: pick a `Policy` for each leaf from its key path.

A leaf's path is its pytree key path joined with ``/`` (``params/LayerNorm_0/scale``);
the first rule whose regex ``re.search``-matches it wins, else the default.

>>> import jax, jax.numpy as jnp
>>> import jmp_policy
>>> pm = jmp_policy.PolicyMap({"LayerNorm": "float32"}, default="mixed_bfloat16")
>>> params = {"Dense_0": {"kernel": jnp.ones(2)}, "LayerNorm_0": {"scale": jnp.ones(2)}}
>>> jax.tree_util.tree_map(lambda x: x.dtype.name, pm.cast_to_compute(params))
{'Dense_0': {'kernel': 'bfloat16'}, 'LayerNorm_0': {'scale': 'float32'}}
"""

from __future__ import annotations

import dataclasses
import functools
import re
import typing
from typing import Any, Callable, Concatenate, Mapping, ParamSpec, Sequence, TypeVar, Union

import jax
import numpy as np

from jmp_policy.paths import path_str
from jmp_policy.policy import _rules
from jmp_policy.policy import _casting
from jmp_policy.policy._policy import Policy, PolicyLike, as_policy, check_callable

T = TypeVar("T")
P = ParamSpec("P")
R = TypeVar("R")

#: ``PolicyMap`` rules: ``{regex: policy}``, or ``[(regex, policy), ...]`` in order.
Rules = Union[Mapping[str, PolicyLike], Sequence[tuple[str, PolicyLike]]]


def _compile_rules(rules: Rules) -> tuple[_rules.Rule[re.Pattern[str]], ...]:
    def compile_key(pattern: object, n: int) -> re.Pattern[str]:
        return _rules.compile_path_regex(pattern, "PolicyMap", n, "params/Dense_0/kernel")

    return _rules.parse_rules(rules, "PolicyMap", "regex", "a Python `re` pattern", compile_key)


@dataclasses.dataclass(frozen=True, init=False, repr=False)  # not slotted: see Policy
class PolicyMap:
    """Per-leaf policies chosen by regex over ``/``-joined key paths; first match wins.

    ``default`` (a policy or name) applies to unmatched leaves; ``None`` means the
    global policy in force when the map is built. Immutable, hashable, and a
    leafless pytree, like `Policy`.

    A rule that matches no leaf of a tree the map is applied to is reported
    with an `UnmatchedRuleWarning` (once per tree structure): a typo such as
    ``"LayerNrom"`` would otherwise leave those leaves in the default policy.

    Attributes:
      rules: the ``(regex, policy)`` pairs, in the order they are tried.
      default: the policy of leaves that no rule matches.
    """

    rules: tuple[tuple[str, Policy], ...]
    default: Policy
    _compiled: tuple[_rules.Rule[re.Pattern[str]], ...] = dataclasses.field(compare=False)
    # Tree structure -> the policy of each leaf. A structure determines every
    # leaf's path, so the paths are matched once, not on every training step.
    _by_structure: dict[Any, tuple[Policy, ...]] = dataclasses.field(compare=False)

    def __init__(self, rules: Rules, default: PolicyLike = None) -> None:
        compiled = _compile_rules(rules)
        object.__setattr__(self, "rules", tuple((r.key, r.policy) for r in compiled))
        object.__setattr__(self, "default", as_policy(default))
        object.__setattr__(self, "_compiled", compiled)
        object.__setattr__(self, "_by_structure", {})

    def __reduce__(self) -> tuple[type[PolicyMap], tuple[Any, ...]]:
        return PolicyMap, (self.rules, self.default)

    def __repr__(self) -> str:
        rules = ", ".join(f"{pattern!r}: {str(p)!r}" for pattern, p in self.rules)
        return f"PolicyMap({{{rules}}}, default={str(self.default)!r})"

    def policy_for(self, path: Union[str, Sequence[Any]]) -> Policy:
        """The policy of the leaf at ``path`` (a ``/``-joined string or a jax key path)."""
        if not isinstance(path, str):
            path = path_str(path)
        return next((r.policy for r in self._compiled if r.matcher.search(path)), self.default)

    def cast_to_param(self, tree: T) -> T:
        """Casts each floating leaf of ``tree`` to the param dtype of its policy."""
        return self._cast(tree, lambda policy: policy.param_dtype)

    def cast_to_compute(self, tree: T) -> T:
        """Casts each floating leaf of ``tree`` to the compute dtype of its policy."""
        return self._cast(tree, lambda policy: policy.compute_dtype)

    def cast_to_output(self, tree: T) -> T:
        """Casts each floating leaf of ``tree`` to the output dtype of its policy."""
        return self._cast(tree, lambda policy: policy.output_dtype)

    def wrap(self, fn: Callable[Concatenate[Any, P], R]) -> Callable[Concatenate[Any, P], R]:
        """``fn`` with its first argument cast by path, the others and the result by the default policy."""
        check_callable(fn, "PolicyMap.wrap(fn)")
        default = self.default

        @functools.wraps(fn)
        def wrapped(params: Any, /, *args: P.args, **kwargs: P.kwargs) -> R:
            args, kwargs = default.cast_to_compute((args, kwargs))
            return default.cast_to_output(fn(self.cast_to_compute(params), *args, **kwargs))

        return wrapped

    def _cast(self, tree: T, dtype_of: Callable[[Policy], np.dtype[Any] | None]) -> T:
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        dtypes = [dtype_of(policy) for policy in self._leaf_policies(tree, treedef)]
        return typing.cast(T, jax.tree_util.tree_unflatten(treedef, _casting.cast_leaves(leaves, dtypes)))

    def _leaf_policies(self, tree: Any, treedef: Any) -> tuple[Policy, ...]:
        try:
            return self._by_structure[treedef]
        except KeyError:
            pass
        paths = [path_str(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
        if paths:  # a tree without leaves has nothing to match
            unmatched = [n for n, rule in enumerate(self._compiled)
                         if not any(rule.matcher.search(path) for path in paths)]
            _rules.warn_unmatched(self._compiled, unmatched, "PolicyMap",
                                  "leaf of the tree it was applied to", paths, stacklevel=4)
        policies = tuple(self.policy_for(path) for path in paths)
        self._by_structure[treedef] = policies
        return policies


jax.tree_util.register_static(PolicyMap)
