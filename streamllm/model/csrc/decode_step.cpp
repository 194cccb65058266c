// A decode step through every layer in one call: B sequences, one new token each
// (streamllm/model/native.py).
//
// A decode step is a few rows: its products are the Python path's (ATen's 4-bit kernel for
// few rows, oneDNN's packed bf16 above) and everything between them is a few hundred floats
// a row. In Python each layer is ~40 small tensor ops and a gathered attention; here the
// small ops are loops over the rows and attention reads each sequence's runs of KV cells in
// place.
//
// The roundings are the Python path's (llama.py): the residual stream, RMSNorm, RoPE and
// softmax in fp32; a product's input, its output, the cells and the attention output in
// bf16; silu and the gate's product each rounded to bf16, as torch rounds a bf16 op.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>
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

// bf16 <-> float by their bits, branch-free so that loops over them vectorize (c10's own conversion
// rounds the same way, to nearest even, but branches on NaN per element).
inline float to_f(bf16 x) {
  const uint32_t u = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline bf16 from_f(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
  return bf16(static_cast<uint16_t>(nan ? 0x7fc0u : rounded), bf16::from_bits());
}

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

#ifdef __AVX512F__
// fast_exp on 16 lanes (the same polynomial; fused multiply-adds may round the last bit otherwise).
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.33654f)), _mm512_set1_ps(88.72283f));
  const __m512 n = _mm512_roundscale_ps(_mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                                      _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_add_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f))),
                    _mm512_mul_ps(n, _mm512_set1_ps(2.12194440e-4f)));
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_add_ps(_mm512_mul_ps(y, x), _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_add_ps(_mm512_mul_ps(y, x), _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_add_ps(_mm512_mul_ps(y, x), _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_add_ps(_mm512_mul_ps(y, x), _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_add_ps(_mm512_mul_ps(y, x), _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(y, x), x), x), _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
}
#endif

// s[i] = exp(s[i] - m) for n values.
inline void exp_shifted(float* s, int64_t n, float m) {
  int64_t i = 0;
#ifdef __AVX512F__
  const __m512 mv = _mm512_set1_ps(m);
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(s + i, exp16(_mm512_sub_ps(_mm512_loadu_ps(s + i), mv)));
#endif
  for (; i < n; ++i) s[i] = fast_exp(s[i] - m);
}

#ifdef __AVX512F__
// 16 floats rounded to bf16 (to nearest even, as from_f) and widened back.
inline __m512 round16(__m512 f) {
  const __m512i u = _mm512_castps_si512(f);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u))));
}

inline void store16(bf16* p, __m512 rounded) {  // a value round16 made: its top 16 bits
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(rounded), 16)));
}
#endif

// out = bf16(bf16(silu(gate)) * up), rounded as torch rounds the two bf16 ops (finite inputs).
inline void silu_mul(const bf16* gate, const bf16* up, bf16* out, int64_t n) {
  int64_t i = 0;
#ifdef __AVX512F__
  const __m512 one = _mm512_set1_ps(1.0f);
  for (; i + 16 <= n; i += 16) {
    const __m512 a = load16(gate + i);
    const __m512 silu = round16(_mm512_div_ps(a, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), a)))));
    store16(out + i, round16(_mm512_mul_ps(silu, load16(up + i))));
  }
#endif
  for (; i < n; ++i) {
    const float a = to_f(gate[i]);
    out[i] = from_f(to_f(from_f(a / (1.0f + fast_exp(-a)))) * to_f(up[i]));
  }
}

// The portable loop's two halves (head sizes and groupings without a vector kernel).
// s[i] = q . k_i for `n` keys (stride `ks` elements apart) of width d; q in fp32.
void dots(const float* q, const bf16* k, int64_t ks, int64_t n, int64_t d, float* s) {
  for (int64_t i = 0; i < n; ++i, k += ks) {
    float dot = 0.f;
    for (int64_t j = 0; j < d; ++j) dot += q[j] * to_f(k[j]);
    s[i] = dot;
  }
}

// acc += sum_i p[i] * v_i for `n` values (stride `vs` elements apart) of width d.
void weighted_sum(const float* p, const bf16* v, int64_t vs, int64_t n, int64_t d, float* acc) {
  for (int64_t i = 0; i < n; ++i, v += vs)
    for (int64_t j = 0; j < d; ++j) acc[j] += p[i] * to_f(v[j]);
}

