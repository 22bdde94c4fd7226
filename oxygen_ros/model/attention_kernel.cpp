// Softmax attention on AMX tiles, or in vdpbf16ps where the CPU has AVX512-BF16 but no AMX:
// oxygen_attention::attention (prefill, denoise, vision; a decode step's rows without AMX).
//
// Why: pi05-cpu's prefill attends 8 query heads x 555 positions to one K/V head of 555 keys
// at a head dim of 32, in six layers. ATen's flash kernel takes ~1.9 ms a layer for it (0.8 ns
// a score): at K = 32 its matmuls are too thin for their set-up, and its exp is the accurate
// one. Here 32 query rows meet all keys at once (a row's 555 scores fit in L1): QK^T and PV
// run on AMX tiles (one TDPBF16PS per 16 rows x 16 keys x 32 dims), the softmax in AVX-512
// with a short polynomial exp in base 2 (fast_exp.h; relative error ~7.5e-5, far under bf16's
// 4e-3): ~1.0 ms a layer, measured alone on the AMX Xeon (QK^T ~0.3, softmax ~0.5, PV ~0.2).
// Head dims 48 and 64 (the vision tower's 48) take a second tile for the dims past 32. Without
// AMX the same layouts feed vdpbf16ps, a row at a time (see "the same products in vdpbf16ps").
//
// Contract (model/gemma.py `cpu_attention_applies` decides when it runs): q [B, G, R, D]
// (the heads sharing a K/V head folded into rows, or one head's rows), k, v [B, G, K, D],
// D in {32, 48, 64}, bf16 on the CPU, any strides; key_bias [B, K] fp32 or bf16, added to the
// scores (0, or -inf for a masked key), or a bool mask [B, K] (True = may attend), or none;
// scale D^-0.5. Optionally a second block of keys k2, v2 [B, G, K2, D] with key_bias2 [B, K2]
// (or none: all visible): the rows attend to both with one softmax, each read where it lies
// (a decode step's prefix slot and its generated block; a denoise step's prefix and own
// block), not concatenated first. With index (long [B]), batch row b reads entry index[b] of
// k, v [S, G, K, D] (a pool's storage, read in place: no gather of each row's slot first);
// index2 the same for k2, v2. Returns [B, G, R, D] bf16:
// SDPA's result within bf16 rounding (P is rounded to bf16 for PV as in ATen's kernel;
// maxima and sums are fp32). A masked key weighs exactly 0, and every row is computed alone:
// a row's result does not depend on the others. packed_native.py builds this file with the
// other kernels; nothing else includes it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_features.h"
#include "fast_exp.h"
#include "pair_dot.h"

namespace {

constexpr int64_t kMaxHeadDim = 64;  // head dims taken: 32 (one tile wide), 48, 64 (two)
constexpr int64_t kTileRows = 16;  // rows of a tile
constexpr int64_t kRows = 32;     // query rows a step (two row tiles)
constexpr int64_t kKeys = 16;     // keys per QK^T tile (its N)
constexpr int64_t kChunk = 32;    // keys per PV tile (its K: 16 pairs)
constexpr float kLog2e = 1.44269504f;
std::atomic<int64_t> call_count{0};

using oxygen::TileConfig;

// One (batch, group): keys in the two layouts the tiles read, padded to whole chunks of 32.
// Only the blocks of 16 keys with a key that may be attended are kept (`sources`, in order):
// a masked key weighs exactly 0, so a block of them adds nothing and is skipped whole (a decode
// step's slot of 968 prefix positions holds ~555 valid ones, in runs: a missing camera's, the
// prompt's padding).
//   k_pairs [2 * chunks][D/2 pairs][16 keys][2]: QK^T B tiles per block of 16 keys (16 pairs
//     of dims a tile, a second for dims past 32)
//   v_pairs [chunks][D/16 dim tiles][16 pairs][16 dims][2]: a PV B tile per 32 keys, 16 dims
//   bias [chunks * 32]: the key's bias in base 2 (0, or -inf for a masked key); -inf for padding
//   keep [chunks * 2]: per block of 16 keys, bit j set where its key j has a bias of 0
//   sources: where each block kept comes from (its part, first key, keys)
// The buffers are reused from call to call (arrange_keys overwrites all of them).
struct Source {
  int part;
  int64_t first, count;
};

struct Keys {
  std::vector<uint16_t> k_pairs, v_pairs;
  std::vector<float> bias;
  std::vector<uint16_t> keep;
  std::vector<Source> sources;
  bool mask_only = true;  // every bias is 0 or -inf (a mask, as the model's): keep says it all
  int64_t chunks = 0;
  int64_t dim = 0;  // D
};

// A [K, D] bf16 matrix as its pointer and strides (keys, dims).
struct Rows {
  const uint16_t* data;
  int64_t key_stride, dim_stride;
};

// V rows 2p and 2p + 1, dims 16t..16t+15 -> their pairs (one B tile's row)
__attribute__((target("avx512f,avx512bw"))) void interleave_rows(const uint16_t* a,
                                                                 const uint16_t* b,
                                                                 uint16_t* out) {
  alignas(64) static const uint16_t kPairs[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37,
                                                  6, 38, 7, 39, 8, 40, 9, 41, 10, 42, 11, 43,
                                                  12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i ra = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)a));
  const __m512i rb = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)b));
  _mm512_storeu_si512(out, _mm512_permutex2var_epi16(ra, _mm512_load_si512(kPairs), rb));
}

