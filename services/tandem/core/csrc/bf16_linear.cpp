// bf16 linear layers for decode and verification steps on an x86 CPU with AVX-512 or AVX2 and FMA
// (tandem.core.bf16_linear builds and calls it).
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
//
// The library is built without instruction-set flags, each path compiled for its own (a function's target
// attribute), so one build runs on any x86 CPU: the AVX-512 path (16 float32 a register, 12 rows a tile) or the AVX2
// path (8 a register, 16 registers: 12 accumulators, 3 rows of a panel or 6 of half of one), as bf16_linear_isa
// set it (the caller picks by torch's own CPU capability). Both sum every output in the same order, so they give the
// same bits. On an AVX2 CPU oneDNN does not pack bf16 at all, and PyTorch's bf16 product converts the weights and
// re-reads them for every row. A third path, for AVX-512 CPUs that run AVX512-BF16 dot products at the rate of
// multiply-adds (where the caller's probe finds them faster), multiplies by those, from the same packing.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#define AVX2 __attribute__((target("avx2,fma")))
#define AVX512_DOT __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

namespace {

constexpr int64_t PANEL = 32;       // output columns per packed panel (two AVX-512 registers of float32 sums)
constexpr int64_t ROW_TILE = 12;    // AVX-512: rows summed together, 24 accumulators beside two widened weights
constexpr int64_t ROW_TILE_AVX2 = 6;  // AVX2: rows of a half-panel tile (half_tile8), 12 accumulators
constexpr int64_t PREFETCH = 1024;  // elements ahead of the stream a task prefetches (32 inputs of the panel)

bool runs_avx512() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

// The path bf16_linear takes: 512 (AVX-512 multiply-adds), 256 (AVX2 and FMA) or DOT (AVX512-BF16 dot products).
constexpr int64_t DOT = 16;
int isa_bits = runs_avx512() ? 512 : 256;

// ---- AVX-512 ----

AVX512 inline __m512 widen(const uint16_t* bf16) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bf16));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// float32 -> bf16, round to nearest even (as c10::BFloat16 rounds; a NaN stays a quiet NaN), 16 at a time.
AVX512 inline __m256i round_to_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, _mm512_set1_epi32(0x7FC0)));
}

// A tile's sums (columns 0-15 in `low`, 16-31 in `high`, a pair per row) plus the bias, each rounded once to bf16.
template <int ROWS>
AVX512 inline void store_rows(const __m512* low, const __m512* high, const uint16_t* bias, uint16_t* y,
                              int64_t out_features) {
  const __m512 bias_low = bias == nullptr ? _mm512_setzero_ps() : widen(bias);
  const __m512 bias_high = bias == nullptr ? _mm512_setzero_ps() : widen(bias + 16);
  for (int r = 0; r < ROWS; ++r) {
    uint16_t* out = y + r * out_features;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), round_to_bf16(_mm512_add_ps(low[r], bias_low)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16), round_to_bf16(_mm512_add_ps(high[r], bias_high)));
  }
}

template <int ROWS>
AVX512 void tile(const uint16_t* panel, int64_t in_features, const float* x, const uint16_t* bias, uint16_t* y,
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
  store_rows<ROWS>(low, high, bias, y, out_features);
}

// A call's rows over one panel, 12 at a time and the remainder, in the AVX-512 paths' tiles: `Tiles::run<ROWS>`
// (MultiplyAdds: x float32; DotProducts: x the bf16 rows themselves).
template <typename Tiles, typename Input>
void rows_of_panel(const uint16_t* panel, const Input* x, int64_t rows, int64_t in_features, const uint16_t* bias,
                   uint16_t* y, int64_t out_features) {
  for (int64_t first = 0; first < rows; first += ROW_TILE) {
    const Input* xs = x + first * in_features;
    uint16_t* ys = y + first * out_features;
    switch (std::min<int64_t>(rows - first, ROW_TILE)) {
      case 12: Tiles::template run<12>(panel, in_features, xs, bias, ys, out_features); break;
      case 11: Tiles::template run<11>(panel, in_features, xs, bias, ys, out_features); break;
      case 10: Tiles::template run<10>(panel, in_features, xs, bias, ys, out_features); break;
      case 9: Tiles::template run<9>(panel, in_features, xs, bias, ys, out_features); break;
      case 8: Tiles::template run<8>(panel, in_features, xs, bias, ys, out_features); break;
      case 7: Tiles::template run<7>(panel, in_features, xs, bias, ys, out_features); break;
      case 6: Tiles::template run<6>(panel, in_features, xs, bias, ys, out_features); break;
      case 5: Tiles::template run<5>(panel, in_features, xs, bias, ys, out_features); break;
      case 4: Tiles::template run<4>(panel, in_features, xs, bias, ys, out_features); break;
      case 3: Tiles::template run<3>(panel, in_features, xs, bias, ys, out_features); break;
      case 2: Tiles::template run<2>(panel, in_features, xs, bias, ys, out_features); break;
      default: Tiles::template run<1>(panel, in_features, xs, bias, ys, out_features); break;
    }
  }
}

