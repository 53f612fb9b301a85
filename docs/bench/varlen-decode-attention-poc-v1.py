"""A proof of concept, not shipped: one-token decode attention that reads each row's own cached length (a plain
AVX-512 C++ loop, built with torch's cpp_extension), against torch's flash kernel over the window the compiled CPU
forward reads (the longest row rounded up to 64, the rows' slots in one buffer), at the 1.5B target's shape: 8 rows,
2 key/value heads, 6 query heads each stacked. Prints each one's error against a float64 reference and their median
microseconds, alternated. Needs g++ and an AVX-512 CPU; the first run compiles for about 20 s.

    python docs/bench/varlen-decode-attention-poc-v1.py 272 60,80,100,120,140,160,180,188   # the bench's shapes
    python docs/bench/varlen-decode-attention-poc-v1.py 528 201,238,275,312,349,386,423,460
"""
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.cpp_extension import load_inline

SRC = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <vector>
#include <cmath>

static inline __m512 load_bf16(const at::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// q [R, H, M, 128], k/v buffers [S, H, C, 128] (rows use slots 0..R-1), lengths [R]: row r reads keys [0, lengths[r]).
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor lengths, double scale) {
  const int64_t R = q.size(0), H = q.size(1), M = q.size(2), D = q.size(3), C = k.size(2);
  TORCH_CHECK(D == 128 && M <= 16, "D 128, M <= 16");
  auto out = torch::empty_like(q);
  const at::BFloat16* qp = q.data_ptr<at::BFloat16>();
  const at::BFloat16* kp = k.data_ptr<at::BFloat16>();
  const at::BFloat16* vp = v.data_ptr<at::BFloat16>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const int64_t* lp = lengths.data_ptr<int64_t>();
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1);
  at::parallel_for(0, R * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(M * C);
    for (int64_t rh = begin; rh < end; ++rh) {
      const int64_t r = rh / H, h = rh % H, L = lp[r];
      __m512 qv[16][8];
      for (int64_t m = 0; m < M; ++m)
        for (int d = 0; d < 8; ++d)
          qv[m][d] = _mm512_mul_ps(load_bf16(qp + ((r * H + h) * M + m) * D + 16 * d), _mm512_set1_ps((float)scale));
      const at::BFloat16* kr = kp + r * ks0 + h * ks1;
      const at::BFloat16* vr = vp + r * ks0 + h * ks1;
      for (int64_t t = 0; t < L; ++t) {
        __m512 kv[8];
        for (int d = 0; d < 8; ++d) kv[d] = load_bf16(kr + t * D + 16 * d);
        for (int64_t m = 0; m < M; ++m) {
          __m512 acc = _mm512_mul_ps(qv[m][0], kv[0]);
          for (int d = 1; d < 8; ++d) acc = _mm512_fmadd_ps(qv[m][d], kv[d], acc);
          scores[m * C + t] = _mm512_reduce_add_ps(acc);
        }
      }
      for (int64_t m = 0; m < M; ++m) {
        float* s = scores.data() + m * C;
        float mx = -INFINITY;
        for (int64_t t = 0; t < L; ++t) mx = std::max(mx, s[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < L; ++t) { s[t] = std::exp(s[t] - mx); sum += s[t]; }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < L; ++t) s[t] *= inv;
      }
      __m512 acc[16][8];
      for (int64_t m = 0; m < M; ++m) for (int d = 0; d < 8; ++d) acc[m][d] = _mm512_setzero_ps();
      for (int64_t t = 0; t < L; ++t) {
        __m512 vv[8];
        for (int d = 0; d < 8; ++d) vv[d] = load_bf16(vr + t * D + 16 * d);
        for (int64_t m = 0; m < M; ++m) {
          const __m512 p = _mm512_set1_ps(scores[m * C + t]);
          for (int d = 0; d < 8; ++d) acc[m][d] = _mm512_fmadd_ps(p, vv[d], acc[m][d]);
        }
      }
      for (int64_t m = 0; m < M; ++m) {
        at::BFloat16* o = op + ((r * H + h) * M + m) * D;
        float tmp[16];
        for (int d = 0; d < 8; ++d) {
          _mm512_storeu_ps(tmp, acc[m][d]);
          for (int i = 0; i < 16; ++i) o[16 * d + i] = at::BFloat16(tmp[i]);
        }
      }
    }
  });
  return out;
}
"""
module = load_inline("poc_decode_attention", cpp_sources=SRC, functions=["decode_attention"],
                  extra_cflags=["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma", "-fopenmp"],
                  extra_ldflags=["-fopenmp"], verbose=False)
torch.set_num_threads(2)
torch.manual_seed(0)
rows, kv_heads, groups, dim = 8, 2, 6, 128
buffer, lengths = int(sys.argv[1]), [int(x) for x in sys.argv[2].split(",")]
assert len(lengths) == rows and max(lengths) <= buffer
query = torch.randn(rows, kv_heads, groups, dim, dtype=torch.bfloat16)
keys = torch.randn(16, kv_heads, buffer, dim, dtype=torch.bfloat16)
values = torch.randn(16, kv_heads, buffer, dim, dtype=torch.bfloat16)
lengths_ = torch.tensor(lengths)
window = -(-max(lengths) // 64) * 64
scale = dim**-0.5
key_view, value_view = keys[:rows, :, :window], values[:rows, :, :window]
mask = (torch.arange(window)[None] < lengths_[:, None])[:, None, None, :]
exact = torch.cat([F.scaled_dot_product_attention(query[r : r + 1].double(), keys[r : r + 1, :, :n].double(),
                                                  values[r : r + 1, :, :n].double(), scale=scale)
                   for r, n in enumerate(lengths)])
ways = {
    "flash_window": lambda: F.scaled_dot_product_attention(query, key_view, value_view, attn_mask=mask, scale=scale),
    "varlen": lambda: module.decode_attention(query, keys, values, lengths_, scale),
}
print("max abs error against float64:",
      {name: (way().double() - exact).abs().max().item() for name, way in ways.items()})
times = {name: [] for name in ways}
for round_ in range(400):
    for name in list(ways) if round_ % 2 else list(ways)[::-1]:
        started = time.perf_counter()
        ways[name]()
        times[name].append(time.perf_counter() - started)
print(f"buffer {buffer}, window {window}, lengths {lengths}:",
      {name: round(statistics.median(t) * 1e6, 1) for name, t in times.items()}, "us")
