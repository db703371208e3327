"""The step both memory tests of checkpointed float8 residuals compile (on XLA:CPU and,
deviceless, for an H100): four GELU MLP layers, each ``jax.checkpoint``-ed saving its
products' outputs (as MaxText's layers are), under ``mixed_bfloat16``; d_model 256, 2048
tokens."""

import functools

import jax
import jax.numpy as jnp

import jmp_policy

SAVED_PRODUCTS_BYTES = 4 * 2048 * (1024 + 256)
"""The products the checkpoint policy saves, per byte of a value: in bfloat16 twice that,
in float8 once."""


def checkpointed_stack(residuals):
    """``(gradient, argument shapes)`` of the stack, with autocast's ``residuals``."""
    policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable

    @functools.partial(jax.checkpoint, policy=policy)
    def layer(x, w1, w2):
        return x + jax.nn.gelu(jax.nn.standardize(x, axis=-1) @ w1) @ w2

    def loss(ws, x):
        for w1, w2 in ws:
            x = layer(x, w1, w2)
        return jnp.mean(x ** 2)

    spec = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    f = jmp_policy.autocast(loss, "mixed_bfloat16", residuals=residuals)
    return jax.grad(f), ([(spec(256, 1024), spec(1024, 256))] * 4, spec(2048, 256))
