"""The benchmarks: each script answers one question a user asks (benchmarks/README.md).

A package, so that the scripts and the tests share one `benchmarks.harness`: run a
script from the repository root as ``python -m benchmarks.<script> [--quick]``.
"""
