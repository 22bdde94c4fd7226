// The product the vdpbf16ps kernels are made of (packed_linear.cpp's few rows on its pair
// copy and on oneDNN's packed copy, the attention's scores): M rows against NB blocks of 16
// columns, each column's K values as K/2 pairs, one 64-byte vector (16 columns x 2) a pair.

#pragma once

#include <immintrin.h>

#include <cstdint>

namespace oxygen {

// acc[m][j] = sum over pairs p of rows[m][2p..2p+1] . block j's pair p, for M rows of P pairs
// (row m's pair p at row_pairs[m * P + p], two bf16 read as one 32-bit word) and NB blocks of
// 16 columns x 2 bf16 a pair: block j's pair p at blocks + j * block_step + p * pair_step.
// M x NB accumulators in registers, a block vector loaded once for M rows (enough
// independent sums to hide the latency).
template <int M, int NB>
__attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl"), always_inline)) inline void
pair_dot_steps(const int32_t* row_pairs, const uint16_t* blocks, int64_t P, int64_t block_step,
               int64_t pair_step, __m512 (&acc)[M][NB]) {
#pragma GCC unroll 16
  for (int m = 0; m < M; ++m) {
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < P; ++p) {
    __m512bh bv[NB];
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) {
      bv[j] = (__m512bh)_mm512_loadu_si512(blocks + j * block_step + p * pair_step);
    }
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) {
      // broadcast straight from memory (an embedded {1to16}), not through a register
      const __m512bh rv = (__m512bh)_mm512_set1_epi32(row_pairs[m * P + p]);
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], rv, bv[j]);
    }
  }
}

// The pair layout's blocks one after another, each [P][16][2]: packed_linear.cpp's few-row
// copy and the attention's arranged keys.
template <int M, int NB>
__attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl"), always_inline)) inline void
pair_dot(const int32_t* row_pairs, const uint16_t* blocks, int64_t P, __m512 (&acc)[M][NB]) {
  pair_dot_steps<M, NB>(row_pairs, blocks, P, P * 32, 32, acc);
}

}  // namespace oxygen
