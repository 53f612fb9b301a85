// Decode attention on an AVX-512 CPU (tandem.core.cpu_attention builds and calls it).
//
// query [rows, kv_heads, queries, dim] bf16: the query heads that share a key/value head stacked along the query axis
// (core.attention); key, value [rows, kv_heads, length, dim] bf16, each position's dim contiguous (views of the slot
// cache); mask [rows, 1, 1 or queries, length] bool, true where a query sees a key, or undefined (every key seen).
// Returns [rows, kv_heads, queries, dim] bf16: softmax(q k^T * scale) v, accumulated in float32.
//
// One task per (row, kv head): every key and value it reads once, for all its queries; keys after the last one any
// query sees are not read. A query that sees no key gets zeros. A query's result does not depend on the other
// queries of its call (its row's width, its batch mates): the keys it does not see add exact zeros.
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

// Softmax of one query's scores over keys [0, live), in place; false when it sees no key.
bool softmax(float* s, const bool* mask, int64_t key_step, int64_t live) {
  float top = NEG_INF;
  for (int64_t t = 0; t < live; ++t) {
    if (mask && !mask[t * key_step]) s[t] = NEG_INF;
    top = std::max(top, s[t]);
  }
  if (top == NEG_INF) return false;
  const __m512 vtop = _mm512_set1_ps(top);
  __m512 vsum = _mm512_setzero_ps();
  int64_t t = 0;
  for (; t + 16 <= live; t += 16) {
    const __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(s + t), vtop));
    _mm512_storeu_ps(s + t, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  if (t < live) {
    const __mmask16 m = static_cast<__mmask16>((1u << (live - t)) - 1);
    const __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + t), vtop));
    _mm512_mask_storeu_ps(s + t, m, e);
    vsum = _mm512_add_ps(vsum, _mm512_maskz_mov_ps(m, e));
  }
  const float inv = 1.f / _mm512_reduce_add_ps(vsum);
  for (t = 0; t < live; ++t) s[t] *= inv;
  return true;
}

template <int DIM>
void attend(const Task& task, int64_t live, float* q, float* scores, float* acc, float* widened) {
  constexpr int CHUNKS = DIM / 16;
  const int64_t queries = task.queries;
  for (int64_t i = 0; i < queries * DIM; ++i) q[i] = bf16_to_float(task.query[i]) * task.scale;
  for (int64_t t = 0; t < live; ++t) {  // each key once, dotted with every query
    __m512 k[CHUNKS];
    for (int c = 0; c < CHUNKS; ++c) k[c] = load_bf16(task.key + t * task.key_step + 16 * c);
    for (int64_t g = 0; g < queries; ++g) {
      const float* qg = q + g * DIM;
      __m512 s = _mm512_mul_ps(k[0], _mm512_loadu_ps(qg));
      for (int c = 1; c < CHUNKS; ++c) s = _mm512_fmadd_ps(k[c], _mm512_loadu_ps(qg + 16 * c), s);
      scores[g * task.length + t] = _mm512_reduce_add_ps(s);
    }
  }
  std::vector<bool> sees(queries);
  for (int64_t g = 0; g < queries; ++g) {
    const bool* mg = task.mask ? task.mask + (task.mask_rows == 1 ? 0 : g) * task.mask_row_step : nullptr;
    sees[g] = softmax(scores + g * task.length, mg, task.mask_key_step, live);
  }
  std::fill(acc, acc + queries * DIM, 0.f);
  for (int64_t t0 = 0; t0 < live; t0 += BLOCK) {  // each value once, widened, then weighed for every query
    const int64_t n = std::min(BLOCK, live - t0);
    for (int64_t j = 0; j < n; ++j)
      for (int c = 0; c < CHUNKS; ++c)
        _mm512_storeu_ps(widened + j * DIM + 16 * c, load_bf16(task.value + (t0 + j) * task.value_step + 16 * c));
    for (int64_t g = 0; g < queries; ++g) {
      if (!sees[g]) continue;
      float* ag = acc + g * DIM;
      const float* sg = scores + g * task.length + t0;
      __m512 a[CHUNKS];
      for (int c = 0; c < CHUNKS; ++c) a[c] = _mm512_loadu_ps(ag + 16 * c);
      for (int64_t j = 0; j < n; ++j) {
        const __m512 p = _mm512_set1_ps(sg[j]);
        for (int c = 0; c < CHUNKS; ++c) a[c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(widened + j * DIM + 16 * c), a[c]);
      }
      for (int c = 0; c < CHUNKS; ++c) _mm512_storeu_ps(ag + 16 * c, a[c]);
    }
  }
  for (int64_t i = 0; i < queries * DIM; ++i) task.out[i] = float_to_bf16(acc[i]);
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
                            const std::optional<at::Tensor>& mask, double scale) {
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
  at::parallel_for(0, rows * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(queries * dim), scores(queries * length), acc(queries * dim), widened(BLOCK * dim);
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
        case 16: attend<16>(task, live, q.data(), scores.data(), acc.data(), widened.data()); break;
        case 32: attend<32>(task, live, q.data(), scores.data(), acc.data(), widened.data()); break;
        case 64: attend<64>(task, live, q.data(), scores.data(), acc.data(), widened.data()); break;
        case 128: attend<128>(task, live, q.data(), scores.data(), acc.data(), widened.data()); break;
        default: attend<256>(task, live, q.data(), scores.data(), acc.data(), widened.data());
      }
    }
  });
  return out;
}

// The schema is core.cpu_attention's (torch.library.define), so that compiled forwards trace it before this loads.
TORCH_LIBRARY_IMPL(tandem, CPU, m) { m.impl("decode_attention", &decode_attention); }
