"""Child process for tests/test_sharded_training.py (not a test module itself).

Runs on 8 simulated CPU devices (the test sets the device count) and writes what it
observed, plain facts and no verdicts, to a JSON file:

    python tests/support/sharded_training_worker.py OUT.json

* ``training``: a train step as a user writes it (``jit`` around ``value_and_grad``,
  the optimizer's ``update`` and ``optax.apply_updates``) of a small MLP whose layers
  are sharded three ways on a (4, 2) mesh of axes ``data`` and ``model``:
  data-parallel (replicated), tensor-parallel (over ``model``) and FSDP (over
  ``data``, gathered for use), the batch over ``data``. Four copies of the MLP train
  at once (``optax.multi_transform``), one per feature: `quantize_state` in 8 and in
  4 bits, `cast_state`, and `low_precision_params` on bfloat16 copies, all inside
  `loss_scaling`; the second of three steps has a non-finite gradient. Under a mesh
  of explicit axes and one of automatic axes, against the same step on one device
  and against plain Adam without loss scaling on the same mesh.
* ``ragged``: ``lax.ragged_dot`` under ``autocast(..., "mixed_bfloat16", fp8=...)``
  for every recipe, the tokens sharded over ``data`` on 8 devices.
"""

from __future__ import annotations

import json
import sys
import traceback
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

# Imported before any mesh is set: jmp_policy cannot be imported under jax.set_mesh.
import jmp_policy
from support.sharded_hlo import collective_ops

PARAM_SPECS = {  # mesh axes of each parameter: (4, 2) devices, ("data", "model")
    "dp": {"w": (), "b": ()},
    "tp": {"up": (None, "model"), "down": ("model", None)},
    "fsdp": {"out": (None, "data")},
}
SHAPES = {
    "dp": {"w": (64, 256), "b": (256,)},
    "tp": {"up": (256, 512), "down": (512, 256)},
    # The output layer's last axis is cut into shards of 32 values: its 8-bit blocks
    # (128, the whole axis) span four; 4-bit blocks (32) fill one each.
    "fsdp": {"out": (256, 128)},
}
FEATURES = ("q8", "q4", "cast", "lp")
BATCH, CLASSES = 32, 128
STEPS = 3
NONFINITE_STEP = 1
MODES = ("explicit", "auto")
RECIPES = ("none", "tensorwise", "rowwise", "mxfp8", "nvfp4")


def main(out: str) -> None:
    facts: dict[str, Any] = {"devices": jax.device_count()}
    for name, part in (("training", training), ("ragged", ragged)):
        try:
            facts[name] = part()
        except Exception:  # the test reports it
            facts[name] = {"crashed": traceback.format_exc()[-3000:]}
    with open(out, "w") as f:
        json.dump(facts, f, indent=1)


# --------------------------------------------------------------------------- #
# Collectives and shardings, as facts.
# --------------------------------------------------------------------------- #

def collective_operands(text: str) -> dict[str, int]:
    """The collectives of optimized HLO, counted by operand: ``"kind reducer type"``
    (``"all-reduce add f32[16]"``). By operand rather than by instruction: XLA combines
    collectives into one in ways that vary from program to program."""
    counts: dict[str, int] = {}
    for op in collective_ops(text):
        for t in op["types"]:
            key = f"{op['kind']} {op['reducer'] or '-'} {t}"
            counts[key] = counts.get(key, 0) + 1
    return counts


def spec_entries(sharding: Any, ndim: int) -> list[Any]:
    """A sharding's mesh axes per dimension (lists where several), ``ndim`` of them.
    (``jax.eval_shape`` gives constants no sharding: they are replicated.)"""
    spec = [] if sharding is None else [
        list(p) if isinstance(p, tuple) else p for p in sharding.spec]
    return spec + [None] * (ndim - len(spec))


def trimmed(entries: list[Any]) -> list[Any]:
    """``entries`` without their trailing ``None``s: one form per sharding."""
    while entries and entries[-1] is None:
        entries = entries[:-1]
    return entries


# --------------------------------------------------------------------------- #
# Training.
# --------------------------------------------------------------------------- #

