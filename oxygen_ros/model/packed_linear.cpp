// The packed linear of model/packed.py as a C++ kernel: oxygen_packed_native::linear.
//
// A compiled graph (inductor's cpp_wrapper) calls it straight through the dispatcher: no
// Python frame, no GIL per call (the Python kernel of oxygen_packed::linear costs ~10-20 us
// of a decode step's ~30-80 us GEMV, and takes the GIL a fleet's row threads share).
// Same contract as the Python registry: a packed copy is used only while the plain weight
// it was packed from is alive, at the same address, with the same shape, strides and dtype,
// and unwritten since (its version counter); anything else runs at::linear on the plain
// weight, counted. packed_native.py builds this file at configure; nothing else includes it.
//
// Few rows (a denoise step's 10, a decode step's batch) run a kernel of this file instead of
// oneDNN where the CPU has AVX512-BF16: oneDNN spends ~16 us setting up each call, more than
// the product of an action expert's layer (10x128 @ 128x320: 0.4 MFLOP). The kernel reads
// the weight once in pairs along K (the layout `vdpbf16ps` takes, which is also an AMX B
// tile's) and accumulates in fp32: on AMX tiles where the CPU has them (up to 32 rows, K a
// multiple of 32: bound by reading the weight), else with vdpbf16ps (up to 16 rows and a
// million multiply-adds). Each output row is computed alone, in the same order whatever the
// row count, so within its range a batch gives its rows' one-by-one results bit for bit.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cpu_features.h"
#include "fast_exp.h"
#include "pair_dot.h"

namespace {

using WeakImpl = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;

std::optional<int64_t> version_of(const at::Tensor& weight) {
  if (weight.is_inference()) {  // an inference-mode tensor has no version counter
    return std::nullopt;
  }
  return static_cast<int64_t>(weight._version());
}

struct Entry {
  WeakImpl weight;  // the plain weight the copy was packed from (not kept alive)
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  c10::ScalarType dtype;
  std::optional<int64_t> version;
  at::Tensor packed;  // oneDNN-blocked copy
  at::Tensor pairs;   // the small-row kernel's copy (pair_layout), or undefined

