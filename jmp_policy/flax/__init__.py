"""Flax integration: policies for linen and NNX modules (optional; needs flax).

``import jmp_policy`` never imports this module; ``import jmp_policy.flax`` does,
and imports flax (``pip install "jmp_policy[flax]"``).

Flax layers already know two dtypes: ``dtype`` (the computation) and
``param_dtype`` (the stored parameters). A policy maps onto them directly:

>>> import flax.linen as nn
>>> import jmp_policy, jmp_policy.flax
>>> layer = nn.Dense(10, **jmp_policy.flax.module_kwargs("mixed_bfloat16"))
>>> layer.dtype, layer.param_dtype
(dtype(bfloat16), dtype('float32'))

Per-module policies (the Flax form of Haiku's ``hk.mixed_precision.set_policy``):
`module_policy` overrides the policy of every linen module matched by class or
by path, for the calls made inside a ``with`` block, through Flax's own method
interception (``flax.linen.intercept_methods``), so it is thread-local:

>>> import jax, jax.numpy as jnp
>>> class Net(nn.Module):
...     @nn.compact
...     def __call__(self, x):
...         x = nn.Dense(8, dtype=jnp.bfloat16)(x)
...         return nn.LayerNorm(dtype=jnp.bfloat16)(x)
>>> net = Net()
>>> params = net.init(jax.random.key(0), jnp.ones((2, 4)))
>>> with jmp_policy.flax.module_policy({nn.LayerNorm: "float32"}):
...     y = net.apply(params, jnp.ones((2, 4)))
>>> y.dtype
dtype('float32')

NNX modules are configured with `module_kwargs` too (or changed in place with
`set_nnx_policy`); train them with ``nnx.Optimizer`` wrapping
`jmp_policy.loss_scaling`, taking gradients with `nnx_scaled_value_and_grad`
and reading the scale back with `optimizer_loss_scale`.
"""

from __future__ import annotations

import functools
import re
import threading
from typing import Any, Callable, Mapping, Optional, ParamSpec, Sequence, Tuple, TypeVar, Union

try:
    import flax.linen as nn
    from flax import nnx
except ModuleNotFoundError as e:  # only Flax's own absence; a broken install raises as it is
    if e.name is None or e.name.partition(".")[0] != "flax":
        raise
    raise ImportError(
        'jmp_policy.flax needs Flax, which is not installed: pip install "jmp_policy[flax]". '
        "(jmp_policy itself works without it.)") from e

import jax
import jax.numpy as jnp

from jmp_policy.paths import path_str
from jmp_policy.policy import Rule, compile_path_regex, parse_rules, warn_unmatched
from jmp_policy.flax._float8 import (
    FLOAT8_HISTORIES, Float8Histories, LinenFloat8DotGeneral, NNXFloat8DotGeneral,
    record_float8_histories)
from jmp_policy.loss_scale import LossScale
from jmp_policy.policy import LossScaleLike
from jmp_policy.policy import Policy, PolicyLike, as_policy
from jmp_policy.optim import loss_scaling_state, scaled_loss_fn

__all__ = [
    "FLOAT8_HISTORIES",
    "Float8Histories",
    "LinenFloat8DotGeneral",
    "ModulePolicy",
    "NNXFloat8DotGeneral",
    "module_kwargs",
    "module_policy",
    "nnx_scaled_value_and_grad",
    "optimizer_loss_scale",
    "optimizer_skipped_steps",
    "record_float8_histories",
    "set_nnx_policy",
]

M = TypeVar("M", bound=nnx.Module)
P = ParamSpec("P")
R = TypeVar("R")

#: Per-module rules: ``{key: policy}`` or ``[(key, policy), ...]``, tried in order.
#: A key is a module class (it matches instances of the class and of its
#: subclasses) or a regex ``re.search``-ed in the module's ``/``-joined path.
#: Keys are checked when the rules are built; they are typed ``Any`` because a
#: mapping whose keys mix classes and strings has no narrower type that mypy
#: infers for a dict literal.
Rules = Union[Mapping[Any, PolicyLike], Sequence[tuple[Any, PolicyLike]]]
_Matcher = Union[type, re.Pattern[str]]


