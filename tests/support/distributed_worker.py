"""Child process for tests/test_distributed.py (not a test module itself).

Each scenario needs a device count that must be fixed before JAX starts, so it
runs here, in a fresh interpreter, and writes what it observed (plain facts,
no verdicts) to a JSON file that the test then checks:

    python tests/support/distributed_worker.py mesh OUT.json
    python tests/support/distributed_worker.py shard_map OUT.json
    python tests/support/distributed_worker.py multiprocess OUT.json PROCESS_ID PORT
"""

from __future__ import annotations

import json
import re
import sys

import numpy as np

SCENARIO = sys.argv[1]
OUT = sys.argv[2]

import jax  # noqa: E402  (device count must be configured before first use)

if SCENARIO == "multiprocess":
    PROCESS_ID, PORT = int(sys.argv[3]), int(sys.argv[4])
    jax.config.update("jax_num_cpu_devices", 4)
    # Gloo is jax's TCP implementation of cross-process collectives on CPU.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{PORT}",
        num_processes=2,
        process_id=PROCESS_ID,
        initialization_timeout=60,
    )
else:
    jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jmp_policy  # noqa: E402

INITIAL_SCALE = 2.0**10
# Shapes of a tiny transformer block; every dimension divisible by 8.
# "attn/q" and "attn/out" share a shape but not a sharding: a finiteness check
# that added them up would make XLA move one of them across devices.
SHAPES = {"attn/qkv": (32, 96), "attn/q": (32, 32), "attn/out": (32, 32), "mlp/up": (32, 128),
          "mlp/down": (128, 32), "mlp/bias": (128,)}


def make_tx(axis_name=None):
    return jmp_policy.loss_scaling(
        optax.adam(1e-2),
        jmp_policy.DynamicLossScale(jnp.float32(INITIAL_SCALE)),
        axis_name=axis_name,
    )


def host_params():
    rng = np.random.default_rng(0)
    return {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}


def host_grads(step):
    rng = np.random.default_rng(100 + step)
    # Gradients of the scaled loss, as `update` receives them.
    return {k: (INITIAL_SCALE * rng.normal(size=s)).astype(np.float32)
            for k, s in SHAPES.items()}


def to_numpy(tree):
    return jax.tree.map(lambda x: np.asarray(x).tolist(), tree)


def state_summary(state):
    """The loss-scaling fields of a LossScalingState, as plain Python values."""
    return {
        "loss_scale": float(jmp_policy.get_loss_scale(state).loss_scale),
        "grads_finite": bool(state.grads_finite),
        "skipped_steps": int(state.skipped_steps),
    }


def hlo_collectives(hlo_text):
    """(op, largest result element count) of every collective in optimized HLO text.

    A result may be a tuple (XLA combines collectives); its largest member counts.
    """
    found = []
    ops = "all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter"
    pattern = re.compile(rf"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s({ops})(?:-start)?\(", re.M)
    for m in pattern.finditer(hlo_text):
        sizes = [int(np.prod([int(d) for d in dims.split(",") if d]))
                 for dims in re.findall(r"[a-z0-9]+\[([0-9,]*)\]", m.group(1))]
        found.append((m.group(2), max(sizes, default=1)))
    return found


_SPECS = {"attn/qkv": P(None, "model"), "attn/q": P(None, "model"), "attn/out": P("model", None),
          "mlp/up": P("data", "model"), "mlp/down": P("model", "data"), "mlp/bias": P("model")}


def scenario_mesh():
    """jit on an 8-device mesh, params/grads/optimizer state sharded (FSDP-like)."""
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    shardings = {k: NamedSharding(mesh, s) for k, s in _SPECS.items()}
    # jax.make_mesh gives explicit-sharding axes, used as jax recommends: inside set_mesh.
    with jax.set_mesh(mesh):
        return _mesh_steps(mesh, shardings)


def scenario_mesh_auto():
    """The same with automatic axes and no mesh context: XLA picks the shardings."""
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    return _mesh_steps(mesh, {k: NamedSharding(mesh, s) for k, s in _SPECS.items()})