  bool matches(const at::Tensor& weight) const {
    auto original = this->weight.lock();  // null once the weight is gone
    return original && original->data() == weight.data_ptr() &&
           weight.sizes().vec() == sizes && weight.strides().vec() == strides &&
           weight.scalar_type() == dtype && version_of(weight) == version;
  }
};

// ---------------------------------------------------------------- the small-row kernel
// Rows run the kernel below while rows * N * K <= kSmallMacs (one row always: a GEMV reads
// the weight at least as fast as oneDNN's). Measured on an AMX Xeon, 1 thread, alone: it
// beats oneDNN's ~16 us up to about a million multiply-adds (10x320x128: 9 vs 16 us;
// 1x2048x256: 13 vs 27 us) and loses past it (AMX multiplies many rows far faster). In
// pi05-cpu's compiled passes 2^20 beat 2^19 (denoise 0.93x of oneDNN's vs 0.95x; decode 8
// 1.00x either way).
//
// Without AMX oneDNN multiplies few rows in AVX512-BF16 too, and this kernel beats it at far
// more work (AMD EPYC, Zen 4, 1 thread: 10x1024x128 14 vs 28 us, 8x2048x256 42 vs 60,
// 8x16384x256 310 vs 379, 16x2048x256 91 vs 96; 16x16384x256 748 vs 668): 2^25.
constexpr int64_t kSmallRows = 16;
constexpr int64_t kSmallMacs = int64_t(1) << 20;
constexpr int64_t kSmallMacsNoAmx = int64_t(1) << 25;
constexpr int64_t kBlock = 16;      // output columns per vector (16 fp32 lanes)
std::atomic<bool> small_rows_on{true};   // use_small_rows(): tests compare both kernels
std::atomic<int64_t> small_row_count{0};  // products the kernel made (small_row_calls)

// On AMX: up to two row tiles, the weight read once whatever N and K (K in whole tiles).
constexpr int64_t kAmxRows = 32;
constexpr int64_t kAmxK = 32;   // K per tile: 16 pairs

std::atomic<bool> amx_rows_on{true};   // use_amx_rows(): vdpbf16ps instead, side by side

bool runs_amx(int64_t rows, int64_t K) {
  return amx_rows_on.load(std::memory_order_relaxed) && oxygen::amx_ready() && rows >= 1 &&
         rows <= kAmxRows && K % kAmxK == 0;
}

bool runs_small(int64_t rows, int64_t N, int64_t K) {
  return small_rows_on.load(std::memory_order_relaxed) &&
         (runs_amx(rows, K) ||
          (rows >= 1 && rows <= kSmallRows &&
           (rows == 1 ||
            rows * N * K <= (oxygen::amx_ready() ? kSmallMacs : kSmallMacsNoAmx))));
}

// A bf16 weight [N, K] (K even) -> [ceil(N/16), K/2, 16, 2]: block b, pair p holds
// w[16b + j][2p], w[16b + j][2p + 1] for j < 16 (zeros past N), one 64-byte vector per pair.
at::Tensor pair_layout(const at::Tensor& weight) {
  const int64_t N = weight.size(0), K = weight.size(1), blocks = (N + kBlock - 1) / kBlock;
  auto padded = at::zeros({blocks * kBlock, K}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  return padded.view({blocks, kBlock, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

// out[M, 16 NB columns from col0] = x[M, K] @ W^T for NB blocks of 16 columns at once (enough
// independent accumulators to hide vdpbf16ps' latency when M is small), block j's pair p at
// blocks + j * block_step + p * pair_step: the few-row copy's pair layout and oneDNN's copy in
// blocks of 64 columns (blocked_rows) alike. Columns from N on are not stored.
template <int M, int NB>
__attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl"))) void pair_blocks(
    const uint16_t* x, int64_t K, const uint16_t* blocks, int64_t block_step, int64_t pair_step,
    int64_t col0, int64_t N, uint16_t* out) {
  __m512 acc[M][NB];
  oxygen::pair_dot_steps<M, NB>(reinterpret_cast<const int32_t*>(x), blocks, K / 2, block_step,
                                pair_step, acc);
  for (int j = 0; j < NB; ++j) {
    const int64_t col = col0 + j * kBlock;
    const int64_t width = std::min<int64_t>(kBlock, N - col);
    const __mmask16 keep = width >= kBlock ? __mmask16(0xFFFF) : __mmask16((1u << width) - 1);
    for (int m = 0; m < M; ++m) {
      const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(acc[m][j]);
      _mm256_mask_storeu_epi16(out + m * N + col, keep, rounded);
    }
  }
}

// The pair layout's blocks from b0: NB blocks of [K/2][16][2] one after another.
template <int M, int NB>
void small_rows_blocks(const uint16_t* x, int64_t K, const uint16_t* pairs, int64_t b0,
                       int64_t N, uint16_t* out) {
  const int64_t block_elems = K * kBlock;
  pair_blocks<M, NB>(x, K, pairs + b0 * block_elems, block_elems, 2 * kBlock, b0 * kBlock, N,
                     out);
}

// Blocks [b0, b1) of M rows: NB at a time, then one at a time (a column's sums are the same
// either way).
template <int M>
void small_rows(const uint16_t* x, int64_t K, const uint16_t* pairs, int64_t N, int64_t b0,
                int64_t b1, uint16_t* out) {
  constexpr int NB = M >= 8 ? 1 : (M >= 4 ? 2 : (M >= 2 ? 4 : 8));
  int64_t b = b0;
  for (; b + NB <= b1; b += NB) {
    small_rows_blocks<M, NB>(x, K, pairs, b, N, out);
  }
  for (; b < b1; ++b) {
    small_rows_blocks<M, 1>(x, K, pairs, b, N, out);
  }
}

template <int... Ms>
void dispatch_rows(int64_t rows, const uint16_t* x, int64_t K, const uint16_t* pairs, int64_t N,
                   int64_t b0, int64_t b1, uint16_t* out, std::integer_sequence<int, Ms...>) {
  ((rows == Ms + 1 ? (small_rows<Ms + 1>(x, K, pairs, N, b0, b1, out), true) : false) || ...);
}

// ------------------------------------------------------- the few-row kernel on AMX tiles
// Tiles: A = x's rows for 32 of K (one tile of <= 16 rows, two for 17..32), B = 16 columns of
// the weight for those 32 (a block of pair_layout: 16 pairs x 16 columns x 2, 1 KB), C = the
// fp32 sums. One row tile: A 0, three column blocks at once (B 1-3, C 4-6); two: A 0, 1, two
// blocks (B 2, 3, C 4-7). The config's rows follow M (no row read past x), one per M.
using oxygen::TileConfig;

TileConfig amx_linear_config(int M) {
  TileConfig config;
  const int top = std::min(M, 16), rest = M - top;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  config.rows[0] = top;
  if (rest == 0) {
    config.rows[4] = config.rows[5] = config.rows[6] = top;
    config.rows[7] = 0;
    config.colsb[7] = 0;
  } else {
    config.rows[1] = rest;
    config.rows[4] = config.rows[5] = top;
    config.rows[6] = config.rows[7] = rest;
  }
  return config;
}

const std::vector<TileConfig> kAmxConfigs = [] {   // [M] for M in 1..kAmxRows
  std::vector<TileConfig> configs(kAmxRows + 1);
  for (int M = 1; M <= kAmxRows; ++M) configs[M] = amx_linear_config(M);
  return configs;
}();

// fp32 sums [rows][16] -> bf16 out[rows][col .. col + width)
__attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl"))) void store_block(
    const float* sums, int rows, int64_t N, int64_t col, uint16_t* out) {
  const int64_t width = std::min<int64_t>(kBlock, N - col);
  const __mmask16 keep = width >= kBlock ? __mmask16(0xFFFF) : __mmask16((1u << width) - 1);
  for (int m = 0; m < rows; ++m) {
    const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(sums + m * kBlock));
    _mm256_mask_storeu_epi16(out + m * N + col, keep, rounded);
  }
}

// Two column blocks (`first`, `second`: blocks of pair_layout) for 17..32 rows on the tiles
// configured for them: A 0 and 1 the row halves (x, x2), B 2 and 3, C 4-7 -> sums [the top
// rows' first, top second, rest first, rest second].
__attribute__((target("amx-tile,amx-bf16"))) inline void two_row_tiles(
    const uint16_t* x, const uint16_t* x2, int64_t x_stride, int64_t chunks,
    const uint16_t* first, const uint16_t* second, float (*sums)[16 * kBlock]) {
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  for (int64_t c = 0; c < chunks; ++c) {
    _tile_loadd(0, x + c * kAmxK, x_stride);
    _tile_loadd(1, x2 + c * kAmxK, x_stride);
    _tile_loadd(2, first + c * 16 * 32, 64);
    _tile_loadd(3, second + c * 16 * 32, 64);
    _tile_dpbf16ps(4, 0, 2);
    _tile_dpbf16ps(5, 0, 3);
    _tile_dpbf16ps(6, 1, 2);
    _tile_dpbf16ps(7, 1, 3);
  }
  _tile_stored(4, sums[0], 64);
  _tile_stored(5, sums[1], 64);
  _tile_stored(6, sums[2], 64);
  _tile_stored(7, sums[3], 64);
}

// Column blocks [b0, b1) of out[M, N] = x[M, K] @ pairs^T on tiles configured for M.
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bf16,avx512bw,avx512vl"))) void
amx_blocks(const uint16_t* x, int M, int64_t K, const uint16_t* pairs, int64_t N, int64_t b0,
           int64_t b1, uint16_t* out) {
  const int64_t P = K / 2, chunks = K / kAmxK, x_stride = K * 2;
  const int64_t block_elems = P * 2 * kBlock;   // one column block of pair_layout
  alignas(64) float sums[4][16 * kBlock];
  _tile_loadconfig(&kAmxConfigs[M]);
  if (M <= 16) {
    for (int64_t b = b0; b < b1; b += 3) {
      // a last group of one or two blocks multiplies its last block again (not stored)
      const int live = static_cast<int>(std::min<int64_t>(3, b1 - b));
      const uint16_t* w = pairs + b * block_elems;
      const uint16_t* w1 = w + std::min(1, live - 1) * block_elems;
      const uint16_t* w2 = w + (live - 1) * block_elems;
      _tile_zero(4);
      _tile_zero(5);
      _tile_zero(6);
      for (int64_t c = 0; c < chunks; ++c) {
        _tile_loadd(0, x + c * kAmxK, x_stride);
        _tile_loadd(1, w + c * 16 * 32, 64);
        _tile_loadd(2, w1 + c * 16 * 32, 64);
        _tile_loadd(3, w2 + c * 16 * 32, 64);
        _tile_dpbf16ps(4, 0, 1);
        _tile_dpbf16ps(5, 0, 2);
        _tile_dpbf16ps(6, 0, 3);
      }
      _tile_stored(4, sums[0], 64);
      _tile_stored(5, sums[1], 64);
      _tile_stored(6, sums[2], 64);
      for (int j = 0; j < live; ++j) store_block(sums[j], M, N, (b + j) * kBlock, out);
    }
  } else {
    const int rest = M - 16;
    const uint16_t* x2 = x + 16 * K;
    uint16_t* out2 = out + 16 * N;
    for (int64_t b = b0; b < b1; b += 2) {
      const bool pair = b + 1 < b1;
      const uint16_t* w = pairs + b * block_elems;
      // a lone last block multiplies its own B twice (the second product is not stored)
      two_row_tiles(x, x2, x_stride, chunks, w, w + (pair ? block_elems : 0), sums);
      store_block(sums[0], 16, N, b * kBlock, out);
      store_block(sums[2], rest, N, b * kBlock, out2);
      if (pair) {
        store_block(sums[1], 16, N, (b + 1) * kBlock, out);
        store_block(sums[3], rest, N, (b + 1) * kBlock, out2);
      }
    }
  }
  _tile_release();
}

// rows [M, K] bf16 contiguous (M <= kAmxRows, K a multiple of 32) -> [M, N] bf16. Threads
// split the columns: each reads its share of the weight once.
void amx_matmul(const uint16_t* x, int M, int64_t K, const uint16_t* pairs, int64_t N,
                uint16_t* out) {
  const int64_t blocks = (N + kBlock - 1) / kBlock;
  const int64_t group = M <= 16 ? 3 : 2;   // blocks a pass of amx_blocks takes at once
  // >= 256 KB of weight a task: less is not worth a thread's start
  const int64_t grain = std::max<int64_t>(1, (int64_t(256) << 10) / (group * K * kBlock * 2));
  at::parallel_for(0, (blocks + group - 1) / group, grain,
                   [&](int64_t begin, int64_t end) {
                     amx_blocks(x, M, K, pairs, N, begin * group,
                                std::min(blocks, end * group), out);
                   });
}

// ------------------------------------------- gate/up and the gated GELU in one pass
// gelu(x Wg^T) * (x Wu^T) for many rows (a prefill's), Wg and Wu the halves of a fused gate/up
// weight [2H, K]: per 32 rows and 16 columns, the gate's and the up's sums stay in tiles,
// then in L1, and only gelu(gate) * up is written (in bf16, rounded once). Apart, the product
// wrote [rows, 2H] bf16 and the GELU read it back: pi05-cpu's [555, 2048] is past L2 (2 MB
// here), and in a prefill the pair took ~1.6 ms a layer where alone they take ~0.7.
// Tiles as amx_blocks' (the same configs): A the rows, B a gate block and its up block.

// gelu(gate) * up of `rows` rows of 16 sums each -> bf16 out rows (stride H)
__attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl"))) void store_gated(
    const float* gate, const float* up, int rows, int64_t H, uint16_t* out) {
  for (int m = 0; m < rows; ++m) {
    const __m512 y = _mm512_mul_ps(oxygen::gelu_tanh(_mm512_loadu_ps(gate + m * kBlock)),
                                   _mm512_loadu_ps(up + m * kBlock));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * H),
                        (__m256i)_mm512_cvtneps_pbh(y));
  }
}