def module_kwargs(policy: PolicyLike = None) -> dict[str, Any]:
    """A policy as Flax constructor arguments: ``{"dtype": compute, "param_dtype": param}``.

    Works for linen (``nn.Dense(10, **module_kwargs(p))``) and NNX
    (``nnx.Linear(3, 10, **module_kwargs(p), rngs=rngs)``) layers alike.
    ``None`` is the global policy. For the deprecated infer policies ``dtype`` is
    ``None``, which Flax reads as "infer from the inputs and parameters".

    Flax layers output their computation dtype, like Keras layers, so a policy
    whose output dtype differs from its compute dtype needs ``policy.wrap`` (or
    `module_policy`) around the call to get that output dtype.

    >>> module_kwargs("mixed_float16")
    {'dtype': dtype('float16'), 'param_dtype': dtype('float32')}
    """
    policy = as_policy(policy)
    if policy.param_dtype is None:
        raise ValueError(
            f"Policy {policy} has no parameter dtype (the deprecated 'infer' policy); Flax "
            "layers need one. Use e.g. 'float32' or 'infer_float32_vars'.")
    return {"dtype": policy.compute_dtype, "param_dtype": policy.param_dtype}


# ---------------------------------------------------------------------------
# Rules, shared by linen's module_policy and NNX's set_nnx_policy.
# ---------------------------------------------------------------------------
def _compile_rules(rules: Rules, api: str) -> tuple[Rule[_Matcher], ...]:
    """Validates ``(key, policy)`` rules for `module_policy` (linen) or `set_nnx_policy` (NNX)."""
    linen = api == "module_policy"
    base: type = nn.Module if linen else nnx.Module
    other: type = nnx.Module if linen else nn.Module
    lib, other_lib = ("flax.linen", "flax.nnx") if linen else ("flax.nnx", "flax.linen")
    other_api = "set_nnx_policy" if linen else "module_policy"

    def compile_key(key: object, n: int) -> _Matcher:
        if isinstance(key, str):
            return compile_path_regex(key, api, n, "Block_0/LayerNorm_0")
        if isinstance(key, type) and issubclass(key, base):
            return key
        if isinstance(key, type) and issubclass(key, other):
            raise TypeError(
                f"{api} rule #{n}: {key.__name__} is a {other_lib} module, which {api} "
                f"never sees; use {other_api} for those.")
        raise TypeError(
            f"{api} rule #{n}: the key must be a {lib}.Module subclass "
            f"(e.g. LayerNorm) or a path regex string, got {key!r}.")

    return parse_rules(rules, api, "key", f"a {lib}.Module subclass or a path regex",
                              compile_key)


def _matching(rules: Sequence[Rule[_Matcher]], module: Any, path: str) -> list[int]:
    """The indices of the rules that match ``module`` at ``path``, in order."""
    return [n for n, rule in enumerate(rules)
            if (isinstance(module, rule.matcher) if isinstance(rule.matcher, type)
                else rule.matcher.search(path))]


def _choose(rules: Sequence[Rule[_Matcher]], matching: list[int],
            default: Optional[Policy], module: Any) -> Optional[Policy]:
    if matching:
        return rules[matching[0]].policy
    # The default is for layers (modules with a ``dtype`` field). Applied to a
    # container it would also cast the container's result, e.g. turn the float32
    # logits a rule asked for back into bfloat16.
    if default is not None and _has_field(module, "dtype"):
        return default
    return None


def _has_field(module: Any, name: str) -> bool:
    fields = getattr(module, "__dataclass_fields__", None)
    return name in (fields if fields is not None else vars(module))


def _dtype_overrides(module: Any, policy: Policy) -> dict[str, Any]:
    """The dtype fields of ``module`` that ``policy`` sets; fields it lacks are left alone."""
    overrides = {}
    if _has_field(module, "dtype"):
        overrides["dtype"] = policy.compute_dtype
    if _has_field(module, "param_dtype") and policy.param_dtype is not None:
        overrides["param_dtype"] = policy.param_dtype
    return overrides


