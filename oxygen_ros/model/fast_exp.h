// e^x and 2^x in AVX-512 for the C++ kernels (activation_kernel.cpp: fast_exp;
// attention_kernel.cpp: fast_exp2_nonpositive).
//
// e^x: 2^n e^r with n = round(x log2 e), |r| <= ln2 / 2 (ln 2 split in two for the reduction),
// e^r by its degree-5 Taylor polynomial: relative error ~3e-6, far under bf16's 4e-3 (the
// kernels round their results to bf16). Sleef's exp, which inductor and ATen use, is exact
// to 1 ulp at ~2x the cost. x is clamped to [-87, 88]: no inf, no NaN; e^-87 is ~1.6e-38.

#pragma once

#include <immintrin.h>

namespace oxygen {

// e^x for x <= 0 (a score minus its row's maximum): only the lower clamp, one op of the ~20
// a softmax value costs
__attribute__((target("avx512f"))) inline __m512 fast_exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.0f / 120);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// 2^x for x <= 0 in the lanes of `keep`, exactly 0 in the others (a softmax's masked keys):
// 2^n 2^r with n = round(x), |r| <= 1/2, 2^r by the degree-4 Taylor polynomial of e^(r ln 2)
// (relative error ~4e-5, a fiftieth of bf16's rounding). A score in base 2 needs no range
// reduction by ln 2 and the mask rides on the scaling: a prefill's softmax 0.64 -> 0.54 ms a
// layer against fast_exp_nonpositive and a masked move (pi05-cpu, AMX Xeon, alone).
// x is clamped at -126 (2^-126, the least normal float: no denormal reaches a sum).
__attribute__((target("avx512f"))) inline __m512 fast_exp2_nonpositive(__m512 x,
                                                                        __mmask16 keep) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(0.0096181291f);                      // ln2^4 / 24
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.0555041087f));     // ln2^3 / 6
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.2402265070f));     // ln2^2 / 2
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.6931471806f));     // ln2
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_maskz_scalef_ps(keep, p, n);
}

__attribute__((target("avx512f"))) inline __m512 fast_exp(__m512 x) {
  return fast_exp_nonpositive(_mm512_min_ps(x, _mm512_set1_ps(88.0f)));
}

}  // namespace oxygen