// M (1..32) rows of x [M, K] -> out [M, H]; pairs: pair_layout of the fused weight [2H, K]
// (H a multiple of 16: the up block of gate block b is block b + H / 16)
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bf16,avx512bw,avx512vl"))) void
gated_rows(const uint16_t* x, int M, int64_t K, const uint16_t* pairs, int64_t H,
           uint16_t* out) {
  const int64_t chunks = K / kAmxK, x_stride = K * 2;
  const int64_t block_elems = (K / 2) * 2 * kBlock;
  const int64_t up_offset = (H / kBlock) * block_elems;
  const int top = std::min(M, 16), rest = M - top;
  const uint16_t* x2 = x + 16 * K;
  alignas(64) float sums[4][16 * kBlock];
  _tile_loadconfig(&kAmxConfigs[M]);
  for (int64_t b = 0; b < H / kBlock; ++b) {
    const uint16_t* gate = pairs + b * block_elems;
    const uint16_t* up = gate + up_offset;
    if (rest == 0) {   // A 0, B 1 (gate) and 2 (up), C 4 and 5
      _tile_zero(4);
      _tile_zero(5);
      for (int64_t c = 0; c < chunks; ++c) {
        _tile_loadd(0, x + c * kAmxK, x_stride);
        _tile_loadd(1, gate + c * 16 * 32, 64);
        _tile_loadd(2, up + c * 16 * 32, 64);
        _tile_dpbf16ps(4, 0, 1);
        _tile_dpbf16ps(5, 0, 2);
      }
      _tile_stored(4, sums[0], 64);
      _tile_stored(5, sums[1], 64);
    } else {   // the gate block and its up block as two_row_tiles' two
      two_row_tiles(x, x2, x_stride, chunks, gate, up, sums);
      store_gated(sums[2], sums[3], rest, H, out + 16 * H + b * kBlock);
    }
    store_gated(sums[0], sums[1], top, H, out + b * kBlock);
  }
  _tile_release();
}

