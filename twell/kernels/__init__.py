"""twell's CUDA kernels, one launcher module beside each source (CuPy ``RawModule``,
NVRTC, sm_90a). The map (docs/design.md has the data flow):

- ``compile``: the one compile path (``common.cuh`` + parameters + source; declared
  parameters per source; the CPU-side NVRTC build).
- ``common.cuh``: device code every source shares (types, bf16 helpers, routing rule,
  cluster, mbarrier and TMA helpers).
- ``tensor_core.cuh``: the tensor-core tile engine (cp.async, ldmatrix, mma fragments)
  that ``heavy_rows.cu`` and ``backward_heavy.cu`` share.
- ``buffers``: the one allocation function (CuPy's pool or torch's allocator), bf16 views.
- ``convert`` / ``convert.cu``: dtype conversions and the bf16 transpose.
- ``cublas``: the dense GEMM ``x @ w.T`` from cuBLAS.
- ``gate_gemm`` / ``gate_gemm.cu``: the wgmma gate GEMM with relu + TwELL packing in its
  epilogue.
- ``pack`` / ``pack.cu``: relu + TwELL packing of a dense pre-activation.
- ``light_rows`` / ``light_rows.cu``: the light rows' gathered up/down projections.
- ``light_rows_sliced`` / ``light_rows_sliced.cu``: the same from TwELL by 256-column
  slices of the weights (the "sliced" route: weights far larger than L2).
- ``light_rows_decode`` / ``light_rows_decode.cu``: the same from the pre-activation for
  few tokens (decode; ``light_rows.from_pre`` picks it), weight rows split over a
  thread-block cluster.
- ``decode_units`` / ``decode_units_{gate,down,scan}.cu``: the whole block for at most
  ``MAX_ROWS`` tokens (per GPU: 192 on an H100, 64 on an H200), divided among the SMs by
  hidden unit (``PreparedBlock`` takes it for decode calls).
- ``heavy_rows`` / ``heavy_rows.cu``: heavy rows: compaction, tensor-core dense math,
  moves to and from fixed-size cuBLAS GEMMs.
- ``pipeline``: the prepared block's forward pass (routes, then heavy rows).
- ``hybrid_ops``: ``gate``, ``down``, ``gated_down``, ``ffn`` on CuPy arrays.
- ``validate`` / ``validate.cu``: a user-built TwELL's contents checked in one pass.
- ``activations``: what a forward pass keeps for the backward (``Activations``,
  ``row_capacity``).
- ``backward`` / ``backward_light.cu``, ``backward_lists.cu``, ``backward_grads.cu``,
  ``backward_heavy.cu``, ``backward_transpose.cu``: the backward pass, one source per step
  (light rows, unit lists, the light pairs' weight gradients, heavy rows, dW_down's layout).
"""

from twell.kernels import backward, validate  # noqa: F401 - declare their sources
from twell.kernels.hybrid_ops import down, ffn, gate, gated_down
from twell.kernels.pipeline import ROUTES, PreparedBlock

__all__ = ["ROUTES", "PreparedBlock", "down", "ffn", "gate", "gated_down"]
