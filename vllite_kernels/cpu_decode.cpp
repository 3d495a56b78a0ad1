// The CPU decode-attention kernel of vllite.kernels.cpu_decode (built there with torch.utils.cpp_extension).
//
// Memory-bound work, so the layout of the reads decides its speed: a sequence's tokens are visited block by
// block, each block fetched once and worked on from the cache while the next one is prefetched into L2; the work
// items (whole sequences, or one KV head each when there are few sequences) are handed out longest first from a
// shared counter so mixed lengths keep every thread busy to the end. Where the CPU has AVX-512 and the head size is a
// multiple of 16 up to 128, scores come sixteen tokens at a time from one transposing reduction and each head's
// output accumulates in registers. The cache is float32, bfloat16 or fp8 (T); queries, scores and sums are float32.
// An fp8 cache row is widened to float32 once per token (then shared by the group's query heads): eight elements at
// a time with F16C where the CPU has AVX2, else through a 256-entry table per format; keys read as element * k_scale
// (folded into the score scale), values as element * v_scale (applied to the finished sums).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

// The two fp8 formats of torch (float8_e4m3fn, float8_e5m2), as raw bytes.
struct Fp8E4M3 { uint8_t bits; };
struct Fp8E5M2 { uint8_t bits; };
template <typename T>
constexpr bool kIsFp8 = std::is_same<T, Fp8E4M3>::value || std::is_same<T, Fp8E5M2>::value;

// The value of every fp8 byte: sign, exp_bits of exponent (bias 2^(exp_bits-1) - 1), the rest mantissa. e4m3fn has
// no infinities and one NaN pattern per sign (all ones); e5m2 follows IEEE (exponent all ones: inf or NaN).
static float fp8_value(uint32_t b, int exp_bits) {
  const int man_bits = 7 - exp_bits, bias = (1 << (exp_bits - 1)) - 1, emax = (1 << exp_bits) - 1;
  const int e = (b >> man_bits) & emax, m = b & ((1 << man_bits) - 1);
  float v;
  if (exp_bits == 4 && e == emax && m == (1 << man_bits) - 1) v = std::numeric_limits<float>::quiet_NaN();
  else if (exp_bits == 5 && e == emax) v = m ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  else if (e == 0) v = std::ldexp(static_cast<float>(m), 1 - bias - man_bits);
  else v = std::ldexp(1.f + static_cast<float>(m) / static_cast<float>(1 << man_bits), e - bias);
  return (b & 0x80) ? -v : v;
}

struct Fp8Tables {
  float e4m3[256], e5m2[256];
  Fp8Tables() {
    for (uint32_t b = 0; b < 256; ++b) { e4m3[b] = fp8_value(b, 4); e5m2[b] = fp8_value(b, 5); }
  }
};
static const Fp8Tables kFp8;

static inline float to_f32(float x) { return x; }
static inline float to_f32(at::BFloat16 x) { return static_cast<float>(x); }
static inline float to_f32(Fp8E4M3 x) { return kFp8.e4m3[x.bits]; }
static inline float to_f32(Fp8E5M2 x) { return kFp8.e5m2[x.bits]; }

#if defined(__AVX2__) && defined(__F16C__)
// Eight fp8 bytes as float32 lanes through the float16 conversion: an e5m2 byte is the high byte of a float16; an
// e4m3 byte's exponent and mantissa, moved into a float16's bit positions, read as the value times 2^-8 (bias 15
// instead of 7, subnormals included), so the result is rescaled by 256. (The e4m3 NaN byte reads as 480; writes
// saturate, so only a NaN key or value makes one.)
static inline __m256 load8(const Fp8E5M2* p) {
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_cvtph_ps(_mm_slli_epi16(b, 8));
}
static inline __m256 load8(const Fp8E4M3* p) {
  // Sign-extended to 16 bits and shifted left by 7, the byte's exponent and mantissa land in a float16's and its sign
  // in bits 15 and 14; clearing bit 14 leaves the float16.
  const __m128i b = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i h = _mm_and_si128(_mm_slli_epi16(b, 7), _mm_set1_epi16(static_cast<short>(0xBFFF)));
  return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.f));
}
#endif

