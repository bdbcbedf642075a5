// tensor_core.cuh — the tensor-core tile engine, shared by the sources that compute dense
// tiles on tensor cores (heavy_rows.cu, backward_heavy.cu).
//
// twell/kernels/compile.py puts this header after common.cuh in front of each source that
// declares it (Source.headers), for the GPU build and the CPU-side NVRTC build alike.
//
// The tile: a CTA of 4 warps computes 64 x 64 fp32 outputs of C = A·Bᵀ with mma.sync
// m16n8k16 (bf16 in, fp32 accumulate: twell_mma_bf16 in common.cuh). The warps sit in a
// 2 x 2 layout (warp = 2 wm + wn) of 32 x 32 outputs each, 2 x 4 mma tiles per warp, so a
// thread holds float acc[2][4][4]: acc[mt][nt][2 half + e] is the output at
//   row    wm·32 + mt·16 + lane/4 + 8·half
//   column wn·32 + nt·8 + 2·(lane%4) + e
// of the tile. The reduction goes in slices of 32 through a ring of shared-memory stages
// that cp.async fills (16 bytes a copy; invalid copies zero-fill and read nothing).
//
// It holds:
// - cp.async (copy, commit, wait) and ldmatrix (x4, plain and transposed);
// - the accumulators: zeroing, the flat numbering of a thread's 32 values, and the loop
//   over a thread's pairs of adjacent values with their rows and columns (epilogues);
// - the ldmatrix engine (backward_heavy.cu): operands staged "K-major" (tile rows x
//   reduction: [64][40] bf16, the reduction contiguous in memory) or "R-major" (reduction
//   rows x tile columns: [32][72] bf16, the tile columns contiguous in memory; fragments
//   through ldmatrix.trans), a 3-stage ring, and the main loop. Pitches of 80 and 144
//   bytes keep the eight rows of every ldmatrix on distinct banks. heavy_rows.cu stages
//   its own ring (one k order per lane read without ldmatrix, relu on load, up to 5
//   stages sharing their bytes with the cluster's reduction).

// ---------------------------------------------------------------- the tile
#define TC_TILE 64   // outputs per side of a CTA's tile
#define TC_SLICE 32  // depth of a reduction slice

// ---------------------------------------------------------------- cp.async, ldmatrix
// 16 bytes from global to shared memory, asynchronously; with !valid the 16 bytes are
// zero-filled and nothing is read (gmem must still be a valid address).
TWELL_DEVICE void twell_cp_async16(void* smem, const void* gmem, bool valid) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem),
               "r"(valid ? 16 : 0)
               : "memory");
}
TWELL_DEVICE void twell_cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// Waits until at most N committed groups of this thread are still in flight.
template <int N>
TWELL_DEVICE void twell_cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
// Four 8 x 8 bf16 matrices from shared memory (lane l gives row l % 8 of matrix l / 8).
TWELL_DEVICE void twell_ldmatrix_x4(uint32_t (&r)[4], const uint16_t* p) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(p);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}
// The same, each matrix transposed.
TWELL_DEVICE void twell_ldmatrix_x4_trans(uint32_t (&r)[4], const uint16_t* p) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(p);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}

// ---------------------------------------------------------------- the accumulators
TWELL_DEVICE void twell_acc_zero(float (&acc)[2][4][4]) {
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.f;
}

// A thread's value number v (0 .. 31; v = (mt·4 + nt)·4 + 2 half + e): the order in which
// a split reduction lays the values out.
TWELL_DEVICE float twell_acc_value(const float (&acc)[2][4][4], int v) {
  return acc[v >> 4][(v >> 2) & 3][v & 3];
}

// body(row, col, mt, nt, half) for each pair of this thread's adjacent values
// acc[mt][nt][2 half], acc[mt][nt][2 half + 1] (columns col and col + 1) of the tile whose
// first row and column are row0 and col0, skipping the pairs at col >= cols or row >= rows.
template <class Body>
TWELL_DEVICE void twell_acc_pairs(int row0, int col0, int rows, int cols, Body body) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int wm = warp >> 1, wn = warp & 1, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      const int col = col0 + wn * 32 + nt * 8 + 2 * t;
      if (col >= cols) continue;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = row0 + wm * 32 + mt * 16 + g + 8 * half;
        if (row >= rows) continue;
        body(row, col, mt, nt, half);
      }
    }
}

// ---------------------------------------------------------------- the ldmatrix engine
#define TC_STAGES 3
#define TC_KPITCH 40
#define TC_RPITCH 72
#define TC_STAGE_BF16 2560  // bf16 per operand and stage (>= 64·40 and 32·72)

struct __align__(16) TwellTcRing {
  uint16_t a[TC_STAGES][TC_STAGE_BF16];
  uint16_t b[TC_STAGES][TC_STAGE_BF16];
};

// K-major operand: the 64 tile rows are fixed for a tile (row pointer, or null: zeros).
struct TwellStageK {
  const uint16_t* p[2];
  const uint16_t* fallback;
  int rr[2], kc[2];
  int red;
  __device__ __forceinline__ void stage(int s, uint16_t* buf) const {
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const int k = s * TC_SLICE + kc[q] * 8;
      const bool ok = p[q] != nullptr && k < red;
      twell_cp_async16(buf + rr[q] * TC_KPITCH + kc[q] * 8, ok ? p[q] + k : fallback, ok);
    }
  }
};

