// The fused decode step of vllite.kernels.cpu_decode_step: a Llama-family decoder's whole forward for a few decode
// tokens (one per sequence) in one call, compiled after cpu_decode.cpp and cpu_linear.cpp (their attention and
// linear routines are used here).
//
// At one to a few rows a step is bound by reading the weights once; what a framework adds around each operation
// (a dispatch, a parallel region woken per op, a temporary per result) is then a large part of the step. Here the
// threads enter one parallel region per step and meet at a spin barrier between the phases of a layer:
//   input norm (each thread its own copy) | Q, K, V heads + bias + rotary, keys and values into the paged cache
//   | attention per (sequence, KV head) | o-proj + residual | post norm (each its own) | gate, up, SiLU
//   | down-proj + residual, and after the last layer the final norm and the LM head.
// Each phase splits its output channels (or heads, or attention items) evenly across the team, so every weight is
// read by one thread once per step and the reads of a thread run through contiguous rows.
//
// Numerics follow transformers' Llama in the model's dtype: float32 throughout for a float32 model; for a bfloat16
// model every value transformers would store in bfloat16 (each linear's output, the norms, rotary, attention output,
// SiLU and product, residual sums, logits) is rounded to bfloat16 at the same point, with float32 accumulation
// inside each operation, as the unfused path does.
#include <omp.h>
#include <pybind11/stl.h>
#include <thread>

namespace decode_step {

// Rounds to the model's dtype: bfloat16 (round to nearest even) or float32 (unchanged).
template <bool kBf16>
inline float to_model(float v) {
  if constexpr (kBf16) return static_cast<float>(at::BFloat16(v));
  return v;
}

// All threads of a step's team wait here until the last one arrives; short waits spin, long ones yield the core.
class SpinBarrier {
 public:
  void wait(int team) {
    const int generation = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) == team - 1) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_acq_rel);
      return;
    }
    for (int spins = 0; generation_.load(std::memory_order_acquire) == generation; ++spins) {
      if (spins < 20000) {
#if defined(__x86_64__)
        __builtin_ia32_pause();
#endif
      } else {
        std::this_thread::yield();
      }
    }
  }

 private:
  std::atomic<int> arrived_{0};
  std::atomic<int> generation_{0};
};

// y[m * ldy] = x[m] . w for the M rows of x (K wide); the same row tiling as dense_linear, so the same sums.
template <typename W>
void dot_rows(const float* x, int64_t M, int64_t K, const W* w, float* y, int64_t ldy) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) channel_dense<4, 2>(x + m * K, w, K, y + m * ldy, ldy);
  switch (M - m) {
    case 3: channel_dense<3, 2>(x + m * K, w, K, y + m * ldy, ldy); break;
    case 2: channel_dense<2, 4>(x + m * K, w, K, y + m * ldy, ldy); break;
    case 1: channel_dense<1, 4>(x + m * K, w, K, y + m * ldy, ldy); break;
    default: break;
  }
}

// The share [begin, end) of `count` items that thread `tid` of `team` takes.
inline std::pair<int64_t, int64_t> share(int64_t count, int tid, int team) {
  return {count * tid / team, count * (tid + 1) / team};
}

// out[m] = weight * normalise(x[m]) over H elements (transformers' RMSNorm, rounding where it does).
template <bool kBf16, typename W>
void rms_norm(const float* x, int64_t M, int64_t H, const W* weight, float eps, float* out) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * H;
    float sq = 0.f;
    for (int64_t i = 0; i < H; ++i) sq += xm[i] * xm[i];
    const float r = 1.f / std::sqrt(sq / static_cast<float>(H) + eps);
    for (int64_t i = 0; i < H; ++i) out[m * H + i] = to_model<kBf16>(widen1(weight[i]) * to_model<kBf16>(xm[i] * r));
  }
}

struct Layer {
  torch::Tensor input_norm, post_norm, q, k, v, o, gate, up, down, q_bias, k_bias, v_bias;
};

// One model's decode step. Holds the weights (as given: float32 or bfloat16, [out, in] contiguous) and the rotary
// tables (float32 [positions, head_dim], already in the model's precision); each step gets the KV caches.
class DecodeStep {
 public:
  DecodeStep(std::vector<torch::Tensor> layer_tensors, torch::Tensor embed, torch::Tensor final_norm,
             torch::Tensor lm_head, torch::Tensor cos, torch::Tensor sin, int64_t num_heads, int64_t num_kv_heads,
             int64_t head_dim, double eps, double scale)
      : embed_(embed), final_norm_(final_norm), lm_head_(lm_head), cos_(cos), sin_(sin), heads_(num_heads),
        kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(static_cast<float>(eps)), scale_(static_cast<float>(scale)) {
    TORCH_CHECK(layer_tensors.size() % 12 == 0, "DecodeStep: 12 tensors per layer");
    for (size_t i = 0; i < layer_tensors.size(); i += 12) {
      auto t = [&](int j) { return layer_tensors[i + j]; };
      layers_.push_back({t(0), t(1), t(2), t(3), t(4), t(5), t(6), t(7), t(8), t(9), t(10), t(11)});
    }
    bf16_ = embed.scalar_type() == at::kBFloat16;
    hidden_ = embed.size(1);
    intermediate_ = layers_.empty() ? 0 : layers_[0].gate.size(0);
    vocab_ = lm_head.size(0);
  }

