// The small per-token ops of a Llama layer for CPUs, float32 and bfloat16: RMSNorm (alone and
// fused with the residual add before it), rotary embedding, SiLU-and-mul and the KV-cache write;
// and greedy sampling's argmax over the logits.
// Their torch references run 3-8 separate ATen ops each, every one a full pass over the
// activations plus dispatch overhead (16 ms of a 164 ms decode step at batch 64 on 2 cores);
// here each is one pass, parallel over tokens.
//
// bfloat16 is computed in float32 and rounded (to nearest even) wherever the reference's
// separate bfloat16 ops round, so the result is the reference's up to the order of a sum.
#include "cpu_ops.h"
#include "vec_cpu.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace {

// Rows per task: small batches (decode) stay on one thread unless there is enough work to split.
constexpr int64_t kGrain = 16;

// How a stored element becomes a float and back. bfloat16 is the top half of a float32, so both
// directions are integer shifts that vectorize (c10's conversions do not, inside these loops).
template <typename T>
struct Num {
  using raw = float;
  static float get(raw v) { return v; }
  static raw put(float v) { return v; }
};

template <>
struct Num<at::BFloat16> {
  using raw = uint16_t;
  static float get(raw v) {
    const uint32_t u = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  }
  static raw put(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    return static_cast<raw>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  }
};

// The float a value holds once stored as T: where the reference rounds between two ops.
template <typename T>
inline float rnd(float v) {
  return Num<T>::get(Num<T>::put(v));
}

template <typename T>
typename Num<T>::raw* raw_ptr(const torch::Tensor& t) {
  return reinterpret_cast<typename Num<T>::raw*>(t.data_ptr());
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 || t.scalar_type() == torch::kBFloat16, name,
              " must be float32 or bfloat16");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [tokens, hidden] with contiguous rows");
}

// Calls f.template operator()<T>() with T the C++ type of `dtype` (float or at::BFloat16).
template <typename F>
void dispatch(at::ScalarType dtype, F&& f) {
  if (dtype == torch::kBFloat16)
    f(at::BFloat16{});
  else
    f(float{});
}

template <typename T>
inline float inv_rms(const typename Num<T>::raw* x, int64_t n, float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) {
    const float v = Num<T>::get(x[i]);
    sum += v * v;
  }
  return 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
}

// out = weight * T(x * inv_rms): the reference scales in float32, rounds, then multiplies by
// the weight in T.
template <typename T>
inline void scale_row(const typename Num<T>::raw* x, const typename Num<T>::raw* w, typename Num<T>::raw* out,
                      int64_t n, float r) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = Num<T>::put(Num<T>::get(w[i]) * rnd<T>(Num<T>::get(x[i]) * r));
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight and x differ in dtype");
  weight = weight.contiguous();
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  const int64_t n = x.size(1), ld = x.stride(0);
  dispatch(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const auto* xp = raw_ptr<T>(x);
    const auto* w = raw_ptr<T>(weight);
    auto* op = raw_ptr<T>(out);
    at::parallel_for(0, x.size(0), kGrain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const auto* row = xp + t * ld;
        scale_row<T>(row, w, op + t * n, n, inv_rms<T>(row, n, static_cast<float>(eps)));
      }
    });
  });
  return out;
}

void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(x.sizes() == residual.sizes(), "x and residual differ in shape");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && residual.scalar_type() == x.scalar_type(),
              "x, residual and weight differ in dtype");
  weight = weight.contiguous();
  const int64_t n = x.size(1), ldx = x.stride(0), ldr = residual.stride(0);
  dispatch(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    auto* xp = raw_ptr<T>(x);
    auto* rp = raw_ptr<T>(residual);
    const auto* w = raw_ptr<T>(weight);
    at::parallel_for(0, x.size(0), kGrain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        auto* xr = xp + t * ldx;
        auto* rr = rp + t * ldr;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) rr[i] = Num<T>::put(Num<T>::get(rr[i]) + Num<T>::get(xr[i]));
        scale_row<T>(rr, w, xr, n, inv_rms<T>(rr, n, static_cast<float>(eps)));
      }
    });
  });
}

namespace {

// One token's heads rotated in place. The reference multiplies, subtracts and adds in T, with
// cos and sin first rounded to T.
template <typename T>
void rotate_heads(typename Num<T>::raw* row, int64_t heads, int64_t head_size, const float* c, const float* s) {
  const int64_t half = head_size / 2;
  for (int64_t h = 0; h < heads; ++h) {
    auto* x1 = row + h * head_size;
    auto* x2 = x1 + half;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float a = Num<T>::get(x1[i]), b = Num<T>::get(x2[i]);
      const float ci = rnd<T>(c[i]), si = rnd<T>(s[i]);
      x1[i] = Num<T>::put(rnd<T>(a * ci) - rnd<T>(b * si));
      x2[i] = Num<T>::put(rnd<T>(b * ci) + rnd<T>(a * si));
    }
  }
}

}  // namespace

