"""`python masstest.py ...` from the repository root: the stress run of the README.

The code is `benchmarks/masstest.py` (also `python -m benchmarks.masstest`); this file only
starts it.
"""

from benchmarks.masstest import main

if __name__ == "__main__":
    raise SystemExit(main())
