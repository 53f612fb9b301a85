// bf16 linear layers for decode and verification steps on an AVX-512 CPU (tandem.core.bf16_linear builds and
// calls it).
//
// x [rows, K] bf16; packed [N / 32, K, 32] bf16: each panel of 32 output columns, K-major, the 32-bit lane i of an
// input's 64 bytes holding column i's weight in its low half and column 16 + i's in its high half; bias [N] bf16 or
// undefined. Returns [rows, N] bf16: x W^T + b, each output summed in float32 over the inputs in order (one fused
// multiply-add each) and rounded once to bf16 (round to nearest even).
//
// A decode step of a few rows streams every weight once, so its speed is the rate the weights come from memory as
// long as the arithmetic keeps up. oneDNN's bf16 product does not at 2-16 rows on a CPU without AMX: it computes by
// AVX512-BF16 dot products, which some CPUs run at half the rate of float32 multiply-adds (a 2-vCPU Xeon here: 0.5
// against 2 a cycle, 32 against 64 flops), and 8 rows took 1.8x one row's time over the 1.5B target's MLP weights.
// Here the weights are widened to float32 as they stream (a shift or a mask per 16 of them, the two halves of each
// lane) and multiplied in by float32 multiply-adds: one task per 32 output columns streams that panel once and runs
// it, 12 rows at a time (24 accumulators), through every row of the call, later row groups reading the panel from
// L2. A row's outputs do not depend on its call's other rows (each sums the same products in the same order), so a
// token scored in a verification step gets the value it gets in a one-row step.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t PANEL = 32;       // output columns per packed panel (two registers of float32 sums)
constexpr int64_t ROW_TILE = 12;    // rows summed together: 24 accumulators beside the two widened weight registers
constexpr int64_t PREFETCH = 1024;  // elements ahead of the stream a task prefetches (32 inputs of the panel)

inline __m512 widen(const uint16_t* bf16) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bf16));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// float32 -> bf16, round to nearest even (as c10::BFloat16 rounds; a NaN stays a quiet NaN), 16 at a time.
inline __m256i round_to_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, _mm512_set1_epi32(0x7FC0)));
}

template <int ROWS>
void tile(const uint16_t* panel, int64_t in_features, const float* x, const uint16_t* bias, uint16_t* y,
          int64_t out_features) {
  __m512 low[ROWS], high[ROWS];
  for (int r = 0; r < ROWS; ++r) low[r] = high[r] = _mm512_setzero_ps();
  const __m512i upper = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t k = 0; k < in_features; ++k) {
    const uint16_t* at = panel + k * PANEL;
    const __m512i raw = _mm512_loadu_si512(at);
    _mm_prefetch(reinterpret_cast<const char*>(at + PREFETCH), _MM_HINT_T0);
    const __m512 first = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));  // columns 0-15
    const __m512 second = _mm512_castsi512_ps(_mm512_and_si512(raw, upper));  // columns 16-31
    for (int r = 0; r < ROWS; ++r) {
      const __m512 input = _mm512_set1_ps(x[r * in_features + k]);
      low[r] = _mm512_fmadd_ps(first, input, low[r]);
      high[r] = _mm512_fmadd_ps(second, input, high[r]);
    }
  }
  const __m512 bias_low = bias == nullptr ? _mm512_setzero_ps() : widen(bias);
  const __m512 bias_high = bias == nullptr ? _mm512_setzero_ps() : widen(bias + 16);
  for (int r = 0; r < ROWS; ++r) {
    uint16_t* out = y + r * out_features;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), round_to_bf16(_mm512_add_ps(low[r], bias_low)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16), round_to_bf16(_mm512_add_ps(high[r], bias_high)));
  }
}

void rows_of_panel(const uint16_t* panel, const float* x, int64_t rows, int64_t in_features, const uint16_t* bias,
                   uint16_t* y, int64_t out_features) {
  for (int64_t first = 0; first < rows; first += ROW_TILE) {
    const float* xs = x + first * in_features;
    uint16_t* ys = y + first * out_features;
    switch (std::min<int64_t>(rows - first, ROW_TILE)) {
      case 12: tile<12>(panel, in_features, xs, bias, ys, out_features); break;
      case 11: tile<11>(panel, in_features, xs, bias, ys, out_features); break;
      case 10: tile<10>(panel, in_features, xs, bias, ys, out_features); break;
      case 9: tile<9>(panel, in_features, xs, bias, ys, out_features); break;
      case 8: tile<8>(panel, in_features, xs, bias, ys, out_features); break;
      case 7: tile<7>(panel, in_features, xs, bias, ys, out_features); break;
      case 6: tile<6>(panel, in_features, xs, bias, ys, out_features); break;
      case 5: tile<5>(panel, in_features, xs, bias, ys, out_features); break;
      case 4: tile<4>(panel, in_features, xs, bias, ys, out_features); break;
      case 3: tile<3>(panel, in_features, xs, bias, ys, out_features); break;
      case 2: tile<2>(panel, in_features, xs, bias, ys, out_features); break;
      default: tile<1>(panel, in_features, xs, bias, ys, out_features); break;
    }
  }
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16, "bf16_linear: bf16 only");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == PANEL && packed.is_contiguous(), "bf16_linear: packing");
  const int64_t in_features = x.size(-1), panels = packed.size(0), out_features = panels * PANEL;
  TORCH_CHECK(in_features == packed.size(1), "bf16_linear: ", in_features, " inputs against a packing of ",
              packed.size(1));
  // Widened once, read by every panel's tasks from cache: 4 bytes a row and input.
  const at::Tensor inputs = x.reshape({-1, in_features}).to(at::kFloat).contiguous();
  const int64_t rows = inputs.size(0);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out_features;
  at::Tensor out = at::empty(shape, x.options());
  if (rows == 0) return out;
  const uint16_t* bias_at = nullptr;
  at::Tensor bias_in;
  if (bias.has_value() && bias->defined()) {
    bias_in = bias->to(at::kBFloat16).contiguous();
    TORCH_CHECK(bias_in.numel() == out_features, "bf16_linear: bias of ", bias_in.numel());
    bias_at = reinterpret_cast<const uint16_t*>(bias_in.data_ptr());
  }
  const auto* weights = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  const float* rows_at = inputs.data_ptr<float>();
  auto* outputs = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t panel = begin; panel < end; ++panel) {
      rows_of_panel(weights + panel * in_features * PANEL, rows_at, rows, in_features,
                    bias_at == nullptr ? nullptr : bias_at + panel * PANEL, outputs + panel * PANEL, out_features);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(tandem, CPU, m) { m.impl("bf16_linear", &bf16_linear); }