// One batch row of key_bias as the caller passed it (no conversion op per call: a denoise
// step's [1, 565] bf16 mask cost ~8 us a call through ATen, ~0.5 ms a pi05-cpu denoise).
struct KeyBias {
  enum Kind { kNone, kFloat, kBFloat16, kBool } kind = kNone;
  const void* data = nullptr;
  int64_t stride = 1;   // between keys

  float at(int64_t key) const {   // the bias of `key` (0 or -inf for a mask)
    switch (kind) {
      case kFloat:
        return static_cast<const float*>(data)[key * stride];
      case kBFloat16: {
        const uint32_t bits = uint32_t(static_cast<const uint16_t*>(data)[key * stride]) << 16;
        float value;
        std::memcpy(&value, &bits, 4);
        return value;
      }
      case kBool:
        return static_cast<const bool*>(data)[key * stride]
                   ? 0.0f : -std::numeric_limits<float>::infinity();
      default:
        return 0.0f;
    }
  }
};

// One part of a (batch, group)'s keys: K rows of k and v and their bias. The keys are the
// parts one after another (a decode step's prefix slot, then its generated block: read where
// they live, never concatenated); each part's last block is padded to 16 keys on its own.
struct KeyPart {
  Rows k, v;
  int64_t count;
  KeyBias bias;
};

// Pairs [p0, p0 + n) (n <= 16) of `count` (<= 16) keys, a key's pairs 32-bit words from
// `first` on (keys key_stride apart) -> out [n pairs][16 keys]: a 16 x 16 transpose of words in
// registers, keys past `count` zero. The scalar scatter it replaces cost ~25 ns a key (D = 32):
// a decode step's 8 rows spent 80% of their call arranging 1000 keys.
__attribute__((target("avx512f"))) void transpose_pairs(const uint32_t* first,
                                                        int64_t key_stride, int64_t count,
                                                        int64_t n, uint32_t* out) {
  const auto lanes = static_cast<__mmask16>((1u << n) - 1);
  __m512i r[16], t[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) {
    r[i] = i < count ? _mm512_maskz_loadu_epi32(lanes, first + i * key_stride)
                     : _mm512_setzero_si512();
  }
  // within 128-bit lanes: words of key pairs, then pairs of those
#pragma GCC unroll 8
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 16; i += 4) {   // r[i + c] lane L: keys i..i+3 of pair 4 L + c
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // then across lanes: pair 4 L + c gathers lane L of r[c], r[4 + c], r[8 + c], r[12 + c]
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) {
    const __m512i even_lo = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x88);
    const __m512i odd_lo = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xdd);
    const __m512i even_hi = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x88);
    const __m512i odd_hi = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xdd);
    t[c] = _mm512_shuffle_i32x4(even_lo, even_hi, 0x88);
    t[8 + c] = _mm512_shuffle_i32x4(even_lo, even_hi, 0xdd);
    t[4 + c] = _mm512_shuffle_i32x4(odd_lo, odd_hi, 0x88);
    t[12 + c] = _mm512_shuffle_i32x4(odd_lo, odd_hi, 0xdd);
  }
  for (int64_t p = 0; p < n; ++p) _mm512_storeu_si512(out + p * 16, t[p]);
}

// The bias of keys [key, key + count) (count <= 16, a block) -> block `to` of keys.bias (base
// 2, for softmax_rows; -inf past count) and its keep bits (bias 0); mask_only cleared by a
// bias neither 0 nor -inf. Returns whether every key of the block is masked (-inf).
__attribute__((target("avx512f,avx512bw,avx512vl"))) bool arrange_bias(const KeyBias& bias,
                                                                       int64_t key,
                                                                       int64_t count,
                                                                       int64_t to, Keys& keys) {
  const auto lanes = static_cast<__mmask16>((1u << count) - 1);
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 b = _mm512_setzero_ps();
  if (bias.stride != 1 && bias.kind != KeyBias::kNone) {
    alignas(64) float each[kKeys] = {};
    for (int64_t j = 0; j < count; ++j) each[j] = bias.at(key + j);
    b = _mm512_load_ps(each);
  } else if (bias.kind == KeyBias::kFloat) {
    b = _mm512_maskz_loadu_ps(lanes, static_cast<const float*>(bias.data) + key);
  } else if (bias.kind == KeyBias::kBFloat16) {
    const __m256i half = _mm256_maskz_loadu_epi16(
        lanes, static_cast<const uint16_t*>(bias.data) + key);
    b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
  } else if (bias.kind == KeyBias::kBool) {
    const __m128i flags = _mm_maskz_loadu_epi8(lanes, static_cast<const bool*>(bias.data) + key);
    b = _mm512_mask_blend_ps(_mm_test_epi8_mask(flags, flags), minus_inf, _mm512_setzero_ps());
  }
  const __mmask16 keep = _mm512_mask_cmp_ps_mask(lanes, b, _mm512_setzero_ps(), _CMP_EQ_OQ);
  const __mmask16 masked = _mm512_mask_cmp_ps_mask(lanes, b, minus_inf, _CMP_EQ_OQ);
  keys.keep[to] = keep;
  if ((keep | masked) != lanes) keys.mask_only = false;
  b = _mm512_mask_blend_ps(lanes, minus_inf, _mm512_mul_ps(b, _mm512_set1_ps(kLog2e)));
  _mm512_storeu_ps(keys.bias.data() + to * kKeys, b);
  return masked == lanes;
}