std::atomic<int64_t> gated_count{0};   // products gated_gelu made in one pass (gated_calls)

// x: M contiguous rows of K, in the few-row range (runs_small) -> `shape` (its last dim N).
// The result is allocated in its final shape and x read by pointer: a reshape, a
// contiguous() and a view through the dispatcher cost more than a denoise step's product.
at::Tensor small_rows_matmul(const at::Tensor& x, int64_t M, const at::Tensor& pairs,
                             at::IntArrayRef shape) {
  const int64_t K = x.size(-1), N = shape.back();
  auto out = at::empty(shape, x.options());
  const auto* xd = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* w = reinterpret_cast<const uint16_t*>(pairs.data_ptr());
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  if (runs_amx(M, K)) {
    amx_matmul(xd, static_cast<int>(M), K, w, N, o);
  } else {
    // threads split the column blocks, >= 256 KB of weight a task (one thread: no region)
    const int64_t grain = std::max<int64_t>(8, (int64_t(256) << 10) / (K * kBlock * 2));
    at::parallel_for(0, (N + kBlock - 1) / kBlock, grain, [&](int64_t begin, int64_t end) {
      dispatch_rows(M, xd, K, w, N, begin, end, o,
                    std::make_integer_sequence<int, kSmallRows>{});
    });
  }
  return out;
}

// --------------------------------------------------- few rows on a plain weight, in place
// out[M, N] = x[M, K] @ w[N, K]^T reading w where it lies, row-major: each output is a dot
// product of a weight row with a row of x, 32 of K a vdpbf16ps, summed across lanes at the
// end. For a weight that has no packed copy and should not get one: full pi05's tied LM head
// (1 GB, also the embedding), whose plain bf16 GEMV through ATen streams it at about half
// the bandwidth this kernel reads it at. The weight is read row after row, one sequential
// stream a thread (rows read side by side, 4 KB apart, share L1 sets and ran at 60%); two
// chains of sums a row (even and odd chunks of 32) hide vdpbf16ps' latency. Every output
// adds in that order whatever M, so rows batched give their one-by-one results bit for bit.
// AMD EPYC (Zen 4), 2 threads, [257152, 2048], side by side: 1 to 4 rows 20-33 ms against
// ATen's 43-62, 5 to 8 rows in one pass 32-46 against 50-62 (in passes of 4 they took 45-65).
// packed.plain_linear sends it at most kPlainRows rows (more run in passes of kPlainRows,
// each reading the weight).
constexpr int64_t kPlainRows = 8;   // rows of x a pass of the weight serves
constexpr int64_t kPlainK = 32;     // K per vdpbf16ps
// From 3 rows of x on, a row's products take long enough that the hardware's prefetch fell
// behind the stream (4 rows: 117 ms where 1 row took 43): the weight 4 rows ahead is asked
// into L2 (past the last row it names no data: a prefetch never faults). Fewer rows run
// faster without (the hint cost 1 row ~20%).
constexpr int64_t kAheadRows = 4;

// xs: M rows of x arranged by chunk (plain_rows: chunk c of row m at (c * M + m) * 32)
template <int M>
__attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl"))) inline void plain_dot_row(
    const uint16_t* xs, int64_t K, const uint16_t* w, float* sums) {
  __m512 even[M], odd[M];
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) even[m] = odd[m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 2 * kPlainK <= K; k += 2 * kPlainK) {
    if constexpr (M >= 3) {
      _mm_prefetch(reinterpret_cast<const char*>(w + kAheadRows * K + k), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(w + kAheadRows * K + k + kPlainK),
                   _MM_HINT_T1);
    }
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + k);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + k + kPlainK);
    const uint16_t* x0 = xs + k * M;   // chunk k / 32: M vectors, then the next chunk's M
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      even[m] = _mm512_dpbf16_ps(even[m], (__m512bh)_mm512_loadu_si512(x0 + m * kPlainK), w0);
      odd[m] = _mm512_dpbf16_ps(odd[m],
                                (__m512bh)_mm512_loadu_si512(x0 + (M + m) * kPlainK), w1);
    }
  }
  if (k < K) {   // an odd number of chunks: the last goes to the even chain
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + k);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      even[m] = _mm512_dpbf16_ps(even[m],
                                 (__m512bh)_mm512_loadu_si512(xs + k * M + m * kPlainK), w0);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) {
    sums[m] = _mm512_reduce_add_ps(_mm512_add_ps(even[m], odd[m]));
  }
}