// n fp8 elements widened to float32 into dst.
template <typename T>
static inline void widen(const T* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX2__) && defined(__F16C__)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load8(src + i));
#endif
  for (; i < n; ++i) dst[i] = to_f32(src[i]);
}

// A dot product over D elements; D_ > 0 fixes the length at compile time so the loop unrolls into whole vectors.
template <int D_, typename T>
static inline float dot(const float* a, const T* b, int64_t d_rt) {
  const int64_t D = D_ > 0 ? D_ : d_rt;
  float sum = 0.f;
  for (int64_t d = 0; d < D; ++d) sum += a[d] * to_f32(b[d]);
  return sum;
}

template <int D_, typename T>
static inline void axpy(float* acc, float p, const T* x, int64_t d_rt) {
  const int64_t D = D_ > 0 ? D_ : d_rt;
  for (int64_t d = 0; d < D; ++d) acc[d] += p * to_f32(x[d]);
}

// Softmax in place over each of `heads` rows of L scores.
static void softmax_rows(float* scores, int64_t heads, int64_t L) {
  for (int64_t head = 0; head < heads; ++head) {
    float* sc = scores + head * L;
    float mx = sc[0];
    for (int64_t t = 1; t < L; ++t) mx = std::max(mx, sc[t]);
    float sum = 0.f;
    for (int64_t t = 0; t < L; ++t) {
      sc[t] = std::exp(sc[t] - mx);
      sum += sc[t];
    }
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < L; ++t) sc[t] *= inv;
  }
}

// Prefetches the used rows of block b (of nblocks) of a cache into L2. Into L1 the prefetches would wait on its
// few miss buffers (1.65x slower single-threaded on scattered 6 KiB blocks).
template <typename T>
static inline void prefetch_block(const T* cache, const int32_t* blocks, int64_t b, int64_t nblocks, int64_t BS,
                                  int64_t row, int64_t L) {
  if (b >= nblocks) return;
  const char* start = reinterpret_cast<const char*>(cache + static_cast<int64_t>(blocks[b]) * BS * row);
  const int64_t bytes = std::min(BS, L - b * BS) * row * static_cast<int64_t>(sizeof(T));
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(start + off, 0, 2);
}

