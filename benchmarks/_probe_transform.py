"""Probe: loss_scaling(adam) vs plain adam, optimizer-only step (temporary helper script).

Prints XLA bytes accessed, HLO instruction count, compile time and wall time,
with params + optimizer state donated and not donated.

    XLA_FLAGS=--xla_cpu_use_thunk_runtime=true python benchmarks/_probe_transform.py [--rounds N]
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import optax

import jmp_policy


def make_params(d=320, layers=6, vocab=1000):
    """~7.7M float32 params in ~100 leaves of transformer-like shapes."""
    params = {"embed": jnp.zeros((vocab, d))}
    for i in range(layers):
        layer = {}
        for n in ("q", "k", "v", "o"):
            layer[f"w{n}"] = jnp.zeros((d, d))
            layer[f"b{n}"] = jnp.zeros((d,))
        layer["w_up"], layer["b_up"] = jnp.zeros((d, 4 * d)), jnp.zeros((4 * d,))
        layer["w_down"], layer["b_down"] = jnp.zeros((4 * d, d)), jnp.zeros((d,))
        for n in ("ln1", "ln2"):
            layer[f"{n}_scale"], layer[f"{n}_bias"] = jnp.ones((d,)), jnp.zeros((d,))
        params[f"layer_{i}"] = layer
    params["final_ln"] = jnp.ones((d,))
    return params


def step_fn(tx):
    def step(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state
    return step


def count_instructions(hlo_text):
    return sum(1 for line in hlo_text.splitlines() if " = " in line and not line.lstrip().startswith(("HloModule", "//")))


def probe(name, tx, params, grads, donate, rounds):
    state = tx.init(params)
    compile_times = []
    for _ in range(3):  # min of 3 fresh compiles: the machine is shared
        jitted = jax.jit(step_fn(tx), donate_argnums=(0, 1) if donate else ())
        lowered = jitted.lower(params, state, grads)
        t0 = time.process_time()  # CPU seconds: less sensitive to other load than wall time
        compiled = lowered.compile()
        compile_times.append(time.process_time() - t0)
    compile_s = min(compile_times)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    n_instr = count_instructions(compiled.as_text())
    return dict(name=name, compiled=compiled, params=params, state=state, bytes=cost["bytes accessed"],
                instr=n_instr, compile_s=compile_s, times=[])


def run_once(entry, grads, donate):
    p, s = entry["params"], entry["state"]
    if donate:
        p, s = jax.tree_util.tree_map(jnp.copy, (p, s))
    t0 = time.perf_counter()
    p2, s2 = entry["compiled"](p, s, grads)
    jax.block_until_ready((p2, s2))
    entry["times"].append(time.perf_counter() - t0)
    if donate:  # feed outputs back, as a train loop does
        entry["params"], entry["state"] = p2, s2


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    params = make_params()
    leaves = jax.tree_util.tree_leaves(params)
    print(f"{sum(x.size for x in leaves) / 1e6:.2f}M params in {len(leaves)} leaves, "
          f"backend {jax.default_backend()}")
    grads = jax.tree_util.tree_map(lambda x: jnp.full_like(x, 1e-3), params)
    for donate in (True, False):
        entries = [
            probe("adam", optax.adam(1e-3), params, grads, donate, args.rounds),
            probe("loss_scaling(adam)", jmp_policy.loss_scaling(optax.adam(1e-3)), params, grads,
                  donate, args.rounds),
        ]
        for e in entries:  # warm-up
            run_once(e, grads, donate)
            e["times"].clear()
        for _ in range(args.rounds):  # interleaved rounds
            for e in entries:
                run_once(e, grads, donate)
        base = entries[0]
        print(f"\n== donated={donate} ==")
        print(f"{'':22s} {'bytes':>12s} {'HLO instr':>10s} {'compile cpu s':>13s} {'wall ms':>9s}")
        for e in entries:
            wall = statistics.median(e["times"]) * 1e3
            print(f"{e['name']:22s} {e['bytes']:12.4g} {e['instr']:10d} {e['compile_s']:13.3f} {wall:9.2f}")
        e = entries[1]
        print(f"{'ratio':22s} {e['bytes'] / base['bytes']:12.3f} {e['instr'] / base['instr']:10.3f} "
              f"{e['compile_s'] / base['compile_s']:13.3f} "
              f"{statistics.median(e['times']) / statistics.median(base['times']):9.3f}")


if __name__ == "__main__":
    main()
