// cuda_emu.h — run twell's CUDA C kernels on the CPU, for testing without a GPU.
//
// Not a general CUDA emulator: just what reuse.cu uses. Each CUDA thread of a block is a
// fiber (ucontext); blocks run one after another. Block barriers, warp collectives
// (shuffles, ballots, mma.sync m16n8k16 bf16 with the PTX fragment layout) and cp.async
// (copies happen at cp.async.wait_group, so a read before the wait sees stale data) are
// emulated faithfully enough to catch indexing, synchronisation and layout mistakes.
// Not modelled: bank conflicts, timing, memory-model races between threads of different
// blocks, flush-to-zero. Collectives must be called by all 32 lanes (full mask).
#pragma once
#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

typedef unsigned char uint8_t_;
struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct alignas(8) uint2 {
  unsigned x, y;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(8) float2 {
  float x, y;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }

namespace emu {

struct Copy {
  void* dst;
  const void* src;
  int bytes;
  int src_bytes;
};

struct Fiber {
  ucontext_t ctx;
  dim3 tid;
  int linear = 0;
  bool done = false;
  const long* wait_ptr = nullptr;  // blocked until *wait_ptr != wait_gen
  long wait_gen = 0;
  std::vector<std::vector<Copy>> groups;
  std::vector<Copy> open;
};

struct WarpState {
  int arrived = 0;
  long gen = 0;
  uint64_t in[32][12];
};

struct State {
  dim3 block_idx, block_dim, grid_dim;
  ucontext_t sched;
  Fiber* cur = nullptr;
  std::vector<Fiber> fibers;
  std::vector<WarpState> warps;
  int live = 0;
  int block_arrived = 0;
  long block_gen = 0;
  unsigned char* dyn_smem = nullptr;
  std::vector<unsigned char> dyn_smem_buf;
  std::vector<char> stacks;
  size_t stack_size = 256 * 1024;
  int errors = 0;
  char error_text[512] = {0};
};
inline State S;

inline void fail(const char* what) {
  if (!S.errors) snprintf(S.error_text, sizeof S.error_text, "%s", what);
  S.errors++;
}

inline void yield_until_changed(const long* ptr, long gen) {
  S.cur->wait_ptr = ptr;
  S.cur->wait_gen = gen;
  while (*ptr == gen) swapcontext(&S.cur->ctx, &S.sched);
  S.cur->wait_ptr = nullptr;
}

inline void syncthreads() {
  const long g = S.block_gen;
  if (++S.block_arrived >= S.live) {
    S.block_arrived = 0;
    S.block_gen++;
    return;
  }
  yield_until_changed(&S.block_gen, g);
}

inline int lane_id() { return S.cur->linear & 31; }
inline WarpState& warp_state() { return S.warps[S.cur->linear >> 5]; }

inline void warp_barrier(unsigned mask) {
  if (mask != 0xffffffffu) fail("warp collective with a partial mask");
  WarpState& w = warp_state();
  const long g = w.gen;
  if (++w.arrived == 32) {
    w.arrived = 0;
    w.gen++;
    return;
  }
  yield_until_changed(&w.gen, g);
}

template <class T>
inline T exchange(unsigned mask, T v, int src) {
  WarpState& w = warp_state();
  static_assert(sizeof(T) <= 8, "exchange of a wide type");
  uint64_t bits = 0;
  memcpy(&bits, &v, sizeof(T));
  w.in[lane_id()][0] = bits;
  warp_barrier(mask);
  const uint64_t got = w.in[src & 31][0];
  warp_barrier(mask);
  T r;
  memcpy(&r, &got, sizeof(T));
  return r;
}

inline unsigned ballot(unsigned mask, bool p) {
  WarpState& w = warp_state();
  w.in[lane_id()][0] = p ? 1 : 0;
  warp_barrier(mask);
  unsigned r = 0;
  for (int l = 0; l < 32; ++l) r |= (unsigned)(w.in[l][0] & 1) << l;
  warp_barrier(mask);
  return r;
}

inline unsigned reduce_add(unsigned mask, unsigned v) {
  WarpState& w = warp_state();
  w.in[lane_id()][0] = v;
  warp_barrier(mask);
  unsigned r = 0;
  for (int l = 0; l < 32; ++l) r += (unsigned)w.in[l][0];
  warp_barrier(mask);
  return r;
}

// fp32 -> bf16 bits, round to nearest even; NaN -> 0x7fff (as cuda_bf16.hpp does).
inline uint32_t float_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;
  u += 0x7fffu + ((u >> 16) & 1u);
  return u >> 16;
}
inline uint32_t pack_bf16x2(float lo, float hi) { return float_to_bf16(lo) | (float_to_bf16(hi) << 16); }

inline float bf16_lo(uint32_t w) {
  uint32_t b = w << 16;
  float f;
  memcpy(&f, &b, 4);
  return f;
}
inline float bf16_hi(uint32_t w) {
  uint32_t b = w & 0xffff0000u;
  float f;
  memcpy(&f, &b, 4);
  return f;
}

// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32, fragments as in the PTX ISA:
// g = lane / 4, t = lane % 4;
// A: a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..)
// B: b0 = (k = 2t..2t+1, n = g), b1 = (k = 2t+8..2t+9, n = g)
// C/D: c0 = (g, 2t), c1 = (g, 2t+1), c2 = (g+8, 2t), c3 = (g+8, 2t+1)
inline void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                     uint32_t b0, uint32_t b1) {
  WarpState& w = warp_state();
  const int lane = lane_id();
  uint64_t* in = w.in[lane];
  in[0] = a0, in[1] = a1, in[2] = a2, in[3] = a3, in[4] = b0, in[5] = b1;
  warp_barrier(0xffffffffu);
  float A[16][16], B[16][8];
  for (int l = 0; l < 32; ++l) {
    const int gl = l >> 2, tl = l & 3;
    const uint64_t* v = w.in[l];
    A[gl][2 * tl] = bf16_lo((uint32_t)v[0]), A[gl][2 * tl + 1] = bf16_hi((uint32_t)v[0]);
    A[gl + 8][2 * tl] = bf16_lo((uint32_t)v[1]), A[gl + 8][2 * tl + 1] = bf16_hi((uint32_t)v[1]);
    A[gl][2 * tl + 8] = bf16_lo((uint32_t)v[2]), A[gl][2 * tl + 9] = bf16_hi((uint32_t)v[2]);
    A[gl + 8][2 * tl + 8] = bf16_lo((uint32_t)v[3]),
                      A[gl + 8][2 * tl + 9] = bf16_hi((uint32_t)v[3]);
    B[2 * tl][gl] = bf16_lo((uint32_t)v[4]), B[2 * tl + 1][gl] = bf16_hi((uint32_t)v[4]);
    B[2 * tl + 8][gl] = bf16_lo((uint32_t)v[5]), B[2 * tl + 9][gl] = bf16_hi((uint32_t)v[5]);
  }
  const int g = lane >> 2, t = lane & 3;
  const int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
  for (int i = 0; i < 4; ++i) {
    double s = 0.0;  // exact products, one rounding: the hardware's order is unspecified
    for (int k = 0; k < 16; ++k) s += (double)A[rows[i]][k] * (double)B[k][cols[i]];
    d[i] = (float)((double)d[i] + s);
  }
  warp_barrier(0xffffffffu);
}