// Attention of one sequence's query heads of KV heads [h0, h1) over its first L cached tokens. Tokens are visited
// block by block and, within a block, row by row: a row holds every KV head of one token, so the reads run through
// each block front to back (what the hardware prefetcher follows) and the next block is prefetched meanwhile.
// An fp8 cache's rows are widened into `wide` (KV heads [h0, h1) of one token) and read from there as float32.
template <int D_, typename T>
static void attend(const float* q, float* o, const T* kp, const T* vp, const int32_t* blocks, int64_t L,
                   int64_t BS, int64_t Hkv, int64_t G, int64_t h0, int64_t h1, int64_t d_rt, float scale,
                   float v_scale, std::vector<float>& scores, std::vector<float>& acc, std::vector<float>& wide) {
  const int64_t D = D_ > 0 ? D_ : d_rt, row = Hkv * D, heads = (h1 - h0) * G;
  const float* qh = q + h0 * G * D;  // the first query head of this range; heads are consecutive
  float* oh = o + h0 * G * D;
  if (L <= 0) { std::fill(oh, oh + heads * D, 0.f); return; }
  scores.resize(heads * L);  // scores[head * L + t]
  const int64_t nblocks = (L + BS - 1) / BS;
  for (int64_t b = 0; b < nblocks; ++b) {
    const T* kb = kp + static_cast<int64_t>(blocks[b]) * BS * row;
    const int64_t t0 = b * BS, nt = std::min(BS, L - t0);
    prefetch_block(kp, blocks, b + 1, nblocks, BS, row, L);
    for (int64_t i = 0; i < nt; ++i) {
      const T* kr = kb + i * row;
      for (int64_t h = h0; h < h1; ++h) {
        if constexpr (kIsFp8<T>) {
          if (h == h0) widen(kr + h0 * D, wide.data(), (h1 - h0) * D);
          const float* k = wide.data() + (h - h0) * D;
          for (int64_t g = 0; g < G; ++g) {
            const int64_t head = (h - h0) * G + g;
            scores[head * L + t0 + i] = dot<D_>(qh + head * D, k, D) * scale;
          }
        } else {
          const T* k = kr + h * D;
          for (int64_t g = 0; g < G; ++g) {
            const int64_t head = (h - h0) * G + g;
            scores[head * L + t0 + i] = dot<D_>(qh + head * D, k, D) * scale;
          }
        }
      }
    }
  }
  softmax_rows(scores.data(), heads, L);
  acc.assign(heads * D, 0.f);
  for (int64_t b = 0; b < nblocks; ++b) {
    const T* vb = vp + static_cast<int64_t>(blocks[b]) * BS * row;
    const int64_t t0 = b * BS, nt = std::min(BS, L - t0);
    prefetch_block(vp, blocks, b + 1, nblocks, BS, row, L);
    for (int64_t i = 0; i < nt; ++i) {
      const T* vr = vb + i * row;
      if constexpr (kIsFp8<T>) widen(vr + h0 * D, wide.data(), (h1 - h0) * D);
      for (int64_t h = h0; h < h1; ++h) {
        for (int64_t g = 0; g < G; ++g) {
          const int64_t head = (h - h0) * G + g;
          if constexpr (kIsFp8<T>)
            axpy<D_>(acc.data() + head * D, scores[head * L + t0 + i], wide.data() + (h - h0) * D, D);
          else
            axpy<D_>(acc.data() + head * D, scores[head * L + t0 + i], vr + h * D, D);
        }
      }
    }
  }
  if (v_scale != 1.f)
    for (float& a : acc) a *= v_scale;
  std::copy(acc.begin(), acc.end(), oh);
}

#if defined(__AVX512F__)
// Lane t of the result is the sum of the 16 lanes of v[t]: sixteen dot products finished at once.
static inline __m512 sum_rows16(__m512* v) {
  __m512 w[8], x[4];
  for (int i = 0; i < 8; ++i)
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
    x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 z01 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88), _mm512_shuffle_f32x4(x[0], x[1], 0xDD));
  const __m512 z23 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x88), _mm512_shuffle_f32x4(x[2], x[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z01, z23, 0x88), _mm512_shuffle_f32x4(z01, z23, 0xDD));
}

