"""The batch-size and density sweeps from a checkout (``twell/sweeps.py``):
``PYTHONPATH=. python bench/bench_serving.py --out results.json --plot sweep.png``."""

import sys

from twell.sweeps import main

if __name__ == "__main__":
    sys.exit(main())