// weight * (x * rsqrt(mean(x^2) + eps)), the product of x and its rsqrt first (as llama.py).
void rmsnorm(const float* x, const float* weight, int64_t n, double eps, bf16* out) {
  double sum = 0.0;  // in double: a sum of 576 squares in any order rounds to the same float
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += static_cast<double>(x[i]) * x[i];
  const float r = 1.0f / std::sqrt(static_cast<float>(sum / n) + static_cast<float>(eps));
  for (int64_t i = 0; i < n; ++i) out[i] = from_f(weight[i] * (x[i] * r));
}

// x * cos + roll(x, D/2) * sin_signed, in fp32, rounded to bf16 (llama.py _rope).
void rope(const bf16* x, const float* cos, const float* sin, int64_t d, bf16* out) {
  const int64_t half = d / 2;
  for (int64_t j = 0; j < half; ++j) out[j] = from_f(to_f(x[j]) * cos[j] + to_f(x[j + half]) * sin[j]);
  for (int64_t j = half; j < d; ++j) out[j] = from_f(to_f(x[j]) * cos[j] + to_f(x[j - half]) * sin[j]);
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

// Scores of G query heads against every key of `segs` (first slot, count pairs; keys `ks` elements
// apart): dot(key, acc) leaves in acc[g] sixteen partial sums of head g's product with the key, and
// four keys' sums reduce together. s[g * stride + t] = scale * the sum; returns how many keys.
template <int G, typename Dot>
int64_t scores(const bf16* k, int64_t ks, const std::vector<int64_t>& segs, float* s, int64_t stride, float scale,
               Dot dot) {
  const __m128 sc = _mm_set1_ps(scale);
  int64_t t = 0;
  for (size_t r = 0; r < segs.size(); r += 2) {
    const bf16* kr = k + segs[r] * ks;
    const int64_t n = segs[r + 1];
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
      __m512 acc[4][G];
      for (int j = 0; j < 4; ++j) dot(kr + (i + j) * ks, acc[j]);
      for (int g = 0; g < G; ++g)
        _mm_storeu_ps(s + g * stride + t + i, _mm_mul_ps(sum4(acc[0][g], acc[1][g], acc[2][g], acc[3][g]), sc));
    }
    for (; i < n; ++i) {
      __m512 acc[G];
      dot(kr + i * ks, acc);
      for (int g = 0; g < G; ++g) s[g * stride + t + i] = _mm512_reduce_add_ps(acc[g]) * scale;
    }
    t += n;
  }
  return t;
}

#ifdef __AVX512BF16__
// Scores with AVX512-BF16's pair dot product: q and the keys stay bf16, products are exact in fp32
// and summed in fp32 (as the Python path's kernel does); scaled after.
template <int G, int C>
int64_t scores_bf16(const bf16* qb, float scale, const bf16* k, int64_t ks, const std::vector<int64_t>& segs,
                    float* s, int64_t stride) {
  constexpr int64_t D = 16 * C;
  __m512bh qh[G][C / 2];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C / 2; ++c) qh[g][c] = (__m512bh)_mm512_loadu_si512(qb + g * D + 32 * c);
  return scores<G>(k, ks, segs, s, stride, scale, [&](const bf16* key, __m512* acc) {
    for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
    for (int c = 0; c < C / 2; ++c) {
      const __m512bh kv = (__m512bh)_mm512_loadu_si512(key + 32 * c);
      for (int g = 0; g < G; ++g) acc[g] = _mm512_dpbf16_ps(acc[g], qh[g][c], kv);
    }
  });
}
#endif