struct MultiplyAdds {
  template <int ROWS>
  static void run(const uint16_t* panel, int64_t in_features, const float* x, const uint16_t* bias, uint16_t* y,
                  int64_t out_features) {
    tile<ROWS>(panel, in_features, x, bias, y, out_features);
  }
};

// ---- AVX512-BF16 dot products ----
// Where a CPU runs vdpbf16ps at the rate of float32 multiply-adds (an AMD Zen 4 does; some Xeons at a quarter of
// it), each one multiplies and sums two inputs' products for 16 columns: twice the arithmetic a cycle, which a step
// of more than 8 rows needs, the weights then coming from cache faster than one multiply-add a weight keeps up with.
// Two inputs k, k + 1 of the panel are re-paired as they stream (lane i: column i at k and at k + 1), and each row's
// inputs k, k + 1 are one 32-bit broadcast of the bf16 row itself. Each output is summed in the same order whatever
// the call's rows, so a row's bits do not depend on its mates here either; they are not the multiply-add paths'
// bits (the instruction adds each pair's two products in its own order and flushes denormals), so a process runs
// one path for all its products (chosen per machine: tandem.core.bf16_linear).

template <int ROWS>
AVX512_DOT void dot_tile(const uint16_t* panel, int64_t in_features, const uint16_t* x, const uint16_t* bias,
                         uint16_t* y, int64_t out_features) {
  __m512 low[ROWS], high[ROWS];
  for (int r = 0; r < ROWS; ++r) low[r] = high[r] = _mm512_setzero_ps();
  constexpr __mmask32 odd_words = 0xAAAAAAAAu;
  int64_t k = 0;
  for (; k + 1 < in_features; k += 2) {
    const uint16_t* at = panel + k * PANEL;
    const __m512i first = _mm512_loadu_si512(at);            // input k: lane i columns i (low), 16 + i (high)
    const __m512i second = _mm512_loadu_si512(at + PANEL);   // input k + 1
    _mm_prefetch(reinterpret_cast<const char*>(at + PREFETCH), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(at + PREFETCH + PANEL), _MM_HINT_T0);
    // lane i: (column i at k, at k + 1) and (column 16 + i at k, at k + 1)
    const __m512bh columns_low = (__m512bh)_mm512_mask_blend_epi16(odd_words, first, _mm512_slli_epi32(second, 16));
    const __m512bh columns_high = (__m512bh)_mm512_mask_blend_epi16(odd_words, _mm512_srli_epi32(first, 16), second);
    for (int r = 0; r < ROWS; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * in_features + k, sizeof(pair));
      const __m512bh inputs = (__m512bh)_mm512_set1_epi32(pair);
      low[r] = _mm512_dpbf16_ps(low[r], columns_low, inputs);
      high[r] = _mm512_dpbf16_ps(high[r], columns_high, inputs);
    }
  }
  if (k < in_features) {  // an odd last input, paired with a zero
    const __m512i last = _mm512_loadu_si512(panel + k * PANEL);
    const __m512bh columns_low = (__m512bh)_mm512_and_si512(last, _mm512_set1_epi32(0xFFFF));
    const __m512bh columns_high = (__m512bh)_mm512_srli_epi32(last, 16);
    for (int r = 0; r < ROWS; ++r) {
      const __m512bh inputs = (__m512bh)_mm512_set1_epi32(x[r * in_features + k]);
      low[r] = _mm512_dpbf16_ps(low[r], columns_low, inputs);
      high[r] = _mm512_dpbf16_ps(high[r], columns_high, inputs);
    }
  }
  store_rows<ROWS>(low, high, bias, y, out_features);
}

struct DotProducts {
  template <int ROWS>
  static void run(const uint16_t* panel, int64_t in_features, const uint16_t* x, const uint16_t* bias, uint16_t* y,
                  int64_t out_features) {
    dot_tile<ROWS>(panel, in_features, x, bias, y, out_features);
  }
};