def host_params() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    model = {layer: {k: (rng.normal(size=s) / np.sqrt(s[0])).astype(np.float32)
                     for k, s in shapes.items()} for layer, shapes in SHAPES.items()}
    return {feature: model for feature in FEATURES}


def host_batches() -> list[Any]:
    rng = np.random.default_rng(1)
    batches = []
    for step in range(STEPS):
        x = rng.normal(size=(BATCH, SHAPES["dp"]["w"][0])).astype(np.float32)
        if step == NONFINITE_STEP:
            x[13, 5] = np.inf  # one token, on one device's shard of the batch
        batches.append((x, rng.integers(0, CLASSES, size=BATCH).astype(np.int32)))
    return batches


def make_loss(explicit: bool) -> Callable[..., Any]:
    """The MLP's loss, written for the mesh's axis types: with explicit axes, FSDP
    weights are gathered (``reshard``) before use and the row-parallel product says
    how its result is sharded, as JAX asks; with automatic axes, XLA decides."""
    def gathered(w: Any) -> Any:
        return jax.sharding.reshard(w, P()) if explicit else w

    def forward(p: Any, x: Any) -> Any:
        f32 = lambda w: w.astype(jnp.float32)  # noqa: E731  (the bfloat16 copy)
        h = jax.nn.gelu(x @ f32(p["dp"]["w"]) + f32(p["dp"]["b"]))
        h = jax.nn.gelu(h @ f32(p["tp"]["up"]))
        h = jax.nn.gelu(jnp.matmul(h, f32(p["tp"]["down"]),
                                   out_sharding=P("data", None) if explicit else None))
        return h @ f32(gathered(p["fsdp"]["out"]))

    def loss(params: Any, x: Any, y: Any) -> Any:
        return sum(optax.softmax_cross_entropy_with_integer_labels(
            forward(params[k], x), y).mean() for k in FEATURES)

    return loss


def make_tx() -> Any:
    adam = optax.adam(1e-3)
    features = {
        "q8": jmp_policy.quantize_state(adam, bits=8),
        "q4": jmp_policy.quantize_state(adam, bits=4),
        "cast": jmp_policy.cast_state(adam),
        "lp": jmp_policy.low_precision_params(adam, "kahan"),
    }

    def labels(params: Any) -> Any:  # each copy of the MLP to its feature
        return {k: jax.tree.map(lambda _, k=k: k, v) for k, v in params.items()}

    # period=1: the scale doubles at each finite step and halves at the non-finite one.
    return jmp_policy.loss_scaling(optax.multi_transform(features, labels),
                                   jmp_policy.DynamicLossScale(jnp.float32(2.0**10), period=1))


def make_steps(explicit: bool) -> tuple[Any, Any, Any]:
    """(the train step, plain Adam's step without loss scaling, the optimizer alone)."""
    loss, tx, adam = make_loss(explicit), make_tx(), optax.adam(1e-3)

    def step(params: Any, state: Any, x: Any, y: Any) -> Any:
        scale = jmp_policy.get_loss_scale(state)
        value, grads = jmp_policy.scaled_value_and_grad(loss)(scale, params, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value, grads

    def plain_step(params: Any, state: Any, x: Any, y: Any) -> Any:
        value, grads = jax.value_and_grad(loss)(params, x, y)
        updates, state = adam.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value, grads

    def update(params: Any, state: Any, grads: Any) -> Any:
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step, plain_step, update


def initial_params() -> Any:
    params = jax.tree.map(jnp.asarray, host_params())
    params["lp"] = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params["lp"])
    return params


def param_shardings(mesh: Any) -> Any:
    layers = {layer: {k: NamedSharding(mesh, P(*s)) for k, s in specs.items()}
              for layer, specs in PARAM_SPECS.items()}
    return {feature: layers for feature in FEATURES}