def _mesh_steps(mesh, shardings):
    params = jax.device_put(host_params(), shardings)
    tx = make_tx()
    # Eager: zeros_like keeps each parameter's sharding (jit would let XLA choose).
    opt_state = tx.init(params)
    # Scalars (step counts, the loss scale) replicated on the mesh, not left on one device.
    opt_state = jax.tree.map(
        lambda x: x if len(x.sharding.device_set) > 1 else jax.device_put(x, NamedSharding(mesh, P())),
        opt_state)
    # Flat, so that no pytree node is rebuilt around sharding objects.
    state_shardings = [x.sharding for x in jax.tree.leaves(opt_state)]

    def train_step(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    step = jax.jit(
        train_step,
        # The optimizer state keeps the shardings `init` gave it (committed arrays).
        in_shardings=(shardings, None, shardings),
        # With automatic axes XLA would pick the outputs' layout: keep the inputs'.
        out_shardings=(shardings, jax.tree.map(lambda x: x.sharding, opt_state)),
        donate_argnums=(0, 1),
    )
    compiled = step.lower(params, opt_state, params).compile()
    hlo = compiled.as_text()

    # The parser must see a gather when one is there, or "no gather" proves nothing.
    gather_all = jax.jit(lambda x: x, out_shardings=NamedSharding(mesh, P()))
    control = hlo_collectives(
        gather_all.lower(params["attn/qkv"]).compile().as_text())

    facts = {"collectives": hlo_collectives(hlo), "control_collectives": control,
             "param_sizes": [int(np.prod(s)) for s in SHAPES.values()], "steps": []}
    facts["mu_sharding_matches_params"] = all(
        opt_state.inner_state[0].mu[k].sharding.is_equivalent_to(shardings[k], len(SHAPES[k]))
        for k in SHAPES)

    def shardings_kept(expected, tree):
        want, got = jax.tree.leaves(expected), jax.tree.leaves(tree)
        return len(want) == len(got) and all(
            s.is_equivalent_to(x.sharding, x.ndim) for s, x in zip(want, got))

    for step_index in range(3):
        grads = host_grads(step_index)
        if step_index == 1:
            # One element that lives on exactly one device of the mesh.
            grads["mlp/up"][20, 100] = np.nan
            owner = [d.id for d, idx in shardings["mlp/up"].devices_indices_map(
                SHAPES["mlp/up"]).items() if idx[0].start <= 20 < idx[0].stop
                and idx[1].start <= 100 < idx[1].stop]
            facts["nan_owner_devices"] = owner
        grads = jax.device_put(grads, shardings)
        params_before = to_numpy(params)
        inner_before = to_numpy(opt_state.inner_state)
        params, opt_state = step(params, opt_state, grads)
        facts["steps"].append({
            **state_summary(opt_state),
            "params_unchanged": to_numpy(params) == params_before,
            "inner_state_unchanged": to_numpy(opt_state.inner_state) == inner_before,
            "all_params_finite": bool(all(np.isfinite(np.asarray(x)).all()
                                          for x in jax.tree.leaves(params))),
            "param_shardings_kept": shardings_kept(shardings, params),
            "state_shardings_kept": shardings_kept(state_shardings, opt_state),
        })
    facts["compiled_output_shardings_kept"] = all(
        a.is_equivalent_to(b, n) for a, b, n in zip(
            jax.tree.leaves(compiled.output_shardings),
            jax.tree.leaves((shardings, state_shardings)),
            [x.ndim for x in jax.tree.leaves((params, opt_state))]))
    return facts


def scenario_shard_map():
    """ZeRO/FSDP-style shard_map: each device holds and updates one slice of the
    params, grads and Adam moments; finiteness is agreed over `axis_name`."""
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    n = mesh.size
    params = {k: jnp.asarray(v) for k, v in host_params().items()}
    facts = {"num_devices": n}
    for axis_name in ("d", None):
        tx = make_tx(axis_name=axis_name)
        opt_state = tx.init(params)
        # Arrays are sliced along their leading axis; scalars (Adam's count,
        # the loss scale, the counters) are replicated.
        spec = lambda x: P("d") if x.ndim else P()
        state_specs = jax.tree.map(spec, opt_state)

        def local_step(params, opt_state, grads):
            updates, opt_state = tx.update(grads, opt_state, params)
            # Every device's own copy of each scalar comes back (leading axis of 1),
            # so that their agreement is observed rather than assumed.
            per_device = jax.tree.map(lambda x: x if x.ndim else x[None], opt_state)
            return optax.apply_updates(params, updates), per_device

        # check_vma stays at its default (True): the types must hold up too.
        step = jax.jit(jax.shard_map(
            local_step, mesh=mesh,
            in_specs=(P("d"), state_specs, P("d")), out_specs=(P("d"), P("d"))))
        grads = host_grads(0)
        grads["mlp/down"][5 * (128 // n), 0] = np.inf  # a row owned by device 5 only
        new_params, per_device = step(params, opt_state, grads)
        changed = [
            any(bool((np.asarray(new_params[k]).reshape(n, -1)
                      != np.asarray(params[k]).reshape(n, -1))[i].any()) for k in SHAPES)
            for i in range(n)]
        mu_changed = [
            any(bool(np.asarray(per_device.inner_state[0].mu[k]).reshape(n, -1)[i].any())
                for k in SHAPES)
            for i in range(n)]
        facts[str(axis_name)] = {
            "scales_per_device": np.asarray(
                jmp_policy.get_loss_scale(per_device).loss_scale).tolist(),
            "skipped_per_device": np.asarray(per_device.skipped_steps).tolist(),
            "finite_per_device": np.asarray(per_device.grads_finite).tolist(),
            "device_updated_params": changed,
            "device_updated_moments": mu_changed,
            "all_params_finite": bool(all(np.isfinite(np.asarray(x)).all()
                                          for x in jax.tree.leaves(new_params))),
        }
    return facts


def scenario_multiprocess():
    """2 processes x 4 CPU devices, one global mesh; NaN only in process 1's local data."""
    mesh = jax.make_mesh((8,), ("d",))
    specs = {k: (P() if k == "mlp/bias" else P("d")) for k in SHAPES}
    shardings = {k: NamedSharding(mesh, s) for k, s in specs.items()}
    with jax.set_mesh(mesh):
        facts = _multiprocess_steps(specs, shardings)
    jax.distributed.shutdown()
    return facts


def _multiprocess_steps(specs, shardings):
    from jax.experimental import multihost_utils

    def global_array(k, full):
        # Each process supplies only the rows of its own devices.
        rows = full.shape[0] // 2
        local = full if specs[k] == P() else full[PROCESS_ID * rows:(PROCESS_ID + 1) * rows]
        return jax.make_array_from_process_local_data(shardings[k], local, full.shape)

    params = {k: global_array(k, v) for k, v in host_params().items()}
    tx = make_tx()
    opt_state = jax.jit(tx.init)(params)
    step = jax.jit(
        lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(*tx.update(g, s, p)),
        donate_argnums=(0, 1))

    facts = {"process_id": PROCESS_ID, "process_count": jax.process_count(),
             "device_count": jax.device_count(), "steps": []}
    for step_index in range(3):
        grads = host_grads(step_index)
        if step_index == 1:
            # Row 70 of 128 lies in process 1's half only; process 0's data stays finite.
            grads["mlp/down"][70, 3] = np.nan
        local_grads_finite = bool(all(
            np.isfinite(x if specs[k] == P() else
                        x[PROCESS_ID * (x.shape[0] // 2):(PROCESS_ID + 1) * (x.shape[0] // 2)]).all()
            for k, x in grads.items()))
        grads = {k: global_array(k, v) for k, v in grads.items()}
        params, opt_state = step(params, opt_state, grads)
        full_params = multihost_utils.process_allgather(params, tiled=True)
        full_mu = multihost_utils.process_allgather(opt_state.inner_state[0].mu, tiled=True)
        facts["steps"].append({
            **state_summary(opt_state),
            "local_grads_finite": local_grads_finite,
            "params": to_numpy(full_params),
            "mu": to_numpy(full_mu),
            "counter": int(jmp_policy.get_loss_scale(opt_state).counter),
        })
    return facts


if __name__ == "__main__":
    result = {"mesh": scenario_mesh, "mesh_auto": scenario_mesh_auto, "shard_map": scenario_shard_map,
              "multiprocess": scenario_multiprocess}[SCENARIO]()
    with open(OUT, "w") as f:
        json.dump(result, f)
