// One decode step of one sequence through every layer, in one call (streamllm/model/native.py).
//
// A decode step is one row: its products read 4-bit weights (ATen's CPU kernel, as the
// Python path calls it) and everything between them is a few hundred floats. In Python
// each layer is ~40 small tensor ops and a gathered attention; here the small ops are
// loops over the row and attention reads the sequence's runs of KV cells in place.
//
// The roundings are the Python path's (llama.py): the residual stream, RMSNorm, RoPE and
// softmax in fp32; a product's input, its output, the cells and the attention output in
// bf16; silu and the gate's product each rounded to bf16, as torch rounds a bf16 op.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

using bf16 = c10::BFloat16;

// A slice of a kv head's keys is worth a task of its own from this many keys on.
constexpr int64_t kMinPartKeys = 128;

struct Weight4 {
  at::Tensor packed, scales_zeros;
};

inline float to_f(bf16 x) { return static_cast<float>(x); }

// exp(x) by Cephes' expf (2^n times a degree-6 polynomial, within 2 ulp): no call, so loops
// over it vectorize, where std::exp is one libm call per element.
inline float fast_exp(float x) {
  x = std::min(std::max(x, -87.33654f), 88.72283f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  x = x - n * 0.693359375f + n * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * x * x + x + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

#ifdef __AVX512F__
// 16 bf16 values as floats
inline __m512 load16(const bf16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
#endif

// s[i] = q . k_i for `n` keys (stride `ks` elements apart) of width d; q in fp32.
void dots(const float* q, const bf16* k, int64_t ks, int64_t n, int64_t d, float* s) {
#ifdef __AVX512F__
  if (d % 16 == 0 && d <= 256) {
    __m512 qv[16];
    for (int64_t c = 0; c < d / 16; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
    for (int64_t i = 0; i < n; ++i, k += ks) {
      __m512 acc = _mm512_mul_ps(qv[0], load16(k));
      for (int64_t c = 1; c < d / 16; ++c) acc = _mm512_fmadd_ps(qv[c], load16(k + 16 * c), acc);
      s[i] = _mm512_reduce_add_ps(acc);
    }
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i, k += ks) {
    float dot = 0.f;
    for (int64_t j = 0; j < d; ++j) dot += q[j] * to_f(k[j]);
    s[i] = dot;
  }
}

// acc += sum_i p[i] * v_i for `n` values (stride `vs` elements apart) of width d.
void weighted_sum(const float* p, const bf16* v, int64_t vs, int64_t n, int64_t d, float* acc) {
#ifdef __AVX512F__
  if (d % 16 == 0 && d <= 256) {
    __m512 av[16];
    for (int64_t c = 0; c < d / 16; ++c) av[c] = _mm512_loadu_ps(acc + 16 * c);
    for (int64_t i = 0; i < n; ++i, v += vs) {
      const __m512 w = _mm512_set1_ps(p[i]);
      for (int64_t c = 0; c < d / 16; ++c) av[c] = _mm512_fmadd_ps(w, load16(v + 16 * c), av[c]);
    }
    for (int64_t c = 0; c < d / 16; ++c) _mm512_storeu_ps(acc + 16 * c, av[c]);
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i, v += vs)
    for (int64_t j = 0; j < d; ++j) acc[j] += p[i] * to_f(v[j]);
}

// weight * (x * rsqrt(mean(x^2) + eps)), the product of x and its rsqrt first (as llama.py).
void rmsnorm(const float* x, const float* weight, int64_t n, double eps, bf16* out) {
  double sum = 0.0;  // in double: a sum of 576 squares in any order rounds to the same float
  for (int64_t i = 0; i < n; ++i) sum += static_cast<double>(x[i]) * x[i];
  const float r = 1.0f / std::sqrt(static_cast<float>(sum / n) + static_cast<float>(eps));
  for (int64_t i = 0; i < n; ++i) out[i] = bf16(weight[i] * (x[i] * r));
}

// x * cos + roll(x, D/2) * sin_signed, in fp32, rounded to bf16 (llama.py _rope).
void rope(const bf16* x, const float* cos, const float* sin, int64_t d, bf16* out) {
  const int64_t half = d / 2;
  for (int64_t j = 0; j < d; ++j) {
    const float a = to_f(x[j]) * cos[j];
    const float b = to_f(x[(j + half) % d]) * sin[j];
    out[j] = bf16(a + b);
  }
}

#ifdef __AVX512F__
// The sums of four vectors' lanes: [sum a, sum b, sum c, sum d].
inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  // per 128-bit lane: a, b, c, d partial sums
  const __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE));
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                                    _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

// Attention of the G query heads that share one kv head over some of its keys (`segs`: first
// slot, count pairs), D = 16 * C: each key and value is read once for all G. q [G, D] fp32
// (scaled); s: scratch of G rows `stride` apart. Out, per head: the scores' max, the sum of
// exp(score - max) and the values weighted by those exps (unnormalised), to merge with the
// other parts of the same keys (flash-decoding's split).
template <int G, int C>
void attend_group(const float* q, const bf16* k, int64_t ks, const bf16* v, int64_t vs,
                  const std::vector<int64_t>& segs, float* s, int64_t stride, float* best, float* total,
                  float* acc_out) {
  constexpr int64_t D = 16 * C;
  __m512 qv[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) qv[g][c] = _mm512_loadu_ps(q + g * D + 16 * c);
  int64_t t = 0;
  for (size_t r = 0; r < segs.size(); r += 2) {
    const bf16* kr = k + segs[r] * ks;
    const int64_t n = segs[r + 1];
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
      __m512 acc[G][4];
      for (int j = 0; j < 4; ++j) {
        const bf16* key = kr + (i + j) * ks;
        for (int c = 0; c < C; ++c) {
          const __m512 kv = load16(key + 16 * c);
          for (int g = 0; g < G; ++g)
            acc[g][j] = c == 0 ? _mm512_mul_ps(qv[g][c], kv) : _mm512_fmadd_ps(qv[g][c], kv, acc[g][j]);
        }
      }
      for (int g = 0; g < G; ++g) _mm_storeu_ps(s + g * stride + t + i, sum4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]));
    }
    for (; i < n; ++i) {
      const bf16* key = kr + i * ks;
      for (int g = 0; g < G; ++g) {
        __m512 acc = _mm512_mul_ps(qv[g][0], load16(key));
        for (int c = 1; c < C; ++c) acc = _mm512_fmadd_ps(qv[g][c], load16(key + 16 * c), acc);
        s[g * stride + t + i] = _mm512_reduce_add_ps(acc);
      }
    }
    t += n;
  }
  const int64_t keys = t;
  for (int g = 0; g < G; ++g) {
    float* sg = s + g * stride;
    float m = -INFINITY;
#pragma omp simd reduction(max : m)
    for (int64_t i = 0; i < keys; ++i) m = std::max(m, sg[i]);
    for (int64_t i = 0; i < keys; ++i) sg[i] = fast_exp(sg[i] - m);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < keys; ++i) sum += sg[i];
    best[g] = m;
    total[g] = sum;
  }
  __m512 acc[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = _mm512_setzero_ps();
  t = 0;
  for (size_t r = 0; r < segs.size(); r += 2) {
    const bf16* vr = v + segs[r] * vs;
    for (int64_t i = 0; i < segs[r + 1]; ++i, ++t) {
      const bf16* val = vr + i * vs;
      __m512 p[G];
      for (int g = 0; g < G; ++g) p[g] = _mm512_set1_ps(s[g * stride + t]);
      for (int c = 0; c < C; ++c) {
        const __m512 vv = load16(val + 16 * c);
        for (int g = 0; g < G; ++g) acc[g][c] = _mm512_fmadd_ps(p[g], vv, acc[g][c]);
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc_out + g * D + 16 * c, acc[g][c]);
}

using GroupKernel = void (*)(const float*, const bf16*, int64_t, const bf16*, int64_t, const std::vector<int64_t>&,
                             float*, int64_t, float*, float*, float*);

template <int C>
GroupKernel group_kernel_c(int64_t g) {
  switch (g) {
    case 1: return attend_group<1, C>;
    case 2: return attend_group<2, C>;
    case 3: return attend_group<3, C>;
    case 4: return attend_group<4, C>;
    case 5: return attend_group<5, C>;
    case 6: return attend_group<6, C>;
    case 7: return attend_group<7, C>;
    case 8: return attend_group<8, C>;
    default: return nullptr;
  }
}

// The kernel for g query heads per kv head and head_dim d, or null (the portable loop runs).
GroupKernel group_kernel(int64_t g, int64_t d) {
  switch (d) {
    case 16: return group_kernel_c<1>(g);
    case 32: return group_kernel_c<2>(g);
    case 64: return group_kernel_c<4>(g);
    case 128: return group_kernel_c<8>(g);
    default: return nullptr;
  }
}
#else
using GroupKernel = void*;
GroupKernel group_kernel(int64_t, int64_t) { return nullptr; }
#endif

class DecodeStep {
 public:
  DecodeStep(std::vector<at::Tensor> input_norm, std::vector<at::Tensor> post_norm,
             std::vector<at::Tensor> qkv, std::vector<at::Tensor> qkv_sz, std::vector<at::Tensor> qkv_bias,
             std::vector<at::Tensor> o, std::vector<at::Tensor> o_sz,
             std::vector<at::Tensor> gate_up, std::vector<at::Tensor> gate_up_sz,
             std::vector<at::Tensor> down, std::vector<at::Tensor> down_sz,
             int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t intermediate,
             int64_t group, double eps, double scale)
      : input_norm_(std::move(input_norm)), post_norm_(std::move(post_norm)), qkv_bias_(std::move(qkv_bias)),
        nh_(num_heads), nkv_(num_kv_heads), d_(head_dim), inter_(intermediate), group_(group), eps_(eps),
        scale_(scale) {
    const size_t layers = input_norm_.size();
    TORCH_CHECK(post_norm_.size() == layers && qkv.size() == layers && o.size() == layers &&
                    gate_up.size() == layers && down.size() == layers,
                "every weight list needs one entry per layer");
    TORCH_CHECK(qkv_bias_.empty() || qkv_bias_.size() == layers, "qkv biases: none or one per layer");
    TORCH_CHECK(nh_ % nkv_ == 0, "query heads must be a multiple of kv heads");
    for (size_t i = 0; i < layers; ++i) {
      qkv_.push_back({qkv[i], qkv_sz[i]});
      o_.push_back({o[i], o_sz[i]});
      gate_up_.push_back({gate_up[i], gate_up_sz[i]});
      down_.push_back({down[i], down_sz[i]});
      TORCH_CHECK(input_norm_[i].scalar_type() == at::kFloat && post_norm_[i].scalar_type() == at::kFloat,
                  "norm weights are fp32");
    }
    hidden_ = input_norm_.empty() ? 0 : input_norm_[0].numel();
  }

  // h [H] fp32, the new token's residual stream, advanced in place through layers [first, last).
  // cos, sin_signed [D] fp32 at its position; k_cache, v_cache [L, Hkv, slots, D] bf16; its K/V go
  // to `slot`; runs: (first slot, count) pairs covering its positions 0..pos in order (its own
  // slot included).
  void run(at::Tensor h, const at::Tensor& cos, const at::Tensor& sin_signed, at::Tensor k_cache,
           at::Tensor v_cache, int64_t slot, const std::vector<int64_t>& runs, int64_t first, int64_t last) {
    TORCH_CHECK(h.scalar_type() == at::kFloat && h.is_contiguous() && h.numel() == hidden_, "h: [H] fp32");
    TORCH_CHECK(k_cache.scalar_type() == at::kBFloat16 && v_cache.scalar_type() == at::kBFloat16,
                "KV cells are bf16");
    TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "KV cells: head_dim contiguous");
    TORCH_CHECK(runs.size() % 2 == 0 && !runs.empty(), "runs: (first slot, count) pairs");
    TORCH_CHECK(0 <= first && first <= last && last <= static_cast<int64_t>(qkv_.size()), "layer range");
    const int64_t g = nh_ / nkv_, q_size = nh_ * d_, kv_size = nkv_ * d_;
    int64_t keys = 0;
    for (size_t r = 1; r < runs.size(); r += 2) keys += runs[r];
    const auto bf = at::TensorOptions().dtype(at::kBFloat16);
    at::Tensor x = at::empty({1, hidden_}, bf);
    at::Tensor attn = at::empty({1, q_size}, bf);
    at::Tensor act = at::empty({1, inter_}, bf);
    std::vector<bf16> qk(static_cast<size_t>((nh_ + nkv_) * d_));
    float* hp = h.data_ptr<float>();
    const float* cp = cos.data_ptr<float>();
    const float* sp = sin_signed.data_ptr<float>();
    std::vector<float> scores(static_cast<size_t>(nh_ * keys));

    for (int64_t li = first; li < last; ++li) {
      rmsnorm(hp, input_norm_[li].data_ptr<float>(), hidden_, eps_, x.data_ptr<bf16>());
      at::Tensor qkv = mm(x, qkv_[li]);
      if (!qkv_bias_.empty()) qkv = qkv + qkv_bias_[li];
      const bf16* qkvp = qkv.data_ptr<bf16>();
      for (int64_t hd = 0; hd < nh_ + nkv_; ++hd) rope(qkvp + hd * d_, cp, sp, d_, qk.data() + hd * d_);
      // this token's key and value into its cells
      at::Tensor kl = k_cache[li], vl = v_cache[li];
      bf16* kp = kl.data_ptr<bf16>();
      bf16* vp = vl.data_ptr<bf16>();
      const int64_t hs = kl.stride(0), ss = kl.stride(1), vhs = vl.stride(0), vss = vl.stride(1);
      for (int64_t hk = 0; hk < nkv_; ++hk) {
        std::copy_n(qk.data() + (nh_ + hk) * d_, d_, kp + hk * hs + slot * ss);
        std::copy_n(qkvp + q_size + kv_size + hk * d_, d_, vp + hk * vhs + slot * vss);
      }
      attend(qk.data(), kp, vp, hs, ss, vhs, vss, runs, keys, g, scores.data(), attn.data_ptr<bf16>());
      at::Tensor o = mm(attn, o_[li]);
      add_into(hp, o.data_ptr<bf16>());
      rmsnorm(hp, post_norm_[li].data_ptr<float>(), hidden_, eps_, x.data_ptr<bf16>());
      at::Tensor gu = mm(x, gate_up_[li]);
      const bf16* gp = gu.data_ptr<bf16>();
      bf16* ap = act.data_ptr<bf16>();
      for (int64_t i = 0; i < inter_; ++i) {
        const float a = to_f(gp[i]);
        const bf16 silu = bf16(a / (1.0f + fast_exp(-a)));
        ap[i] = bf16(to_f(silu) * to_f(gp[inter_ + i]));
      }
      at::Tensor down = mm(act, down_[li]);
      add_into(hp, down.data_ptr<bf16>());
    }
  }

 private:
  at::Tensor mm(const at::Tensor& x, const Weight4& w) const {
    return at::_weight_int4pack_mm_for_cpu(x, w.packed, group_, w.scales_zeros);
  }

  void add_into(float* h, const bf16* y) const {
    for (int64_t i = 0; i < hidden_; ++i) h[i] += to_f(y[i]);
  }

  // One query head per task: scores over every key of the runs, softmax in fp32, weighted values.
  void attend(const bf16* q_all, const bf16* kp, const bf16* vp, int64_t hs, int64_t ss, int64_t vhs,
              int64_t vss, const std::vector<int64_t>& runs, int64_t keys, int64_t g, float* scores,
              bf16* out) const {
    const int64_t d = d_;
    const float scale = static_cast<float>(scale_);
#ifdef __AVX512F__
    if (const GroupKernel kernel = group_kernel(g, d)) {
      // Each kv head's keys in `parts` slices, so that both threads work when there are fewer kv heads
      // than twice the threads; the slices' partials merge by their maxima, exactly as one softmax.
      const int64_t parts = std::max<int64_t>(1, std::min<int64_t>((2 * at::get_num_threads() + nkv_ - 1) / nkv_,
                                                                   keys / kMinPartKeys));
      std::vector<std::vector<int64_t>> segs(parts);
      for (int64_t p = 0, r = 0, used = 0; p < parts; ++p) {  // the key range [keys*p/parts, keys*(p+1)/parts)
        int64_t want = keys * (p + 1) / parts - keys * p / parts;
        while (want > 0) {
          const int64_t take = std::min(want, runs[r + 1] - used);
          segs[p].push_back(runs[r] + used);
          segs[p].push_back(take);
          want -= take;
          used += take;
          if (used == runs[r + 1]) r += 2, used = 0;
        }
      }
      std::vector<float> best(nkv_ * parts * g), total(nkv_ * parts * g), acc(nkv_ * parts * g * d);
      at::parallel_for(0, nkv_ * parts, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> q(g * d);
        for (int64_t task = begin; task < end; ++task) {
          const int64_t hk = task / parts, p = task % parts;
          for (int64_t j = 0; j < g * d; ++j) q[j] = to_f(q_all[hk * g * d + j]) * scale;
          kernel(q.data(), kp + hk * hs, ss, vp + hk * vhs, vss, segs[p], scores + hk * g * keys + keys * p / parts,
                 keys, best.data() + task * g, total.data() + task * g, acc.data() + task * g * d);
        }
      });
      for (int64_t hk = 0; hk < nkv_; ++hk) {
        for (int64_t j = 0; j < g; ++j) {
          float m = -INFINITY, sum = 0.f;
          for (int64_t p = 0; p < parts; ++p) m = std::max(m, best[(hk * parts + p) * g + j]);
          std::vector<float> row(d, 0.f);
          for (int64_t p = 0; p < parts; ++p) {
            const int64_t at = (hk * parts + p) * g + j;
            const float w = parts == 1 ? 1.f : fast_exp(best[at] - m);
            sum += w * total[at];
            for (int64_t c = 0; c < d; ++c) row[c] += w * acc[at * d + c];
          }
          const float inv = 1.0f / sum;
          for (int64_t c = 0; c < d; ++c) out[(hk * g + j) * d + c] = bf16(row[c] * inv);
        }
      }
      return;
    }
#endif
    at::parallel_for(0, nh_, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> q(d), acc(d);
      for (int64_t hq = begin; hq < end; ++hq) {
        const int64_t hk = hq / g;
        for (int64_t j = 0; j < d; ++j) q[j] = to_f(q_all[hq * d + j]);
        float* s = scores + hq * keys;
        int64_t t = 0;
        for (size_t r = 0; r < runs.size(); t += runs[r + 1], r += 2)
          dots(q.data(), kp + hk * hs + runs[r] * ss, ss, runs[r + 1], d, s + t);
        float best = -INFINITY;
#pragma omp simd reduction(max : best)
        for (int64_t i = 0; i < keys; ++i) best = std::max(best, s[i] *= scale);
        for (int64_t i = 0; i < keys; ++i) s[i] = fast_exp(s[i] - best);
        float total = 0.f;
#pragma omp simd reduction(+ : total)
        for (int64_t i = 0; i < keys; ++i) total += s[i];
        std::fill(acc.begin(), acc.end(), 0.f);
        t = 0;
        for (size_t r = 0; r < runs.size(); t += runs[r + 1], r += 2)
          weighted_sum(s + t, vp + hk * vhs + runs[r] * vss, vss, runs[r + 1], d, acc.data());
        const float inv = 1.0f / total;
        for (int64_t j = 0; j < d; ++j) out[hq * d + j] = bf16(acc[j] * inv);
      }
    });
  }

  std::vector<at::Tensor> input_norm_, post_norm_, qkv_bias_;
  std::vector<Weight4> qkv_, o_, gate_up_, down_;
  int64_t nh_, nkv_, d_, inter_, group_, hidden_ = 0;
  double eps_, scale_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<DecodeStep>(m, "DecodeStep")
      .def(pybind11::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                          std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                          std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                          std::vector<at::Tensor>, std::vector<at::Tensor>, int64_t, int64_t, int64_t, int64_t,
                          int64_t, double, double>())
      .def("run", &DecodeStep::run, pybind11::call_guard<pybind11::gil_scoped_release>());
}