// Weight rows [n0, n1) against M rows of x (arranged) -> out[M, N] (bf16, rounded once), kTile
// outputs at a time through fp32 sums on the stack.
template <int M>
__attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl"))) void plain_rows_range(
    const uint16_t* x, int64_t K, const uint16_t* w, int64_t N, int64_t n0, int64_t n1,
    uint16_t* out) {
  constexpr int64_t kTile = 256;
  // [output][row]: a weight row's M sums side by side (one store each, near each other)
  alignas(64) float sums[kTile * M];
  const __m512i lanes = _mm512_mullo_epi32(_mm512_set1_epi32(M),
                                           _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9,
                                                             10, 11, 12, 13, 14, 15));
  for (int64_t t0 = n0; t0 < n1; t0 += kTile) {
    const int64_t width = std::min(kTile, n1 - t0);
    for (int64_t n = 0; n < width; ++n) {
      plain_dot_row<M>(x, K, w + (t0 + n) * K, sums + n * M);
    }
    for (int m = 0; m < M; ++m) {
      for (int64_t c = 0; c < width; c += 16) {
        const int64_t left = std::min<int64_t>(16, width - c);
        const __mmask16 keep = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
        const __m512 column = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), keep, lanes,
                                                       sums + c * M + m, 4);
        _mm256_mask_storeu_epi16(out + m * N + t0 + c, keep,
                                 (__m256i)_mm512_cvtneps_pbh(column));
      }
    }
  }
}

template <int... Ms>
void dispatch_plain(int64_t rows, const uint16_t* x, int64_t K, const uint16_t* w, int64_t N,
                    int64_t n0, int64_t n1, uint16_t* out, std::integer_sequence<int, Ms...>) {
  ((rows == Ms + 1 ? (plain_rows_range<Ms + 1>(x, K, w, N, n0, n1, out), true) : false) ||
   ...);
}

// x [..., K] bf16, weight [N, K] bf16 contiguous, K a multiple of 32, on a CPU with
// AVX512-BF16 -> [..., N] bf16. Threads split the weight's rows: each reads its share once
// per group of kPlainRows rows of x.
at::Tensor plain_rows(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(oxygen::has_avx512_bf16(), "plain_rows needs AVX512-BF16, this CPU has none");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              "plain_rows: x and weight must be bfloat16, got ", x.scalar_type(), " and ",
              weight.scalar_type());
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && x.size(-1) == weight.size(1) &&
                  weight.size(1) % kPlainK == 0,
              "plain_rows: weight must be a contiguous [N, K] with K = x's last dim and a "
              "multiple of ", kPlainK, ", got x ", x.sizes(), ", weight ", weight.sizes());
  const int64_t N = weight.size(0), K = weight.size(1);
  const auto rows = x.reshape({-1, K}).contiguous();
  const int64_t M = rows.size(0);
  auto shape = x.sizes().vec();
  shape.back() = N;
  auto out = at::empty({M, N}, rows.options());
  const auto* xd = reinterpret_cast<const uint16_t*>(rows.data_ptr());
  const auto* w = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  // >= 256 KB of weight a task
  const int64_t grain = std::max<int64_t>(16, (int64_t(256) << 10) / (K * 2));
  // a group's rows by chunk of 32, the M vectors a chunk's products read side by side (rows
  // of x K * 2 bytes apart, 4 KB in pi05, would share L1 sets with each other)
  std::vector<uint16_t> arranged(std::min(kPlainRows, M) * K);
  for (int64_t r0 = 0; r0 < M; r0 += kPlainRows) {
    const int64_t group = std::min(kPlainRows, M - r0);
    for (int64_t c = 0; c < K / kPlainK; ++c) {
      for (int64_t m = 0; m < group; ++m) {
        std::copy_n(xd + (r0 + m) * K + c * kPlainK, kPlainK,
                    arranged.data() + (c * group + m) * kPlainK);
      }
    }
    at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
      dispatch_plain(group, arranged.data(), K, w, N, begin, end, o + r0 * N,
                     std::make_integer_sequence<int, kPlainRows>{});
    });
  }
  return out.view(shape);
}

// ---------------------------------------- few rows on oneDNN's packed copy, where it lies
// Full pi05 packs its backbone in place: oneDNN's copy (packed for a prefill's rows) is the
// only one, with no pair copy for the few-row kernel. oneDNN's own product for a decode step's
// 1-4 rows streamed it at 17-22 GB/s (its four layer shapes, 2 threads, AMD EPYC); this reads
// the copy where it lies at 24-33 GB/s when its layout is the one the kernel knows,
// [N/64][K/2][64][2]: block b's pair p holds w[64b + c][2p], w[64b + c][2p + 1] for c < 64 (a
// pair layout of 64-column blocks, what oneDNN chose for every pi05 shape on that machine).
// blocked_layout_matches compares a copy with its plain weight before the plain one is
// released (packed.py, at pack time); any other layout stays with oneDNN.
constexpr int64_t kBlockedCols = 64;   // columns of a block of oneDNN's copy
constexpr int64_t kBlockedRows = 4;    // rows of x a call serves (packed.py sends no more)

}  // namespace

