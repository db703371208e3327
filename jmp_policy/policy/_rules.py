"""Per-path and per-module rules, shared by `PolicyMap` and `jmp_policy.flax`.

A rule pairs a key (a regex searched in a ``/``-joined path, or for Flax a
module class) with a policy. Both users accept the same shapes of rules, name
the same mistakes, and report a rule that matched nothing the same way: a typo
such as ``"LayerNrom"`` would otherwise silently leave those layers in the
default policy.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from typing import Any, Callable, Generic, Iterable, Mapping, Sequence, TypeVar

from jmp_policy.policy._policy import Policy, as_policy

K = TypeVar("K")


class UnmatchedRuleWarning(UserWarning):
    """A per-path or per-module rule matched nothing in the tree or model it was applied to.

    Usually a typo in a pattern or the wrong module class. Where a rule is
    meant to match only some of the trees it meets, silence the warning with
    the ``warnings`` module:

    >>> import warnings, jax.numpy as jnp, jmp_policy
    >>> policies = jmp_policy.PolicyMap({"LayerNorm": "float32"}, default="bfloat16")
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore", jmp_policy.UnmatchedRuleWarning)
    ...     policies.cast_to_compute({"Dense_0": jnp.ones(2)})["Dense_0"].dtype
    dtype(bfloat16)
    """


@dataclasses.dataclass(frozen=True)
class Rule(Generic[K]):
    """One validated rule: the key as the user wrote it, its compiled form, and its policy."""

    key: Any
    matcher: K
    policy: Policy

    def describe(self) -> str:
        """The key as a user would write it: ``'LayerNorm'`` or ``LayerNorm`` for a class."""
        key = self.key
        return key.__name__ if isinstance(key, type) else repr(key)


def parse_rules(
    rules: Mapping[Any, Any] | Sequence[tuple[Any, Any]],
    owner: str,
    key_name: str,
    key_desc: str,
    compile_key: Callable[[Any, int], K],
) -> tuple[Rule[K], ...]:
    """Validates a mapping or a sequence of ``(key, policy)`` pairs; first rule first.

    ``owner`` names the caller in errors, ``key_name`` and ``key_desc`` what a
    key is; ``compile_key(key, n)`` validates and compiles the key of rule
    number ``n`` (raising an error that names it).
    """
    if isinstance(rules, (str, bytes)) or not isinstance(rules, Iterable):
        raise TypeError(
            f"{owner} rules must be a mapping or a sequence of ({key_name}, policy) pairs, "
            f"where a {key_name} is {key_desc}; got {rules!r}.")
    items: Iterable[Any] = rules.items() if isinstance(rules, Mapping) else rules
    parsed = []
    for n, item in enumerate(items):
        try:
            key, policy = item
        except (TypeError, ValueError):
            raise TypeError(
                f"{owner} rule #{n} is {item!r}; each rule must be a ({key_name}, policy) pair, "
                f"where a {key_name} is {key_desc}.") from None
        matcher = compile_key(key, n)
        try:
            parsed.append(Rule(key, matcher, as_policy(policy)))
        except (TypeError, ValueError) as e:
            raise type(e)(f"{owner} rule #{n} ({key!r}): {e}") from None
    return tuple(parsed)


def compile_path_regex(pattern: object, owner: str, n: int, example: str) -> re.Pattern[str]:
    """Compiles rule ``n``'s path pattern; ``example`` shows what paths look like in errors."""
    if not isinstance(pattern, str):
        raise TypeError(
            f"{owner} rule #{n}: the pattern must be a regex string such as 'LayerNorm', got "
            f"{pattern!r}.")
    try:
        return re.compile(pattern)
    except re.error as e:
        raise ValueError(
            f"{owner} rule #{n}: {pattern!r} is not a valid regular expression ({e}); "
            f"patterns are Python `re` expressions searched (re.search) in paths such as "
            f"{example!r}.") from None


def warn_unmatched(
    rules: Sequence[Rule[Any]],
    unmatched: Iterable[int],
    owner: str,
    where: str,
    seen: Sequence[str],
    stacklevel: int,
) -> None:
    """Warns for each rule whose index is in ``unmatched``, naming it.

    ``where`` says what the rules were applied to ("leaf of the tree", "module
    of the model"); ``seen`` are a few of its paths, to show what they look
    like; ``stacklevel`` counts from the caller of this function.
    """
    examples = ", ".join(repr(path) for path in seen[:3])
    for n in sorted(unmatched):
        warnings.warn(
            f"{owner} rule #{n} ({rules[n].describe()}) matched no {where}; check it for a "
            f"typo. Paths there look like: {examples or '(none)'}.",
            UnmatchedRuleWarning, stacklevel=stacklevel + 1)
