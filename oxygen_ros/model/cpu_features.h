// What the CPU offers the C++ kernels (packed_linear.cpp, attention_kernel.cpp,
// activation_kernel.cpp): asked at run time, as the library is built once for any x86-64.
// Also the AMX tile configuration the linear and the attention share.

#pragma once

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace oxygen {

// AVX-512 with the byte/word and 128/256-bit forms the kernels' masked loads and stores use
// (Skylake-SP and later Xeons, AMD Zen 4).
inline bool has_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f") &&
                          __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl");
  return yes;
}

// has_avx512 and its bf16 instructions (vdpbf16ps, vcvtne2ps2bf16): Cooper Lake, Sapphire
// Rapids and later Xeons, AMD Zen 4.
inline bool has_avx512_bf16() {
  static const bool yes = has_avx512() && __builtin_cpu_supports("avx512bf16");
  return yes;
}

// AMX with bf16 tiles (CPUID.7.0:EDX bits 22 and 24: Sapphire Rapids and later Xeons), the
// AVX-512 bf16 instructions the kernels pair with it, and the kernel's leave to use the tile
// state (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA), asked once per process.
inline bool amx_ready() {
  static const bool ready = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool bf16 = (d >> 22) & 1, tile = (d >> 24) & 1;
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
    return bf16 && tile && has_avx512_bf16() &&
           syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  }();
  return ready;
}

// A tile configuration (palette 1) as ldtilecfg reads it. Kept in globals, not locals: GCC 12
// drops the stores to a local config as dead (it does not see ldtilecfg read them), and the
// load then faults.
struct alignas(64) TileConfig {
  unsigned char palette = 1;
  unsigned char start_row = 0;
  unsigned char reserved[14] = {};
  unsigned short colsb[16] = {};
  unsigned char rows[16] = {};
};

}  // namespace oxygen
