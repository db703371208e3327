"""The test suite's helpers (no tests here): imported by the test modules as
``support.<module>``, the suite's folder ``tests/`` being on ``sys.path`` under pytest.

* `compiled_kernels`: the distinct kernels of a compiled optimizer step.
* `excess_precision`: XLA:GPU's removal of float round trips, emulated on XLA:CPU.
* `jaxpr_walk`: the equations of a jaxpr and of the jaxprs inside it; what JAX's
  derivative of ``tanh`` keeps.
* `real_models`: the real-model zoo (Flax linen and NNX, Equinox).
* `xla_gpu`: the deviceless XLA:GPU tier's tools (compile for an H100 without one).
* `sharded_hlo`: runs a script on 8 simulated CPU devices in a child interpreter,
  once per session; the collectives of optimized HLO.
* `distributed_worker`, `sharded_training_worker`: scripts that those child
  interpreters run, by path (not imported by the tests).
"""
