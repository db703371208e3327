# The worker is a script run in subprocesses by test_distributed.py, not a test module:
# keep --doctest-modules (pyproject) from importing it.
collect_ignore = ["_distributed_worker.py"]