// weak: AOTInductor's accessors, internal to torch; where a torch lacks them the kernel is off
namespace at::native {
__attribute__((weak)) void* data_ptr_from_mkldnn(const at::Tensor& mkldnn_tensor);
__attribute__((weak)) int64_t nbytes_from_mkldnn(const at::Tensor& mkldnn_tensor);
}  // namespace at::native

namespace {

bool blocked_rows_available() {
  return oxygen::has_avx512_bf16() && at::native::data_ptr_from_mkldnn != nullptr &&
         at::native::nbytes_from_mkldnn != nullptr;
}

// Say whether `packed` (oneDNN's copy of the bf16 weight [N, K]) is laid out as the kernel
// reads it: every element (full), or every block's first, middle and last pairs (oneDNN lays
// a shape out one way: packed.py checks a shape's first weight in full, ~3 GB/s).
bool blocked_layout_matches(const at::Tensor& weight, const at::Tensor& packed, bool full) {
  if (!blocked_rows_available() || !packed.is_mkldnn() || weight.dim() != 2 ||
      weight.scalar_type() != at::kBFloat16 || !weight.is_contiguous()) {
    return false;
  }
  const int64_t N = weight.size(0), K = weight.size(1);
  if (N % kBlockedCols != 0 || K % 2 != 0 ||
      at::native::nbytes_from_mkldnn(packed) != N * K * 2) {
    return false;
  }
  const auto* w = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  const auto* c = reinterpret_cast<const uint16_t*>(at::native::data_ptr_from_mkldnn(packed));
  const int64_t P = K / 2;
  const int64_t spots[3] = {0, P / 2, P - 1};
  std::atomic<bool> same{true};
  at::parallel_for(0, N / kBlockedCols, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end && same.load(std::memory_order_relaxed); ++b) {
      const uint16_t* block = c + b * kBlockedCols * K;
      for (int64_t i = 0; i < (full ? P : 3); ++i) {
        const int64_t p = full ? i : spots[i];
        for (int64_t col = 0; col < kBlockedCols; ++col) {
          const uint16_t* want = w + (b * kBlockedCols + col) * K + 2 * p;
          const uint16_t* got = block + (p * kBlockedCols + col) * 2;
          if (got[0] != want[0] || got[1] != want[1]) same.store(false);
        }
      }
    }
  });
  return same.load();
}

// Blocks [b0, b1) of the copy against M rows of x -> out[M, N] (bf16, rounded once): a block's
// 64 columns as 4 vectors of 16, each pair's 256 bytes read once for the M rows.
template <int M>
void blocked_range(const uint16_t* x, int64_t K, const uint16_t* copy, int64_t N, int64_t b0,
                   int64_t b1, uint16_t* out) {
  for (int64_t b = b0; b < b1; ++b) {
    pair_blocks<M, kBlockedCols / kBlock>(x, K, copy + b * kBlockedCols * K, 2 * kBlock,
                                          2 * kBlockedCols, b * kBlockedCols, N, out);
  }
}

template <int... Ms>
void dispatch_blocked(int64_t rows, const uint16_t* x, int64_t K, const uint16_t* copy,
                      int64_t N, int64_t b0, int64_t b1, uint16_t* out,
                      std::integer_sequence<int, Ms...>) {
  ((rows == Ms + 1 ? (blocked_range<Ms + 1>(x, K, copy, N, b0, b1, out), true) : false) || ...);
}

// x [..., K] bf16 (1..kBlockedRows rows), packed: oneDNN's copy of a weight [N, K] whose
// layout blocked_layout_matches confirmed -> [..., N] bf16. Threads split the blocks.
at::Tensor blocked_rows(const at::Tensor& x, const at::Tensor& packed, int64_t N) {
  TORCH_CHECK(blocked_rows_available(), "blocked_rows needs AVX512-BF16 and torch's mkldnn "
              "accessors; this CPU or torch has not");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.is_mkldnn(),
              "blocked_rows: x must be bfloat16 and packed an mkldnn tensor, got ",
              x.scalar_type(), " and ", packed.layout());
  const int64_t K = x.size(-1);
  const auto rows = x.reshape({-1, K}).contiguous();
  const int64_t M = rows.size(0);
  TORCH_CHECK(M >= 1 && M <= kBlockedRows && N % kBlockedCols == 0 && K % 2 == 0 &&
                  at::native::nbytes_from_mkldnn(packed) == N * K * 2,
              "blocked_rows: takes 1 to ", kBlockedRows, " rows of an even K against a copy of ",
              "N x K bf16 with N a multiple of ", kBlockedCols, ", got ", M, " rows, K ", K,
              ", N ", N, ", copy of ", at::native::nbytes_from_mkldnn(packed), " bytes");
  auto shape = x.sizes().vec();
  shape.back() = N;
  auto out = at::empty({M, N}, rows.options());
  const auto* xd = reinterpret_cast<const uint16_t*>(rows.data_ptr());
  const auto* c = reinterpret_cast<const uint16_t*>(at::native::data_ptr_from_mkldnn(packed));
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  // >= 256 KB of weight a task
  const int64_t grain = std::max<int64_t>(1, (int64_t(256) << 10) / (kBlockedCols * K * 2));
  at::parallel_for(0, N / kBlockedCols, grain, [&](int64_t begin, int64_t end) {
    dispatch_blocked(M, xd, K, c, N, begin, end, o,
                     std::make_integer_sequence<int, kBlockedRows>{});
  });
  return out.view(shape);
}

