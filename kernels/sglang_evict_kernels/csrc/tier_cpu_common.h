// Shared by the tier's CPU kernels (tier_attention_cpu.cpp, tier_quantize_cpu.cpp):
// fixed-width vectors, elements of the dtypes the tier stores (float32, float16,
// bfloat16) read as and written from float32, and the entry points the module binds.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace sglang_evict_tier {

// Fixed-width vectors (GCC's and Clang's vector extension: one AVX-512 register, two
// AVX2 ones or four NEON ones, as the machine has), loaded and stored unaligned.
template <typename T, int N>
struct VecOf {
  typedef T type __attribute__((vector_size(N * sizeof(T))));
};
template <typename T, int N>
using Vec = typename VecOf<T, N>::type;

template <typename T, int N>
inline Vec<T, N> load_vec(const T* p) {
  Vec<T, N> v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <typename T, int N>
inline void store_vec(T* p, Vec<T, N> v) {
  std::memcpy(p, &v, sizeof v);
}

// ``n`` floats from a tensor's elements of dtype ``type`` (the tier's scale dtypes and
// the full-precision dtypes of outlier rows and KV buffers).
inline void load_floats(const void* src, c10::ScalarType type, int64_t offset, int n, float* out) {
  switch (type) {
    case c10::ScalarType::Float: {
      const float* p = static_cast<const float*>(src) + offset;
      for (int i = 0; i < n; ++i) out[i] = p[i];
      break;
    }
    case c10::ScalarType::Half: {
      const c10::Half* p = static_cast<const c10::Half*>(src) + offset;
      for (int i = 0; i < n; ++i) out[i] = static_cast<float>(p[i]);
      break;
    }
    case c10::ScalarType::BFloat16: {
      const c10::BFloat16* p = static_cast<const c10::BFloat16*>(src) + offset;
      for (int i = 0; i < n; ++i) out[i] = static_cast<float>(p[i]);
      break;
    }
    default:
      TORCH_CHECK(false, "tier CPU kernel: unsupported dtype ", type);
  }
}

// ``value`` rounded to dtype ``type`` (round to nearest even, as torch's ``.to``) at
// element ``offset`` of ``dst``; returns the stored value as float32.
inline float store_float(void* dst, c10::ScalarType type, int64_t offset, float value) {
  switch (type) {
    case c10::ScalarType::Float:
      static_cast<float*>(dst)[offset] = value;
      return value;
    case c10::ScalarType::Half: {
      const c10::Half h(value);
      static_cast<c10::Half*>(dst)[offset] = h;
      return static_cast<float>(h);
    }
    case c10::ScalarType::BFloat16: {
      const c10::BFloat16 b(value);
      static_cast<c10::BFloat16*>(dst)[offset] = b;
      return static_cast<float>(b);
    }
    default:
      TORCH_CHECK(false, "tier CPU kernel: unsupported dtype ", type);
  }
  return 0.f;
}

std::vector<at::Tensor> tier_attention(
    at::Tensor q, at::Tensor table, at::Tensor counts, at::Tensor k_codes, at::Tensor k_scale,
    at::Tensor k_zero, at::Tensor v_codes, at::Tensor v_scale, at::Tensor v_zero,
    at::Tensor out_index, at::Tensor out_k, at::Tensor out_v, int64_t bits,
    int64_t group_channels, double sm_scale);

// The store's tensors as pointers (tier_format.py's layout; the kernels' launchers check
// that they are contiguous), and the dtypes of its scales and outlier rows.
struct StoreView {
  uint8_t* k_codes;  // [S, G, H, PD]
  void* k_scale;     // [S, H, D]
  void* k_zero;
  uint8_t* v_codes;  // [S, G, H, PD]
  void* v_scale;     // [S, G, H, NB]
  void* v_zero;
  int16_t* out_index;  // [S, H, NO]
  void* out_k;         // [S, H, NO, D]
  void* out_v;
  c10::ScalarType scale_type, full_type;
};

inline StoreView store_view(const at::Tensor& k_codes, const at::Tensor& k_scale,
                            const at::Tensor& k_zero, const at::Tensor& v_codes,
                            const at::Tensor& v_scale, const at::Tensor& v_zero,
                            const at::Tensor& out_index, const at::Tensor& out_k,
                            const at::Tensor& out_v) {
  return StoreView{k_codes.data_ptr<uint8_t>(), k_scale.data_ptr(),  k_zero.data_ptr(),
                   v_codes.data_ptr<uint8_t>(), v_scale.data_ptr(),  v_zero.data_ptr(),
                   out_index.data_ptr<int16_t>(), out_k.data_ptr(), out_v.data_ptr(),
                   k_scale.scalar_type(),       out_k.scalar_type()};
}

at::Tensor tier_decode_merge(
    at::Tensor q, at::Tensor o_full, at::Tensor k_buffer, at::Tensor req_to_token,
    at::Tensor rows, at::Tensor lens, at::Tensor table, at::Tensor counts, at::Tensor k_codes,
    at::Tensor k_scale, at::Tensor k_zero, at::Tensor v_codes, at::Tensor v_scale,
    at::Tensor v_zero, at::Tensor out_index, at::Tensor out_k, at::Tensor out_v, int64_t bits,
    int64_t group_channels, double sm_scale);

void tier_quantize(at::Tensor k_buffer, at::Tensor v_buffer, at::Tensor token_slots,
                   at::Tensor group_slots, at::Tensor k_codes, at::Tensor k_scale,
                   at::Tensor k_zero, at::Tensor v_codes, at::Tensor v_scale, at::Tensor v_zero,
                   at::Tensor out_index, at::Tensor out_k, at::Tensor out_v, int64_t bits,
                   int64_t group_channels);

}  // namespace sglang_evict_tier