void rotary_embedding(torch::Tensor positions, torch::Tensor query, torch::Tensor key,
                      torch::Tensor cos_sin_cache, int64_t head_size) {
  check_rows(query, "query");
  check_rows(key, "key");
  TORCH_CHECK(key.scalar_type() == query.scalar_type(), "query and key differ in dtype");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.dim() == 1, "positions must be int64 [T]");
  TORCH_CHECK(cos_sin_cache.scalar_type() == torch::kFloat32 && cos_sin_cache.size(1) == head_size,
              "cos_sin_cache must be float32 [max_position, head_size]");
  positions = positions.contiguous();
  cos_sin_cache = cos_sin_cache.contiguous();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cache = cos_sin_cache.data_ptr<float>();
  const int64_t max_pos = cos_sin_cache.size(0);
  for (int64_t t = 0; t < positions.size(0); ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "position ", pos[t], " outside the rotary table");
  const int64_t qh = query.size(1) / head_size, kh = key.size(1) / head_size;
  const int64_t ldq = query.stride(0), ldk = key.stride(0);
  dispatch(query.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    auto* q = raw_ptr<T>(query);
    auto* k = raw_ptr<T>(key);
    at::parallel_for(0, positions.size(0), kGrain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* c = cache + pos[t] * head_size;
        rotate_heads<T>(q + t * ldq, qh, head_size, c, c + head_size / 2);
        rotate_heads<T>(k + t * ldk, kh, head_size, c, c + head_size / 2);
      }
    });
  });
}

// kW values of Num<T> as floats and back (bfloat16: the shifts and the rounding of Num, a
// vector at a time; with AVX-512 by one zero-extending load and one narrowing store, which GCC's
// generic conversions split in halves where it tunes for 256-bit vectors).
inline vu32 bf16_bits_rounded(vfloat v) {  // the bfloat16 nearest v, in the top half (ties to even)
  vu32 u;
  std::memcpy(&u, &v, sizeof u);
  return (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
}

template <typename T>
inline vfloat load_vec(const typename Num<T>::raw* p) {
  if constexpr (std::is_same_v<T, float>) {
    return vload(p);
  } else {
    vfloat f;
    widen(reinterpret_cast<const at::BFloat16*>(p), reinterpret_cast<float*>(&f), kW);
    return f;
  }
}

template <typename T>
inline void store_vec(typename Num<T>::raw* p, vfloat v) {
  if constexpr (std::is_same_v<T, float>) {
    vstore(p, v);
  } else {
    const vu32 top = bf16_bits_rounded(v) >> 16;
#if defined(__AVX512F__)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16((__m512i)top));
#else
    const vu16 h = __builtin_convertvector(top, vu16);
    std::memcpy(p, &h, sizeof h);
#endif
  }
}

template <typename T>
inline vfloat round_vec(vfloat v) {  // rnd<T> on a vector
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    const vu32 bits = bf16_bits_rounded(v);
    vfloat f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  }
}

// SiLU(gate) * up for kW values, with the inlined vexp (libmvec's expf is a call per vector):
// float32 1.05-1.3x the omp simd loop it replaces, bfloat16 level with it (paired, 32 and 1,024
// rows). Below g = -80, 1 + e^-g nears float's largest and g / (1 + e^-g) came out 0 (the AVX2
// build, g = -88.5) where the reference's is ~3e-37; there SiLU is g e^g (1 + e^g is 1 in float),
// taken as g e^(g+8) e^-8 to stay normal down to the reference's last nonzero value.
constexpr float kExpMinus8 = 3.35462628e-4f;

template <typename T>
inline void silu_and_mul_vector(const typename Num<T>::raw* gate, const typename Num<T>::raw* up,
                                typename Num<T>::raw* o) {
  const vfloat g = load_vec<T>(gate);
  const vint tiny = g < -80.f;
  const vfloat e = vexp(tiny ? g + 8.f : -g);
  const vfloat silu = tiny ? g * e * kExpMinus8 : g / (1.f + e);
  store_vec<T>(o, round_vec<T>(silu) * load_vec<T>(up));
}

inline float silu_scalar(float g) {  // the same, one value (a row's tail past its whole vectors)
  return g < -80.f ? g * std::exp(g + 8.f) * kExpMinus8 : g / (1.f + std::exp(-g));
}

torch::Tensor silu_and_mul(torch::Tensor x) {
  check_rows(x, "x");
  const int64_t n = x.size(1) / 2, ld = x.stride(0);
  auto out = torch::empty({x.size(0), n}, x.options());
  dispatch(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const auto* xp = raw_ptr<T>(x);
    auto* op = raw_ptr<T>(out);
    at::parallel_for(0, x.size(0), kGrain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const auto* gate = xp + t * ld;
        const auto* up = gate + n;
        auto* o = op + t * n;
        const int64_t whole = n / kW * kW;
        for (int64_t i = 0; i < whole; i += kW) silu_and_mul_vector<T>(gate + i, up + i, o + i);
        for (int64_t i = whole; i < n; ++i) {
          const float g = Num<T>::get(gate[i]);
          o[i] = Num<T>::put(rnd<T>(silu_scalar(g)) * Num<T>::get(up[i]));
        }
      }
    });
  });
  return out;
}