// ------------------------------------------------------ greedy ids from the LM head's logits
// x [B, V] float32 -> long [B]: torch.argmax(x, -1)'s answer (the first index of the largest
// value; a row holding NaN answers its first NaN, which torch counts as the largest). Inside
// a compiled decode step inductor's argmax took ~11 us a row of 16384 (pi05-cpu: ~90 us of a
// step of 8 rows); here 16 lanes keep their own best and their first index of it.
__attribute__((target("avx512f,avx512bw,avx512vl"))) int64_t argmax_row(const float* x,
                                                                        int64_t V) {
  __m512 best = _mm512_set1_ps(-INFINITY);
  __m512i where = _mm512_set1_epi32(-1);
  __m512i index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  __mmask16 nan = 0;
  for (int64_t v = 0; v < V; v += 16) {
    const int64_t left = std::min<int64_t>(16, V - v);
    const __mmask16 keep = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
    const __m512 values = _mm512_maskz_loadu_ps(keep, x + v);
    nan |= _mm512_mask_cmp_ps_mask(keep, values, values, _CMP_UNORD_Q);
    // strictly greater: a lane keeps its first index of its best (-inf rows: index -1 below)
    const __mmask16 better = _mm512_mask_cmp_ps_mask(keep, values, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, better, values);
    where = _mm512_mask_mov_epi32(where, better, index);
    index = _mm512_add_epi32(index, step);
  }
  if (nan) {
    for (int64_t v = 0; v < V; ++v) {
      if (std::isnan(x[v])) return v;
    }
  }
  const float top = _mm512_reduce_max_ps(best);
  const __mmask16 tops = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
  // the smallest index among the lanes holding the best; a row of -inf (no lane moved: -1) is 0
  const int first = _mm512_mask_reduce_min_epi32(tops, where);
  return first < 0 ? 0 : first;
}

at::Tensor row_argmax(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) > 0 &&
                  x.size(1) < (int64_t(1) << 31),
              "row_argmax: x must be float32 [B, V] with 0 < V < 2^31, got ", x.scalar_type(),
              " ", x.sizes());
  const auto rows = x.contiguous();
  const int64_t B = rows.size(0), V = rows.size(1);
  auto out = at::empty({B}, x.options().dtype(at::kLong));
  auto* o = out.data_ptr<int64_t>();
  const float* data = rows.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) o[b] = argmax_row(data + b * V, V);
  return out;
}

bool row_argmax_available() { return oxygen::has_avx512(); }

// ---------------------------------------------------------------- the registry
std::mutex registry_lock;
std::unordered_map<int64_t, Entry> registry;  // key: the plain weight's data pointer
std::atomic<int64_t> stale_count{0};

int64_t key_of(const at::Tensor& weight) {
  return static_cast<int64_t>(reinterpret_cast<std::uintptr_t>(weight.data_ptr()));
}

// (oneDNN copy, small-row copy) of a weight; both undefined when it has no valid entry
std::pair<at::Tensor, at::Tensor> lookup(const at::Tensor& weight) {
  std::lock_guard<std::mutex> guard(registry_lock);
  auto found = registry.find(key_of(weight));
  if (found == registry.end() || !found->second.matches(weight)) {
    return {};
  }
  return {found->second.packed, found->second.pairs};
}

// rows [M, K] @ packed^T (+ bias, added in fp32 before the rounding) through oneDNN (the op
// ATen registers as mkldnn::_linear_pointwise)
at::Tensor packed_matmul(const at::Tensor& rows, const at::Tensor& packed,
                         const std::optional<at::Tensor>& bias) {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{rows, packed, bias.has_value() ? c10::IValue(*bias) : c10::IValue(),
                          c10::IValue(std::string("none")),
                          c10::IValue(c10::List<std::optional<at::Scalar>>()),
                          c10::IValue(std::string(""))};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight,
                  const std::optional<at::Tensor>& bias) {
  auto [packed, pairs] = lookup(weight);
  if (!packed.defined()) {
    if (stale_count.fetch_add(1) == 0) {
      TORCH_WARN("a packed linear ran unpacked: its weight ", weight.sizes(),
                 " changed (or was never packed) after configure; results stay exact, "
                 "only slower");
    }
    return at::linear(x, weight, bias);
  }
  auto shape = x.sizes().vec();
  shape.back() = weight.size(0);
  const int64_t K = x.size(-1), M = K ? x.numel() / K : 0;
  // the few-row kernel has no bias (the vision tower's biased linears take 512 rows)
  if (pairs.defined() && !bias.has_value() && x.scalar_type() == at::kBFloat16 &&
      runs_small(M, weight.size(0), weight.size(1))) {
    small_row_count.fetch_add(1, std::memory_order_relaxed);
    return small_rows_matmul(x.is_contiguous() ? x : x.contiguous(), M, pairs, shape);
  }
  return packed_matmul(x.reshape({-1, K}), packed, bias).view(shape);
}