// Sixteen cache elements as float32 lanes: bfloat16 is the high half of a float32, so widening is one shift.
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// The AVX-512 form of attend() for head sizes that are a multiple of 16 (C = D / 16 vectors per head row).
template <int C, typename T>
static void attend_avx512(const float* q, float* o, const T* kp, const T* vp, const int32_t* blocks,
                          int64_t L, int64_t BS, int64_t Hkv, int64_t G, int64_t h0, int64_t h1, float scale,
                          std::vector<float>& scores, std::vector<float>& acc) {
  constexpr int64_t D = 16 * C;
  const int64_t row = Hkv * D, heads = (h1 - h0) * G;
  const float* qh = q + h0 * G * D;
  float* oh = o + h0 * G * D;
  if (L <= 0) { std::fill(oh, oh + heads * D, 0.f); return; }
  scores.resize(heads * L);
  const int64_t nblocks = (L + BS - 1) / BS;
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t b = 0; b < nblocks; ++b) {
    const T* kb = kp + static_cast<int64_t>(blocks[b]) * BS * row;
    const int64_t t0 = b * BS, nt = std::min(BS, L - t0);
    prefetch_block(kp, blocks, b + 1, nblocks, BS, row, L);
    for (int64_t h = h0; h < h1; ++h) {
      for (int64_t g = 0; g < G; ++g) {
        const int64_t head = (h - h0) * G + g;
        __m512 qv[C];
        for (int c = 0; c < C; ++c) qv[c] = _mm512_loadu_ps(qh + head * D + 16 * c);
        for (int64_t i0 = 0; i0 < nt; i0 += 16) {
          const int64_t m = std::min<int64_t>(16, nt - i0);
          __m512 part[16];
          for (int64_t i = 0; i < 16; ++i) {
            if (i >= m) { part[i] = _mm512_setzero_ps(); continue; }
            const T* k = kb + (i0 + i) * row + h * D;
            __m512 s = _mm512_mul_ps(qv[0], load16(k));
            for (int c = 1; c < C; ++c) s = _mm512_fmadd_ps(qv[c], load16(k + 16 * c), s);
            part[i] = s;
          }
          const __mmask16 mask = static_cast<__mmask16>((1u << m) - 1u);
          _mm512_mask_storeu_ps(scores.data() + head * L + t0 + i0, mask, _mm512_mul_ps(sum_rows16(part), vscale));
        }
      }
    }
  }
  softmax_rows(scores.data(), heads, L);
  acc.assign(heads * D, 0.f);
  for (int64_t b = 0; b < nblocks; ++b) {
    const T* vb = vp + static_cast<int64_t>(blocks[b]) * BS * row;
    const int64_t t0 = b * BS, nt = std::min(BS, L - t0);
    prefetch_block(vp, blocks, b + 1, nblocks, BS, row, L);
    for (int64_t h = h0; h < h1; ++h) {
      for (int64_t g = 0; g < G; ++g) {
        const int64_t head = (h - h0) * G + g;
        float* a = acc.data() + head * D;
        const float* p = scores.data() + head * L + t0;
        __m512 av[C];
        for (int c = 0; c < C; ++c) av[c] = _mm512_loadu_ps(a + 16 * c);
        for (int64_t i = 0; i < nt; ++i) {
          const __m512 pv = _mm512_set1_ps(p[i]);
          const T* v = vb + i * row + h * D;
          for (int c = 0; c < C; ++c) av[c] = _mm512_fmadd_ps(pv, load16(v + 16 * c), av[c]);
        }
        for (int c = 0; c < C; ++c) _mm512_storeu_ps(a + 16 * c, av[c]);
      }
    }
  }
  std::copy(acc.begin(), acc.end(), oh);
}
#endif

// Attention of one sequence's query heads of KV heads [h0, h1): the AVX-512 form where the CPU and head size allow it
// (not for fp8), else the portable one.
template <typename T>
static void attend_any(const float* q, float* o, const T* kp, const T* vp, const int32_t* blocks, int64_t L, int64_t BS,
                       int64_t Hkv, int64_t G, int64_t h0, int64_t h1, int64_t D, float scale, float v_scale,
                       std::vector<float>& scores, std::vector<float>& acc, std::vector<float>& wide) {
#if defined(__AVX512F__)
  if constexpr (!kIsFp8<T>) {
#define VLLITE_AVX512_CASE(C)                                                                  \
  case C:                                                                                      \
    attend_avx512<C, T>(q, o, kp, vp, blocks, L, BS, Hkv, G, h0, h1, scale, scores, acc);       \
    return;
    if (D % 16 == 0) {
      switch (D / 16) {
        VLLITE_AVX512_CASE(1) VLLITE_AVX512_CASE(2) VLLITE_AVX512_CASE(3) VLLITE_AVX512_CASE(4)
        VLLITE_AVX512_CASE(5) VLLITE_AVX512_CASE(6) VLLITE_AVX512_CASE(7) VLLITE_AVX512_CASE(8)
        default: break;
      }
    }
#undef VLLITE_AVX512_CASE
  }
#endif
  if (D == 64) attend<64, T>(q, o, kp, vp, blocks, L, BS, Hkv, G, h0, h1, D, scale, v_scale, scores, acc, wide);
  else if (D == 128) attend<128, T>(q, o, kp, vp, blocks, L, BS, Hkv, G, h0, h1, D, scale, v_scale, scores, acc, wide);
  else attend<0, T>(q, o, kp, vp, blocks, L, BS, Hkv, G, h0, h1, D, scale, v_scale, scores, acc, wide);
}