constexpr int64_t kAhead = 4;   // blocks prefetched ahead of the one arranged

void arrange_keys(const KeyPart* parts, int n_parts, int64_t D, Keys& keys) {
  int64_t blocks = 0;  // the parts'
  for (int i = 0; i < n_parts; ++i) blocks += (parts[i].count + kKeys - 1) / kKeys;
  keys.dim = D;
  keys.mask_only = true;
  keys.bias.resize((blocks + 1) * kKeys);
  keys.keep.resize(blocks + 1);
  keys.sources.resize(blocks);
  int64_t kept = 0;  // a block's bias lands at the next free place; a masked one is overwritten
  for (int i = 0; i < n_parts; ++i) {
    const KeyPart& part = parts[i];
    for (int64_t first = 0; first < part.count; first += kKeys) {
      const int64_t count = std::min(kKeys, part.count - first);
      const bool masked = arrange_bias(part.bias, first, count, kept, keys);
      const bool last = i == n_parts - 1 && first + count == part.count;
      if (!masked || (kept == 0 && last)) keys.sources[kept++] = {i, first, count};  // >= 1
    }
  }
  keys.chunks = (kept + 1) / 2;
  const int64_t width = keys.chunks * kChunk;
  keys.k_pairs.resize(width * D);
  keys.v_pairs.resize(width * D);
  static const uint16_t zero[kMaxHeadDim] = {};
  for (int64_t to = 0; to < kept; ++to) {
    const Source& from = keys.sources[to];
    const Rows k = parts[from.part].k, v = parts[from.part].v;
    const int64_t first = from.first, count = from.count;
    if (to + kAhead < kept) {   // a later block's rows on their way (a decode step's are cold)
      const Source& next = keys.sources[to + kAhead];
      const Rows nk = parts[next.part].k, nv = parts[next.part].v;
      for (int64_t j = 0; j < next.count; ++j) {
        const char* k_row =
            reinterpret_cast<const char*>(nk.data + (next.first + j) * nk.key_stride);
        const char* v_row =
            reinterpret_cast<const char*>(nv.data + (next.first + j) * nv.key_stride);
        for (int64_t line = 0; line < D * 2; line += 64) {   // a row's cache lines (D x 2 B)
          _mm_prefetch(k_row + line, _MM_HINT_T0);
          _mm_prefetch(v_row + line, _MM_HINT_T0);
        }
      }
    }
    const bool dense = k.dim_stride == 1 && v.dim_stride == 1 && k.key_stride % 2 == 0;
    if (dense) {  // a pair of dims is one 32-bit word; keys past count zero
      for (int64_t p0 = 0; p0 < D / 2; p0 += 16) {
        transpose_pairs(reinterpret_cast<const uint32_t*>(k.data + first * k.key_stride) + p0,
                        k.key_stride / 2, count, std::min<int64_t>(16, D / 2 - p0),
                        reinterpret_cast<uint32_t*>(keys.k_pairs.data()) +
                            (to * (D / 2) + p0) * kKeys);
      }
    } else {
      uint16_t* block = keys.k_pairs.data() + to * kKeys * D;
      std::fill(block, block + kKeys * D, 0);
      for (int64_t j = 0; j < count; ++j) {
        const uint16_t* row = k.data + (first + j) * k.key_stride;
        for (int64_t d = 0; d < D; ++d) {
          block[((d / 2) * kKeys + j) * 2 + d % 2] = row[d * k.dim_stride];
        }
      }
    }
    // V: the block's key pairs are pairs 0-7 (an even block) or 8-15 of chunk to / 2
    for (int64_t j = 0; j < kKeys; j += 2) {
      const int64_t key = first + j, pair = (to % 2) * (kKeys / 2) + j / 2;
      for (int64_t t = 0; t < D / 16; ++t) {
        uint16_t* out = keys.v_pairs.data() + (((to / 2) * (D / 16) + t) * 16 + pair) * 32;
        if (j >= count) {  // padding: zero, which its -inf bias drops
          std::fill(out, out + 32, 0);
        } else if (dense) {
          interleave_rows(v.data + key * v.key_stride + 16 * t,
                          j + 1 < count ? v.data + (key + 1) * v.key_stride + 16 * t : zero,
                          out);
        } else {
          for (int64_t d = 0; d < 16; ++d) {
            out[d * 2] = v.data[key * v.key_stride + (16 * t + d) * v.dim_stride];
            out[d * 2 + 1] = j + 1 < count
                ? v.data[(key + 1) * v.key_stride + (16 * t + d) * v.dim_stride] : 0;
          }
        }
      }
    }
  }
  if (kept % 2 == 1) {  // the last chunk's second block: padding
    std::fill(keys.k_pairs.end() - kKeys * D, keys.k_pairs.end(), 0);
    for (int64_t t = 0; t < D / 16; ++t) {
      uint16_t* out = keys.v_pairs.data() + (((kept / 2) * (D / 16) + t) * 16 + 8) * 32;
      std::fill(out, out + 8 * 32, 0);
    }
    std::fill(keys.bias.begin() + kept * kKeys, keys.bias.begin() + width,
              -std::numeric_limits<float>::infinity());
    keys.keep[kept] = 0;
  }
}

