"""The batch-size and density sweeps from a checkout (``twell/sweeps.py``, also
``python -m twell bench --sweep``): ``python bench/bench_serving.py --help``."""

import sys

from twell.sweeps import main

if __name__ == "__main__":
    sys.exit(main())
