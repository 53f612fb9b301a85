// Decode attention on an AVX-512 CPU (tandem.core.cpu_attention builds and calls it).
//
// query [rows, kv_heads, queries, dim] bf16: the query heads that share a key/value head stacked along the query axis
// (core.attention); key, value [rows, kv_heads, length, dim] bf16, each position's dim contiguous (views of the slot
// cache); mask [rows, 1, 1 or queries, length] bool, true where a query sees a key, or undefined (every key seen).
// Returns [rows, kv_heads, queries, dim] bf16: softmax(q k^T * scale) v, accumulated in float32.
//
// One task per (row, kv head): every key and value it reads once from memory, for all its queries; keys after the
// last one any query sees are not read. Where the CPU has AVX512-BF16 (bf16_dot), dot products compute the scores, a
// block of 16 keys at a time (each query's 16 dot products summed together, sum16, not one horizontal sum per key),
// and the weighted values, with the weights rounded to bf16 as PyTorch's bf16 sdpa rounds them; else float32
// multiply-adds on widened keys and values. A query that sees no key gets zeros. A query's result does not depend on
// the other queries of its call (its row's width, its batch mates): the keys it does not see add exact zeros.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

namespace {

constexpr int64_t BLOCK = 32;  // values widened to float32 per block, reused by every query from L1
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
alignas(64) const uint16_t ZEROS[256] = {};  // a key of zeros, for a block's places past the last key

inline __m512 load_bf16(const uint16_t* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

inline float bf16_to_float(uint16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, as PyTorch converts
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

// e^x for x <= 0: 2^(x log2 e), the fraction's power by a degree-6 polynomial (relative error ~1e-7), the integer's
// by scalef. Below -87 (under float32's smallest normal), and for a masked key's -inf, exactly 0.
inline __m512 exp_ps(__m512 x) {
  const __mmask16 kept = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_GE_OQ);
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(1.4426950408889634f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_maskz_mov_ps(kept, _mm512_scalef_ps(p, n));
}

struct Task {
  const uint16_t* query;  // [queries, dim]
  const uint16_t* key;    // position t at key + t * key_step
  const uint16_t* value;
  int64_t key_step, value_step;
  const bool* mask;  // this row's [mask_rows, length] (strided), or null
  int64_t mask_rows, mask_row_step, mask_key_step;
  int64_t queries, length;
  float scale;
  uint16_t* out;  // [queries, dim]
};

// A thread's working memory, sized once per call.
struct Scratch {
  int64_t stride;  // scores per query: the length rounded up to whole blocks of 16
  std::vector<float> q, scores, acc, widened, inv;
  std::vector<uint16_t> weights;  // the softmax weights in bf16 (bf16_dot), [queries, stride]
  Scratch(int64_t queries, int64_t length, int64_t dim)
      : stride((length + 15) / 16 * 16), q(queries * dim), scores(queries * stride), acc(queries * dim),
        widened(BLOCK * dim), inv(queries), weights(queries * stride) {}
};

// Lane j of the result: the sum of part[j]'s 16 lanes, by one tree for every j (so a key's score does not depend on
// its place in the block).
__attribute__((always_inline)) inline __m512 sum16(const __m512* part) {
  __m512 pairs[8], quads[4], halves[2];
  for (int i = 0; i < 8; ++i)
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(part[2 * i], part[2 * i + 1]),
                             _mm512_unpackhi_ps(part[2 * i], part[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    quads[i] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0xEE));
  for (int i = 0; i < 2; ++i)
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0x88),
                              _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], 0x88),
                       _mm512_shuffle_f32x4(halves[0], halves[1], 0xDD));
}

// Which of keys [t0, t0 + 16) query row `mg` sees (every key before `live` where there is no mask).
inline __mmask16 seen(const bool* mg, int64_t key_step, int64_t t0, int64_t live) {
  const int64_t n = std::min<int64_t>(16, live - t0);
  const __mmask16 in = static_cast<__mmask16>(n >= 16 ? 0xFFFF : (1u << n) - 1);
  if (!mg) return in;
  if (key_step == 1) return _mm_mask_test_epi8_mask(in, _mm_maskz_loadu_epi8(in, mg + t0), _mm_set1_epi8(1));
  __mmask16 bits = 0;
  for (int64_t j = 0; j < n; ++j) bits |= static_cast<__mmask16>(mg[(t0 + j) * key_step] ? 1u << j : 0u);
  return bits;
}

inline const bool* mask_row(const Task& task, int64_t g) {
  return task.mask ? task.mask + (task.mask_rows == 1 ? 0 : g) * task.mask_row_step : nullptr;
}