#ifdef __AVX512BF16__
// acc_out [G, D] = sum over keys of p * value, with AVX512-BF16's pair dot product over two keys at
// once: the weights p = s rounded to bf16 (as the Python path's kernel multiplies them), the values
// as stored. Two keys' values interleave 16 bits at a time, so each fp32 lane holds one dimension of
// the pair; unpack's order (four dimensions per 128-bit lane from each half) is undone at the end.
template <int G, int C>
void values_bf16(const float* s, int64_t stride, const bf16* v, int64_t vs, const std::vector<int64_t>& segs,
                 int64_t keys, float* acc_out) {
  constexpr int64_t D = 16 * C;
  std::vector<uint16_t> pb(static_cast<size_t>(G * (keys + 1)), 0);
  for (int g = 0; g < G; ++g) {
    int64_t i = 0;
    for (; i + 16 <= keys; i += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb.data() + g * (keys + 1) + i),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s + g * stride + i)));
    for (; i < keys; ++i) pb[g * (keys + 1) + i] = from_f(s[g * stride + i]).x;
  }
  __m512 lo[G][C / 2], hi[G][C / 2];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C / 2; ++c) lo[g][c] = hi[g][c] = _mm512_setzero_ps();
  int64_t t = 0;
  for (size_t r = 0; r < segs.size(); r += 2) {
    const bf16* vr = v + segs[r] * vs;
    const int64_t n = segs[r + 1];
    for (int64_t i = 0; i < n; i += 2, t += 2) {
      const bool pair = i + 1 < n;  // a lone last key pairs with itself at weight 0
      const bf16* a = vr + i * vs;
      const bf16* b = pair ? a + vs : a;
      __m512i pp[G];
      for (int g = 0; g < G; ++g) {
        const uint16_t* w = pb.data() + g * (keys + 1) + t;
        pp[g] = _mm512_set1_epi32(static_cast<int32_t>(w[0] | (pair ? static_cast<uint32_t>(w[1]) << 16 : 0u)));
      }
      for (int c = 0; c < C / 2; ++c) {
        const __m512i va = _mm512_loadu_si512(a + 32 * c), vb = _mm512_loadu_si512(b + 32 * c);
        const __m512bh il = (__m512bh)_mm512_unpacklo_epi16(va, vb), ih = (__m512bh)_mm512_unpackhi_epi16(va, vb);
        for (int g = 0; g < G; ++g) {
          lo[g][c] = _mm512_dpbf16_ps(lo[g][c], il, (__m512bh)pp[g]);
          hi[g][c] = _mm512_dpbf16_ps(hi[g][c], ih, (__m512bh)pp[g]);
        }
      }
      if (!pair) t -= 1;
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C / 2; ++c) {
      alignas(64) float l[16], h[16];
      _mm512_store_ps(l, lo[g][c]);
      _mm512_store_ps(h, hi[g][c]);
      float* out = acc_out + g * D + 32 * c;
      for (int lane = 0; lane < 4; ++lane)
        for (int k = 0; k < 4; ++k) {
          out[8 * lane + k] = l[4 * lane + k];
          out[8 * lane + 4 + k] = h[4 * lane + k];
        }
    }
}
#endif

// Scores with the keys widened to fp32 (q fp32, scaled already).
template <int G, int C>
int64_t scores_f32(const float* q, const bf16* k, int64_t ks, const std::vector<int64_t>& segs, float* s,
                   int64_t stride) {
  constexpr int64_t D = 16 * C;
  __m512 qv[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) qv[g][c] = _mm512_loadu_ps(q + g * D + 16 * c);
  return scores<G>(k, ks, segs, s, stride, 1.0f, [&](const bf16* key, __m512* acc) {
    for (int c = 0; c < C; ++c) {
      const __m512 kv = load16(key + 16 * c);
      for (int g = 0; g < G; ++g) acc[g] = c == 0 ? _mm512_mul_ps(qv[g][c], kv) : _mm512_fmadd_ps(qv[g][c], kv, acc[g]);
    }
  });
}

// Attention of the G query heads that share one kv head over some of its keys (`segs`: first
// slot, count pairs), D = 16 * C: each key and value is read once for all G. qb [G, D] the
// queries as the layer made them, q the same in fp32 times `scale`; s: scratch of G rows
// `stride` apart. Out, per head: the scores' max, the sum of exp(score - max) and the values
// weighted by those exps (unnormalised), to merge with the other parts of the same keys
// (flash-decoding's split).
template <int G, int C>
void attend_group(const bf16* qb, const float* q, float scale, const bf16* k, int64_t ks, const bf16* v,
                  int64_t vs, const std::vector<int64_t>& segs, float* s, int64_t stride, float* best, float* total,
                  float* acc_out) {
  constexpr int64_t D = 16 * C;
  int64_t t;
#ifdef __AVX512BF16__
  if constexpr (C % 2 == 0)
    t = scores_bf16<G, C>(qb, scale, k, ks, segs, s, stride);
  else
    t = scores_f32<G, C>(q, k, ks, segs, s, stride);
#else
  t = scores_f32<G, C>(q, k, ks, segs, s, stride);
#endif
  const int64_t keys = t;
  for (int g = 0; g < G; ++g) {
    float* sg = s + g * stride;
    float m = -INFINITY;
#pragma omp simd reduction(max : m)
    for (int64_t i = 0; i < keys; ++i) m = std::max(m, sg[i]);
    exp_shifted(sg, keys, m);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < keys; ++i) sum += sg[i];
    best[g] = m;
    total[g] = sum;
  }