// ---- AVX2 ----
// A 64-byte input of the panel is two 32-byte halves: lanes 0-7 (columns 0-7 low, 16-23 high) and lanes 8-15
// (columns 8-15, 24-31), so a row keeps four sums of 8 columns.

AVX2 inline __m256 widen8(const uint16_t* bf16) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bf16));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// float32 -> bf16 as round_to_bf16 rounds, 8 at a time.
AVX2 inline __m128i round_to_bf16_8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  const __m256i kept = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
  // Each 32-bit lane holds at most 0xFFFF, so the unsigned saturating pack keeps it whole.
  return _mm_packus_epi32(_mm256_castsi256_si128(kept), _mm256_extracti128_si256(kept, 1));
}

template <int ROWS>
AVX2 void tile8(const uint16_t* panel, int64_t in_features, const float* x, const uint16_t* bias, uint16_t* y,
                int64_t out_features) {
  __m256 sums[ROWS][4];  // columns 0-7, 16-23, 8-15, 24-31
  for (int r = 0; r < ROWS; ++r)
    for (int part = 0; part < 4; ++part) sums[r][part] = _mm256_setzero_ps();
  const __m256i upper = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t k = 0; k < in_features; ++k) {
    const uint16_t* at = panel + k * PANEL;
    _mm_prefetch(reinterpret_cast<const char*>(at + PREFETCH), _MM_HINT_T0);
    for (int half = 0; half < 2; ++half) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + 16 * half));
      const __m256 low = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
      const __m256 high = _mm256_castsi256_ps(_mm256_and_si256(raw, upper));
      for (int r = 0; r < ROWS; ++r) {
        const __m256 input = _mm256_set1_ps(x[r * in_features + k]);
        sums[r][2 * half] = _mm256_fmadd_ps(low, input, sums[r][2 * half]);
        sums[r][2 * half + 1] = _mm256_fmadd_ps(high, input, sums[r][2 * half + 1]);
      }
    }
  }
  constexpr int column[4] = {0, 16, 8, 24};
  for (int part = 0; part < 4; ++part) {
    const __m256 add = bias == nullptr ? _mm256_setzero_ps() : widen8(bias + column[part]);
    for (int r = 0; r < ROWS; ++r) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(y + r * out_features + column[part]),
                       round_to_bf16_8(_mm256_add_ps(sums[r][part], add)));
    }
  }
}

// Half a panel (`half` 0: columns 0-7 and 16-23, 1: 8-15 and 24-31) for up to 6 rows: 12 accumulators, the two
// widened weights, an input and the mask in the 16 registers, each input broadcast once. A whole panel's tile
// holds 3 rows, and there the compiler keeps each input for both halves and spills an accumulator.
template <int ROWS>
AVX2 void half_tile8(const uint16_t* panel, int half, int64_t in_features, const float* x, const uint16_t* bias,
                     uint16_t* y, int64_t out_features) {
  __m256 low[ROWS], high[ROWS];
  for (int r = 0; r < ROWS; ++r) low[r] = high[r] = _mm256_setzero_ps();
  const __m256i upper = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t k = 0; k < in_features; ++k) {
    const uint16_t* at = panel + k * PANEL + 16 * half;
    _mm_prefetch(reinterpret_cast<const char*>(at + PREFETCH), _MM_HINT_T0);
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
    const __m256 first = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
    const __m256 second = _mm256_castsi256_ps(_mm256_and_si256(raw, upper));
    for (int r = 0; r < ROWS; ++r) {
      const __m256 input = _mm256_set1_ps(x[r * in_features + k]);
      low[r] = _mm256_fmadd_ps(first, input, low[r]);
      high[r] = _mm256_fmadd_ps(second, input, high[r]);
    }
  }
  const int64_t columns[2] = {8 * half, 16 + 8 * half};
  for (int part = 0; part < 2; ++part) {
    const __m256 add = bias == nullptr ? _mm256_setzero_ps() : widen8(bias + columns[part]);
    for (int r = 0; r < ROWS; ++r) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(y + r * out_features + columns[part]),
                       round_to_bf16_8(_mm256_add_ps(part == 0 ? low[r] : high[r], add)));
    }
  }
}

