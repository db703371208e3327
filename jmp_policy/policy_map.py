"""Per-parameter policies: pick a `Policy` for each leaf from its key path.

A leaf's path is its pytree key path joined with ``/`` (``params/LayerNorm_0/scale``);
the first rule whose regex ``re.search``-matches it wins, else the default.

>>> import jax.numpy as jnp
>>> import jmp_policy
>>> pm = jmp_policy.PolicyMap({"LayerNorm": "float32"}, default="mixed_bfloat16")
>>> params = {"Dense_0": {"kernel": jnp.ones(2)}, "LayerNorm_0": {"scale": jnp.ones(2)}}
>>> {k: v for k, v in jax.tree_util.tree_map(lambda x: x.dtype.name, pm.cast_to_compute(params)).items()}
{'Dense_0': {'kernel': 'bfloat16'}, 'LayerNorm_0': {'scale': 'float32'}}
"""

from __future__ import annotations

import functools
import re
from typing import Any, Callable, Iterable, Mapping, Sequence, Tuple, TypeVar, Union

import jax

from jmp_policy import _casting
from jmp_policy.policy import Policy, PolicyLike, as_policy

T = TypeVar("T")
Rules = Union[Mapping[str, PolicyLike], Iterable[Tuple[str, PolicyLike]]]


def parse_rules(
    rules: Any, owner: str, key_name: str, key_desc: str, compile_key: Callable[[Any, int], Any]
) -> Tuple[Tuple[Any, Any, Policy], ...]:
    """``(key, compile_key(key, n), policy)`` per rule of a mapping or sequence of pairs.

    Shared by `PolicyMap` and the Flax per-module policies, so both accept the
    same shapes and name the same mistakes; ``owner`` names the caller in errors.
    """
    if isinstance(rules, (str, bytes)) or rules is None:
        raise TypeError(
            f"{owner} rules must be a mapping or a sequence of ({key_name}, policy) pairs, "
            f"where a {key_name} is {key_desc}; got {rules!r}.")
    items = rules.items() if isinstance(rules, Mapping) else rules
    parsed = []
    for n, item in enumerate(items):
        try:
            key, policy = item
        except (TypeError, ValueError):
            raise TypeError(
                f"{owner} rule #{n} is {item!r}; each rule must be a ({key_name}, policy) pair."
            ) from None
        compiled = compile_key(key, n)
        try:
            parsed.append((key, compiled, as_policy(policy)))
        except (TypeError, ValueError) as e:
            raise type(e)(f"{owner} rule #{n} ({key!r}): {e}") from None
    return tuple(parsed)


def compile_path_regex(pattern: str, owner: str, n: int, example: str) -> re.Pattern:
    try:
        return re.compile(pattern)
    except re.error as e:
        raise ValueError(
            f"{owner} rule #{n}: {pattern!r} is not a valid regular expression ({e}); "
            f"patterns are Python `re` expressions searched (re.search) in paths such as "
            f"{example!r}.") from None


def _compile_rules(rules: Rules) -> Tuple[Tuple[re.Pattern, Policy], ...]:
    def compile_key(pattern: Any, n: int) -> re.Pattern:
        if not isinstance(pattern, str):
            raise TypeError(f"PolicyMap rule #{n}: the pattern must be a regex string, got {pattern!r}.")
        return compile_path_regex(pattern, "PolicyMap", n, "params/Dense_0/kernel")

    parsed = parse_rules(rules, "PolicyMap", "regex", "a Python `re` pattern", compile_key)
    return tuple((regex, policy) for _, regex, policy in parsed)


class PolicyMap:
    """Per-leaf policies chosen by regex over ``/``-joined key paths; first match wins.

    ``default`` (a policy or name) applies to unmatched leaves; ``None`` means the
    global policy in force when the map is built. Immutable, hashable, and a
    leafless pytree, like `Policy`.
    """

    __slots__ = ("_rules", "_default", "_cache")

    def __init__(self, rules: Rules, default: PolicyLike = None):
        object.__setattr__(self, "_rules", _compile_rules(rules))
        object.__setattr__(self, "_default", as_policy(default))
        object.__setattr__(self, "_cache", {})

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"PolicyMap is immutable; cannot set {name!r}.")

    @property
    def rules(self) -> Tuple[Tuple[str, Policy], ...]:
        return tuple((regex.pattern, policy) for regex, policy in self._rules)

    @property
    def default(self) -> Policy:
        return self._default

    def _key(self) -> tuple:
        return (self.rules, self._default)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PolicyMap) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        rules = ", ".join(f"{pattern!r}: {str(p)!r}" for pattern, p in self.rules)
        return f"PolicyMap({{{rules}}}, default={str(self._default)!r})"

    def policy_for(self, path: Union[str, Sequence[Any]]) -> Policy:
        """The policy of the leaf at ``path`` (a ``/``-joined string or a jax key path)."""
        if not isinstance(path, str):
            path = _casting.path_str(path)
        policy = self._cache.get(path)
        if policy is None:
            policy = next((p for regex, p in self._rules if regex.search(path)), self._default)
            self._cache[path] = policy
        return policy

    def cast_to_param(self, tree: T) -> T:
        return _casting.cast_tree_by_path(tree, lambda path: self.policy_for(path).param_dtype)

    def cast_to_compute(self, tree: T) -> T:
        return _casting.cast_tree_by_path(tree, lambda path: self.policy_for(path).compute_dtype)

    def cast_to_output(self, tree: T) -> T:
        return _casting.cast_tree_by_path(tree, lambda path: self.policy_for(path).output_dtype)

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` with its first argument cast by path, the others and the result by the default policy."""
        default = self._default

        @functools.wraps(fn)
        def wrapped(params: Any, *args: Any, **kwargs: Any) -> Any:
            params = self.cast_to_compute(params)
            args, kwargs = default.cast_to_compute((args, kwargs))
            return default.cast_to_output(fn(params, *args, **kwargs))

        return wrapped


jax.tree_util.register_static(PolicyMap)