inline void cp_async(void* dst, const void* src, int bytes, int src_bytes) {
  S.cur->open.push_back({dst, src, bytes, src_bytes});
}
inline void cp_commit() {
  S.cur->groups.push_back(std::move(S.cur->open));
  S.cur->open.clear();
}
inline void cp_wait(int n) {
  auto& q = S.cur->groups;
  while ((int)q.size() > n) {
    for (const Copy& c : q.front()) {
      memset(c.dst, 0, c.bytes);
      if (c.src_bytes) memcpy(c.dst, c.src, c.src_bytes);
    }
    q.erase(q.begin());
  }
}

using Entry = void (*)(void**);
inline Entry g_entry;
inline void** g_args;

inline void fiber_main() {
  g_entry(g_args);
  Fiber* f = S.cur;
  if (!f->open.empty() || !f->groups.empty()) fail("thread exited with cp.async pending");
  f->done = true;
  S.live--;
  if (S.block_arrived > 0 && S.block_arrived >= S.live) {  // exited threads count as arrived
    S.block_arrived = 0;
    S.block_gen++;
  }
  swapcontext(&f->ctx, &S.sched);
}

// Runs `entry(args)` for every thread of the grid; returns the number of errors seen.
inline int launch(Entry entry, void** args, dim3 grid, dim3 block, unsigned smem) {
  g_entry = entry;
  g_args = args;
  const int n = (int)(block.x * block.y * block.z);
  if (n % 32) {
    fail("block size not a multiple of 32");
    return S.errors;
  }
  S.block_dim = block;
  S.grid_dim = grid;
  S.fibers.assign(n, Fiber());
  S.warps.assign(n / 32, WarpState());
  if (S.stacks.size() < (size_t)n * S.stack_size) S.stacks.resize((size_t)n * S.stack_size);
  S.dyn_smem_buf.assign(smem + 64, 0);
  S.dyn_smem = S.dyn_smem_buf.data() + ((16 - ((uintptr_t)S.dyn_smem_buf.data() & 15)) & 15);
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        S.block_idx = {bx, by, bz};
        memset(S.dyn_smem, 0xCD, smem);  // garbage: a read before a write shows up
        S.live = n;
        S.block_arrived = 0;
        for (auto& w : S.warps) w = WarpState();
        for (int i = 0; i < n; ++i) {
          Fiber& f = S.fibers[i];
          f = Fiber();
          f.linear = i;
          f.tid = {(unsigned)(i % block.x), (unsigned)((i / block.x) % block.y),
                   (unsigned)(i / (block.x * block.y))};
          getcontext(&f.ctx);
          f.ctx.uc_stack.ss_sp = S.stacks.data() + (size_t)i * S.stack_size;
          f.ctx.uc_stack.ss_size = S.stack_size;
          f.ctx.uc_link = nullptr;
          makecontext(&f.ctx, fiber_main, 0);
        }
        int left = n;
        while (left > 0) {
          bool progressed = false;
          for (int i = 0; i < n; ++i) {
            Fiber& f = S.fibers[i];
            if (f.done) continue;
            if (f.wait_ptr && *f.wait_ptr == f.wait_gen) continue;
            S.cur = &f;
            swapcontext(&S.sched, &f.ctx);
            progressed = true;
            if (f.done) left--;
          }
          if (!progressed) {
            fail("deadlock: every live thread waits at a barrier");
            return S.errors;
          }
        }
        if (S.errors) return S.errors;
      }
  return S.errors;
}