// Up to 3 rows stream the panel once in whole-panel tiles (a step's weights come from memory at these widths);
// more run each half of it, from L2 the second time, up to 6 rows a tile.
AVX2 void rows_of_panel8(const uint16_t* panel, const float* x, int64_t rows, int64_t in_features,
                         const uint16_t* bias, uint16_t* y, int64_t out_features) {
  switch (rows) {
    case 1: return tile8<1>(panel, in_features, x, bias, y, out_features);
    case 2: return tile8<2>(panel, in_features, x, bias, y, out_features);
    case 3: return tile8<3>(panel, in_features, x, bias, y, out_features);
    default: break;
  }
  // Tiles of balanced sizes (8 rows as 4 and 4): a tile of 2 rows has 4 chains of sums, too few to keep both
  // multiply-add units busy through their latency.
  const int64_t tiles = (rows + ROW_TILE_AVX2 - 1) / ROW_TILE_AVX2;
  for (int half = 0; half < 2; ++half) {
    for (int64_t tile = 0, first = 0; tile < tiles; ++tile) {
      const int64_t count = rows / tiles + (tile < rows % tiles ? 1 : 0);
      const float* xs = x + first * in_features;
      uint16_t* ys = y + first * out_features;
      first += count;
      switch (count) {
        case 6: half_tile8<6>(panel, half, in_features, xs, bias, ys, out_features); break;
        case 5: half_tile8<5>(panel, half, in_features, xs, bias, ys, out_features); break;
        case 4: half_tile8<4>(panel, half, in_features, xs, bias, ys, out_features); break;
        case 3: half_tile8<3>(panel, half, in_features, xs, bias, ys, out_features); break;
        case 2: half_tile8<2>(panel, half, in_features, xs, bias, ys, out_features); break;
        default: half_tile8<1>(panel, half, in_features, xs, bias, ys, out_features); break;
      }
    }
  }
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16, "bf16_linear: bf16 only");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == PANEL && packed.is_contiguous(), "bf16_linear: packing");
  const int64_t in_features = x.size(-1), panels = packed.size(0), out_features = panels * PANEL;
  TORCH_CHECK(in_features == packed.size(1), "bf16_linear: ", in_features, " inputs against a packing of ",
              packed.size(1));
  // Widened once, read by every panel's tasks from cache: 4 bytes a row and input (the dot path reads bf16 pairs).
  const bool dot = isa_bits == DOT;
  const at::Tensor inputs = dot ? x.reshape({-1, in_features}).contiguous()
                                : x.reshape({-1, in_features}).to(at::kFloat).contiguous();
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
  auto* outputs = reinterpret_cast<uint16_t*>(out.data_ptr());
  const auto run = isa_bits == 512 ? rows_of_panel<MultiplyAdds, float> : rows_of_panel8;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t panel = begin; panel < end; ++panel) {
      const uint16_t* weights_at = weights + panel * in_features * PANEL;
      const uint16_t* bias_of = bias_at == nullptr ? nullptr : bias_at + panel * PANEL;
      if (dot) {
        rows_of_panel<DotProducts>(weights_at, reinterpret_cast<const uint16_t*>(inputs.data_ptr()), rows,
                                   in_features, bias_of, outputs + panel * PANEL, out_features);
      } else {
        run(weights_at, inputs.data_ptr<float>(), rows, in_features, bias_of, outputs + panel * PANEL, out_features);
      }
    }
  });
  return out;
}

// Sets the path (512, 256 or DOT; 0 leaves it) and returns the one in force; refuses a path this CPU cannot run.
int64_t bf16_linear_isa(int64_t bits) {
  if (bits == DOT) {
    TORCH_CHECK(runs_avx512() && __builtin_cpu_supports("avx512bf16"),
                "bf16_linear: AVX512-BF16 dot products asked of a CPU without them");
  } else if (bits == 512) {
    TORCH_CHECK(runs_avx512(), "bf16_linear: AVX-512 asked of a CPU without it");
  } else if (bits == 256) {
    TORCH_CHECK(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"),
                "bf16_linear: AVX2 and FMA asked of a CPU without them");
  } else {
    TORCH_CHECK(bits == 0, "bf16_linear_isa: 512, 256, 16 or 0, got ", bits);
    return isa_bits;
  }
  isa_bits = static_cast<int>(bits);
  return isa_bits;
}

}  // namespace

TORCH_LIBRARY_IMPL(tandem, CPU, m) { m.impl("bf16_linear", &bf16_linear); }
TORCH_LIBRARY_FRAGMENT(tandem, m) { m.def("bf16_linear_isa(int bits) -> int", &bf16_linear_isa); }
