"""`python run.py ...` from the repository root: the engine benchmark of the README.

The code is `benchmarks/run.py` (also `python -m benchmarks.run`); this file only starts it.
"""

from benchmarks.run import main

if __name__ == "__main__":
    raise SystemExit(main())