void reshape_and_cache(torch::Tensor key, torch::Tensor value, torch::Tensor key_cache, torch::Tensor value_cache,
                       torch::Tensor slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes(), "key and value must be [T, kv_heads, head_size]");
  TORCH_CHECK(key.stride(2) == 1 && key.stride(1) == key.size(2) && value.stride(2) == 1 &&
                  value.stride(1) == value.size(2),
              "each token's key and value must be contiguous");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(key.scalar_type() == key_cache.scalar_type() && value.scalar_type() == value_cache.scalar_type(),
              "key/value and the caches differ in dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.dim() == 1 &&
                  slot_mapping.size(0) == key.size(0),
              "slot_mapping must be int64 [T]");
  const int64_t row = key.size(1) * key.size(2);
  TORCH_CHECK(key_cache.numel() % row == 0 && key_cache.size(2) * key_cache.size(3) == row,
              "caches must be [blocks, block_size, kv_heads, head_size] like key");
  slot_mapping = slot_mapping.contiguous();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t num_slots = key_cache.numel() / row, bytes = row * key.element_size();
  for (int64_t t = 0; t < key.size(0); ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot ", slots[t], " outside the cache");
  const char* kp = static_cast<const char*>(key.data_ptr());
  const char* vp = static_cast<const char*>(value.data_ptr());
  char* kc = static_cast<char*>(key_cache.data_ptr());
  char* vc = static_cast<char*>(value_cache.data_ptr());
  const int64_t ldk = key.stride(0) * key.element_size(), ldv = value.stride(0) * value.element_size();
  at::parallel_for(0, key.size(0), 4 * kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      std::memcpy(kc + slots[t] * bytes, kp + t * ldk, bytes);
      std::memcpy(vc + slots[t] * bytes, vp + t * ldv, bytes);
    }
  });
}

namespace {

// A float's bits as an int32 that orders like the float: non-negative floats keep their bits,
// negative ones become minus their magnitude (so -0 and +0 tie, as they compare equal), and every
// NaN is the largest key, as torch.argmax ranks NaN. Integer keys, because under -ffast-math the
// compiler may assume float comparisons never meet a NaN. Scalar and vector forms.
template <typename U, typename I>
inline I order_key(U u) {
  const I mag = (I)(u & 0x7FFFFFFFu);  // a bit cast, for vectors too
  const I key = (u >> 31) != 0 ? -mag : mag;
  return mag > 0x7F800000 ? INT32_MAX : key;
}

template <typename T>
inline uint32_t float_bits(typename Num<T>::raw v) {
  if constexpr (std::is_same_v<T, float>) {
    uint32_t u;
    std::memcpy(&u, &v, sizeof u);
    return u;
  } else {
    return static_cast<uint32_t>(v) << 16;
  }
}

template <typename T>
inline vu32 float_bits_vec(const typename Num<T>::raw* x) {
  if constexpr (std::is_same_v<T, float>) {
    vu32 u;
    std::memcpy(&u, x, sizeof u);
    return u;
  } else {
    vu16 h;
    std::memcpy(&h, x, sizeof h);
    return __builtin_convertvector(h, vu32) << 16;
  }
}

// One pass, kW lanes each keeping its largest key and that key's first index; then the lanes
// (ties to the smaller index) and the tail (later indices: only a larger key replaces).
template <typename T>
int64_t row_argmax(const typename Num<T>::raw* x, int64_t n) {
  vint best = vint{} + INT32_MIN, best_at = vint{}, at;
  for (int j = 0; j < kW; ++j) at[j] = j;
  int64_t i = 0;
  for (; i + kW <= n; i += kW, at += kW) {
    const vint key = order_key<vu32, vint>(float_bits_vec<T>(x + i));
    const vint larger = key > best;
    best = larger ? key : best;
    best_at = larger ? at : best_at;
  }
  int32_t top = INT32_MIN;
  int64_t top_at = 0;
  for (int j = 0; j < kW; ++j)
    if (best[j] > top || (best[j] == top && best_at[j] < top_at)) top = best[j], top_at = best_at[j];
  for (; i < n; ++i) {
    const int32_t key = order_key<uint32_t, int32_t>(float_bits<T>(x[i]));
    if (key > top) top = key, top_at = i;
  }
  return top_at;
}

}  // namespace

torch::Tensor argmax_rows(torch::Tensor logits) {
  check_rows(logits, "logits");
  TORCH_CHECK(logits.size(1) > 0, "logits must have at least one column");
  auto out = torch::empty({logits.size(0)}, logits.options().dtype(torch::kInt64));
  auto* op = out.data_ptr<int64_t>();
  const int64_t n = logits.size(1), ld = logits.stride(0);
  dispatch(logits.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const auto* xp = raw_ptr<T>(logits);
    at::parallel_for(0, logits.size(0), 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) op[r] = row_argmax<T>(xp + r * ld, n);
    });
  });
  return out;
}