// The tile unit gets independent products to overlap from two row tiles of 16 at once.
//
// QK^T at D = 32 (one tile wide): tiles 0, 1 the row halves of Q; 2, 5 two key blocks; 3, 4,
// 6, 7 their scores (four accumulators).
__attribute__((target("amx-tile,amx-bf16"))) void scores_narrow(const uint16_t* q_rows,
                                                                const Keys& keys,
                                                                float* scores) {
  const int64_t width = keys.chunks * kChunk, D = keys.dim;
  const uint16_t* kp = keys.k_pairs.data();
  _tile_loadd(0, q_rows, D * 2);
  _tile_loadd(1, q_rows + kTileRows * D, D * 2);
  for (int64_t c = 0; c < keys.chunks; ++c) {
    _tile_zero(3);
    _tile_zero(4);
    _tile_zero(6);
    _tile_zero(7);
    _tile_loadd(2, kp + (2 * c) * kKeys * D, 64);
    _tile_loadd(5, kp + (2 * c + 1) * kKeys * D, 64);
    _tile_dpbf16ps(3, 0, 2);
    _tile_dpbf16ps(4, 1, 2);
    _tile_dpbf16ps(6, 0, 5);
    _tile_dpbf16ps(7, 1, 5);
    float* at = scores + c * kChunk;
    _tile_stored(3, at, width * 4);
    _tile_stored(4, at + kTileRows * width, width * 4);
    _tile_stored(6, at + kKeys, width * 4);
    _tile_stored(7, at + kTileRows * width + kKeys, width * 4);
  }
}

// QK^T at D = 48 or 64 (two tiles wide: dims 0-31, then the rest): tiles 0, 1 the first row
// half's two parts, 2, 3 the second's; 4, 5 a key block's two parts; 6, 7 its scores.
__attribute__((target("amx-tile,amx-bf16"))) void scores_wide(const uint16_t* q_rows,
                                                              const Keys& keys, float* scores) {
  const int64_t width = keys.chunks * kChunk, D = keys.dim;
  const uint16_t* kp = keys.k_pairs.data();
  _tile_loadd(0, q_rows, D * 2);
  _tile_loadd(1, q_rows + 32, D * 2);
  _tile_loadd(2, q_rows + kTileRows * D, D * 2);
  _tile_loadd(3, q_rows + kTileRows * D + 32, D * 2);
  for (int64_t b = 0; b < 2 * keys.chunks; ++b) {
    const uint16_t* block = kp + b * kKeys * D;  // [D/2 pairs][16 keys][2]
    _tile_zero(6);
    _tile_zero(7);
    _tile_loadd(4, block, 64);
    _tile_loadd(5, block + 16 * 32, 64);  // from pair 16 (dim 32) on
    _tile_dpbf16ps(6, 0, 4);
    _tile_dpbf16ps(7, 2, 4);
    _tile_dpbf16ps(6, 1, 5);
    _tile_dpbf16ps(7, 3, 5);
    _tile_stored(6, scores + b * kKeys, width * 4);
    _tile_stored(7, scores + kTileRows * width + b * kKeys, width * 4);
  }
}

// 16 scores scaled and biased (in base 2)
__attribute__((target("avx512f"))) inline __m512 biased(const float* scores, __m512 scale,
                                                        const float* bias) {
  return _mm512_fmadd_ps(_mm512_loadu_ps(scores), scale, _mm512_loadu_ps(bias));
}

