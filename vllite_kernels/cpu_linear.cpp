// The decode-sized linear layers of vllite.kernels.cpu_linear (built there with torch.utils.cpp_extension): dense
// float32 or bfloat16 weights (dense_linear, at the end), and weight-only int8 and int4 codes, with
// x float32 [M, K], y float32 [M, N], one row of codes per output channel, K a multiple of the group size and the group
// size a multiple of 32, scale (and offset) float32 [N, G]:
//   int8: y[m, n] = sum_g scale[n, g] * sum_{k in g} x[m, k] * q[n, k]                       (q int8 [N, K])
//   int4: y[m, n] = sum_g scale[n, g] * sum_{k in g} x[m, k] * c[n, k] + offset[n, g] * sum_{k in g} x[m, k]
//         (codes c 0..15 packed two per byte [N, K / 2]: byte j of each 16-column chunk holds column j in its low
//         nibble and column j + 8 in its high one, so eight bytes widen into two vectors of eight columns)
//
// At decode batch sizes a layer is bound by reading its weights, so each weight byte is read once (a quarter or an
// eighth of float32's bytes) and widened in registers against up to four activation rows; a group's partial sums are
// scaled once at its end. Output channels are split across torch's threads, and a thread's weight row stays in L1
// while it serves every tile of activation rows.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

// One float32 or bfloat16 (its bits in a uint16_t) weight as float32.
inline float widen1(float v) { return v; }
inline float widen1(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

#if defined(__AVX2__) && defined(__FMA__)
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256 widen8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// M activation rows (x + m * K) against output channel n; U independent accumulators per row hide the FMA latency.
template <int M, int U>
void channel(const float* x, const int8_t* q, const float* scale, int64_t K, int64_t gs, int64_t G, float* y,
             int64_t ldy) {
  __m256 total[M];
  for (int m = 0; m < M; ++m) total[m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256 acc[M][U];
    for (int m = 0; m < M; ++m)
      for (int u = 0; u < U; ++u) acc[m][u] = _mm256_setzero_ps();
    for (int64_t k = g * gs; k < (g + 1) * gs; k += 8 * U) {
      for (int u = 0; u < U; ++u) {
        const __m256 w = widen8(q + k + 8 * u);
        for (int m = 0; m < M; ++m) acc[m][u] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + m * K + k + 8 * u), acc[m][u]);
      }
    }
    const __m256 s = _mm256_set1_ps(scale[g]);
    for (int m = 0; m < M; ++m) {
      __m256 sum = acc[m][0];
      for (int u = 1; u < U; ++u) sum = _mm256_add_ps(sum, acc[m][u]);
      total[m] = _mm256_fmadd_ps(sum, s, total[m]);
    }
  }
  for (int m = 0; m < M; ++m) y[m * ldy] = hsum(total[m]);
}
// int4: U chunks of 16 columns per step, each chunk's low and high nibbles into their own accumulators.
template <int M, int U>
void channel4(const float* x, const uint8_t* c, const float* scale, const float* offset, const float* xsum, int64_t K,
              int64_t gs, int64_t G, float* y, int64_t ldy) {
  const __m256i low = _mm256_set1_epi32(0xF);
  __m256 total[M];
  for (int m = 0; m < M; ++m) total[m] = _mm256_setzero_ps();
  float fixed[M] = {};
  for (int64_t g = 0; g < G; ++g) {
    __m256 acc[M][2 * U];
    for (int m = 0; m < M; ++m)
      for (int u = 0; u < 2 * U; ++u) acc[m][u] = _mm256_setzero_ps();
    for (int64_t k = g * gs; k < (g + 1) * gs; k += 16 * U) {
      for (int u = 0; u < U; ++u) {
        const int64_t kk = k + 16 * u;
        const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + kk / 2)));
        const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, low));
        const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
        for (int m = 0; m < M; ++m) {
          acc[m][2 * u] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(x + m * K + kk), acc[m][2 * u]);
          acc[m][2 * u + 1] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(x + m * K + kk + 8), acc[m][2 * u + 1]);
        }
      }
    }
    const __m256 s = _mm256_set1_ps(scale[g]);
    for (int m = 0; m < M; ++m) {
      __m256 sum = acc[m][0];
      for (int u = 1; u < 2 * U; ++u) sum = _mm256_add_ps(sum, acc[m][u]);
      total[m] = _mm256_fmadd_ps(sum, s, total[m]);
      fixed[m] += offset[g] * xsum[m * G + g];
    }
  }
  for (int m = 0; m < M; ++m) y[m * ldy] = hsum(total[m]) + fixed[m];
}
// float32 or bfloat16 weights (W = float or uint16_t holding bfloat16 bits), one group of the whole row, no scale.
inline __m256 widen8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 widen8(const uint16_t* p) {
  const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
}

