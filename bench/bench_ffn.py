"""The FFN benchmark of docs/benchmark.md from a checkout: ``python bench/bench_ffn.py --help``.

The protocol lives in :mod:`twell.benchmark` (also ``python -m twell bench``).
"""

import sys

from twell.benchmark import main

if __name__ == "__main__":
    sys.exit(main())