template <typename T>
static void paged_decode_typed(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                               torch::Tensor block_tables, torch::Tensor seq_lens, double scale, double k_scale,
                               double v_scale) {
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), Hkv = k_cache.size(2), G = H / Hkv, MB = block_tables.size(1);
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const T* kp = reinterpret_cast<const T*>(k_cache.data_ptr());
  const T* vp = reinterpret_cast<const T*>(v_cache.data_ptr());
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  // Scales apply to fp8 caches only; k_scale folds into the score scale.
  const float fscale = static_cast<float>(kIsFp8<T> ? scale * k_scale : scale);
  const float vscale = kIsFp8<T> ? static_cast<float>(v_scale) : 1.f;
  const int64_t threads = at::get_num_threads();
  // Work items, longest first, handed out one at a time: contexts of 16 and 800 tokens in one batch still keep
  // every thread busy to the end. Whole sequences when there are enough of them, else one KV head each.
  const int64_t split = n >= 4 * threads ? 1 : Hkv;
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return sl[a] > sl[b]; });
  const int64_t items = n * split;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    std::vector<float> scores, acc, wide(Hkv * D);
    for (int64_t w = next.fetch_add(1); w < items; w = next.fetch_add(1)) {
      const int64_t s = order[w / split];
      const int64_t h0 = split == 1 ? 0 : w % split, h1 = split == 1 ? Hkv : h0 + 1;
      const float* qs = qp + s * H * D;
      float* os = op + s * H * D;
      const int32_t* blocks = bt + s * MB;
      const int64_t L = sl[s];
      attend_any<T>(qs, os, kp, vp, blocks, L, BS, Hkv, G, h0, h1, D, fscale, vscale, scores, acc, wide);
    }
  });
}

// out = in * scale, float32 from a contiguous fp8 tensor (the gather path's widening of gathered cache blocks; torch's
// own fp8 conversion runs element by element, several times slower than a copy).
void widen_fp8(torch::Tensor out, torch::Tensor in, double scale) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && in.is_contiguous(), "widen_fp8: layouts");
  TORCH_CHECK(out.numel() == in.numel(), "widen_fp8: sizes differ");
  const auto dtype = in.scalar_type();
  TORCH_CHECK(dtype == at::kFloat8_e4m3fn || dtype == at::kFloat8_e5m2, "widen_fp8: the input is fp8");
  float* o = out.data_ptr<float>();
  const float s = static_cast<float>(scale);
  auto run = [&](auto* src) {
    at::parallel_for(0, in.numel(), 1 << 16, [&](int64_t begin, int64_t end) {
      widen(src + begin, o + begin, end - begin);
      if (s != 1.f)
        for (int64_t i = begin; i < end; ++i) o[i] *= s;
    });
  };
  if (dtype == at::kFloat8_e4m3fn) run(reinterpret_cast<const Fp8E4M3*>(in.data_ptr()));
  else run(reinterpret_cast<const Fp8E5M2*>(in.data_ptr()));
}

// out, q: [n, H, D] float32; caches: [num_blocks, block_size, Hkv, D] float32, bfloat16, float8_e4m3fn or
// float8_e5m2; block_tables: [n, max_blocks] int32; seq_lens: [n] int32. Sequence s attends to its first seq_lens[s]
// cached tokens. k_scale and v_scale: the fp8 caches' dequantization scales (ignored for the others).
void paged_decode(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                  torch::Tensor block_tables, torch::Tensor seq_lens, double scale, double k_scale, double v_scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat, "paged_decode: q and out are float32");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "paged_decode: K and V caches differ in dtype");
  const auto dtype = k_cache.scalar_type();
  if (dtype == at::kBFloat16)
    paged_decode_typed<at::BFloat16>(out, q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale);
  else if (dtype == at::kFloat8_e4m3fn)
    paged_decode_typed<Fp8E4M3>(out, q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale);
  else if (dtype == at::kFloat8_e5m2)
    paged_decode_typed<Fp8E5M2>(out, q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale);
  else {
    TORCH_CHECK(dtype == at::kFloat, "paged_decode: the cache is float32, bfloat16 or fp8");
    paged_decode_typed<float>(out, q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale);
  }
}
