"""Debugging mixed precision: inspect the byte-level transformer LM's numerics.

    python examples/inspect_numerics.py                 # ~2-4 min on a laptop CPU
    python examples/inspect_numerics.py --out /tmp/inspect --layers 1

``jmp_policy.inspect_numerics`` evaluates a function once in float32 and once
as ``jmp_policy.autocast`` would run it, operation by operation, and reports
for each operation (named by its Flax module path) how its low-precision result
compares with float32: overflows, values flushed to zero, subnormals, error.
The model is ``examples/transformer_lm.py``'s ``TransformerLM`` (imported, not
copied), its loss and gradients inspected three times:

1. in ``mixed_float16``: the riskiest operations (the backward pass's attention
   products, whose gradients are mostly below float16's normal range) and the
   loss scale that brings the gradients into range;
2. in ``mixed_bfloat16`` with float8 matrix products (``fp8="rowwise"``): the
   float8 products' error and how many operand values flush to zero;
3. a deliberately fragile variant, whose first MLP's up-projection weights are
   scaled up (as a layer's weights can drift up in training): its weights and
   product exceed float16's 65504, ``autocast`` gives a NaN loss, and two rounds
   of the rules that the reports suggest (that layer, then the next, in float32)
   fix it.

Prints the tables and writes ``reports.json`` (every report) and one plot per
report (each scope's dynamic range against float16, bfloat16 and float8's) to
``--out`` (default ``results/inspect_numerics/``); ``--docs-dir docs/img`` also
writes the tables and plots that ``docs/debugging.md`` shows.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import time
import warnings
from typing import Any, Dict

import jax
import jax.numpy as jnp
import optax

import jmp_policy


def load_lm():
    """``examples/transformer_lm.py``, loaded by path (the examples are not a package)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "transformer_lm.py")
    spec = importlib.util.spec_from_file_location("transformer_lm", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # flax modules are dataclasses: they look their module up
    spec.loader.exec_module(module)
    return module


lm = load_lm()

# The fragile variant: the first block's MLP up-projection scaled by this much.
FRAGILE_SCALE = 3e5
FRAGILE_LAYER = ("Block_0", "Dense_0")


def make_loss(model):
    """The LM's loss, written in float32 (no policy in the model code): autocast or the
    inspector applies the policy from outside."""
    def loss_fn(params, tokens):
        logits = model.apply({"params": params}, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), tokens[:, 1:]).mean()
    return loss_fn


def fragile(params):
    """``params`` with the first MLP's up-projection scaled up."""
    block, layer = FRAGILE_LAYER
    params = jax.tree.map(lambda x: x, params)  # a copy of the nested dicts
    params[block][layer]["kernel"] = params[block][layer]["kernel"] * FRAGILE_SCALE
    return params