def training() -> dict[str, Any]:
    """The train step on each mesh, then each step's optimizer again on one device."""
    runs: dict[str, Any] = {}
    # The initial state's values, computed on one device; its layout is each mesh's.
    values = jax.device_get(jax.jit(make_tx().init)(initial_params()))
    specs = None
    for mode in MODES:
        axis = AxisType.Explicit if mode == "explicit" else AxisType.Auto
        mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis, axis))
        try:
            with jax.set_mesh(mesh):
                runs[mode], specs = sharded_run(mesh, mode, values, specs)
        except Exception as e:
            runs[mode] = {"crashed": f"{type(e).__name__}: {str(e)[:1500]}"}
    # Outside any mesh: one device, one compilation of each program for both runs.
    update = jax.jit(make_steps(explicit=False)[2])
    grad = jax.jit(jax.value_and_grad(make_loss(explicit=False)))
    for run in runs.values():
        if "crashed" not in run:
            compare_with_one_device(run, update, grad)
    return runs


def sharded_run(mesh: Any, mode: str, values: Any, specs: Any) -> tuple[dict[str, Any], Any]:
    """The train steps on ``mesh`` from the initial state ``values``: facts, with each
    step's inputs and outputs (host copies) under ``"trace"``; and the state's layout.

    Under explicit axes the layout is the one ``init``'s types give (``specs`` is
    ``None``); the automatic mesh's state is laid out as the explicit mesh's was
    (``specs``): there, ``jit(init)`` lets XLA replicate it (plain Adam's too)."""
    step, plain_step, _ = make_steps(explicit=mode == "explicit")
    tx = make_tx()
    params = jax.device_put(initial_params(), param_shardings(mesh))
    if specs is None:
        specs = jax.tree.map(lambda a: spec_entries(a.sharding, a.ndim),
                             jax.eval_shape(tx.init, params))
    state = jax.device_put(values, jax.tree.map(
        lambda s: NamedSharding(mesh, P(*[tuple(e) if isinstance(e, list) else e
                                          for e in s])),
        specs, is_leaf=lambda s: isinstance(s, list)))
    batches = [jax.device_put(b, NamedSharding(mesh, P("data"))) for b in host_batches()]

    run = jax.jit(step)
    compiled = run.lower(params, state, *batches[0]).compile()
    # Eager: zeros_like keeps each parameter's sharding (jit would let XLA replicate).
    plain_state = optax.adam(1e-3).init(params)
    plain = jax.jit(plain_step).lower(params, plain_state, *batches[0]).compile()
    facts: dict[str, Any] = {
        "collectives": collective_operands(compiled.as_text()),
        "plain_adam_collectives": collective_operands(plain.as_text()),
        "layout": layout_mismatches(params, state, mesh),
        "layout_of_a_replicated_state": layout_mismatches(params, replicated_codes(state, mesh),
                                                          mesh),
        "steps": [], "trace": [],
    }
    shardings_in = [x.sharding for x in jax.tree.leaves((params, state))]
    before = jax.device_get((params, state))
    for x, y in batches:
        params, state, loss, grads = run(params, state, x, y)
        facts["steps"].append({
            "shardings_changed": [
                jax.tree_util.keystr(path) for (path, leaf), s in zip(
                    jax.tree_util.tree_leaves_with_path((params, state)), shardings_in)
                if not s.is_equivalent_to(leaf.sharding, leaf.ndim)]})
        after = jax.device_get((params, state, loss, grads))
        facts["trace"].append((before, after))
        before = after[:2]
    return facts, specs


def compare_with_one_device(facts: dict[str, Any], update: Any, grad: Any) -> None:
    """Adds to each step's facts: the optimizer's result on one device from the same
    inputs (bit for bit, by feature), the loss-scaling state, and for the first step
    the loss and gradients of one device (the same parameters in)."""
    trace = facts.pop("trace")
    for k, ((params, state), (new_params, new_state, loss, grads)) in enumerate(trace):
        want = jax.device_get(update(params, state, grads))
        step = facts["steps"][k]
        step["optimizer_differs"] = [
            jax.tree_util.keystr(path) for (path, a), b in zip(
                jax.tree_util.tree_leaves_with_path((new_params, new_state)),
                jax.tree.leaves(want))
            if np.asarray(a).tobytes() != np.asarray(b).tobytes()]
        step.update({
            "loss_scale": float(jmp_policy.get_loss_scale(new_state).loss_scale),
            "grads_finite": bool(new_state.grads_finite),
            "skipped_steps": int(new_state.skipped_steps),
            "params_finite": all(bool(np.isfinite(np.asarray(p, np.float32)).all())
                                 for p in jax.tree.leaves(new_params)),
            "unchanged": all(np.asarray(a).tobytes() == np.asarray(b).tobytes()
                             for a, b in zip(jax.tree.leaves((params, state.inner_state)),
                                             jax.tree.leaves((new_params,
                                                              new_state.inner_state)))),
        })
        if k == 0:
            scale = float(jmp_policy.get_loss_scale(state).loss_scale)
            x, y = host_batches()[0]
            want_loss, want_grads = grad(params, x, y)
            step["loss_error"] = abs(float(loss) - float(want_loss)) / abs(float(want_loss))
            step["grad_error"] = {f: max_relative_error(
                jax.tree.map(lambda g: np.asarray(g, np.float64) / scale, grads[f]),
                want_grads[f]) for f in FEATURES}


