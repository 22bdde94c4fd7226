// What the CPU offers the C++ kernels (packed_linear.cpp, attention_kernel.cpp,
// activation_kernel.cpp): asked at run time, as the library is built once for any x86-64.

#pragma once

namespace oxygen {

// AVX-512 with its bf16 instructions (vdpbf16ps, vcvtne2ps2bf16) and the byte/word and
// 128/256-bit forms the kernels' masked loads and stores use: Cooper Lake, Sapphire Rapids
// and later Xeons, AMD Zen 4.
inline bool has_avx512_bf16() {
  static const bool yes = __builtin_cpu_supports("avx512f") &&
                          __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") &&
                          __builtin_cpu_supports("avx512bf16");
  return yes;
}

}  // namespace oxygen