// P = exp(S scale + bias - max), unnormalised, in bf16; 1 / the row sums (fp32) in inv_sum.
// Computed in base 2 (the scale and the keys' bias carry log2 e: e^x = 2^(x log2 e)), so the
// exp needs no range reduction (fast_exp2). A row is read twice (max, then exp) rather than
// stored scaled: the fmadd costs less. MaskOnly (every bias 0 or -inf, the model's masks):
// the keys' keep bits mask the max and the exp, and the bias is never read: one op less in
// the max's loop and two in the exp's (a prefill layer's softmax ~0.61 -> 0.50 ms, pi05-cpu,
// AMX Xeon, alone). Either way a masked key weighs exactly 0.
template <bool MaskOnly>
__attribute__((target("avx512f,avx512bw,avx512bf16,avx512vl"))) void softmax_rows(
    const Keys& keys, float scale, const float* scores, uint16_t* probs, float* inv_sum,
    int64_t rows) {
  const int64_t width = keys.chunks * kChunk;
  const __m512 vscale = _mm512_set1_ps(scale * kLog2e);
  const __m512 floor = _mm512_set1_ps(-1e30f);
  const float* bias = keys.bias.data();   // in base 2 (arrange_keys)
  const uint16_t* keep = keys.keep.data();
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = scores + r * width;
    __m512 max0 = _mm512_set1_ps(-std::numeric_limits<float>::infinity()), max1 = max0;
    for (int64_t c = 0; c < width; c += 32) {  // width is whole chunks of 32
      if constexpr (MaskOnly) {   // the raw scores' max (the scale is positive)
        max0 = _mm512_mask_max_ps(max0, keep[c / 16], max0, _mm512_loadu_ps(row + c));
        max1 = _mm512_mask_max_ps(max1, keep[c / 16 + 1], max1, _mm512_loadu_ps(row + c + 16));
      } else {
        max0 = _mm512_max_ps(max0, biased(row + c, vscale, bias + c));
        max1 = _mm512_max_ps(max1, biased(row + c + 16, vscale, bias + c + 16));
      }
    }
    __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(_mm512_max_ps(max0, max1)));
    if constexpr (MaskOnly) m = _mm512_mul_ps(m, vscale);
    __m512 sum0 = _mm512_setzero_ps(), sum1 = sum0;
    for (int64_t c = 0; c < width; c += 32) {
      __m512 p0, p1;
      if constexpr (MaskOnly) {
        p0 = oxygen::fast_exp2<3>(_mm512_fmsub_ps(_mm512_loadu_ps(row + c), vscale, m),
                                  keep[c / 16]);
        p1 = oxygen::fast_exp2<3>(_mm512_fmsub_ps(_mm512_loadu_ps(row + c + 16), vscale, m),
                                  keep[c / 16 + 1]);
      } else {
        const __m512 s0 = biased(row + c, vscale, bias + c);
        const __m512 s1 = biased(row + c + 16, vscale, bias + c + 16);
        // a masked key's -inf gives exactly 0, not the clamped exp's tiny value
        p0 = oxygen::fast_exp2<3>(_mm512_sub_ps(s0, m),
                                  _mm512_cmp_ps_mask(s0, floor, _CMP_GT_OQ));
        p1 = oxygen::fast_exp2<3>(_mm512_sub_ps(s1, m),
                                  _mm512_cmp_ps_mask(s1, floor, _CMP_GT_OQ));
      }
      _mm512_storeu_si512(probs + r * width + c, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
      sum0 = _mm512_add_ps(sum0, p0);
      sum1 = _mm512_add_ps(sum1, p1);
    }
    inv_sum[r] = 1.0f / _mm512_reduce_add_ps(_mm512_add_ps(sum0, sum1));
  }
}

// O = P V [32][D] fp32 into acc, 32 keys a step. D = 32: tiles 0, 1 the row halves of P; 2, 3
// the dim halves of V; 4-7 the four outputs. Wider: one dim tile of 16 at a time, tiles 0, 2
// the row halves of P, 4 the V tile, 6, 7 the outputs.
__attribute__((target("amx-tile,amx-bf16"))) void values(const Keys& keys,
                                                         const uint16_t* probs, float* acc) {
  const int64_t width = keys.chunks * kChunk, D = keys.dim;
  const uint16_t* vp = keys.v_pairs.data();
  if (D == 32) {
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int64_t c = 0; c < keys.chunks; ++c) {
      _tile_loadd(0, probs + c * kChunk, width * 2);
      _tile_loadd(1, probs + kTileRows * width + c * kChunk, width * 2);
      _tile_loadd(2, vp + (c * 2 + 0) * 16 * 32, 64);
      _tile_loadd(3, vp + (c * 2 + 1) * 16 * 32, 64);
      _tile_dpbf16ps(4, 0, 2);
      _tile_dpbf16ps(5, 0, 3);
      _tile_dpbf16ps(6, 1, 2);
      _tile_dpbf16ps(7, 1, 3);
    }
    _tile_stored(4, acc, D * 4);
    _tile_stored(5, acc + 16, D * 4);
    _tile_stored(6, acc + kTileRows * D, D * 4);
    _tile_stored(7, acc + kTileRows * D + 16, D * 4);
    return;
  }
  for (int64_t t = 0; t < D / 16; ++t) {
    _tile_zero(6);
    _tile_zero(7);
    for (int64_t c = 0; c < keys.chunks; ++c) {
      _tile_loadd(0, probs + c * kChunk, width * 2);
      _tile_loadd(2, probs + kTileRows * width + c * kChunk, width * 2);
      _tile_loadd(4, vp + (c * (D / 16) + t) * 16 * 32, 64);
      _tile_dpbf16ps(6, 0, 4);
      _tile_dpbf16ps(7, 2, 4);
    }
    _tile_stored(6, acc + 16 * t, D * 4);
    _tile_stored(7, acc + kTileRows * D + 16 * t, D * 4);
  }
}

// ------------------------------------------- the same products in vdpbf16ps (no AMX)
// Where the CPU has AVX512-BF16 but no AMX (AMD Zen 4, Cooper Lake), one vdpbf16ps does for a
// row what a tile product does for 16: it reads the same pair layouts (a key block's pairs are
// a B tile's rows), so arrange_keys and the softmax serve both. Only the n rows asked are
// computed. ATen's flash kernel, the alternative, took 147 us for a pi05-cpu denoise step's
// 80 rows x 565 keys and 4 ms for a prefill layer (AMD EPYC, 1 thread).