template <typename... A, size_t... I>
void call_with(void (*f)(A...), void** args, std::index_sequence<I...>) {
  f(*reinterpret_cast<std::remove_reference_t<A>*>(args[I])...);
}

}  // namespace emu

// ------------------------------------------------------------------ CUDA spellings
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#define __shared__ static  // blocks run one at a time
#define threadIdx (emu::S.cur->tid)
#define blockIdx (emu::S.block_idx)
#define blockDim (emu::S.block_dim)
#define gridDim (emu::S.grid_dim)

inline void __syncthreads() { emu::syncthreads(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { emu::warp_barrier(mask); }
template <class T>
inline T __shfl_sync(unsigned m, T v, int src) {
  return emu::exchange(m, v, src);
}
template <class T>
inline T __shfl_xor_sync(unsigned m, T v, int x) {
  return emu::exchange(m, v, emu::lane_id() ^ x);
}
template <class T>
inline T __shfl_up_sync(unsigned m, T v, unsigned d) {
  const int l = emu::lane_id();
  T r = emu::exchange(m, v, l >= (int)d ? l - (int)d : l);
  return r;
}
template <class T>
inline T __shfl_down_sync(unsigned m, T v, unsigned d) {
  const int l = emu::lane_id();
  return emu::exchange(m, v, l + (int)d < 32 ? l + (int)d : l);
}
inline unsigned __ballot_sync(unsigned m, int p) { return emu::ballot(m, p != 0); }
inline int __any_sync(unsigned m, int p) { return emu::ballot(m, p != 0) != 0; }
inline int __all_sync(unsigned m, int p) { return emu::ballot(m, p != 0) == 0xffffffffu; }
inline unsigned __reduce_add_sync(unsigned m, unsigned v) { return emu::reduce_add(m, v); }
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __ffs(int v) { return __builtin_ffs(v); }
inline int __clz(int v) { return v ? __builtin_clz((unsigned)v) : 32; }
inline float __uint_as_float(unsigned v) {
  float f;
  memcpy(&f, &v, 4);
  return f;
}
inline unsigned __float_as_uint(float f) {
  unsigned v;
  memcpy(&v, &f, 4);
  return v;
}
inline unsigned atomicOr(unsigned* p, unsigned v) {
  const unsigned old = *p;
  *p = old | v;
  return old;
}
template <class T>
inline T __ldg(const T* p) {
  return *p;
}
template <class T>
inline T __ldcs(const T* p) {
  return *p;
}
template <class T>
inline T __ldcg(const T* p) {
  return *p;
}
template <class T>
inline void __stcs(T* p, T v) {
  *p = v;
}
template <class T>
inline void __stcg(T* p, T v) {
  *p = v;
}