# ---------------------------------------------------------------------------
# Linen: per-module policies through method interception.
# ---------------------------------------------------------------------------
class _Block(threading.local):
    """What one thread's outermost ``with`` block of a `ModulePolicy` has seen."""

    def __init__(self) -> None:
        self.contexts: list[Any] = []  # the open flax interception contexts, innermost last
        self.called = False  # whether any module was called in the block
        self.matched: set[int] = set()  # rules that matched a module called in the block
        self.paths: list[str] = []  # a few module paths, to show in a warning


class ModulePolicy:
    """Per-module policies for ``flax.linen``; a reusable, re-entrant context manager.

    Build it with `module_policy`. Inside ``with``, every linen module method call
    (``setup``, ``__call__`` and other methods, at ``init`` and ``apply``) on a
    module matched by a rule runs under that rule's policy:

    * the module's ``dtype`` field is the policy's compute dtype and its
      ``param_dtype`` field the param dtype (modules without these fields, such
      as your own containers, keep their code's dtypes);
    * floating arguments are cast to the compute dtype and floating results to
      the output dtype (as ``policy.wrap`` does).

    Rules are tried in order and the first match wins: a module class matches its
    instances (subclasses included); a string is a regex ``re.search``-ed against
    the module path (``"Block_0/LayerNorm_0"``; auto-generated names contain the
    class name, and a path rule also matches the modules below the one it names).
    Unmatched layers (modules with a ``dtype`` field) use ``default`` if given;
    every other module runs exactly as constructed.

    A rule that matched none of the modules called in a ``with`` block is
    reported with a `jmp_policy.UnmatchedRuleWarning` when the outermost block
    ends (once per rule). Under ``jit`` modules are called while tracing, so a
    block around a call that hits jit's cache sees no module and reports nothing.

    Interception goes through ``flax.linen.intercept_methods``, whose interceptor
    stack is thread-local: a ``with`` block affects only its own thread. It
    reaches into lifted transforms (``nn.remat``, ``nn.scan``, ``nn.vmap``...);
    inside ``nn.scan`` the carry must keep its dtype, so a module that ends a
    scanned block should get an output dtype equal to its input dtype (e.g.
    ``Policy("float32", "float32", "bfloat16")`` for a float32 LayerNorm in a
    bfloat16 block).
    Parameters that already exist are not converted; ``param_dtype`` matters when
    they are created (``init``). Nested contexts compose like nested
    ``policy.wrap`` calls: the innermost matching policy sets the module's dtypes,
    and each level casts the results on the way out.
    """

    def __init__(self, rules: Rules, default: PolicyLike = None) -> None:
        self._rules = _compile_rules(rules, "module_policy")
        self._default = None if default is None else as_policy(default)
        self._block = _Block()
        self._warned: set[int] = set()

    @property
    def rules(self) -> tuple[tuple[Any, Policy], ...]:
        """The ``(key, policy)`` pairs, in the order they are tried."""
        return tuple((rule.key, rule.policy) for rule in self._rules)

    @property
    def default(self) -> Optional[Policy]:
        """The policy of layers that no rule matches (``None``: as constructed)."""
        return self._default

    def __repr__(self) -> str:
        rules = ", ".join(f"{rule.describe()}: {str(rule.policy)!r}" for rule in self._rules)
        default = None if self._default is None else str(self._default)
        return f"ModulePolicy({{{rules}}}, default={default!r})"

    def policy_for(self, module: nn.Module) -> Optional[Policy]:
        """The policy for a bound linen module, or ``None`` if it runs as constructed."""
        path = path_str(module.path) if module.scope is not None else ""
        return _choose(self._rules, _matching(self._rules, module, path), self._default, module)

    def _intercept(self, next_fun: Callable[..., Any], args: tuple[Any, ...],
                   kwargs: dict[str, Any], context: Any) -> Any:
        module = context.module
        path = path_str(module.path) if module.scope is not None else ""
        matching = _matching(self._rules, module, path)
        self._record(matching, path)
        policy = _choose(self._rules, matching, self._default, module)
        if policy is None:
            return next_fun(*args, **kwargs)
        overrides = _dtype_overrides(module, policy)
        saved = {name: getattr(module, name) for name in overrides}
        # Linen modules are frozen dataclasses; the bound instance seen here is a
        # clone made by init/apply (or .bind), never the user's module, so
        # overriding its fields for the duration of the call leaks neither into
        # the user's module nor into other init/apply calls. (A module bound with
        # .bind() and called from two threads at once would share the override.)
        # Nested calls on the same module save and restore in stack order.
        for name, value in overrides.items():
            object.__setattr__(module, name, value)
        try:
            if context.method_name == "setup":
                return next_fun(*args, **kwargs)
            return policy.wrap(next_fun)(*args, **kwargs)
        finally:
            for name, value in saved.items():
                object.__setattr__(module, name, value)

    def _record(self, matching: list[int], path: str) -> None:
        block = self._block
        block.called = True
        block.matched.update(matching)
        if path and len(block.paths) < 3 and path not in block.paths:
            block.paths.append(path)

    def __enter__(self) -> ModulePolicy:
        block = self._block
        if not block.contexts:  # the outermost block of this thread starts afresh
            block.called = False
            block.matched.clear()
            block.paths.clear()
        context = nn.intercept_methods(self._intercept)
        context.__enter__()
        block.contexts.append(context)
        return self

    def __exit__(self, *exc: Any) -> None:
        block = self._block
        block.contexts.pop().__exit__(*exc)
        # Reported when the outermost block ends without error: only then have
        # all the modules it calls been seen. Each rule is reported once.
        if not block.contexts and exc[0] is None and block.called:
            unmatched = set(range(len(self._rules))) - block.matched - self._warned
            self._warned |= unmatched
            warn_unmatched(self._rules, unmatched, "module_policy",
                                  "module called in the with block", block.paths, stacklevel=2)

    def __call__(self, fn: Callable[P, R]) -> Callable[P, R]:
        """Use as a decorator: ``fn`` runs inside this context."""

        @functools.wraps(fn)
        def wrapped(*args: P.args, **kwargs: P.kwargs) -> R:
            with self:
                return fn(*args, **kwargs)

        return wrapped