// few_rows: also keep the few-row kernel's copy (not for a weight only many rows multiply,
// such as the vision tower's)
// gelu(x Wg^T) * (x Wu^T), [..., K] -> [..., H], for the fused gate/up weight [2H, K]: in one
// pass (gated_rows) where the weight has its pair copy, the CPU AMX and the shapes whole tiles;
// else the packed linear and the GELU apart, in float32 (results within bf16 of each other).
at::Tensor gated_gelu(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) % 2 == 0 && x.size(-1) == weight.size(1),
              "gated_gelu: weight must be [2H, K] with K = x's last dim, got x ",
              x.sizes(), ", weight ", weight.sizes());
  const int64_t K = weight.size(1), H = weight.size(0) / 2;
  auto shape = x.sizes().vec();
  shape.back() = H;
  auto [packed, pairs] = lookup(weight);
  if (!pairs.defined() || !oxygen::amx_ready() || x.scalar_type() != at::kBFloat16 ||
      K % kAmxK != 0 || H % kBlock != 0) {
    const auto both = ::linear(x, weight, std::nullopt).to(at::kFloat);   // not at::linear
    return (at::gelu(both.narrow(-1, 0, H), "tanh") * both.narrow(-1, H, H)).to(x.scalar_type());
  }
  gated_count.fetch_add(1, std::memory_order_relaxed);
  const auto rows = x.reshape({-1, K}).contiguous();
  const int64_t M = rows.size(0);
  auto out = at::empty({M, H}, rows.options());
  const auto* xd = reinterpret_cast<const uint16_t*>(rows.data_ptr());
  const auto* w = reinterpret_cast<const uint16_t*>(pairs.data_ptr());
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, (M + kAmxRows - 1) / kAmxRows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t r0 = blk * kAmxRows;
      gated_rows(xd + r0 * K, static_cast<int>(std::min(kAmxRows, M - r0)), K, w, H,
                 o + r0 * H);
    }
  });
  return out.view(shape);
}

int64_t gated_calls() { return gated_count.load(); }

int64_t remember(const at::Tensor& weight, const at::Tensor& packed, bool few_rows) {
  const bool small_rows = few_rows && oxygen::has_avx512_bf16() && weight.dim() == 2 &&
                          weight.scalar_type() == at::kBFloat16 && weight.size(1) % 2 == 0;
  Entry entry{WeakImpl(weight.getIntrusivePtr()), weight.sizes().vec(), weight.strides().vec(),
              weight.scalar_type(), version_of(weight), packed,
              small_rows ? pair_layout(weight) : at::Tensor()};
  const int64_t extra = entry.pairs.defined() ? entry.pairs.nbytes() : 0;
  std::lock_guard<std::mutex> guard(registry_lock);
  registry.insert_or_assign(key_of(weight), std::move(entry));
  return extra;  // bytes of the few-row kernel's copy
}

void forget(int64_t key) {
  std::lock_guard<std::mutex> guard(registry_lock);
  registry.erase(key);
}

int64_t stale_calls() { return stale_count.load(); }

// Switch the small-row kernel on or off (every row count then goes to oneDNN); the old value.
bool use_small_rows(bool on) { return small_rows_on.exchange(on); }

bool small_rows_available() { return oxygen::has_avx512_bf16(); }

bool small_rows_on_amx() { return oxygen::amx_ready(); }

// Switch the AMX path off (its rows then run vdpbf16ps, or oneDNN past that kernel's range).
bool use_amx_rows(bool on) { return amx_rows_on.exchange(on); }

int64_t small_row_calls() { return small_row_count.load(); }

int64_t entries() {
  std::lock_guard<std::mutex> guard(registry_lock);
  return static_cast<int64_t>(registry.size());
}

}  // namespace

// Threads at::parallel_for hands the library's tasks to: torch.get_num_threads() where the
// library was built with OpenMP (packed_native's -fopenmp); built without, the header's
// parallel region compiles away and every kernel runs on the caller's thread alone.
int64_t parallel_threads() {
  std::atomic<int64_t> tasks{0};
  at::parallel_for(0, at::get_num_threads(), 1,
                   [&](int64_t, int64_t) { tasks.fetch_add(1, std::memory_order_relaxed); });
  return tasks.load();
}

// linear has a CPU kernel (its fake, for tracing, is registered from Python); the
// bookkeeping ops take any inputs (a packed copy is an mkldnn tensor).
TORCH_LIBRARY(oxygen_packed_native, m) {
  m.def("linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  m.def("gated_gelu(Tensor x, Tensor weight) -> Tensor");
  m.def("plain_rows(Tensor x, Tensor weight) -> Tensor");
  m.def("row_argmax(Tensor x) -> Tensor");
  m.def("row_argmax_available() -> bool", row_argmax_available);
  m.def("gated_calls() -> int", gated_calls);
  m.def("remember(Tensor weight, Tensor packed, bool few_rows=True) -> int", remember);
  m.def("forget(int key) -> ()", forget);
  m.def("stale_calls() -> int", stale_calls);
  m.def("entries() -> int", entries);
  m.def("use_small_rows(bool on) -> bool", use_small_rows);
  m.def("small_rows_available() -> bool", small_rows_available);
  m.def("small_rows_on_amx() -> bool", small_rows_on_amx);
  m.def("use_amx_rows(bool on) -> bool", use_amx_rows);
  m.def("small_row_calls() -> int", small_row_calls);
  m.def("parallel_threads() -> int", parallel_threads);
  m.def("blocked_rows(Tensor x, Tensor packed, int N) -> Tensor", blocked_rows);
  m.def("blocked_rows_available() -> bool", blocked_rows_available);
  m.def("blocked_layout_matches(Tensor weight, Tensor packed, bool full=True) -> bool",
        blocked_layout_matches);
}

TORCH_LIBRARY_IMPL(oxygen_packed_native, CPU, m) {
  m.impl("linear", linear);
  m.impl("gated_gelu", gated_gelu);
  m.impl("plain_rows", plain_rows);
  m.impl("row_argmax", row_argmax);
}