// The K-major operand of the tile rows row0 .. row0 + 63 (row_ptr(i): row i's pointer or
// null), `red` deep; `fallback`: any valid address (read by no copy).
template <class Fn>
TWELL_DEVICE TwellStageK twell_stage_k(Fn row_ptr, int row0, int red, const uint16_t* fallback) {
  TwellStageK st;
  st.fallback = fallback;
  st.red = red;
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    const int c = threadIdx.x + 128 * q;
    st.rr[q] = c >> 2;
    st.kc[q] = c & 3;
    st.p[q] = row_ptr(row0 + st.rr[q]);
  }
  return st;
}

// R-major operand: the reduction row's pointer comes from `row_ptr(r)` (null: zeros),
// columns col0 .. col0 + 63 of it (those >= width are zeros).
template <class Fn>
struct TwellStageR {
  Fn row_ptr;
  const uint16_t* fallback;
  int col0, width;
  __device__ __forceinline__ void stage(int s, uint16_t* buf) const {
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const int c = threadIdx.x + 128 * q;
      const int rr = c >> 3, mc = c & 7;
      const uint16_t* p = row_ptr(s * TC_SLICE + rr);
      const int col = col0 + mc * 8;
      const bool ok = p != nullptr && col < width;
      twell_cp_async16(buf + rr * TC_RPITCH + mc * 8, ok ? p + col : fallback, ok);
    }
  }
};

template <class Fn>
TWELL_DEVICE TwellStageR<Fn> twell_stage_r(Fn row_ptr, int col0, int width,
                                           const uint16_t* fallback) {
  TwellStageR<Fn> st{row_ptr, fallback, col0, width};
  return st;
}

// Fragments of warp (wm, wn) for the k16 step ks of a staged slice: A's mma tile mt,
// B's pair of mma tiles np (2 np and 2 np + 1).
template <bool RMAJOR>
TWELL_DEVICE void twell_frag_a(const uint16_t* buf, int ks, int mt, int wm, int lane,
                               uint32_t (&r)[4]) {
  if (RMAJOR) {
    const int k = ks * 16 + (lane & 7) + ((lane >> 4) << 3);
    const int m = wm * 32 + mt * 16 + ((lane >> 3) & 1) * 8;
    twell_ldmatrix_x4_trans(r, buf + k * TC_RPITCH + m);
  } else {
    const int m = wm * 32 + mt * 16 + (lane & 15);
    const int k = ks * 16 + (lane >> 4) * 8;
    twell_ldmatrix_x4(r, buf + m * TC_KPITCH + k);
  }
}
template <bool RMAJOR>
TWELL_DEVICE void twell_frag_b(const uint16_t* buf, int ks, int np, int wn, int lane,
                               uint32_t (&r)[4]) {
  if (RMAJOR) {
    const int k = ks * 16 + (lane & 7) + (((lane >> 3) & 1) << 3);
    const int n = wn * 32 + np * 16 + (lane >> 4) * 8;
    twell_ldmatrix_x4_trans(r, buf + k * TC_RPITCH + n);
  } else {
    const int n = wn * 32 + np * 16 + (lane & 7) + ((lane >> 4) << 3);
    const int k = ks * 16 + ((lane >> 3) & 1) * 8;
    twell_ldmatrix_x4(r, buf + n * TC_KPITCH + k);
  }
}

// acc += A·Bᵀ over the slices s0 .. s0 + ns - 1 (each TC_SLICE deep): A the tile rows
// (la: a TwellStageK or TwellStageR, R-major when A_R), B the tile columns (lb, B_R).
// Starts with a CTA barrier (every earlier read of the ring is done); ends with this
// thread's copies complete (no barrier).
template <bool A_R, bool B_R, class LA, class LB>
TWELL_DEVICE void twell_tc_mainloop(float (&acc)[2][4][4], const LA& la, const LB& lb, int s0,
                                    int ns, TwellTcRing& sm) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int wm = warp >> 1, wn = warp & 1;
  __syncthreads();
  if (ns > 0) {
    la.stage(s0, sm.a[0]);
    lb.stage(s0, sm.b[0]);
  }
  twell_cp_async_commit();
  if (ns > 1) {
    la.stage(s0 + 1, sm.a[1]);
    lb.stage(s0 + 1, sm.b[1]);
  }
  twell_cp_async_commit();
#pragma unroll 1
  for (int s = 0; s < ns; ++s) {
    twell_cp_async_wait<1>();
    __syncthreads();
    if (s + 2 < ns) {
      la.stage(s0 + s + 2, sm.a[(s + 2) % TC_STAGES]);
      lb.stage(s0 + s + 2, sm.b[(s + 2) % TC_STAGES]);
    }
    twell_cp_async_commit();
    const uint16_t* A = sm.a[s % TC_STAGES];
    const uint16_t* B = sm.b[s % TC_STAGES];
#pragma unroll
    for (int ks = 0; ks < 2; ++ks) {
      uint32_t af[2][4], bf[2][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) twell_frag_a<A_R>(A, ks, mt, wm, lane, af[mt]);
#pragma unroll
      for (int np = 0; np < 2; ++np) twell_frag_b<B_R>(B, ks, np, wn, lane, bf[np]);
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
          twell_mma_bf16(acc[mt][nt], af[mt][0], af[mt][1], af[mt][2], af[mt][3],
                         bf[nt >> 1][(nt & 1) * 2], bf[nt >> 1][(nt & 1) * 2 + 1]);
    }
  }
  twell_cp_async_wait<0>();
}