template <int M, int U, typename W>
void channel_dense(const float* x, const W* w, int64_t K, float* y, int64_t ldy) {
  __m256 acc[M][U];
  for (int m = 0; m < M; ++m)
    for (int u = 0; u < U; ++u) acc[m][u] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8 * U) {
    for (int u = 0; u < U; ++u) {
      const __m256 v = widen8(w + k + 8 * u);
      for (int m = 0; m < M; ++m) acc[m][u] = _mm256_fmadd_ps(v, _mm256_loadu_ps(x + m * K + k + 8 * u), acc[m][u]);
    }
  }
  for (int m = 0; m < M; ++m) {
    __m256 sum = acc[m][0];
    for (int u = 1; u < U; ++u) sum = _mm256_add_ps(sum, acc[m][u]);
    y[m * ldy] = hsum(sum);
  }
}
#else
template <int M, int U>
void channel(const float* x, const int8_t* q, const float* scale, int64_t K, int64_t gs, int64_t G, float* y,
             int64_t ldy) {
  for (int m = 0; m < M; ++m) {
    float total = 0.f;
    for (int64_t g = 0; g < G; ++g) {
      float acc = 0.f;
      for (int64_t k = g * gs; k < (g + 1) * gs; ++k) acc += x[m * K + k] * static_cast<float>(q[k]);
      total += acc * scale[g];
    }
    y[m * ldy] = total;
  }
}
template <int M, int U>
void channel4(const float* x, const uint8_t* c, const float* scale, const float* offset, const float* xsum, int64_t K,
              int64_t gs, int64_t G, float* y, int64_t ldy) {
  for (int m = 0; m < M; ++m) {
    float total = 0.f;
    for (int64_t g = 0; g < G; ++g) {
      float acc = 0.f;
      for (int64_t k = g * gs; k < (g + 1) * gs; ++k) {
        const uint8_t byte = c[(k / 16) * 8 + (k % 8)];
        acc += x[m * K + k] * static_cast<float>((k % 16) < 8 ? (byte & 0xF) : (byte >> 4));
      }
      total += acc * scale[g] + offset[g] * xsum[m * G + g];
    }
    y[m * ldy] = total;
  }
}

template <int M, int U, typename W>
void channel_dense(const float* x, const W* w, int64_t K, float* y, int64_t ldy) {
  for (int m = 0; m < M; ++m) {
    float acc = 0.f;
    for (int64_t k = 0; k < K; ++k) acc += x[m * K + k] * widen1(w[k]);
    y[m * ldy] = acc;
  }
}
#endif

}  // namespace

void int8_linear(torch::Tensor y, torch::Tensor x, torch::Tensor q, torch::Tensor scales, int64_t group_size) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && y.dtype() == torch::kFloat32 && scales.dtype() == torch::kFloat32,
              "int8_linear: x, y and scales must be float32");
  TORCH_CHECK(q.dtype() == torch::kInt8, "int8_linear: q must be int8");
  TORCH_CHECK(x.is_contiguous() && y.is_contiguous() && q.is_contiguous() && scales.is_contiguous(),
              "int8_linear: tensors must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0), G = scales.size(1);
  TORCH_CHECK(q.size(1) == K && group_size % 32 == 0 && G * group_size == K && scales.size(0) == N,
              "int8_linear: K must be groups x group_size, the group size a multiple of 32");
  TORCH_CHECK(y.size(0) == M && y.size(1) == N, "int8_linear: y must be [M, N]");
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // About 64 KiB of weights per task: enough to amortise a task, small enough to split a layer across threads.
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(K, 1));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const int8_t* qn = qp + n * K;
      const float* sn = sp + n * G;
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) channel<4, 2>(xp + m * K, qn, sn, K, group_size, G, yp + m * N + n, N);
      switch (M - m) {
        case 3: channel<3, 2>(xp + m * K, qn, sn, K, group_size, G, yp + m * N + n, N); break;
        case 2: channel<2, 4>(xp + m * K, qn, sn, K, group_size, G, yp + m * N + n, N); break;
        case 1: channel<1, 4>(xp + m * K, qn, sn, K, group_size, G, yp + m * N + n, N); break;
        default: break;
      }
    }
  });
}

