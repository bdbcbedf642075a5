"""twell's CUDA kernels and their launchers (CuPy ``RawModule``, sm_90a).

- ``compile``: the one compile path (sources, parameters, cache, CPU-side NVRTC).
- ``ffn_gpu``: the GPU ops on CuPy arrays — :func:`gate`, :func:`down`,
  :func:`gated_down`, :func:`ffn` — and the prepared :class:`SparseFFN`.

Kernel sources, one per family: ``pack.cu`` (relu + TwELL packing, heavy rows),
``sparse_rows.cu`` (light rows: gathered up/down, from the pre-activation or from
TwELL), ``sparse_ffn.cu`` (version 1 of the same, the simple baseline), ``dense_rows.cu``
(heavy rows on tensor cores), ``convert.cu`` (transpose, dtype conversions).
"""

from twell.kernels.ffn_gpu import SparseFFN, down, ffn, gate, gated_down

__all__ = ["SparseFFN", "down", "ffn", "gate", "gated_down"]