def timed(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start


def inspect(loss_fn, params, tokens, policy, **kwargs):
    """One inspection, timed: the first call compiles, the second one is what it costs."""
    inspector = jmp_policy.inspect_numerics(loss_fn, policy, argnums=0, **kwargs)
    report, first = timed(inspector, params, tokens)
    _, second = timed(inspector, params, tokens)
    return report, {"first_call_s": first, "call_s": second}


def loss_scale(report) -> tuple:
    """The suggested loss scale, and the warning it may give, as text."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scale = report.suggest_loss_scale()
    return scale, [str(w.message) for w in caught]


def finite_or_none(x: Any) -> Any:
    """``x`` with non-finite floats (a NaN loss) as None, for standard JSON."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: finite_or_none(v) for k, v in x.items()}
    if isinstance(x, list):
        return [finite_or_none(v) for v in x]
    return x


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join("results", "inspect_numerics"))
    parser.add_argument("--docs-dir", default=None,
                        help="also write the tables and plots shown in docs/debugging.md here "
                             "(debugging-*.txt and .png; docs/img for the docs)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worst", type=int, default=8, help="rows of each table")
    for field in ("d_model", "heads", "layers", "seq_len", "batch_size"):
        parser.add_argument("--" + field.replace("_", "-"), type=int,
                            default=getattr(lm.Config(), field))
    args = parser.parse_args(argv)
    config = lm.Config(d_model=args.d_model, heads=args.heads, layers=args.layers,
                       seq_len=args.seq_len, batch_size=args.batch_size)
    model = lm.TransformerLM(config)
    loss_fn = make_loss(model)
    params = jax.jit(model.init)(jax.random.key(args.seed),
                                 jnp.zeros((1, config.seq_len), jnp.int32))["params"]
    tokens = jnp.asarray(next(lm.batches(lm.load_text(), config, args.seed)))
    os.makedirs(args.out, exist_ok=True)
    results: Dict[str, Any] = {"device": str(jax.devices()[0]), "config": vars(args)}
    reports: Dict[str, Any] = {}
    texts: Dict[str, str] = {}

    print("1. mixed_float16: the LM's loss and gradients\n")
    report, times = inspect(loss_fn, params, tokens, "mixed_float16")
    scale, notes = loss_scale(report)
    texts["float16"] = "\n".join([str(report.worst(args.worst)), "",
                                  f"suggested loss scale: 2**{int(math.log2(scale))}",
                                  *(f"({n})" for n in notes)])
    results["float16"] = {"report": json.loads(report.to_json()), "loss_scale": scale, **times}
    reports["float16"] = report

    print("2. mixed_bfloat16 with float8 products (fp8='rowwise')\n")
    report8, times = inspect(loss_fn, params, tokens, "mixed_bfloat16", fp8="rowwise")
    flushed = sum(r.fp8_flushed or 0 for r in report8)
    saturated = sum(r.fp8_saturated or 0 for r in report8)
    texts["float8"] = "\n".join([str(report8.worst(args.worst)), "",
                                 f"float8 operand values, all products: {flushed} flushed to "
                                 f"zero, {saturated} saturated"])
    results["float8"] = {"report": json.loads(report8.to_json()), **times}
    reports["float8"] = report8

    print(f"3. a fragile variant: {'/'.join(FRAGILE_LAYER)}'s kernel x {FRAGILE_SCALE:g}\n")
    broken = fragile(params)
    # An overflow hides what it feeds: inspect again with the suggested rules until
    # nothing overflows (each round pins at least one more scope).
    report_f, times = inspect(loss_fn, broken, tokens, "mixed_float16")
    rules, rounds = report_f.suggest_rules(), [report_f.suggest_rules()]
    for _ in range(3):
        again, _ = inspect(loss_fn, broken, tokens, "mixed_float16", rules=rules)
        if not any(row.overflow for row in again):
            break
        rules = again.suggest_rules()
        rounds.append(rules)
    before = float(jmp_policy.autocast(loss_fn, "mixed_float16")(broken, tokens))
    after = float(jmp_policy.autocast(loss_fn, "mixed_float16", rules=rules)(broken, tokens))
    exact = float(jax.jit(loss_fn)(broken, tokens))
    texts["fragile"] = "\n".join([
        str(report_f.worst(4)), "",
        *(f"suggested rules, round {i + 1}: {r}" for i, r in enumerate(rounds)),
        f"loss: float32 {exact:.4f}, autocast {before:.4f}, "
        f"autocast with the suggested rules {after:.4f}"])
    results["fragile"] = {"report": json.loads(report_f.to_json()), "rules": rules,
                          "loss": {"float32": exact, "autocast": before,
                                   "autocast_with_rules": after}, **times}
    reports["fragile"] = report_f

    for name, r in reports.items():
        print(texts[name], end="\n\n")
        r.plot(os.path.join(args.out, f"lm_{name}.png"))
        if args.docs_dir:
            with open(os.path.join(args.docs_dir, f"debugging-{name}.txt"), "w") as f:
                f.write(texts[name] + "\n")
            if name != "float8":  # its ranges are float16's: the float32 evaluation's
                r.plot(os.path.join(args.docs_dir, f"debugging-{name}.png"))
    with open(os.path.join(args.out, "reports.json"), "w") as f:
        json.dump(finite_or_none(results), f, indent=1, allow_nan=False)
    for name in reports:
        t = results[name]
        print(f"inspection ({name}): first call {t['first_call_s']:.1f} s (tracing and "
              f"compiling), then {t['call_s']:.2f} s")
    print(f"\nwrote {os.path.join(args.out, 'reports.json')} and lm_*.png there")


if __name__ == "__main__":
    main()