void int4_linear(torch::Tensor y, torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor offsets,
                 int64_t group_size) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && y.dtype() == torch::kFloat32 && scales.dtype() == torch::kFloat32 &&
                  offsets.dtype() == torch::kFloat32,
              "int4_linear: x, y, scales and offsets must be float32");
  TORCH_CHECK(codes.dtype() == torch::kUInt8, "int4_linear: codes must be uint8");
  TORCH_CHECK(x.is_contiguous() && y.is_contiguous() && codes.is_contiguous() && scales.is_contiguous() &&
                  offsets.is_contiguous(),
              "int4_linear: tensors must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0), G = scales.size(1);
  TORCH_CHECK(codes.size(1) * 2 == K && group_size % 32 == 0 && G * group_size == K && scales.size(0) == N &&
                  offsets.sizes() == scales.sizes(),
              "int4_linear: K must be groups x group_size, the group size a multiple of 32");
  TORCH_CHECK(y.size(0) == M && y.size(1) == N, "int4_linear: y must be [M, N]");
  const float* xp = x.data_ptr<float>();
  // Each row's sum over each group, for the offsets.
  std::vector<float> xsum(M * G, 0.f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xsum[m * G + k / group_size] += xp[m * K + k];
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* op = offsets.data_ptr<float>();
  const float* xs = xsum.data();
  float* yp = y.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, 131072 / std::max<int64_t>(K, 1));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* cn = cp + n * (K / 2);
      const float* sn = sp + n * G;
      const float* on = op + n * G;
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) channel4<4, 1>(xp + m * K, cn, sn, on, xs + m * G, K, group_size, G, yp + m * N + n, N);
      switch (M - m) {
        case 3: channel4<3, 1>(xp + m * K, cn, sn, on, xs + m * G, K, group_size, G, yp + m * N + n, N); break;
        case 2: channel4<2, 2>(xp + m * K, cn, sn, on, xs + m * G, K, group_size, G, yp + m * N + n, N); break;
        case 1: channel4<1, 2>(xp + m * K, cn, sn, on, xs + m * G, K, group_size, G, yp + m * N + n, N); break;
        default: break;
      }
    }
  });
}

template <typename W>
static void dense_rows(float* yp, const float* xp, const W* wp, int64_t M, int64_t K, int64_t N) {
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(K * static_cast<int64_t>(sizeof(W)), 1) * 2);
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const W* wn = wp + n * K;
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) channel_dense<4, 2>(xp + m * K, wn, K, yp + m * N + n, N);
      switch (M - m) {
        case 3: channel_dense<3, 2>(xp + m * K, wn, K, yp + m * N + n, N); break;
        case 2: channel_dense<2, 4>(xp + m * K, wn, K, yp + m * N + n, N); break;
        case 1: channel_dense<1, 4>(xp + m * K, wn, K, yp + m * N + n, N); break;
        default: break;
      }
    }
  });
}

// y = x @ w^T for a float32 or bfloat16 weight [N, K] (K a multiple of 32) and float32 x [M, K], y [M, N].
void dense_linear(torch::Tensor y, torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && y.dtype() == torch::kFloat32, "dense_linear: x and y must be float32");
  TORCH_CHECK(w.dtype() == torch::kFloat32 || w.dtype() == torch::kBFloat16, "dense_linear: w must be float32 or bfloat16");
  TORCH_CHECK(x.is_contiguous() && y.is_contiguous() && w.is_contiguous(), "dense_linear: tensors must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K && K % 32 == 0 && y.size(0) == M && y.size(1) == N,
              "dense_linear: w must be [N, K] with K a multiple of 32, y [M, N]");
  if (w.dtype() == torch::kFloat32)
    dense_rows(y.data_ptr<float>(), x.data_ptr<float>(), w.data_ptr<float>(), M, K, N);
  else
    dense_rows(y.data_ptr<float>(), x.data_ptr<float>(), reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), M, K, N);
}