// scores[M rows][NB blocks of 16 keys from b0] = q_rows . keys: M x NB accumulators in
// registers, a key vector loaded once for M rows (enough independent sums to hide latency).
template <int M, int NB>
__attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl"))) void scores_dp_block(
    const uint16_t* q_rows, const Keys& keys, int64_t b0, float* scores) {
  const int64_t width = keys.chunks * kChunk, P = keys.dim / 2;
  __m512 acc[M][NB];
  oxygen::pair_dot<M, NB>(reinterpret_cast<const int32_t*>(q_rows),
                          keys.k_pairs.data() + b0 * kKeys * keys.dim, P, acc);
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) {
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) {
      _mm512_storeu_ps(scores + m * width + (b0 + j) * kKeys, acc[m][j]);
    }
  }
}

// M rows of QK^T over all key blocks (2 per chunk, so always an even count)
template <int M>
void scores_dp_rows(const uint16_t* q_rows, const Keys& keys, float* scores) {
  const int64_t blocks = 2 * keys.chunks;
  int64_t b = 0;
  for (; b + 4 <= blocks; b += 4) scores_dp_block<M, 4>(q_rows, keys, b, scores);
  for (; b < blocks; b += 2) scores_dp_block<M, 2>(q_rows, keys, b, scores);
}

// acc[M rows][D] = probs . V over all chunks, T = D / 16 dim vectors a row
template <int M, int T>
__attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl"))) void values_dp_rows(
    const Keys& keys, const uint16_t* probs, float* acc) {
  const int64_t width = keys.chunks * kChunk;
  const auto* p_pairs = reinterpret_cast<const int32_t*>(probs);  // probs[m][2i..2i+1]
  const uint16_t* vp = keys.v_pairs.data();
  __m512 sums[M][T];
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) {
#pragma GCC unroll 4
    for (int t = 0; t < T; ++t) sums[m][t] = _mm512_setzero_ps();
  }
  for (int64_t c = 0; c < keys.chunks; ++c) {
    for (int64_t p = 0; p < kChunk / 2; ++p) {
      __m512bh vv[T];
#pragma GCC unroll 4
      for (int t = 0; t < T; ++t) {
        vv[t] = (__m512bh)_mm512_loadu_si512(vp + ((c * T + t) * 16 + p) * 32);
      }
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        const __m512bh pv = (__m512bh)_mm512_set1_epi32(p_pairs[m * width / 2 + c * 16 + p]);
#pragma GCC unroll 4
        for (int t = 0; t < T; ++t) sums[m][t] = _mm512_dpbf16_ps(sums[m][t], pv, vv[t]);
      }
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) {
#pragma GCC unroll 4
    for (int t = 0; t < T; ++t) _mm512_storeu_ps(acc + m * T * 16 + t * 16, sums[m][t]);
  }
}

// n rows (1..32): groups of 4, then what is left
void scores_dp(const uint16_t* q_rows, const Keys& keys, int64_t n, float* scores) {
  const int64_t width = keys.chunks * kChunk, D = keys.dim;
  int64_t r = 0;
  for (; r + 4 <= n; r += 4) scores_dp_rows<4>(q_rows + r * D, keys, scores + r * width);
  switch (n - r) {
    case 3: scores_dp_rows<3>(q_rows + r * D, keys, scores + r * width); break;
    case 2: scores_dp_rows<2>(q_rows + r * D, keys, scores + r * width); break;
    case 1: scores_dp_rows<1>(q_rows + r * D, keys, scores + r * width); break;
    default: break;
  }
}

template <int T>
void values_dp_dims(const Keys& keys, const uint16_t* probs, int64_t n, float* acc) {
  constexpr int kGroup = T <= 2 ? 8 : 4;   // up to 16 sums in registers
  const int64_t width = keys.chunks * kChunk, D = keys.dim;
  int64_t r = 0;
  for (; r + kGroup <= n; r += kGroup) {
    values_dp_rows<kGroup, T>(keys, probs + r * width, acc + r * D);
  }
  for (; r < n; ++r) values_dp_rows<1, T>(keys, probs + r * width, acc + r * D);
}

void values_dp(const Keys& keys, const uint16_t* probs, int64_t n, float* acc) {
  switch (keys.dim) {
    case 32: values_dp_dims<2>(keys, probs, n, acc); break;
    case 48: values_dp_dims<3>(keys, probs, n, acc); break;
    default: values_dp_dims<4>(keys, probs, n, acc); break;
  }
}

// 32 query rows of one (batch, group): q_rows [32][D] bf16 (rows past n zero) -> out [n][D].
// tiles: on AMX (all 32 rows, two row tiles), else vdpbf16ps (the n rows).
__attribute__((target("avx512f,avx512bw,avx512bf16,avx512vl"))) void attend_rows(
    const uint16_t* q_rows, const Keys& keys, int64_t n, float scale, float* scores,
    uint16_t* probs, float* acc, uint16_t* out, bool tiles) {
  const int64_t D = keys.dim;
  if (!tiles) {
    scores_dp(q_rows, keys, n, scores);
  } else if (D == 32) {
    scores_narrow(q_rows, keys, scores);
  } else {
    scores_wide(q_rows, keys, scores);
  }
  float inv_sum[kRows];
  const int64_t rows = tiles ? kRows : n;
  if (keys.mask_only) {
    softmax_rows<true>(keys, scale, scores, probs, inv_sum, rows);
  } else {
    softmax_rows<false>(keys, scale, scores, probs, inv_sum, rows);
  }
  if (tiles) {
    values(keys, probs, acc);
  } else {
    values_dp(keys, probs, n, acc);
  }
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t t = 0; t < D / 16; ++t) {
      const __m512 o = _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + t * 16),
                                     _mm512_set1_ps(inv_sum[r]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * D + t * 16),
                          (__m256i)_mm512_cvtneps_pbh(o));
    }
  }
}

