// Quantize-and-pack on CPU: quantize_into_reference's bytes (sglang_evict_kernels/
// tier_quant.py; the format and its reference in tier_format.py) written straight into
// the store at each group's slot, one task per (group, KV head), bit for bit.
//
// A task gathers its group's G key and value rows of one KV head (float32, exact from
// the buffers' float32, float16 or bfloat16), picks the outlier tokens (smallest key L1
// norm summed in float64, ties to the earlier token, then in token order), takes each
// channel's key range over the other tokens and each token's value range per block of
// C channels, stores the scales and zeros in the store's scale dtype (round to nearest
// even, as torch's ``.to``) and computes every code from the values as stored,
// ``floor((x - zero) / scale + 0.5)`` clamped to [0, 2**bits - 1] (0 where the scale is
// not positive) in float32, in the reference's operation order (no reciprocal, no fused
// multiply-add: the build has no -ffast-math). Rows pack as tier_format.py lays them out
// (whole codes in each 32-bit word; 3 bits as a 2-bit and a 1-bit plane). Outlier rows
// are stored in the store's full dtype.
#include "tier_cpu_common.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace sglang_evict_tier {
namespace {

struct QuantInputs {
  const void* k;  // [T, H, D]
  const void* v;
  const int64_t* token_slots;  // [N, G]
  const int64_t* group_slots;  // [N]
  StoreView st;
  c10::ScalarType buffer_type;
  int64_t n, g, h, d, c, no, pd, bits;
};

struct QuantScratch {
  std::vector<float> kf, vf, ks, kz, lo, hi, codes, vs, vz;
  std::vector<double> norms;
  std::vector<char> is_out;
  explicit QuantScratch(const QuantInputs& in)
      : kf(in.g * in.d), vf(in.g * in.d), ks(in.d), kz(in.d), lo(in.d), hi(in.d),
        codes(in.d), vs(in.d), vz(in.d), norms(in.g), is_out(in.g) {}
};

constexpr int kLanes = 16;  // channels per vector; the head dim is 64, 128 or 256
using V = Vec<float, kLanes>;
using V8 = Vec<float, 8>;  // a value block's channels (a multiple of 8)

// The reference's codes of ``x`` over the ranges stored as ``scale`` and ``zero``,
// floor((x - zero) / scale + 0.5) clamped to [0, levels], 0 where the scale is not
// positive, as floats. The vector division is IEEE's, as the reference's; the floor of
// a value clamped to [0, levels] first is its truncation.
inline V encode(V x, V scale, V zero, float levels) {
  const V none = V{}, top = V{} + levels;
  const auto positive = scale > none;
  V y = (x - zero) / (positive ? scale : none + 1.f) + 0.5f;
  y = y > none ? y : none;
  y = y < top ? y : top;
  const V code = __builtin_convertvector(__builtin_convertvector(y, Vec<int32_t, kLanes>), V);
  return positive ? code : none;
}

// A row of ``d`` codes (d a multiple of kLanes), channel i over scale[i] and zero[i].
inline void encode_row(const float* x, const float* scale, const float* zero, int64_t d,
                       float levels, float* codes) {
  for (int64_t i = 0; i < d; i += kLanes)
    store_vec<float, kLanes>(codes + i, encode(load_vec<float, kLanes>(x + i),
                                               load_vec<float, kLanes>(scale + i),
                                               load_vec<float, kLanes>(zero + i), levels));
}

// ``d`` codes of ``bits`` bits, one little-endian bit stream (code i of a chunk of 8 at
// bit ``bits * i`` of the chunk's word), into ``d * bits / 8`` bytes: the ``bits`` bits of
// each code from its bit ``shift`` up.
inline void pack_stream(const float* codes, int64_t d, int64_t bits, int shift, uint8_t* out) {
  const uint32_t mask = (1u << bits) - 1;
  for (int64_t c = 0; c < d / 8; ++c) {
    uint64_t word = 0;
    for (int j = 0; j < 8; ++j)
      word |= uint64_t((uint32_t(codes[c * 8 + j]) >> shift) & mask) << (bits * j);
    for (int64_t k = 0; k < bits; ++k) out[c * bits + k] = static_cast<uint8_t>(word >> (8 * k));
  }
}

// ``d`` codes of ``bits`` bits into a row of ``d * bits / 8`` bytes (tier_format.py's
// layout): one stream at 2, 4 and 8 bits; at 3 bits the low two bits' stream (``d / 4``
// bytes) and then the high bit's (``d / 8``).
inline void pack_row(const float* codes, int64_t d, int64_t bits, uint8_t* out) {
  if (bits == 8) {
    for (int64_t i = 0; i < d; ++i) out[i] = static_cast<uint8_t>(codes[i]);
  } else if (bits == 3) {
    pack_stream(codes, d, 2, 0, out);
    pack_stream(codes, d, 1, 2, out + d / 4);
  } else {
    pack_stream(codes, d, bits, 0, out);
  }
}

void quantize_group(const QuantInputs& in, int64_t group, int64_t head, QuantScratch& s) {
  const int64_t G = in.g, D = in.d, H = in.h, C = in.c, NB = in.d / in.c, NO = in.no;
  const float levels = static_cast<float>((1 << in.bits) - 1);
  const float inf = std::numeric_limits<float>::infinity();
  const int64_t slot = in.group_slots[group];
  for (int64_t t = 0; t < G; ++t) {
    const int64_t row = (in.token_slots[group * G + t] * H + head) * D;
    load_floats(in.k, in.buffer_type, row, D, s.kf.data() + t * D);
    load_floats(in.v, in.buffer_type, row, D, s.vf.data() + t * D);
  }
  // Outlier tokens: the NO smallest key L1 norms, ties to the earlier token.
  std::fill(s.is_out.begin(), s.is_out.end(), 0);
  // The sums are exact in float64 for float16 and bfloat16 rows (and float32 rows of
  // a sane range), so their order, eight running sums here, does not change them.
  for (int64_t t = 0; t < G && NO > 0; ++t) {
    double part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t i = 0; i < D; i += 8)
      for (int j = 0; j < 8; ++j) part[j] += std::fabs(static_cast<double>(s.kf[t * D + i + j]));
    s.norms[t] = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
  }
  for (int64_t o = 0; o < NO; ++o) {
    int64_t best = -1;
    for (int64_t t = 0; t < G; ++t)
      if (!s.is_out[t] && (best < 0 || s.norms[t] < s.norms[best])) best = t;
    s.is_out[best] = 1;
  }
  for (int64_t t = 0, o = 0; t < G; ++t) {
    if (!s.is_out[t]) continue;
    const int64_t at = (slot * H + head) * NO + o++;
    in.st.out_index[at] = static_cast<int16_t>(t);
    for (int64_t i = 0; i < D; ++i) {
      store_float(in.st.out_k, in.st.full_type, at * D + i, s.kf[t * D + i]);
      store_float(in.st.out_v, in.st.full_type, at * D + i, s.vf[t * D + i]);
    }
  }
  // Keys per channel over the group's other tokens.
  for (int64_t i = 0; i < D; i += kLanes) {
    V lo = V{} + inf, hi = V{} - inf;
    for (int64_t t = 0; t < G; ++t) {
      if (s.is_out[t]) continue;
      const V x = load_vec<float, kLanes>(s.kf.data() + t * D + i);
      lo = x < lo ? x : lo;
      hi = x > hi ? x : hi;
    }
    store_vec<float, kLanes>(s.lo.data() + i, lo);
    store_vec<float, kLanes>(s.hi.data() + i, hi);
  }
  const int64_t kbase = (slot * H + head) * D;
  for (int64_t i = 0; i < D; ++i) {
    s.ks[i] = store_float(in.st.k_scale, in.st.scale_type, kbase + i, (s.hi[i] - s.lo[i]) / levels);
    s.kz[i] = store_float(in.st.k_zero, in.st.scale_type, kbase + i, s.lo[i]);
  }
  for (int64_t t = 0; t < G; ++t) {
    encode_row(s.kf.data() + t * D, s.ks.data(), s.kz.data(), D, levels, s.codes.data());
    pack_row(s.codes.data(), D, in.bits, in.st.k_codes + ((slot * G + t) * H + head) * in.pd);
  }
  // Values per token and block of C channels.
  for (int64_t t = 0; t < G; ++t) {
    const float* x = s.vf.data() + t * D;
    for (int64_t b = 0; b < NB; ++b) {
      // The block's range, eight channels at a time (exact in any order).
      V8 lo8 = V8{} + inf, hi8 = V8{} - inf;
      for (int64_t i = b * C; i < (b + 1) * C; i += 8) {
        const V8 y = load_vec<float, 8>(x + i);
        lo8 = y < lo8 ? y : lo8;
        hi8 = y > hi8 ? y : hi8;
      }
      float lo = lo8[0], hi = hi8[0];
      for (int j = 1; j < 8; ++j) {
        lo = lo8[j] < lo ? lo8[j] : lo;
        hi = hi8[j] > hi ? hi8[j] : hi;
      }
      const int64_t at = ((slot * G + t) * H + head) * NB + b;
      const float scale = store_float(in.st.v_scale, in.st.scale_type, at, (hi - lo) / levels);
      const float zero = store_float(in.st.v_zero, in.st.scale_type, at, lo);
      std::fill(s.vs.begin() + b * C, s.vs.begin() + (b + 1) * C, scale);
      std::fill(s.vz.begin() + b * C, s.vz.begin() + (b + 1) * C, zero);
    }
    encode_row(x, s.vs.data(), s.vz.data(), D, levels, s.codes.data());
    pack_row(s.codes.data(), D, in.bits, in.st.v_codes + ((slot * G + t) * H + head) * in.pd);
  }
}