#ifdef __AVX512BF16__
  if constexpr (C % 2 == 0) {
    values_bf16<G, C>(s, stride, v, vs, segs, keys, acc_out);
    return;
  }
#endif
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

using GroupKernel = void (*)(const bf16*, const float*, float, const bf16*, int64_t, const bf16*, int64_t,
                             const std::vector<int64_t>&, float*, int64_t, float*, float*, float*);

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
using GroupKernel = void (*)(const bf16*, const float*, float, const bf16*, int64_t, const bf16*, int64_t,
                             const std::vector<int64_t>&, float*, int64_t, float*, float*, float*);
GroupKernel group_kernel(int64_t, int64_t) { return nullptr; }
#endif

// The same partials as attend_group for any head count and size, one head at a time.
void attend_group_portable(int64_t G, int64_t D, const float* q, const bf16* k, int64_t ks, const bf16* v,
                           int64_t vs, const std::vector<int64_t>& segs, float* s, int64_t stride, float* best,
                           float* total, float* acc_out) {
  for (int64_t g = 0; g < G; ++g) {
    float* sg = s + g * stride;
    int64_t t = 0;
    for (size_t r = 0; r < segs.size(); t += segs[r + 1], r += 2) dots(q + g * D, k + segs[r] * ks, ks, segs[r + 1], D, sg + t);
    float m = -INFINITY;
    for (int64_t i = 0; i < t; ++i) m = std::max(m, sg[i]);
    exp_shifted(sg, t, m);
    float sum = 0.f;
    for (int64_t i = 0; i < t; ++i) sum += sg[i];
    best[g] = m;
    total[g] = sum;
    std::fill(acc_out + g * D, acc_out + (g + 1) * D, 0.f);
    t = 0;
    for (size_t r = 0; r < segs.size(); t += segs[r + 1], r += 2)
      weighted_sum(sg + t, v + segs[r] * vs, vs, segs[r + 1], D, acc_out + g * D);
  }
}

// oneDNN's product on a weight packed once (torch.ops.mkldnn._linear_pointwise, as llama.py calls it).
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed) {
  static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack;
  stack.reserve(6);
  stack.emplace_back(x);
  stack.emplace_back(packed);
  stack.emplace_back(c10::IValue());  // no bias
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<std::optional<at::Scalar>>());
  stack.emplace_back(std::string(""));
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// One weight kind of every layer: 4-bit copies for up to `int4_rows` rows, oneDNN-packed bf16 above.
struct Kind {
  std::vector<at::Tensor> packed4, scales_zeros, packed_bf16;
  int64_t int4_rows;
};

using KindArgs = std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>, int64_t>;

// One sequence's share of a layer's attention: its kv head `hk`, keys `segs` of its runs.
struct Task {
  int64_t seq, hk, offset;  // offset: the slice's first key among the sequence's keys
  std::vector<int64_t> segs;
};

class DecodeStep {
 public:
  DecodeStep(std::vector<at::Tensor> input_norm, std::vector<at::Tensor> post_norm, std::vector<at::Tensor> qkv_bias,
             KindArgs qkv, KindArgs o, KindArgs gate_up, KindArgs down, int64_t num_heads, int64_t num_kv_heads,
             int64_t head_dim, int64_t intermediate, int64_t group, double eps, double scale)
      : input_norm_(std::move(input_norm)), post_norm_(std::move(post_norm)), qkv_bias_(std::move(qkv_bias)),
        qkv_(kind(std::move(qkv))), o_(kind(std::move(o))), gate_up_(kind(std::move(gate_up))),
        down_(kind(std::move(down))), nh_(num_heads), nkv_(num_kv_heads), d_(head_dim), inter_(intermediate),
        group_(group), eps_(eps), scale_(scale) {
    const size_t layers = input_norm_.size();
    TORCH_CHECK(layers > 0 && post_norm_.size() == layers, "norm weights: one per layer");
    for (const Kind* k : {&qkv_, &o_, &gate_up_, &down_}) {
      TORCH_CHECK(k->packed4.size() == layers && k->scales_zeros.size() == layers, "4-bit copies: one per layer");
      TORCH_CHECK(k->packed_bf16.empty() || k->packed_bf16.size() == layers, "packed weights: none or one per layer");
    }
    TORCH_CHECK(qkv_bias_.empty() || qkv_bias_.size() == layers, "qkv biases: none or one per layer");
    TORCH_CHECK(nh_ % nkv_ == 0, "query heads must be a multiple of kv heads");
    for (size_t i = 0; i < layers; ++i)
      TORCH_CHECK(input_norm_[i].scalar_type() == at::kFloat && post_norm_[i].scalar_type() == at::kFloat,
                  "norm weights are fp32");
    hidden_ = input_norm_[0].numel();
  }