  // logits float32 [n, vocab]; ids, positions, slots int64 [n]; block_tables int32 [n, max_blocks]; seq_lens int32
  // [n] (each sequence's length including this step's token); kv: every layer's caches in one contiguous tensor
  // [layers, 2 (key, value), blocks, block_size, kv_heads, head_dim] of the model's dtype.
  void step(torch::Tensor logits, torch::Tensor ids, torch::Tensor positions, torch::Tensor slots,
            torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor kv) {
    TORCH_CHECK(kv.dim() == 6 && kv.size(0) == static_cast<int64_t>(layers_.size()) && kv.size(1) == 2 &&
                    kv.size(4) == kv_heads_ && kv.size(5) == head_dim_ && kv.is_contiguous() &&
                    kv.scalar_type() == embed_.scalar_type(),
                "DecodeStep: kv must be [layers, 2, blocks, block_size, kv_heads, head_dim] in the model's dtype");
    TORCH_CHECK(block_tables.is_contiguous() && logits.is_contiguous() && ids.is_contiguous() &&
                    positions.is_contiguous() && slots.is_contiguous() && seq_lens.is_contiguous(),
                "DecodeStep: contiguous inputs");
    if (bf16_) run<true, uint16_t, at::BFloat16>(logits, ids, positions, slots, block_tables, seq_lens, kv);
    else run<false, float, float>(logits, ids, positions, slots, block_tables, seq_lens, kv);
  }

 private:
  template <bool kBf16, typename W, typename T>
  void run(torch::Tensor& logits_t, torch::Tensor& ids_t, torch::Tensor& pos_t, torch::Tensor& slots_t,
           torch::Tensor& tables_t, torch::Tensor& lens_t, torch::Tensor& kv) {
    const int64_t n = ids_t.numel(), H = hidden_, D = head_dim_, Hq = heads_, Hkv = kv_heads_, G = Hq / Hkv;
    const int64_t I = intermediate_, V = vocab_, QD = Hq * D, MB = tables_t.size(1);
    const int64_t* ids = ids_t.data_ptr<int64_t>();
    const int64_t* pos = pos_t.data_ptr<int64_t>();
    const int64_t* slots = slots_t.data_ptr<int64_t>();
    const int32_t* tables = tables_t.data_ptr<int32_t>();
    const int32_t* lens = lens_t.data_ptr<int32_t>();
    const float* cos = cos_.data_ptr<float>();
    const float* sin = sin_.data_ptr<float>();
    float* logits = logits_t.data_ptr<float>();
    const int64_t BS = kv.size(3), cache_stride = kv.stride(1);
    T* kv_base = reinterpret_cast<T*>(kv.data_ptr());
    x_.resize(n * H);
    q_.resize(n * QD);
    o_.resize(n * QD);
    act_.resize(n * I);
    auto w = [](const torch::Tensor& t) { return reinterpret_cast<const W*>(t.data_ptr()); };
    const W* embed = w(embed_);
    SpinBarrier barrier;
    const int requested = at::get_num_threads();
#pragma omp parallel num_threads(requested)
    {
      const int team = omp_get_num_threads(), tid = omp_get_thread_num();
      std::vector<float> xn(n * H), head(n * D), tmp(n), up(n), rotated(D), scores, acc, wide(Hkv * D);
      {
        auto [c0, c1] = share(H, tid, team);
        for (int64_t m = 0; m < n; ++m)
          for (int64_t c = c0; c < c1; ++c) x_[m * H + c] = widen1(embed[ids[m] * H + c]);
      }
      barrier.wait(team);
      for (size_t li = 0; li < layers_.size(); ++li) {
        const Layer& L = layers_[li];
        T* kc = kv_base + 2 * li * cache_stride;
        T* vc = kc + cache_stride;
        rms_norm<kBf16>(x_.data(), n, H, w(L.input_norm), eps_, xn.data());
        // Q, K and V one head at a time: the head's rows, bias, rotary, then into q_ or the caches.
        auto [u0, u1] = share(Hq + 2 * Hkv, tid, team);
        for (int64_t u = u0; u < u1; ++u) {
          const int kind = u < Hq ? 0 : (u < Hq + Hkv ? 1 : 2);
          const int64_t h = kind == 0 ? u : (kind == 1 ? u - Hq : u - Hq - Hkv);
          const torch::Tensor& weight = kind == 0 ? L.q : (kind == 1 ? L.k : L.v);
          const torch::Tensor& bias = kind == 0 ? L.q_bias : (kind == 1 ? L.k_bias : L.v_bias);
          const W* rows = w(weight) + h * D * H;
          for (int64_t d = 0; d < D; ++d) dot_rows(xn.data(), n, H, rows + d * H, head.data() + d, D);
          const W* b = bias.numel() ? w(bias) + h * D : nullptr;
          for (int64_t m = 0; m < n; ++m) {
            float* hv = head.data() + m * D;
            for (int64_t d = 0; d < D; ++d) hv[d] = to_model<kBf16>(b ? hv[d] + widen1(b[d]) : hv[d]);
            if (kind != 2) rotate<kBf16>(hv, cos + pos[m] * D, sin + pos[m] * D, D, rotated.data());
            if (kind == 0) {
              std::copy(hv, hv + D, q_.data() + m * QD + h * D);
            } else if (slots[m] >= 0) {
              T* row = (kind == 1 ? kc : vc) + slots[m] * Hkv * D + h * D;
              for (int64_t d = 0; d < D; ++d) row[d] = static_cast<T>(hv[d]);
            }
          }
        }
        barrier.wait(team);
        auto [a0, a1] = share(n * Hkv, tid, team);
        for (int64_t item = a0; item < a1; ++item) {
          const int64_t s = item / Hkv, h = item % Hkv;
          attend_any<T>(q_.data() + s * QD, o_.data() + s * QD, kc, vc, tables + s * MB, lens[s], BS, Hkv, G, h, h + 1,
                        D, scale_, 1.f, scores, acc, wide);
          if constexpr (kBf16)
            for (float* p = o_.data() + s * QD + h * G * D; p < o_.data() + s * QD + (h + 1) * G * D; ++p)
              *p = to_model<kBf16>(*p);
        }
        barrier.wait(team);
        project_add<kBf16>(o_.data(), n, QD, w(L.o), H, tid, team, tmp.data());
        barrier.wait(team);
        rms_norm<kBf16>(x_.data(), n, H, w(L.post_norm), eps_, xn.data());
        {
          auto [c0, c1] = share(I, tid, team);
          for (int64_t c = c0; c < c1; ++c) {
            dot_rows(xn.data(), n, H, w(L.gate) + c * H, tmp.data(), 1);
            dot_rows(xn.data(), n, H, w(L.up) + c * H, up.data(), 1);
            for (int64_t m = 0; m < n; ++m) {
              const float g = to_model<kBf16>(tmp[m]);
              const float silu = to_model<kBf16>(g / (1.f + std::exp(-g)));
              act_[m * I + c] = to_model<kBf16>(silu * to_model<kBf16>(up[m]));
            }
          }
        }
        barrier.wait(team);
        project_add<kBf16>(act_.data(), n, I, w(L.down), H, tid, team, tmp.data());
        barrier.wait(team);
      }
      rms_norm<kBf16>(x_.data(), n, H, w(final_norm_), eps_, xn.data());
      auto [v0, v1] = share(V, tid, team);
      const W* head_rows = w(lm_head_);
      for (int64_t c = v0; c < v1; ++c) {
        dot_rows(xn.data(), n, H, head_rows + c * H, tmp.data(), 1);
        for (int64_t m = 0; m < n; ++m) logits[m * V + c] = to_model<kBf16>(tmp[m]);
      }
    }
  }