def module_policy(rules: Rules, default: PolicyLike = None) -> ModulePolicy:
    """Per-module policies for linen, as a context manager (or decorator) around ``init``/``apply``.

    ``rules``: a mapping or sequence of ``(key, policy)``; a key is a
    ``flax.linen.Module`` subclass or a regex over module paths; a policy is a
    `Policy` or a name. ``default``: policy for unmatched layers, i.e. modules
    with a ``dtype`` field (``None``: leave them as constructed). See `ModulePolicy`.

    Keep LayerNorm and the logits in float32 while the rest runs in bfloat16:

    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> class LM(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, x):
    ...         x = nn.LayerNorm()(nn.Dense(16)(x))
    ...         return nn.Dense(5, name="logits")(x)
    >>> policies = module_policy({nn.LayerNorm: "float32", "logits": "float32"},
    ...                          default="mixed_bfloat16")
    >>> with policies:
    ...     params = LM().init(jax.random.key(0), jnp.ones((1, 3)))
    ...     logits = LM().apply(params, jnp.ones((1, 3)))
    >>> logits.dtype, params["params"]["Dense_0"]["kernel"].dtype
    (dtype('float32'), dtype('float32'))
    """
    return ModulePolicy(rules, default)


# ---------------------------------------------------------------------------
# NNX.
# ---------------------------------------------------------------------------
def set_nnx_policy(model: M, policy: PolicyLike = None, rules: Rules = ()) -> M:
    """Sets the policy of every submodule of an NNX model in place; returns the model.

    NNX modules are mutable Python objects, so no interception is needed: each
    submodule that has a ``dtype`` attribute gets the compute dtype, one with a
    ``param_dtype`` attribute gets the param dtype and its own ``nnx.Param``
    values are cast to it. ``rules`` (module class or path regex -> policy, first
    match wins, as in `module_policy`) take precedence over ``policy``, which
    applies to the rest. Without ``policy``, submodules no rule matches are left
    as built when rules are given (as `module_policy` leaves them), and get the
    global policy when none are. A rule that matches no submodule is reported
    with a `jmp_policy.UnmatchedRuleWarning`.

    >>> from flax import nnx
    >>> model = nnx.Sequential(nnx.Linear(2, 4, rngs=nnx.Rngs(0)), nnx.LayerNorm(4, rngs=nnx.Rngs(0)))
    >>> model = set_nnx_policy(model, "mixed_bfloat16", rules={nnx.LayerNorm: "float32"})
    >>> model.layers[0].dtype, model.layers[1].dtype
    (dtype(bfloat16), dtype('float32'))
    """
    if not isinstance(model, nnx.Module):
        hint = ("; linen modules take a policy through module_kwargs(policy) when built, or "
                "module_policy(...) around init/apply" if isinstance(model, nn.Module) else "")
        raise TypeError(
            f"set_nnx_policy expects a flax.nnx.Module, got {type(model).__module__}."
            f"{type(model).__qualname__}{hint}.")
    compiled = _compile_rules(rules, "set_nnx_policy")
    default = None if policy is None and compiled else as_policy(policy)
    unmatched = set(range(len(compiled)))
    paths = []
    for parts, module in nnx.iter_modules(model):
        path = path_str(parts)
        matching = _matching(compiled, module, path)
        unmatched.difference_update(matching)
        paths.append(path)
        chosen = _choose(compiled, matching, default, module)
        if chosen is not None:
            _set_module_dtypes(module, chosen)
    warn_unmatched(compiled, unmatched, "set_nnx_policy", "submodule of the model",
                          [path for path in paths if path], stacklevel=2)
    return model


