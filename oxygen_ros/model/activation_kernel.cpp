// GELU (tanh approximation) in AVX-512: oxygen_activation::gelu_tanh, Gemma's gated form too.
//
// Why: inductor computes the activation's exp (or tanh) with Sleef, exact to 1 ulp, at ~30
// cycles per 16 values in bf16 here: a pi05-cpu prefill layer's [555, 1024] gate took ~0.5 ms,
// a SigLIP layer's [512, 768] ~0.25 ms, more than their matmuls. The bf16 result needs 8
// bits: fast_exp.h's GELU (a polynomial 2^x) gives it at a fraction of the cost (~22 ops a
// vector of 16 values, loads and stores included). packed_linear.cpp's gated_gelu runs the
// same function on its product's sums.
//
// gelu_tanh(x, up): x [..., H] bf16 or fp32 on the CPU (rows may be strided: a chunk of a
// fused gate/up product; the last dim contiguous), up none or x's shape and dtype. Returns
// gelu(x) * up (or gelu(x)), contiguous, x's dtype, computed in fp32 and rounded once:
// gelu(x) = 0.5 x (1 + tanh u) = x sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3).
// packed_native.py builds this file with the other kernels; nothing else includes it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <atomic>
#include <cstdint>

#include "cpu_features.h"
#include "fast_exp.h"

namespace {

std::atomic<int64_t> call_count{0};

int64_t calls() { return call_count.load(); }

bool available() { return oxygen::has_avx512_bf16(); }

// 16 values of a row from bf16 or fp32 (the tail masked), as fp32
template <typename T>
__attribute__((target("avx512f,avx512bw,avx512bf16,avx512vl"))) inline __m512 load(const T* p,
                                                                          __mmask16 m) {
  if constexpr (sizeof(T) == 2) {
    const __m256i raw = _mm256_maskz_loadu_epi16(m, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  } else {
    return _mm512_maskz_loadu_ps(m, p);
  }
}

template <typename T>
__attribute__((target("avx512f,avx512bw,avx512bf16,avx512vl"))) inline void store(T* p, __m512 v,
                                                                         __mmask16 m) {
  if constexpr (sizeof(T) == 2) {
    _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
  } else {
    _mm512_mask_storeu_ps(p, m, v);
  }
}

template <typename T>
__attribute__((target("avx512f,avx512bw,avx512bf16,avx512vl"))) void gelu_rows(
    const T* x, int64_t x_stride, const T* up, int64_t up_stride, T* out, int64_t begin,
    int64_t end, int64_t H) {
  for (int64_t r = begin; r < end; ++r) {
    for (int64_t c = 0; c < H; c += 16) {
      const __mmask16 m = H - c >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (H - c)) - 1);
      __m512 y = oxygen::gelu_tanh(load(x + r * x_stride + c, m));
      if (up != nullptr) y = _mm512_mul_ps(y, load(up + r * up_stride + c, m));
      store(out + r * H + c, y, m);
    }
  }
}

// [..., H] with a contiguous last dim -> (rows, row stride): the leading dims must collapse
int64_t row_stride(const at::Tensor& t) {
  TORCH_CHECK(t.stride(-1) == 1, "gelu_tanh: the last dim must be contiguous");
  int64_t stride = t.dim() > 1 ? t.stride(-2) : t.size(-1);
  for (int64_t d = t.dim() - 2; d > 0; --d) {
    TORCH_CHECK(t.stride(d - 1) == t.stride(d) * t.size(d),
                "gelu_tanh: leading dims must be collapsible to rows");
  }
  return stride;
}

at::Tensor gelu_tanh(const at::Tensor& x, const std::optional<at::Tensor>& up) {
  TORCH_CHECK(available(), "oxygen_activation::gelu_tanh needs AVX512-BF16 (available())");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "gelu_tanh: x must be bfloat16 or float32, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1, "gelu_tanh: x must have a last dim");
  if (up.has_value()) {
    TORCH_CHECK(up->sizes() == x.sizes() && up->scalar_type() == x.scalar_type(),
                "gelu_tanh: up must have x's shape and dtype");
  }
  call_count.fetch_add(1, std::memory_order_relaxed);
  const int64_t H = x.size(-1), rows = H == 0 ? 0 : x.numel() / H;
  auto out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (rows == 0) return out;
  const int64_t xs = row_stride(x), us = up.has_value() ? row_stride(*up) : 0;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    if (x.scalar_type() == at::kBFloat16) {
      using T = uint16_t;
      gelu_rows<T>(static_cast<const T*>(x.data_ptr()), xs,
                   up.has_value() ? static_cast<const T*>(up->data_ptr()) : nullptr, us,
                   static_cast<T*>(out.data_ptr()), begin, end, H);
    } else {
      gelu_rows<float>(x.data_ptr<float>(), xs,
                       up.has_value() ? up->data_ptr<float>() : nullptr, us,
                       out.data_ptr<float>(), begin, end, H);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(oxygen_activation, m) {
  m.def("gelu_tanh(Tensor x, Tensor? up) -> Tensor");
  m.def("available() -> bool", available);
  m.def("calls() -> int", calls);
}

TORCH_LIBRARY_IMPL(oxygen_activation, CPU, m) { m.impl("gelu_tanh", gelu_tanh); }