  // The most sequences a step may hold: any number where every kind has packed weights for
  // many rows, else what the 4-bit copies take.
  int64_t max_rows() const {
    int64_t rows = INT64_MAX;
    for (const Kind* k : {&qkv_, &o_, &gate_up_, &down_})
      if (k->packed_bf16.empty()) rows = std::min(rows, k->int4_rows);
    return rows;
  }

  // B sequences, one new token each. h [B, H] fp32, their residual streams, advanced in place through
  // layers [first, last); cos, sin_signed [B, D] fp32 at their positions; k_cache, v_cache
  // [L, Hkv, slots, D] bf16; sequence b's K/V go to slots[b]; its runs are the (first slot, count)
  // pairs runs[2 * bounds[b] .. 2 * bounds[b + 1]) covering its positions 0..pos in order (its own
  // slot included).
  void run(at::Tensor h, const at::Tensor& cos, const at::Tensor& sin_signed, at::Tensor k_cache,
           at::Tensor v_cache, const std::vector<int64_t>& slots, const std::vector<int64_t>& runs,
           const std::vector<int64_t>& bounds, int64_t first, int64_t last) {
    const int64_t rows = static_cast<int64_t>(slots.size());
    TORCH_CHECK(rows > 0 && rows <= max_rows(), "rows: 1 to ", max_rows());
    TORCH_CHECK(h.scalar_type() == at::kFloat && h.is_contiguous() && h.dim() == 2 && h.size(0) == rows &&
                    h.size(1) == hidden_, "h: [B, H] fp32");
    TORCH_CHECK(cos.is_contiguous() && sin_signed.is_contiguous() && cos.numel() == rows * d_ &&
                    sin_signed.numel() == rows * d_, "cos, sin: [B, D] fp32");
    TORCH_CHECK(k_cache.scalar_type() == at::kBFloat16 && v_cache.scalar_type() == at::kBFloat16,
                "KV cells are bf16");
    TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "KV cells: head_dim contiguous");
    TORCH_CHECK(static_cast<int64_t>(bounds.size()) == rows + 1 && bounds[0] == 0 &&
                    2 * bounds[rows] == static_cast<int64_t>(runs.size()), "bounds: B + 1 offsets into runs");
    TORCH_CHECK(0 <= first && first <= last && last <= static_cast<int64_t>(input_norm_.size()), "layer range");
    const int64_t cells = k_cache.size(2);
    TORCH_CHECK(v_cache.size(2) == cells, "K and V pools differ in size");
    for (int64_t b = 0; b < rows; ++b) {  // nothing is read or written outside the pool
      TORCH_CHECK(0 <= slots[b] && slots[b] < cells, "sequence ", b, ": slot ", slots[b], " outside the pool");
      TORCH_CHECK(bounds[b] < bounds[b + 1], "sequence ", b, " has no runs");
      for (int64_t r = bounds[b]; r < bounds[b + 1]; ++r)
        TORCH_CHECK(runs[2 * r] >= 0 && runs[2 * r + 1] > 0 && runs[2 * r] + runs[2 * r + 1] <= cells,
                    "sequence ", b, ": run (", runs[2 * r], ", ", runs[2 * r + 1], ") outside the pool");
    }
    const int64_t g = nh_ / nkv_, q_size = nh_ * d_, kv_size = nkv_ * d_;
    const std::vector<Task> tasks = plan(runs, bounds);
    const auto bf = at::TensorOptions().dtype(at::kBFloat16);
    at::Tensor x = at::empty({rows, hidden_}, bf);
    at::Tensor attn = at::empty({rows, q_size}, bf);
    at::Tensor act = at::empty({rows, inter_}, bf);
    std::vector<bf16> qk(static_cast<size_t>(rows * (nh_ + nkv_) * d_));
    std::vector<float> best(tasks.size() * g), total(tasks.size() * g), acc(tasks.size() * g * d_);
    float* hp = h.data_ptr<float>();
    const float* cp = cos.data_ptr<float>();
    const float* sp = sin_signed.data_ptr<float>();

