// validate.cu — the contents check of a TwELL buffer (and of a Hybrid's routing rule) in
// one pass over the packed words, for buffers a user handed in (docs/format.md,
// "Checking a buffer from elsewhere").
//
// One thread per row-tile (m, j). Checks, in slot order:
//   1  count word > TILE                                       (every row)
// and for rows with light[m] != 0 (light == nullptr: every row), when the tile did not
// overflow:
//   2  a stored column outside the tile [j*TILE, (j+1)*TILE)
//   3  a stored value of ±0
//   4  a column stored twice in the tile (a TILE-bit mask per thread in shared memory)
// and with `routing` set (a Hybrid's light rows):
//   5  the tile overflowed (more than SLOTS-1 nonzeros): the row needs its dense backup
//   6  a stored value is non-finite: likewise
// The first failure in (row, tile, slot) order wins: every failing thread offers the key
// ((m * tiles + j) * SLOTS + slot) * 8 + code to an atomicMin, whose result does not
// depend on the order the threads run in. result[0] = ~0 when the buffer is valid.
//
// Layouts: packed uint32 [M, tiles * SLOTS]; light uint8 [M] or null.
// Compile-time parameters: TWELL_TILE, TWELL_SLOTS; constant TWELL_THREADS (validate.py).

#define MASK_WORDS (TWELL_TILE / 32)
#define THREADS TWELL_THREADS

__device__ __forceinline__ void offer(unsigned long long* result, long long m, int tiles, int j,
                                      int slot, int code) {
  const unsigned long long key =
      ((((unsigned long long)m * tiles + j) * TWELL_SLOTS + slot) << 3) | (unsigned)code;
  atomicMin(result, key);
}

extern "C" __global__ void twell_validate_tiles(const uint32_t* __restrict__ packed,
                                                const uint8_t* __restrict__ light, int routing,
                                                long long M, int tiles,
                                                unsigned long long* __restrict__ result) {
  __shared__ uint32_t seen_all[THREADS][MASK_WORDS + 1];  // +1: no bank conflicts
  uint32_t* seen = seen_all[threadIdx.x];
  const long long total = M * tiles;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += (long long)gridDim.x * blockDim.x) {
    const long long m = i / tiles;
    const int j = (int)(i - m * tiles);
    const uint32_t* words = packed + i * TWELL_SLOTS;
    const uint32_t count = words[0];
    if (count > (uint32_t)TWELL_TILE) {
      offer(result, m, tiles, j, 0, 1);
      continue;
    }
    if (light != nullptr && !light[m]) continue;
    if (twell_tile_overflows((int)count, TWELL_SLOTS)) {
      if (routing) offer(result, m, tiles, j, 0, 5);
      continue;
    }
#pragma unroll
    for (int w = 0; w < MASK_WORDS; ++w) seen[w] = 0u;
    for (int s = 1; s <= (int)count; ++s) {
      const uint32_t word = words[s];
      const uint32_t column = word & 0xffffu, bits = word >> 16;
      int code = 0;
      if ((int)(column / TWELL_TILE) != j) {
        code = 2;
      } else if ((bits & 0x7fffu) == 0u) {
        code = 3;
      } else {
        const uint32_t c = column % TWELL_TILE, bit = 1u << (c % 32);
        if (seen[c / 32] & bit) {
          code = 4;
        } else {
          seen[c / 32] |= bit;
          if (routing && twell_non_finite(bits)) code = 6;
        }
      }
      if (code) {
        offer(result, m, tiles, j, s, code);
        break;
      }
    }
  }
}