def max_relative_error(a: Any, b: Any) -> float:
    errors = [float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)))
                    / max(float(np.max(np.abs(np.asarray(y, np.float64)))), 1e-30))
              for x, y in zip(jax.tree.leaves(jax.device_get(a)), jax.tree.leaves(b))]
    return max(errors)


def layout_mismatches(params: Any, state: Any, mesh: Any) -> list[str]:
    """The state arrays not sharded as their parameter says: moments, Kahan buffers and
    quantized codes like the parameter; block exponents like it too, except along a
    last axis whose shards do not hold whole blocks (replicated there); everything that
    belongs to no parameter (counts, keys, the loss scale, samples) replicated."""
    owners = {jax.tree_util.keystr(path): p
              for path, p in jax.tree_util.tree_leaves_with_path(params)}
    wrong = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        name = jax.tree_util.keystr(path)
        owner = next((p for k, p in owners.items() if k in name), None)
        if owner is None:
            expected = [None] * leaf.ndim
        else:
            expected = spec_entries(owner.sharding, owner.ndim)
            if name.endswith(".exponents"):
                expected[-1] = exponent_axis(owner, expected[-1], leaf.shape[-1], mesh)
        want = NamedSharding(mesh, P(*[tuple(e) if isinstance(e, list) else e
                                       for e in expected]))
        if not want.is_equivalent_to(leaf.sharding, leaf.ndim):
            wrong.append(f"{name}: {leaf.sharding.spec}, expected {want.spec}")
    return wrong


def exponent_axis(owner: Any, axis: Any, blocks: int, mesh: Any) -> Any:
    """The sharding of the exponents' last axis: the parameter's where each shard holds
    whole blocks, else none."""
    if axis is None:
        return None
    names = axis if isinstance(axis, list) else [axis]
    parts = 1
    for n in names:
        parts *= mesh.shape[n]
    return axis if blocks % parts == 0 else None


def replicated_codes(state: Any, mesh: Any) -> Any:
    """``state`` with the codes of a sharded parameter's moment replicated: what a
    layout check must catch."""
    def replicate(path: Any, leaf: Any) -> Any:
        name = jax.tree_util.keystr(path)
        if "['q8']['tp']['up']" in name and name.endswith(".values"):
            return jax.device_put(leaf, NamedSharding(mesh, P()))
        return leaf

    return jax.tree_util.tree_map_with_path(replicate, state)


# --------------------------------------------------------------------------- #
# Ragged products.
# --------------------------------------------------------------------------- #

M, K, N = 128, 64, 48
SIZES = (24, 40, 0, 64)  # tokens per expert: groups span shards of 16 tokens; one empty


def ragged_operands() -> Any:
    rng = np.random.default_rng(2)
    rows = np.repeat(np.arange(len(SIZES)), SIZES)
    x = rng.normal(size=(M, K)) * np.array([1.0, 4.0, 1.0, 0.125])[rows, None]
    w = rng.normal(size=(len(SIZES), K, N)) * K ** -0.5
    return (x.astype(np.float32), w.astype(np.float32), np.asarray(SIZES, np.int32))