// 32 bf16 from p (16 for a head dim of 16, the rest zeros), as vdpbf16ps takes them.
template <int DIM>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
inline __m512bh bf16_pairs(const uint16_t* p) {
  if constexpr (DIM >= 32) return (__m512bh)_mm512_loadu_si512(p);
  else return (__m512bh)_mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Scores, the AVX512-BF16 way: each query's bf16 pairs dotted with each key's (vdpbf16ps: exact products, float32
// sums), times the scale; -inf where the query does not see the key. Keys in blocks of 16, each block read from L1 by
// every query, its 16 dot products reduced together.
template <int DIM>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
void scores_bf16(const Task& task, int64_t live, Scratch& w) {
  constexpr int CHUNKS = DIM >= 32 ? DIM / 32 : 1;
  const __m512 scale = _mm512_set1_ps(task.scale);
  for (int64_t t0 = 0; t0 < live; t0 += 16) {
    const uint16_t* keys[16];  // a block's keys; past `live`, a row of zeros (its scores are masked)
    for (int64_t j = 0; j < 16; ++j) keys[j] = t0 + j < live ? task.key + (t0 + j) * task.key_step : ZEROS;
    for (int64_t g = 0; g < task.queries; ++g) {
      __m512bh q[CHUNKS];
      for (int c = 0; c < CHUNKS; ++c) q[c] = bf16_pairs<DIM>(task.query + g * DIM + 32 * c);
      __m512 part[16];  // unrolled, so that the 16 sums stay in registers
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) {
        __m512 sum = _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int c = 0; c < CHUNKS; ++c) sum = _mm512_dpbf16_ps(sum, bf16_pairs<DIM>(keys[j] + 32 * c), q[c]);
        part[j] = sum;
      }
      const __mmask16 m = seen(mask_row(task, g), task.mask_key_step, t0, live);
      _mm512_storeu_ps(w.scores.data() + g * w.stride + t0,
                       _mm512_mask_mul_ps(_mm512_set1_ps(NEG_INF), m, sum16(part), scale));
    }
  }
}

// Scores without AVX512-BF16: each key widened to float32 once, in registers, dotted with every scaled float32
// query (one horizontal sum per key and query: with float32 products, summing 16 keys together measured slower);
// then -inf where a query does not see the key.
template <int DIM>
void scores_f32(const Task& task, int64_t live, Scratch& w) {
  constexpr int CHUNKS = DIM / 16;
  float* q = w.q.data();
  float* scores = w.scores.data();
  for (int64_t i = 0; i < task.queries * DIM; ++i) q[i] = bf16_to_float(task.query[i]) * task.scale;
  for (int64_t t = 0; t < live; ++t) {
    __m512 k[CHUNKS];
    for (int c = 0; c < CHUNKS; ++c) k[c] = load_bf16(task.key + t * task.key_step + 16 * c);
    for (int64_t g = 0; g < task.queries; ++g) {
      const float* qg = q + g * DIM;
      __m512 sum = _mm512_mul_ps(k[0], _mm512_loadu_ps(qg));
      for (int c = 1; c < CHUNKS; ++c) sum = _mm512_fmadd_ps(k[c], _mm512_loadu_ps(qg + 16 * c), sum);
      scores[g * w.stride + t] = _mm512_reduce_add_ps(sum);
    }
  }
  for (int64_t g = 0; g < task.queries; ++g)
    for (int64_t t0 = 0; t0 < live; t0 += 16) {
      const __mmask16 m = seen(mask_row(task, g), task.mask_key_step, t0, live);
      float* s = scores + g * w.stride + t0;
      _mm512_storeu_ps(s, _mm512_mask_mov_ps(_mm512_set1_ps(NEG_INF), m, _mm512_loadu_ps(s)));
    }
}

// A query's scores over [0, live) to e^(s - max) in place; returns 1 / their sum, or 0 where it sees no key.
float softmax(float* s, int64_t live) {
  __m512 vtop = _mm512_set1_ps(NEG_INF);
  for (int64_t t = 0; t < live; t += 16) vtop = _mm512_max_ps(vtop, _mm512_loadu_ps(s + t));  // padded: -inf past live
  const float top = _mm512_reduce_max_ps(vtop);
  if (top == NEG_INF) return 0.f;
  vtop = _mm512_set1_ps(top);
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t t = 0; t < live; t += 16) {
    const __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(s + t), vtop));
    _mm512_storeu_ps(s + t, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  return 1.f / _mm512_reduce_add_ps(vsum);
}