bool float_type(c10::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

}  // namespace

void tier_quantize(at::Tensor k_buffer, at::Tensor v_buffer, at::Tensor token_slots,
                   at::Tensor group_slots, at::Tensor k_codes, at::Tensor k_scale,
                   at::Tensor k_zero, at::Tensor v_codes, at::Tensor v_scale, at::Tensor v_zero,
                   at::Tensor out_index, at::Tensor out_k, at::Tensor out_v, int64_t bits,
                   int64_t group_channels) {
  for (const at::Tensor& t : {k_buffer, v_buffer, token_slots, group_slots, k_codes, k_scale,
                              k_zero, v_codes, v_scale, v_zero, out_index, out_k, out_v})
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(),
                "tier CPU quantize: every tensor must be a contiguous CPU tensor");
  TORCH_CHECK(bits == 2 || bits == 3 || bits == 4 || bits == 8,
              "tier CPU quantize: ", bits, " bits not supported");
  TORCH_CHECK(k_buffer.dim() == 3 && k_buffer.sizes() == v_buffer.sizes() &&
                  k_buffer.scalar_type() == v_buffer.scalar_type() &&
                  float_type(k_buffer.scalar_type()),
              "tier CPU quantize: K and V buffers must be float [tokens, heads, head dim] alike");
  TORCH_CHECK(token_slots.scalar_type() == at::kLong && group_slots.scalar_type() == at::kLong &&
                  token_slots.dim() == 2 && token_slots.size(0) == group_slots.numel(),
              "tier CPU quantize: token slots int64 [N, G] and group slots int64 [N]");
  TORCH_CHECK(out_index.scalar_type() == at::kShort, "tier CPU quantize: out_index must be int16");
  TORCH_CHECK(float_type(k_scale.scalar_type()) && float_type(out_k.scalar_type()) &&
                  v_scale.scalar_type() == k_scale.scalar_type() &&
                  k_zero.scalar_type() == k_scale.scalar_type() &&
                  v_zero.scalar_type() == k_scale.scalar_type() &&
                  out_v.scalar_type() == out_k.scalar_type(),
              "tier CPU quantize: scales float16/bfloat16/float32, outlier rows one float dtype");
  QuantInputs in;
  in.n = group_slots.numel();
  in.g = k_codes.size(1);
  in.h = k_codes.size(2);
  in.pd = k_codes.size(3);
  in.d = k_buffer.size(2);
  in.c = group_channels;
  in.no = out_index.size(2);
  in.bits = bits;
  TORCH_CHECK(token_slots.size(1) == in.g && k_buffer.size(1) == in.h && in.pd * 8 == in.d * bits &&
                  in.c % 8 == 0 && in.d % in.c == 0 && (in.d == 64 || in.d == 128 || in.d == 256) && in.no < in.g,
              "tier CPU quantize: the buffers, slots and store do not fit one format");
  const int64_t tokens = k_buffer.size(0), slots = k_codes.size(0);
  const int64_t* ts = token_slots.data_ptr<int64_t>();
  const int64_t* gs = group_slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < token_slots.numel(); ++i)
    TORCH_CHECK(ts[i] >= 0 && ts[i] < tokens, "tier CPU quantize: token slot ", ts[i],
                " outside the buffers' ", tokens, " slots");
  for (int64_t i = 0; i < in.n; ++i)
    TORCH_CHECK(gs[i] >= 0 && gs[i] < slots, "tier CPU quantize: group slot ", gs[i],
                " outside the store's ", slots, " slots");
  in.k = k_buffer.data_ptr();
  in.v = v_buffer.data_ptr();
  in.token_slots = ts;
  in.group_slots = gs;
  in.st = store_view(k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, out_index, out_k, out_v);
  in.buffer_type = k_buffer.scalar_type();
  // A task takes a few microseconds (G x D elements, about 8 us at 32 x 64 here) and a
  // pass quantizes a few groups a layer: a parallel region would cost more than it
  // saves (and waits for a busy core), so threads split only passes of 64 tasks or more.
  at::parallel_for(0, in.n * in.h, 64, [&](int64_t begin, int64_t end) {
    QuantScratch scratch(in);
    for (int64_t i = begin; i < end; ++i) quantize_group(in, i / in.h, i % in.h, scratch);
  });
}

}  // namespace sglang_evict_tier
