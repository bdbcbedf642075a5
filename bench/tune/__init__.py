"""The probes that measure twell's thresholds on a GPU (twell/tuning/), run by
``python -m twell tune`` from a checkout's root (``PYTHONPATH=.``; a Hopper GPU, CuPy,
torch). One probe per threshold family, each timing the kernels both ways around its
threshold and checking every timed variant against float32 math first:

    decode_gates.py   decode_gates   decode_units.MMA_GATE_TOKENS, WGMMA_TOKENS
    decode_units.py   decode_scan    decode_units.SCAN_TOKENS, SCAN_WIDE_UNITS
                      decode_rows    decode_units.MAX_ROWS
    light_rows.py     light_rows     light_rows_decode.DECODE_ROWS_BELOW
    flag_rows.py      flag_rows      heavy_rows.FLAG_ROWS
    sliced.py         sliced         light_rows_sliced.WEIGHT_BYTES, MIN_ROWS
    row_limit.py      row_limit      options.ROW_LIMIT_PERCENT
    crossover.py      crossover      density.CROSSOVER
                      heavy_dense    density.HEAVY_DENSE

``run.py`` runs them in that order and writes the file; ``common.py`` holds the weight
sets, the checked timing and the rules that turn timings into a value.

    PYTHONPATH=. python -m twell tune                # all: about 4 minutes on an H200
    PYTHONPATH=. python -m twell tune --quick        # decode_gates, decode_rows, crossover
    PYTHONPATH=. python -m twell tune --only sliced --out /tmp/h200.json
"""