def ragged_loss(recipe: str, form: str) -> Callable[..., Any]:
    """``sum(tanh(ragged_dot(x, w, sizes)))`` under autocast with ``recipe`` ("plain":
    no autocast). ``form``: "plain" (``lax.ragged_dot``), "auto_axes" (inside
    ``jax.sharding.auto_axes``, the form JAX supports under explicit axes) or
    "out_sharding" (``lax.ragged_dot(..., out_sharding=...)``, the tokens' sharding)."""
    def product(x: Any, w: Any, s: Any) -> Any:
        if form == "auto_axes":
            return jax.sharding.auto_axes(lax.ragged_dot, out_sharding=P("data"))(x, w, s)
        if form == "out_sharding":  # the tokens' own sharding
            return lax.ragged_dot(x, w, s, out_sharding=jax.typeof(x).sharding.spec)
        return lax.ragged_dot(x, w, s)

    def loss(x: Any, w: Any, s: Any) -> Any:
        return jnp.sum(jnp.tanh(product(x, w, s).astype(jnp.float32)))

    if recipe == "plain":
        return loss
    # tanh and its derivative in float32 (the product returns bfloat16): sharded and
    # single-device programs then differ by summation order only, not by where XLA fuses
    # (and keeps excess precision in) bfloat16 work, which float8 rounding would magnify.
    return jmp_policy.autocast(loss, "mixed_bfloat16", rules={"float32": ["tanh"]},
                               fp8=None if recipe == "none" else recipe)


def ragged() -> dict[str, Any]:
    """Each recipe's loss and gradients on one device and sharded, a program each.

    Not one program for every recipe: NVFP4's stochastic rounding is salted with the
    values' bits, and XLA:CPU, fusing a bigger program otherwise, may compute a value
    to another last bit, which gives NVFP4 another sample of its rounding."""
    def grad(recipe: str, form: str) -> Any:
        return jax.jit(jax.value_and_grad(ragged_loss(recipe, form), argnums=(0, 1)))

    operands = ragged_operands()
    facts: dict[str, Any] = {mode: {} for mode in MODES}
    for recipe in RECIPES:
        single = jax.tree.leaves(jax.device_get(grad(recipe, "plain")(*operands)))
        for mode in MODES:
            axis = AxisType.Explicit if mode == "explicit" else AxisType.Auto
            mesh = jax.make_mesh((8,), ("data",), axis_types=(axis,))
            try:
                with jax.set_mesh(mesh):
                    args = [jax.device_put(a, NamedSharding(mesh, spec))
                            for a, spec in zip(operands, (P("data"), P(), P()))]
                    compiled = grad(recipe, "auto_axes" if mode == "explicit" else "plain"
                                    ).lower(*args).compile()
                    value, grads = compiled(*args)
                got = jax.tree.leaves(jax.device_get((value, grads)))
                facts[mode][recipe] = {
                    "error": max(float(np.max(np.abs(a - b)) / np.max(np.abs(b)))
                                 for a, b in zip(got, single)),
                    "shardings": [trimmed(spec_entries(g.sharding, g.ndim)) for g in grads],
                    "collectives": collective_operands(compiled.as_text()),
                }
            except Exception as e:
                facts[mode][recipe] = {"crashed": f"{type(e).__name__}: {str(e)[:1500]}"}
    facts["out_sharding"] = ragged_out_sharding()
    return facts


def ragged_out_sharding() -> dict[str, Any]:
    """Whether ``lax.ragged_dot(..., out_sharding=...)`` runs under explicit axes, plain
    and under autocast with each recipe: its gradients with the tokens sharded, and its
    value with the tokens replicated."""
    operands = ragged_operands()
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    cases = {"sharded gradients": (P("data"), True), "replicated value": (P(), False)}
    runs: dict[str, Any] = {}
    for case, (tokens, gradients) in cases.items():
        runs[case] = {}
        for recipe in ("plain",) + RECIPES:
            f = ragged_loss(recipe, "out_sharding")
            f = jax.value_and_grad(f, argnums=(0, 1)) if gradients else f
            try:
                with jax.set_mesh(mesh):
                    jax.jit(f)(*[jax.device_put(a, NamedSharding(mesh, spec))
                                 for a, spec in zip(operands, (tokens, P(), P()))])
                runs[case][recipe] = "ok"
            except Exception as e:
                runs[case][recipe] = f"{type(e).__name__}: {str(e)[:200]}"
    return runs


if __name__ == "__main__":
    main(sys.argv[1])
