// 2^x and the GELU built on it, in AVX-512, for the C++ kernels (activation_kernel.cpp,
// attention_kernel.cpp, packed_linear.cpp).
//
// Both in base 2: e^y = 2^(y log2 e), and a caller folds log2 e into its own constants.
// 2^x = 2^n 2^r with n = round(x), |r| <= 1/2, 2^r by a polynomial fitted for the least
// relative error on [-1/2, 1/2]: degree 3, 7.5e-5 (the softmax: its probabilities round to
// bf16, 2e-3); degree 4, 2.6e-6 (the GELU, whose float32 form is held to 1e-4). Sleef's exp,
// which inductor and ATen use, is exact to 1 ulp at ~2x the cost. No range reduction by ln 2,
// and a mask rides on the scaling: a masked lane is exactly 0.

#pragma once

#include <immintrin.h>

namespace oxygen {

// 2^x in the lanes of `keep`, 0 in the others. x is clamped at -126 (2^-126, the least normal
// float: no denormal reaches a sum or a product, where the CPU takes ~10x longer); callers
// keep x below 128 (no inf).
template <int Degree>
__attribute__((target("avx512f"))) inline __m512 fast_exp2(__m512 x, __mmask16 keep) {
  static_assert(Degree == 3 || Degree == 4, "fitted for degrees 3 and 4");
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(x, n);
  __m512 p;
  if constexpr (Degree == 3) {
    p = _mm512_set1_ps(0.0551714338f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.242610812f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.693260968f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.999928117f));
  } else {
    p = _mm512_set1_ps(0.00957007986f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.0559178367f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.240247443f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.693121791f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.999999285f));
  }
  return _mm512_maskz_scalef_ps(keep, p, n);
}

// gelu(x) = x / (1 + 2^z), z = -2 u log2 e = x (c1 + c3 x^2): the constants of u and the base
// folded into two, so z costs three ops
__attribute__((target("avx512f"))) inline __m512 gelu_tanh(__m512 x) {
  constexpr float c1 = -2.0f * 0.7978845608f * 1.44269504f, c3 = c1 * 0.044715f;
  const __m512 z = _mm512_mul_ps(
      x, _mm512_fmadd_ps(_mm512_mul_ps(x, x), _mm512_set1_ps(c3), _mm512_set1_ps(c1)));
  // z capped at 43 (e^30): past it x / (1 + e) is below 1e-12 of x, and an uncapped e (up to
  // 2^127) made x / (1 + e) a denormal, which the CPU computes ~10x slower
  const __m512 e = fast_exp2<4>(_mm512_min_ps(z, _mm512_set1_ps(43.0f)), 0xFFFF);
  // x / (1 + e) through the reciprocal estimate (relative error 2^-14, under bf16's 2^-8)
  return _mm512_mul_ps(x, _mm512_rcp14_ps(_mm512_add_ps(_mm512_set1_ps(1.0f), e)));
}

}  // namespace oxygen