def _set_module_dtypes(module: nnx.Module, policy: Policy) -> None:
    for name, value in _dtype_overrides(module, policy).items():
        setattr(module, name, value)
        if name == "param_dtype":
            for var in list(vars(module).values()):
                if isinstance(var, nnx.Param) and jnp.issubdtype(var.dtype, jnp.floating):
                    var.set_value(var.get_value().astype(value))


def optimizer_loss_scale(optimizer: nnx.Optimizer[Any]) -> LossScale:
    """The current loss scale held in an ``nnx.Optimizer`` built on `jmp_policy.loss_scaling`.

    ``nnx.Optimizer`` wraps every array of its optax state in a ``Variable``; this
    unwraps them and finds the scale as `jmp_policy.get_loss_scale` does.
    """
    return loss_scaling_state(nnx.as_pure(optimizer.opt_state)).loss_scale


def optimizer_skipped_steps(optimizer: nnx.Optimizer[Any]) -> jax.Array:
    """Total steps skipped for non-finite gradients, from an ``nnx.Optimizer``'s state."""
    skipped: jax.Array = loss_scaling_state(nnx.as_pure(optimizer.opt_state)).skipped_steps
    return skipped


def nnx_scaled_value_and_grad(
    fun: Callable[..., Any],
    argnums: int = 0,
    has_aux: bool = False,
    wrt: Any = nnx.Param,
) -> Callable[..., Tuple[Any, Any]]:
    """`jmp_policy.scaled_value_and_grad` for NNX: differentiates w.r.t. a module's ``wrt`` variables.

    Returns ``g(loss_scale, *args, **kwargs) -> (value, grads)``: ``value`` is the
    unscaled loss (``(loss, aux)`` with ``has_aux``), ``grads`` an ``nnx.State``
    of the gradients of the *scaled* loss, ready for ``optimizer.update`` with a
    `jmp_policy.loss_scaling` transformation. ``loss_scale`` takes the same forms
    as in `jmp_policy.scaled_value_and_grad`, and the loss is scaled the same way.
    Module state changes made by ``fun`` (batch statistics, RNG counters) are
    kept, as with ``nnx.grad``.
    """

    def g(loss_scale: LossScaleLike, *args: Any, **kwargs: Any) -> Tuple[Any, Any]:
        scaled = scaled_loss_fn(fun, loss_scale, has_aux)
        grad_fn = nnx.grad(scaled, argnums=nnx.DiffState(argnums, wrt), has_aux=True)
        grads, (loss, aux) = grad_fn(*args, **kwargs)
        return ((loss, aux) if has_aux else loss), grads

    return g
