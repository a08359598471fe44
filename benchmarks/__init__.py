"""Benchmarks and stress runs, one module each, run from the repository root as
`python -m benchmarks.<name>` (`run.py` and `masstest.py` at the root start `benchmarks.run`
and `benchmarks.masstest`). Each compares against a reference measured in the same run."""