// The weighted values, the AVX512-BF16 way, for a head dim of 32 or more: each pair of positions' values interleaved
// once per block, dotted with a query's two weights rounded to bf16 (as PyTorch's bf16 sdpa rounds them before its
// product with the values), float32 sums. The sums hold their dims in unpack order (per 32: 0-3, 8-11, 16-19, 24-27,
// then 4-7, 12-15, 20-23, 28-31), put back in order as they are written out.
template <int DIM>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
void values_bf16(const Task& task, int64_t live, Scratch& w) {
  constexpr int CHUNKS = DIM / 32;
  const int64_t queries = task.queries;
  uint16_t* weights = w.weights.data();  // each query's e^(s - max) in bf16, [queries, stride]
  for (int64_t g = 0; g < queries; ++g)
    for (int64_t t = 0; t < live; t += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(weights + g * w.stride + t),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(w.scores.data() + g * w.stride + t)));
  auto* paired = reinterpret_cast<uint16_t*>(w.widened.data());  // [BLOCK / 2 pairs, 2 * DIM]
  float* acc = w.acc.data();
  std::fill(acc, acc + queries * DIM, 0.f);
  for (int64_t t0 = 0; t0 < live; t0 += BLOCK) {
    const int64_t n = std::min(BLOCK, live - t0), pairs = (n + 1) / 2;
    for (int64_t i = 0; i < pairs; ++i) {
      const uint16_t* a = task.value + (t0 + 2 * i) * task.value_step;
      const uint16_t* b = 2 * i + 1 < n ? a + task.value_step : ZEROS;
      for (int c = 0; c < CHUNKS; ++c) {
        const __m512i va = _mm512_loadu_si512(a + 32 * c), vb = _mm512_loadu_si512(b + 32 * c);
        _mm512_storeu_si512(paired + i * 2 * DIM + 64 * c, _mm512_unpacklo_epi16(va, vb));
        _mm512_storeu_si512(paired + i * 2 * DIM + 64 * c + 32, _mm512_unpackhi_epi16(va, vb));
      }
    }
    for (int64_t g = 0; g < queries; ++g) {
      if (w.inv[g] == 0.f) continue;
      float* ag = acc + g * DIM;
      const auto* pg = reinterpret_cast<const uint32_t*>(weights + g * w.stride + t0);  // (p_t, p_t+1) pairs
      __m512 sums[2 * CHUNKS];
      for (int c = 0; c < 2 * CHUNKS; ++c) sums[c] = _mm512_loadu_ps(ag + 16 * c);
      for (int64_t i = 0; i < pairs; ++i) {
        const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(pg[i]));
#pragma GCC unroll 16
        for (int c = 0; c < 2 * CHUNKS; ++c)
          sums[c] = _mm512_dpbf16_ps(sums[c], (__m512bh)_mm512_loadu_si512(paired + i * 2 * DIM + 32 * c), p);
      }
      for (int c = 0; c < 2 * CHUNKS; ++c) _mm512_storeu_ps(ag + 16 * c, sums[c]);
    }
  }
  for (int64_t g = 0; g < queries; ++g)
    for (int64_t c = 0; c < CHUNKS; ++c)
      for (int64_t half = 0; half < 2; ++half)
        for (int64_t lane = 0; lane < 16; ++lane)  // sums[2c + half] lane: dim 32c + 8 (lane / 4) + 4 half + lane % 4
          task.out[g * DIM + 32 * c + 8 * (lane / 4) + 4 * half + lane % 4] =
              float_to_bf16(acc[g * DIM + 32 * c + 16 * half + lane] * w.inv[g]);
}

template <int DIM>
void attend(const Task& task, int64_t live, bool bf16_dot, Scratch& w) {
  constexpr int CHUNKS = DIM / 16;
  const int64_t queries = task.queries;
  if (bf16_dot) scores_bf16<DIM>(task, live, w);
  else scores_f32<DIM>(task, live, w);
  for (int64_t g = 0; g < queries; ++g) w.inv[g] = softmax(w.scores.data() + g * w.stride, live);
  if constexpr (DIM >= 32) {
    if (bf16_dot) return values_bf16<DIM>(task, live, w);
  }
  float* acc = w.acc.data();
  float* widened = w.widened.data();
  std::fill(acc, acc + queries * DIM, 0.f);
  for (int64_t t0 = 0; t0 < live; t0 += BLOCK) {  // each value once, widened, then weighed for every query
    const int64_t n = std::min(BLOCK, live - t0);
    for (int64_t j = 0; j < n; ++j)
      for (int c = 0; c < CHUNKS; ++c)
        _mm512_storeu_ps(widened + j * DIM + 16 * c, load_bf16(task.value + (t0 + j) * task.value_step + 16 * c));
    for (int64_t g = 0; g < queries; ++g) {
      if (w.inv[g] == 0.f) continue;
      float* ag = acc + g * DIM;
      const float* sg = w.scores.data() + g * w.stride + t0;
      __m512 a[CHUNKS];
      for (int c = 0; c < CHUNKS; ++c) a[c] = _mm512_loadu_ps(ag + 16 * c);
      for (int64_t j = 0; j < n; ++j) {
        const __m512 p = _mm512_set1_ps(sg[j]);
        for (int c = 0; c < CHUNKS; ++c) a[c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(widened + j * DIM + 16 * c), a[c]);
      }
      for (int c = 0; c < CHUNKS; ++c) _mm512_storeu_ps(ag + 16 * c, a[c]);
    }
  }
  for (int64_t g = 0; g < queries; ++g)
    for (int64_t i = 0; i < DIM; ++i) task.out[g * DIM + i] = float_to_bf16(acc[g * DIM + i] * w.inv[g]);
}

