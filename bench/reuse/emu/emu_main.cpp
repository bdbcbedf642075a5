// The kernels of reuse.cu built for the CPU emulator (cuda_emu.h), behind one C entry
// point that emu_backend.py calls through ctypes. Compile-time parameters come as -D
// flags (TWELL_KDIM, ...), as the GPU build gets them as #define lines.
#define TWELL_EMU 1
#include "cuda_emu.h"
#include "reuse.cu"

#include <cstring>

namespace {
template <typename... A>
void invoke(void (*f)(A...), void** args) {
  emu::call_with(f, args, std::index_sequence_for<A...>{});
}
#define TRAMPOLINE(name) \
  { #name, [](void** a) { invoke(name, a); } }
struct Named {
  const char* name;
  emu::Entry entry;
};
const Named kernels[] = {
    TRAMPOLINE(twell_reuse_scan_pre),  TRAMPOLINE(twell_reuse_scan_twell),
    TRAMPOLINE(twell_reuse_unit_ptr),  TRAMPOLINE(twell_reuse_row_ptr),
    TRAMPOLINE(twell_reuse_scatter),   TRAMPOLINE(twell_reuse_up),
    TRAMPOLINE(twell_reuse_up_finish), TRAMPOLINE(twell_reuse_up_gather),
    TRAMPOLINE(twell_reuse_down),
};
}  // namespace

extern "C" int twell_emu_launch(const char* name, unsigned gx, unsigned gy, unsigned gz,
                                unsigned bx, unsigned by, unsigned bz, unsigned smem,
                                void** args, char* error, int error_len) {
  emu::S.errors = 0;
  emu::S.error_text[0] = 0;
  for (const Named& k : kernels) {
    if (strcmp(k.name, name) == 0) {
      const int errors = emu::launch(k.entry, args, dim3{gx, gy, gz}, dim3{bx, by, bz}, smem);
      if (errors) snprintf(error, error_len, "%s", emu::S.error_text);
      return errors;
    }
  }
  snprintf(error, error_len, "no kernel named %s", name);
  return -1;
}