// The tile shapes, one config per head dim (see scores_narrow, scores_wide, values); globals
// (cpu_features.h says why).
TileConfig tile_config(int64_t D) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  if (D > 32) {   // the second parts: Q's dims past 32 (tiles 1, 3), K's pairs past 16 (5)
    config.colsb[1] = config.colsb[3] = static_cast<uint16_t>((D - 32) * 2);
    config.rows[5] = static_cast<uint8_t>((D - 32) / 2);
  }
  return config;
}

const TileConfig kTiles32 = tile_config(32), kTiles48 = tile_config(48),
                 kTiles64 = tile_config(64);

__attribute__((target("amx-tile"))) void configure_tiles(int64_t D) {
  _tile_loadconfig(D == 32 ? &kTiles32 : D == 48 ? &kTiles48 : &kTiles64);
}

__attribute__((target("amx-tile"))) void release_tiles() { _tile_release(); }

// AVX512-BF16 (the softmax's, and vdpbf16ps where there is no AMX)
bool available() { return oxygen::has_avx512_bf16(); }

bool on_amx() { return oxygen::amx_ready(); }   // the products on AMX tiles

int64_t calls() { return call_count.load(); }

// A key bias as passed ([B, K] fp32, bf16 or bool; another dtype converted once), read in
// place by KeyBias; none where undefined.
struct BiasArg {
  at::Tensor tensor;
  KeyBias::Kind kind = KeyBias::kNone;

  BiasArg(const std::optional<at::Tensor>& bias, int64_t B, int64_t K, const char* name) {
    if (!bias.has_value()) return;
    TORCH_CHECK(bias->dim() == 2 && bias->size(0) == B && bias->size(1) == K, name,
                " must be [B, K] = [", B, ", ", K, "], got ", bias->sizes());
    const auto dtype = bias->scalar_type();
    tensor = dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kBool
                 ? *bias : bias->to(at::kFloat);
    kind = tensor.scalar_type() == at::kFloat      ? KeyBias::kFloat
           : tensor.scalar_type() == at::kBFloat16 ? KeyBias::kBFloat16
                                                   : KeyBias::kBool;
  }

  KeyBias row(int64_t b) const {
    if (!tensor.defined()) return {};
    return {kind, static_cast<const char*>(tensor.data_ptr()) +
                      b * tensor.stride(0) * tensor.element_size(), tensor.stride(1)};
  }
};

// K/V rows of group g of entry e of k [S, G, K, D]
Rows rows_of(const at::Tensor& k, int64_t e, int64_t g) {
  return {reinterpret_cast<const uint16_t*>(k.data_ptr()) + e * k.stride(0) + g * k.stride(1),
          k.stride(2), k.stride(3)};
}