// One past the last key any of the row's queries sees.
int64_t last_seen(const bool* mask, int64_t rows, int64_t row_step, int64_t key_step, int64_t length) {
  int64_t live = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t t = length - 1; t >= live; --t)
      if (mask[r * row_step + t * key_step]) {
        live = t + 1;
        break;
      }
  return live;
}

}  // namespace

at::Tensor decode_attention(const at::Tensor& query_in, const at::Tensor& key_in, const at::Tensor& value_in,
                            const std::optional<at::Tensor>& mask, double scale, bool bf16_dot) {
  at::Tensor query = query_in, key = key_in, value = value_in;
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && key.scalar_type() == at::kBFloat16 &&
              value.scalar_type() == at::kBFloat16, "bf16 query, key and value");
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4, "4-d query, key and value");
  const int64_t rows = query.size(0), heads = query.size(1), queries = query.size(2), dim = query.size(3);
  const int64_t length = key.size(2);
  TORCH_CHECK(dim == 16 || dim == 32 || dim == 64 || dim == 128 || dim == 256, "head dim 16, 32, 64, 128 or 256");
  TORCH_CHECK(key.size(0) == rows && key.size(1) == heads && key.size(3) == dim && value.sizes() == key.sizes(),
              "key and value [rows, kv_heads, length, dim] as the query");
  query = query.contiguous();
  if (key.stride(3) != 1) key = key.contiguous();
  if (value.stride(3) != 1) value = value.contiguous();
  const bool masked = mask.has_value() && mask->defined();
  at::Tensor m = masked ? *mask : at::Tensor();
  if (masked) {
    TORCH_CHECK(m.scalar_type() == at::kBool && m.dim() == 4 && m.size(0) == rows && m.size(1) == 1 &&
                (m.size(2) == 1 || m.size(2) == queries) && m.size(3) == length,
                "mask [rows, 1, 1 or queries, length] bool");
  }
  auto out = at::empty({rows, heads, queries, dim}, query.options());
  const auto* qp = reinterpret_cast<const uint16_t*>(query.data_ptr());
  const auto* kp = reinterpret_cast<const uint16_t*>(key.data_ptr());
  const auto* vp = reinterpret_cast<const uint16_t*>(value.data_ptr());
  const bool* mp = masked ? m.data_ptr<bool>() : nullptr;
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  TORCH_CHECK(!bf16_dot || __builtin_cpu_supports("avx512bf16"), "bf16_dot on a CPU without AVX512-BF16");
  at::parallel_for(0, rows * heads, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch(queries, length, dim);
    for (int64_t index = begin; index < end; ++index) {
      const int64_t b = index / heads, h = index % heads;
      Task task{qp + index * queries * dim,
                kp + b * key.stride(0) + h * key.stride(1),
                vp + b * value.stride(0) + h * value.stride(1),
                key.stride(2), value.stride(2),
                masked ? mp + b * m.stride(0) : nullptr,
                masked ? m.size(2) : 0, masked ? m.stride(2) : 0, masked ? m.stride(3) : 0,
                queries, length, static_cast<float>(scale), op + index * queries * dim};
      const int64_t live =
          masked ? last_seen(task.mask, task.mask_rows, task.mask_row_step, task.mask_key_step, length) : length;
      switch (dim) {
        case 16: attend<16>(task, live, bf16_dot, scratch); break;
        case 32: attend<32>(task, live, bf16_dot, scratch); break;
        case 64: attend<64>(task, live, bf16_dot, scratch); break;
        case 128: attend<128>(task, live, bf16_dot, scratch); break;
        default: attend<256>(task, live, bf16_dot, scratch);
      }
    }
  });
  return out;
}

// The schema is core.cpu_attention's (torch.library.define), so that compiled forwards trace it before this loads.
TORCH_LIBRARY_IMPL(tandem, CPU, m) { m.impl("decode_attention", &decode_attention); }