  // q or k of one head in place: v * cos + rotate_half(v) * sin, rounded where transformers rounds.
  template <bool kBf16>
  static void rotate(float* v, const float* cos, const float* sin, int64_t D, float* scratch) {
    const int64_t half = D / 2;
    for (int64_t d = 0; d < D; ++d) {
      const float rot = d < half ? -v[d + half] : v[d - half];
      scratch[d] = to_model<kBf16>(to_model<kBf16>(v[d] * cos[d]) + to_model<kBf16>(rot * sin[d]));
    }
    std::copy(scratch, scratch + D, v);
  }

  // x_[m, c] += in[m] . weight[c] for this thread's share of the H output channels (a residual add).
  template <bool kBf16, typename W>
  void project_add(const float* in, int64_t n, int64_t K, const W* weight, int64_t H, int tid, int team, float* tmp) {
    auto [c0, c1] = share(H, tid, team);
    for (int64_t c = c0; c < c1; ++c) {
      dot_rows(in, n, K, weight + c * K, tmp, 1);
      for (int64_t m = 0; m < n; ++m) x_[m * H + c] = to_model<kBf16>(x_[m * H + c] + to_model<kBf16>(tmp[m]));
    }
  }

  std::vector<Layer> layers_;
  torch::Tensor embed_, final_norm_, lm_head_, cos_, sin_;
  int64_t heads_, kv_heads_, head_dim_, hidden_ = 0, intermediate_ = 0, vocab_ = 0;
  float eps_, scale_;
  bool bf16_ = false;
  std::vector<float> x_, q_, o_, act_;  // the residual stream, queries, attention outputs, MLP activations
};

}  // namespace decode_step

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<decode_step::DecodeStep>(m, "DecodeStep")
      .def(pybind11::init<std::vector<torch::Tensor>, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor,
                          torch::Tensor, int64_t, int64_t, int64_t, double, double>())
      .def("step", &decode_step::DecodeStep::step, pybind11::call_guard<pybind11::gil_scoped_release>());
}
