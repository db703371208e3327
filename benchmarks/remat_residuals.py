"""What ``jax.checkpoint`` policies save under autocast, against plain JAX in bfloat16.

A layer with a named product without batch dimensions (``x @ w``, 1024 x 256 by
256 x 256) and a batched one (attention-like scores), differentiated through
``jax.checkpoint`` with each saving policy: the bytes of the residuals saved (the
arguments apart), under ``autocast(..., "mixed_bfloat16")`` with and without float8,
and for the same layer written by hand with bfloat16 operands. Prints a Markdown
table. Run it on two checkouts to compare them (``PYTHONPATH=<checkout>``).

    python benchmarks/remat_residuals.py
"""

import contextlib
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name, print_saved_residuals

from jmp_policy import Float8Recipe, autocast

POLICIES = {
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "save_only_these_names": jax.checkpoint_policies.save_only_these_names("proj"),
}
RECIPES = {"mixed_bfloat16": None, "tensorwise": Float8Recipe("tensorwise", exclude=()),
           "rowwise": Float8Recipe("rowwise", exclude=())}
ITEMSIZE = {"f32": 4, "bf16": 2, "f16": 2, "f8_e4m3fn": 1, "f8_e5m2": 1}


def layer(w, x):
    h = jnp.tanh(checkpoint_name(x @ w, "proj")).reshape(16, 64, 256)
    return jnp.sum(jnp.tanh(jnp.einsum("bqd,bkd->bqk", h, h)))


def by_hand(w, x):
    return layer(w.astype(jnp.bfloat16), x.astype(jnp.bfloat16))


def saved_bytes(fn, *args):
    """Bytes of what ``fn`` (a ``jax.checkpoint``-ed function) saves, arguments apart."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(fn, *args)
    total = 0
    for line in out.getvalue().splitlines():
        match = re.match(r"(\w+)(<\w+>)?\[([\d,]*)\]", line)
        if match and "from the argument" not in line:
            shape = [int(s) for s in match.group(3).split(",") if s]
            total += ITEMSIZE[match.group(1)] * int(np.prod(shape))
    return total


def main():
    w, x = jnp.ones((256, 256)) / 16, jnp.ones((1024, 256))
    print("| policy | recipe | autocast (KiB) | plain bfloat16 (KiB) |")
    print("|---|---|---|---|")
    for name, policy in POLICIES.items():
        plain = saved_bytes(jax.checkpoint(by_hand, policy=policy), w, x) / 1024
        for recipe, fp8 in RECIPES.items():
            f = autocast(layer, "mixed_bfloat16", fp8=fp8)
            got = saved_bytes(jax.checkpoint(f, policy=policy), w, x) / 1024
            print(f"| {name} | {recipe} | {got:.0f} | {plain:.0f} |")


if __name__ == "__main__":
    main()