    for (int64_t li = first; li < last; ++li) {
      for (int64_t b = 0; b < rows; ++b)
        rmsnorm(hp + b * hidden_, input_norm_[li].data_ptr<float>(), hidden_, eps_, x.data_ptr<bf16>() + b * hidden_);
      at::Tensor qkv = product(x, qkv_, li);
      if (!qkv_bias_.empty()) qkv = qkv + qkv_bias_[li];
      const int64_t width = q_size + 2 * kv_size;
      at::Tensor kl = k_cache[li], vl = v_cache[li];
      bf16* kp = kl.data_ptr<bf16>();
      bf16* vp = vl.data_ptr<bf16>();
      const int64_t hs = kl.stride(0), ss = kl.stride(1), vhs = vl.stride(0), vss = vl.stride(1);
      for (int64_t b = 0; b < rows; ++b) {
        const bf16* row = qkv.data_ptr<bf16>() + b * width;
        bf16* out = qk.data() + b * (nh_ + nkv_) * d_;
        for (int64_t hd = 0; hd < nh_ + nkv_; ++hd) rope(row + hd * d_, cp + b * d_, sp + b * d_, d_, out + hd * d_);
        for (int64_t hk = 0; hk < nkv_; ++hk) {  // this token's key and value into its cells
          std::copy_n(out + (nh_ + hk) * d_, d_, kp + hk * hs + slots[b] * ss);
          std::copy_n(row + q_size + kv_size + hk * d_, d_, vp + hk * vhs + slots[b] * vss);
        }
      }
      attend(qk.data(), kp, vp, hs, ss, vhs, vss, tasks, best.data(), total.data(), acc.data(),
             attn.data_ptr<bf16>());
      add_into(hp, product(attn, o_, li), rows);
      for (int64_t b = 0; b < rows; ++b)
        rmsnorm(hp + b * hidden_, post_norm_[li].data_ptr<float>(), hidden_, eps_, x.data_ptr<bf16>() + b * hidden_);
      at::Tensor gu = product(x, gate_up_, li);
      for (int64_t b = 0; b < rows; ++b) {
        const bf16* gp = gu.data_ptr<bf16>() + b * 2 * inter_;
        bf16* ap = act.data_ptr<bf16>() + b * inter_;
        silu_mul(gp, gp + inter_, ap, inter_);
      }
      add_into(hp, product(act, down_, li), rows);
    }
  }

 private:
  static Kind kind(KindArgs args) {
    return Kind{std::move(std::get<0>(args)), std::move(std::get<1>(args)), std::move(std::get<2>(args)),
                std::get<3>(args)};
  }

  at::Tensor product(const at::Tensor& x, const Kind& w, int64_t li) const {
    if (x.size(0) <= w.int4_rows) return at::_weight_int4pack_mm_for_cpu(x, w.packed4[li], group_, w.scales_zeros[li]);
    return packed_linear(x, w.packed_bf16[li]);
  }

  void add_into(float* h, const at::Tensor& y, int64_t rows) const {
    const bf16* yp = y.data_ptr<bf16>();
    for (int64_t i = 0; i < rows * hidden_; ++i) h[i] += to_f(yp[i]);
  }

  // The layer's attention tasks, the same in every layer: per sequence and kv head, its keys in
  // slices when there are fewer tasks than twice the threads (flash-decoding's split), so both
  // threads work on a lone sequence; the slices' partials merge by their maxima in `attend`.
  std::vector<Task> plan(const std::vector<int64_t>& runs, const std::vector<int64_t>& bounds) const {
    const int64_t rows = static_cast<int64_t>(bounds.size()) - 1;
    const int64_t want = (2 * at::get_num_threads() + rows * nkv_ - 1) / (rows * nkv_);
    std::vector<Task> tasks;
    for (int64_t b = 0; b < rows; ++b) {
      int64_t keys = 0;
      for (int64_t r = bounds[b]; r < bounds[b + 1]; ++r) keys += runs[2 * r + 1];
      const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(want, keys / kMinPartKeys));
      for (int64_t hk = 0; hk < nkv_; ++hk) {
        int64_t r = bounds[b], used = 0;
        for (int64_t p = 0; p < parts; ++p) {  // keys [keys * p / parts, keys * (p + 1) / parts)
          Task task{b, hk, keys * p / parts, {}};
          for (int64_t left = keys * (p + 1) / parts - task.offset; left > 0;) {
            const int64_t take = std::min(left, runs[2 * r + 1] - used);
            task.segs.push_back(runs[2 * r] + used);
            task.segs.push_back(take);
            left -= take;
            used += take;
            if (used == runs[2 * r + 1]) ++r, used = 0;
          }
          tasks.push_back(std::move(task));
        }
      }
    }
    return tasks;
  }

  void attend(const bf16* qk, const bf16* kp, const bf16* vp, int64_t hs, int64_t ss, int64_t vhs, int64_t vss,
              const std::vector<Task>& tasks, float* best, float* total, float* acc, bf16* out) const {
    const int64_t g = nh_ / nkv_, d = d_, stride = (nh_ + nkv_) * d_;
    const float scale = static_cast<float>(scale_);
    const GroupKernel kernel = group_kernel(g, d);
    at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
      std::vector<float> q(g * d), scratch;
      for (int64_t i = begin; i < end; ++i) {
        const Task& task = tasks[i];
        int64_t keys = 0;
        for (size_t r = 1; r < task.segs.size(); r += 2) keys += task.segs[r];
        scratch.resize(static_cast<size_t>(g * keys));
        const bf16* qs = qk + task.seq * stride + task.hk * g * d;
        for (int64_t j = 0; j < g * d; ++j) q[j] = to_f(qs[j]) * scale;
        const bf16* k = kp + task.hk * hs;
        const bf16* v = vp + task.hk * vhs;
#ifdef __AVX512F__
        if (kernel != nullptr) {
          kernel(qs, q.data(), scale, k, ss, v, vss, task.segs, scratch.data(), keys, best + i * g, total + i * g,
                 acc + i * g * d);
          continue;
        }
#endif
        attend_group_portable(g, d, q.data(), k, ss, v, vss, task.segs, scratch.data(), keys, best + i * g,
                              total + i * g, acc + i * g * d);
      }
    });
    // merge each sequence's slices per query head: weights exp(max_slice - max_all)
    std::vector<float> row(d);
    for (size_t i = 0; i < tasks.size();) {
      size_t end = i;
      while (end < tasks.size() && tasks[end].seq == tasks[i].seq && tasks[end].hk == tasks[i].hk) ++end;
      for (int64_t j = 0; j < g; ++j) {
        float m = -INFINITY, sum = 0.f;
        for (size_t t = i; t < end; ++t) m = std::max(m, best[t * g + j]);
        std::fill(row.begin(), row.end(), 0.f);
        for (size_t t = i; t < end; ++t) {
          const float w = end - i == 1 ? 1.f : fast_exp(best[t * g + j] - m);
          sum += w * total[t * g + j];
          for (int64_t c = 0; c < d; ++c) row[c] += w * acc[(t * g + j) * d + c];
        }
        const float inv = 1.0f / sum;
        bf16* o = out + tasks[i].seq * nh_ * d + (tasks[i].hk * g + j) * d;
        for (int64_t c = 0; c < d; ++c) o[c] = from_f(row[c] * inv);
      }
      i = end;
    }
  }

  std::vector<at::Tensor> input_norm_, post_norm_, qkv_bias_;
  Kind qkv_, o_, gate_up_, down_;
  int64_t nh_, nkv_, d_, inter_, group_, hidden_ = 0;
  double eps_, scale_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<DecodeStep>(m, "DecodeStep")
      .def(pybind11::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>, KindArgs,
                          KindArgs, KindArgs, KindArgs, int64_t, int64_t, int64_t, int64_t, int64_t, double, double>())
      .def("max_rows", &DecodeStep::max_rows)
      .def("run", &DecodeStep::run, pybind11::call_guard<pybind11::gil_scoped_release>());
}