// The entry of k [S, G, K, D] each batch row reads: index[b] (long [B] on the CPU, checked
// against S), or b itself without an index (then S = B).
std::vector<int64_t> entries(const std::optional<at::Tensor>& index, const at::Tensor& k,
                             int64_t B, const char* name) {
  std::vector<int64_t> out(B);
  if (!index.has_value()) {
    TORCH_CHECK(k.size(0) == B, name, ": without an index its first dim must be B = ", B,
                ", got ", k.size(0));
    for (int64_t b = 0; b < B; ++b) out[b] = b;
    return out;
  }
  TORCH_CHECK(index->dim() == 1 && index->size(0) == B && index->scalar_type() == at::kLong &&
                  index->device().is_cpu(),
              name, "'s index must be long [B] = [", B, "] on the CPU, got ", index->sizes(),
              " ", index->scalar_type());
  const auto rows = index->contiguous();
  const int64_t* ids = rows.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(ids[b] >= 0 && ids[b] < k.size(0), name, "'s index ", ids[b], " (row ", b,
                ") is outside its ", k.size(0), " entries");
    out[b] = ids[b];
  }
  return out;
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const std::optional<at::Tensor>& key_bias,
                     const std::optional<at::Tensor>& k2, const std::optional<at::Tensor>& v2,
                     const std::optional<at::Tensor>& key_bias2,
                     const std::optional<at::Tensor>& index,
                     const std::optional<at::Tensor>& index2) {
  TORCH_CHECK(oxygen::has_avx512_bf16(),
              "oxygen_attention::attention needs AVX512-BF16 (available() says)");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q, k, v must be [B, G, rows, D]");
  const int64_t D = q.size(3);
  TORCH_CHECK((D == 32 || D == 48 || D == 64) && k.size(3) == D && v.size(3) == D,
              "head dim must be 32, 48 or 64 (q, k and v alike), got ", D);
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
                  v.scalar_type() == at::kBFloat16, "q, k, v must be bfloat16");
  const int64_t B = q.size(0), G = q.size(1), R = q.size(2), K = k.size(2);
  TORCH_CHECK(k.size(1) == G && v.sizes() == k.sizes(),
              "k, v must be [S, G, K, D] alike with q's G and D, got ", k.sizes(), " and ",
              v.sizes());
  TORCH_CHECK(k2.has_value() == v2.has_value(), "k2 and v2 come together");
  TORCH_CHECK(k2.has_value() || !index2.has_value(), "index2 needs k2 and v2");
  TORCH_CHECK(k2.has_value() || !key_bias2.has_value(), "key_bias2 needs k2 and v2");
  const int64_t K2 = k2.has_value() ? k2->size(2) : 0;
  if (k2.has_value()) {
    TORCH_CHECK(k2->dim() == 4 && k2->size(1) == G && k2->size(3) == D &&
                    v2->sizes() == k2->sizes(),
                "k2, v2 must be [S2, G, K2, D] like k, got ", k2->sizes(), " and ", v2->sizes());
    TORCH_CHECK(k2->scalar_type() == at::kBFloat16 && v2->scalar_type() == at::kBFloat16,
                "k2, v2 must be bfloat16");
  }
  TORCH_CHECK(K + K2 > 0, "attention needs at least one key");
  const BiasArg bias(key_bias, B, K, "key_bias"), bias2(key_bias2, B, K2, "key_bias2");
  const std::vector<int64_t> at1 = entries(index, k, B, "k"),
                             at2 = k2.has_value() ? entries(index2, *k2, B, "k2")
                                                  : std::vector<int64_t>();
  call_count.fetch_add(1, std::memory_order_relaxed);
  auto out = at::empty({B, G, R, D}, q.options());
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  // The caller's arranged keys, kept between calls. A thread_local named inside the workers'
  // lambda would be each worker's own (empty) one, so they read them through this reference.
  thread_local std::vector<Keys> kept;
  std::vector<Keys>& keys = kept;
  if (static_cast<int64_t>(keys.size()) < B * G) keys.resize(B * G);
  for (int64_t bg = 0; bg < B * G; ++bg) {
    const int64_t b = bg / G, g = bg % G;
    KeyPart parts[2] = {{rows_of(k, at1[b], g), rows_of(v, at1[b], g), K, bias.row(b)}, {}};
    int n_parts = 1;
    if (K2 > 0) {
      parts[n_parts++] = {rows_of(*k2, at2[b], g), rows_of(*v2, at2[b], g), K2, bias2.row(b)};
    }
    arrange_keys(parts, n_parts, D, keys[bg]);
  }
  const int64_t row_blocks = (R + kRows - 1) / kRows;
  const auto* qd = reinterpret_cast<const uint16_t*>(q.data_ptr());
  const auto qs = q.strides();
  auto* od = reinterpret_cast<uint16_t*>(out.data_ptr());
  const bool tiles = oxygen::amx_ready();
  int64_t chunks = 0;  // the most any (batch, group) kept: its masked blocks are skipped
  for (int64_t bg = 0; bg < B * G; ++bg) chunks = std::max(chunks, keys[bg].chunks);
  at::parallel_for(0, B * G * row_blocks, 1, [&](int64_t begin, int64_t end) {
    const int64_t width = chunks * kChunk;
    thread_local std::vector<float> scores, acc;
    thread_local std::vector<uint16_t> probs, q_rows;
    scores.resize(kRows * width);
    probs.resize(kRows * width);
    acc.resize(kRows * D);
    q_rows.resize(kRows * D);
    if (tiles) configure_tiles(D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t bg = item / row_blocks, r0 = (item % row_blocks) * kRows;
      const int64_t b = bg / G, g = bg % G, n = std::min(kRows, R - r0);
      std::fill(q_rows.begin(), q_rows.end(), 0);
      const uint16_t* first = qd + b * qs[0] + g * qs[1] + r0 * qs[2];
      for (int64_t r = 0; r < n; ++r) {
        if (qs[3] == 1) {
          std::memcpy(&q_rows[r * D], first + r * qs[2], D * 2);
        } else {
          for (int64_t d = 0; d < D; ++d) {
            q_rows[r * D + d] = first[r * qs[2] + d * qs[3]];
          }
        }
      }
      attend_rows(q_rows.data(), keys[bg], n, scale, scores.data(), probs.data(), acc.data(),
                  od + ((b * G + g) * R + r0) * D, tiles);
    }
    if (tiles) release_tiles();
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(oxygen_attention, m) {
  m.def("attention(Tensor q, Tensor k, Tensor v, Tensor? key_bias, Tensor? k2=None, "
        "Tensor? v2=None, Tensor? key_bias2=None, Tensor? index=None, Tensor? index2=None) "
        "-> Tensor");
  m.def("available() -> bool", available);
  m.def("on_amx() -> bool", on_amx);
  m.def("calls() -> int", calls);
}

TORCH_LIBRARY_IMPL(oxygen_attention, CPU, m) { m.impl("attention", attention); }
