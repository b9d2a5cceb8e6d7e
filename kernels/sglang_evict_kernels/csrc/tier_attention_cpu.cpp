// Decode attention over the quantized tier on CPU: tier_attention_reference's result
// (sglang_evict_kernels/tier_attention.py) read straight from the packed bytes, one task
// per (request, KV head). Nothing of the size of the tier is materialized: the groups are
// streamed with an online softmax, one group's codes unpacked at a time.
//
// Keys are read with their per-channel scale folded into the query:
//     q . (code * scale + zero) = (q * scale) . code + q . zero
// (the same value, another rounding order). A group's key codes are unpacked transposed
// (head_dim x G floats), so the scores are vectors over tokens held in a register over
// the channels. Values are dequantized as the reference does, code * scale + zero per
// token and block of channels, one row at a time in chunk order: the j-th code of every
// 8-code chunk of a row is one vector (lanes = chunks), so a row is 8 vector shifts,
// masks, conversions and multiply-adds with no per-code scalar work. The weighted sum
// runs over the group's rows with 16 channels held in a register, in that chunk order;
// the output's channel order is restored once per task. Outlier tokens read their
// full-precision rows. The vectors are GCC's and Clang's vector extension, so the build
// needs one of the two. Layouts: tier_format.py's module docstring; every tensor
// contiguous (checked by the Python launcher).
//
// tier_decode_merge is SGLang's CPU decode step with the tier in one call per layer:
// per (request, KV head) the attention above, the log-sum-exp of the request's scores
// over its full-precision keys read where they lie in the pool (req_to_token[row,
// :seq_len], an online sum), and the log-sum-exp merge with SGLang's own output
// (tier_attention.decode_merge_reference is the reference). This module also binds
// tier_quantize (tier_quantize_cpu.cpp).
#include "tier_cpu_common.h"

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <limits>
#include <vector>

namespace sglang_evict_tier {
namespace {

// exp(x) for the softmax's x <= 0, in operations a loop over tokens vectorizes (Cephes'
// expf polynomial on [-ln2/2, ln2/2], relative error about 1e-7); below -87 it returns
// exp(-87) ~ 1.6e-38 instead of a denormal, which weighs nothing beside the maximum's 1.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// A row of ``d`` codes of BITS bits (tier_format.py's layout), read in chunks of 8
// codes. At 2, 4 and 8 bits the row is one little-endian bit stream, a chunk ``BITS``
// bytes of it (code j at bit ``BITS * j``). At 3 bits the row is a 2-bit plane of the
// codes' low bits (``d / 4`` bytes) and a 1-bit plane of their high bit (``d / 8``): a
// chunk's word holds its 16 low bits (code j's at bit 2j) and, from bit 16, its 8 high
// bits (code j's at bit 16 + j).
template <int BITS>
using Word = std::conditional_t<(BITS * 8 <= 32), uint32_t, uint64_t>;

template <int BITS>
inline Word<BITS> chunk_word(const uint8_t* chunk) {
  Word<BITS> word = 0;
  for (int k = 0; k < BITS; ++k) word |= Word<BITS>(chunk[k]) << (8 * k);
  return word;
}

// The word of chunk ``c`` of a row of ``chunks`` chunks: one unaligned load where the
// load stays inside the row (its bytes past the chunk land above the codes, which every
// use masks off), byte by byte for the row's last chunks.
template <int BITS>
inline Word<BITS> row_chunk_word(const uint8_t* row, int64_t c, int64_t chunks) {
  if constexpr (BITS == 3) {
    uint16_t low;
    std::memcpy(&low, row + 2 * c, sizeof low);
    return Word<3>(low) | (Word<3>(row[2 * chunks + c]) << 16);
  } else {
    if (c * BITS + int64_t(sizeof(Word<BITS>)) <= chunks * BITS) {
      Word<BITS> word;
      std::memcpy(&word, row + c * BITS, sizeof word);
      return word;
    }
    return chunk_word<BITS>(row + c * BITS);
  }
}

// Code ``j`` of a chunk's word (or of a vector of them: one chunk a lane).
template <int BITS, typename W>
inline W chunk_code(W word, int j) {
  if constexpr (BITS == 3) {
    return ((word >> (2 * j)) & 3) | (((word >> (16 + j)) & 1) << 2);
  } else {
    return (word >> (BITS * j)) & ((1u << BITS) - 1);
  }
}

struct Inputs {
  const float* q;         // [B, HQ, D]
  const int64_t* table;   // [B, W]
  const int64_t* counts;  // [B]
  StoreView st;  // read only here
  int64_t b, w, hq, h, d, g, c, no, pd, slots;
  float sm_scale;
  float* o;    // [B, HQ, D]
  float* lse;  // [B, HQ]
};

// One task's buffers, sized once per task range.
struct Scratch {
  // acc: [P, D] and vbuf: [G, D] in chunk order (code j of chunk c at j * D/8 + c);
  // key_t: [D, G], a group's key codes transposed; qs: [P, D], queries times key scales
  std::vector<float> qv, qs, acc, m, l, sc, key_t, vbuf, ks, kz, full_row, vs, vz;
  std::vector<int> outlier_of;
  explicit Scratch(const Inputs& in) {
    const int64_t P = in.hq / in.h, D = in.d, G = in.g, NB = in.d / in.c;
    qv.resize(P * D);
    qs.resize(P * D);
    acc.resize(P * D);
    m.resize(P);
    l.resize(P);
    sc.resize(P * G);
    key_t.resize(D * G);
    vbuf.resize(G * D);
    ks.resize(D);
    kz.resize(D);
    full_row.resize(D);
    vs.resize(NB);
    vz.resize(NB);
    outlier_of.resize(G);
  }
};

// scores[t] = bias + sum_i a[i] * key_t[i * g + t] for t < g, TB tokens at a time held
// in a register over the channels.
template <int TB>
inline void key_scores(const float* a, const float* key_t, float bias, int64_t d, int64_t g,
                       float* scores) {
  using V = Vec<float, TB>;
  for (int64_t tb = 0; tb < g; tb += TB) {
    V part = V{} + bias;
    for (int64_t i = 0; i < d; ++i) part += a[i] * load_vec<float, TB>(key_t + i * g + tb);
    store_vec<float, TB>(scores + tb, part);
  }
}

// acc[i] += sum_t e[t] * vbuf[t * d + i] for i < d, 16 channels at a time held in a
// register over the tokens.
inline void value_sums(const float* e, const float* vbuf, int64_t d, int64_t g, float* acc) {
  using V = Vec<float, 16>;
  for (int64_t ib = 0; ib < d; ib += 16) {
    V part = load_vec<float, 16>(acc + ib);
    for (int64_t t = 0; t < g; ++t) part += e[t] * load_vec<float, 16>(vbuf + t * d + ib);
    store_vec<float, 16>(acc + ib, part);
  }
}

// Request ``row``'s attention for the query heads of KV head ``head``. NC, the chunks
// of a row (head dim / 8), is a constant so that the chunk-order loops are whole vectors.
template <int BITS, int NC>
void attend(const Inputs& in, int64_t row, int64_t head, Scratch& s) {
  constexpr int64_t D = NC * 8;
  const int64_t P = in.hq / in.h, G = in.g, NB = in.d / in.c, H = in.h;
  const int64_t CB = in.c / 8;  // chunks per value block
  const float neg_inf = -std::numeric_limits<float>::infinity();
  std::fill(s.acc.begin(), s.acc.end(), 0.f);
  std::fill(s.l.begin(), s.l.end(), 0.f);
  std::fill(s.m.begin(), s.m.end(), neg_inf);
  for (int64_t p = 0; p < P; ++p) {
    const float* src = in.q + (row * in.hq + head * P + p) * D;
    for (int64_t i = 0; i < D; ++i) s.qv[p * D + i] = src[i] * in.sm_scale;
  }
  std::vector<Word<BITS>> words(G);
  const int64_t count = std::min<int64_t>(std::max<int64_t>(in.counts[row], 0), in.w);
  for (int64_t gi = 0; gi < count; ++gi) {
    const int64_t slot = in.table[row * in.w + gi];
    TORCH_CHECK(slot >= 0 && slot < in.slots, "tier CPU kernel: request ", row, " group ", gi,
                " names slot ", slot, " of a store of ", in.slots);
    const int64_t sh = slot * H + head;
    const int64_t token_stride = H * in.pd;  // bytes from one token's row to the next's
    const uint8_t* k_rows = in.st.k_codes + (slot * G * H + head) * in.pd;
    // keys, transposed: key_t[channel * G + token], a loop over tokens per channel
    for (int64_t c = 0; c < NC; ++c) {
      for (int64_t t = 0; t < G; ++t)
        words[t] = row_chunk_word<BITS>(k_rows + t * token_stride, c, NC);
      for (int j = 0; j < 8; ++j) {
        float* col = s.key_t.data() + (c * 8 + j) * G;
        for (int64_t t = 0; t < G; ++t) col[t] = float(chunk_code<BITS>(words[t], j));
      }
    }
    load_floats(in.st.k_scale, in.st.scale_type, sh * D, D, s.ks.data());
    load_floats(in.st.k_zero, in.st.scale_type, sh * D, D, s.kz.data());
    for (int64_t p = 0; p < P; ++p) {
      float bias = 0.f;
      for (int64_t i = 0; i < D; ++i) {
        bias += s.qv[p * D + i] * s.kz[i];
        s.qs[p * D + i] = s.qv[p * D + i] * s.ks[i];
      }
      float* scores = s.sc.data() + p * G;
      if (G % 16 == 0)  // G is a power of two of at least 8
        key_scores<16>(s.qs.data() + p * D, s.key_t.data(), bias, D, G, scores);
      else
        key_scores<8>(s.qs.data() + p * D, s.key_t.data(), bias, D, G, scores);
    }
    std::fill(s.outlier_of.begin(), s.outlier_of.end(), -1);
    for (int64_t n = 0; n < in.no; ++n) {
      const int64_t t = in.st.out_index[sh * in.no + n];
      if (t < 0 || t >= G) continue;
      s.outlier_of[t] = int(n);
      load_floats(in.st.out_k, in.st.full_type, (sh * in.no + n) * D, D, s.full_row.data());
      for (int64_t p = 0; p < P; ++p) {
        float score = 0.f;
        for (int64_t i = 0; i < D; ++i) score += s.qv[p * D + i] * s.full_row[i];
        s.sc[p * G + t] = score;
      }
    }
    // online softmax: rescale what came before, then this group's weights
    for (int64_t p = 0; p < P; ++p) {
      float* scores = s.sc.data() + p * G;
      float top = s.m[p];
      for (int64_t t = 0; t < G; ++t) top = std::max(top, scores[t]);
      const float alpha = s.m[p] == neg_inf ? 0.f : std::exp(s.m[p] - top);
      for (int64_t t = 0; t < G; ++t) scores[t] = exp_nonpositive(scores[t] - top);
      float sum = 0.f;
      for (int64_t t = 0; t < G; ++t) sum += scores[t];
      s.l[p] = s.l[p] * alpha + sum;
      if (alpha != 1.f)
        for (int64_t i = 0; i < D; ++i) s.acc[p * D + i] *= alpha;
      s.m[p] = top;
    }
    // values: the group's rows dequantized in chunk order (code j of every chunk is one
    // vector over the chunks), then summed under the weights
    const uint8_t* v_rows = in.st.v_codes + (slot * G * H + head) * in.pd;
    for (int64_t t = 0; t < G; ++t) {
      float* dst = s.vbuf.data() + t * D;
      const int n = s.outlier_of[t];
      if (n >= 0) {
        load_floats(in.st.out_v, in.st.full_type, (sh * in.no + n) * D, D, s.full_row.data());
        for (int j = 0; j < 8; ++j)
          for (int c = 0; c < NC; ++c) dst[j * NC + c] = s.full_row[c * 8 + j];
        continue;
      }
      const uint8_t* v_row = v_rows + t * token_stride;
      using W = Vec<Word<BITS>, NC>;
      using F = Vec<float, NC>;
      W vw;
      for (int c = 0; c < NC; ++c) vw[c] = row_chunk_word<BITS>(v_row, c, NC);
      const int64_t tok = (slot * G + t) * H + head;
      load_floats(in.st.v_scale, in.st.scale_type, tok * NB, NB, s.vs.data());
      load_floats(in.st.v_zero, in.st.scale_type, tok * NB, NB, s.vz.data());
      F scale, zero;
      for (int64_t b = 0, c = 0; b < NB; ++b)
        for (int64_t k = 0; k < CB; ++k, ++c) {
          scale[c] = s.vs[b];
          zero[c] = s.vz[b];
        }
      for (int j = 0; j < 8; ++j) {
        const F code = __builtin_convertvector(chunk_code<BITS>(vw, j), F);
        store_vec<float, NC>(dst + j * NC, code * scale + zero);
      }
    }
    for (int64_t p = 0; p < P; ++p)
      value_sums(s.sc.data() + p * G, s.vbuf.data(), D, G, s.acc.data() + p * D);
  }
  for (int64_t p = 0; p < P; ++p) {
    const int64_t qh = row * in.hq + head * P + p;
    float* out = in.o + qh * D;
    if (s.l[p] > 0.f) {
      for (int j = 0; j < 8; ++j)
        for (int c = 0; c < NC; ++c) out[c * 8 + j] = s.acc[p * D + j * NC + c] / s.l[p];
      in.lse[qh] = s.m[p] + std::log(s.l[p]);
    } else {
      for (int64_t i = 0; i < D; ++i) out[i] = 0.f;
      in.lse[qh] = neg_inf;
    }
  }
}

// ``attend`` for the bits of the call (2, 3, 4 or 8: checked by the caller).
template <int NC>
void attend_bits(const Inputs& in, int64_t bits, int64_t row, int64_t head, Scratch& s) {
  switch (bits) {
    case 2: attend<2, NC>(in, row, head, s); break;
    case 3: attend<3, NC>(in, row, head, s); break;
    case 4: attend<4, NC>(in, row, head, s); break;
    default: attend<8, NC>(in, row, head, s); break;
  }
}

}  // namespace

namespace {

// The inputs both entry points share: the queries, the group table and counts, the store.
Inputs attention_inputs(const torch::Tensor& q, const torch::Tensor& table,
                        const torch::Tensor& counts, const torch::Tensor& k_codes,
                        const torch::Tensor& k_scale, const torch::Tensor& k_zero,
                        const torch::Tensor& v_codes, const torch::Tensor& v_scale,
                        const torch::Tensor& v_zero, const torch::Tensor& out_index,
                        const torch::Tensor& out_k, const torch::Tensor& out_v, int64_t bits,
                        int64_t group_channels, double sm_scale) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && q.is_contiguous() && q.dim() == 3,
              "tier CPU kernel: queries must be contiguous float32 [B, HQ, D]");
  TORCH_CHECK(table.scalar_type() == torch::kInt64 && counts.scalar_type() == torch::kInt64,
              "tier CPU kernel: the group table and counts must be int64");
  TORCH_CHECK(out_index.scalar_type() == torch::kInt16, "tier CPU kernel: out_index must be int16");
  TORCH_CHECK(bits == 2 || bits == 3 || bits == 4 || bits == 8,
              "tier CPU kernel: ", bits, " bits not supported");
  Inputs in;
  in.b = q.size(0);
  in.hq = q.size(1);
  in.d = q.size(2);
  in.w = table.size(1);
  in.g = k_codes.size(1);
  in.h = k_codes.size(2);
  in.pd = k_codes.size(3);
  in.slots = k_codes.size(0);
  in.c = group_channels;
  in.no = out_index.size(2);
  TORCH_CHECK((in.d == 64 || in.d == 128 || in.d == 256) && in.c % 8 == 0 && in.d % in.c == 0 &&
                  in.hq % in.h == 0,
              "tier CPU kernel: head dim ", in.d, " / value group ", in.c, " / heads ", in.hq,
              " over ", in.h, " do not fit");
  TORCH_CHECK(in.pd * 8 == in.d * bits, "tier CPU kernel: packed rows of ", in.pd,
              " bytes do not hold ", in.d, " codes of ", bits, " bits");
  auto readable = [](c10::ScalarType t) {
    return t == torch::kFloat32 || t == torch::kFloat16 || t == torch::kBFloat16;
  };
  TORCH_CHECK(readable(k_scale.scalar_type()) && readable(out_k.scalar_type()),
              "tier CPU kernel: scales and outlier rows must be float32, float16 or bfloat16");
  in.q = q.data_ptr<float>();
  in.table = table.data_ptr<int64_t>();
  in.counts = counts.data_ptr<int64_t>();
  in.st = store_view(k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, out_index, out_k, out_v);
  in.sm_scale = float(sm_scale);
  return in;
}

inline void attend_task(const Inputs& in, int64_t bits, int64_t row, int64_t head, Scratch& s) {
  if (in.d == 64)
    attend_bits<8>(in, bits, row, head, s);
  else if (in.d == 128)
    attend_bits<16>(in, bits, row, head, s);
  else
    attend_bits<32>(in, bits, row, head, s);
}

// The full-precision side's inputs: the pool's keys and each request's slots.
struct FullInputs {
  const void* k;  // [T, H, D], the layer's key buffer
  c10::ScalarType type;
  const int32_t* req_to_token;  // [R, W]
  const int64_t* rows;          // [B]: each request's row of req_to_token
  const int64_t* lens;          // [B]: its keys, the new token's included
  int64_t width;
};

// A task's buffers for the full side (full_lse).
struct FullScratch {
  static constexpr int64_t kBlock = 16;  // tokens whose scores share a register
  std::vector<float> qv, key_t, row, sc, m, l;
  explicit FullScratch(const Inputs& in)
      : qv(in.hq / in.h * in.d), key_t(in.d * kBlock), row(in.d), sc(kBlock),
        m(in.hq / in.h), l(in.hq / in.h) {}
};

// lse[p], p < P: the log-sum-exp of query head (head * P + p)'s scaled scores over the
// keys of request ``row`` (req_to_token[rows[row], :lens[row]]; -inf for none). Blocks
// of 16 tokens: the block's keys transposed (key_t[channel * 16 + token]) so that
// key_scores holds the 16 scores in a register over the channels (the scale folded
// into the query), then an online log-sum-exp over the blocks.
void full_lse(const Inputs& in, const FullInputs& full, int64_t row, int64_t head,
              FullScratch& f, float* lse) {
  constexpr int64_t TB = FullScratch::kBlock;
  const int64_t P = in.hq / in.h, D = in.d, H = in.h, len = full.lens[row];
  const int32_t* slots = full.req_to_token + full.rows[row] * full.width;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t p = 0; p < P; ++p) {
    const float* q = in.q + (row * in.hq + head * P + p) * D;
    for (int64_t i = 0; i < D; ++i) f.qv[p * D + i] = q[i] * in.sm_scale;
    f.m[p] = neg_inf;
    f.l[p] = 0.f;
  }
  for (int64_t t0 = 0; t0 < len; t0 += TB) {
    const int64_t n = std::min(TB, len - t0);
    for (int64_t t = 0; t < TB; ++t) {
      if (t < n)
        load_floats(full.k, full.type, (int64_t(slots[t0 + t]) * H + head) * D, D, f.row.data());
      else
        std::fill(f.row.begin(), f.row.end(), 0.f);  // past the request's keys: not counted
      for (int64_t i = 0; i < D; ++i) f.key_t[i * TB + t] = f.row[i];
    }
    for (int64_t p = 0; p < P; ++p) {
      key_scores<TB>(f.qv.data() + p * D, f.key_t.data(), 0.f, D, TB, f.sc.data());
      float top = f.m[p];
      for (int64_t t = 0; t < n; ++t) top = std::max(top, f.sc[t]);
      const float alpha = f.m[p] == neg_inf ? 0.f : std::exp(f.m[p] - top);
      float sum = 0.f;
      for (int64_t t = 0; t < n; ++t) sum += exp_nonpositive(f.sc[t] - top);
      f.l[p] = f.l[p] * alpha + sum;
      f.m[p] = top;
    }
  }
  for (int64_t p = 0; p < P; ++p) lse[p] = f.l[p] > 0.f ? f.m[p] + std::log(f.l[p]) : neg_inf;
}

}  // namespace

std::vector<torch::Tensor> tier_attention(
    torch::Tensor q, torch::Tensor table, torch::Tensor counts, torch::Tensor k_codes,
    torch::Tensor k_scale, torch::Tensor k_zero, torch::Tensor v_codes, torch::Tensor v_scale,
    torch::Tensor v_zero, torch::Tensor out_index, torch::Tensor out_k, torch::Tensor out_v,
    int64_t bits, int64_t group_channels, double sm_scale) {
  Inputs in = attention_inputs(q, table, counts, k_codes, k_scale, k_zero, v_codes, v_scale,
                               v_zero, out_index, out_k, out_v, bits, group_channels, sm_scale);
  auto o = torch::empty({in.b, in.hq, in.d}, q.options());
  auto lse = torch::empty({in.b, in.hq}, q.options());
  in.o = o.data_ptr<float>();
  in.lse = lse.data_ptr<float>();
  at::parallel_for(0, in.b * in.h, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch(in);
    for (int64_t i = begin; i < end; ++i) attend_task(in, bits, i / in.h, i % in.h, scratch);
  });
  return {o, lse};
}

torch::Tensor tier_decode_merge(
    torch::Tensor q, torch::Tensor o_full, torch::Tensor k_buffer, torch::Tensor req_to_token,
    torch::Tensor rows, torch::Tensor lens, torch::Tensor table, torch::Tensor counts,
    torch::Tensor k_codes, torch::Tensor k_scale, torch::Tensor k_zero, torch::Tensor v_codes,
    torch::Tensor v_scale, torch::Tensor v_zero, torch::Tensor out_index, torch::Tensor out_k,
    torch::Tensor out_v, int64_t bits, int64_t group_channels, double sm_scale) {
  Inputs in = attention_inputs(q, table, counts, k_codes, k_scale, k_zero, v_codes, v_scale,
                               v_zero, out_index, out_k, out_v, bits, group_channels, sm_scale);
  const int64_t B = in.b, HQ = in.hq, D = in.d, H = in.h, P = in.hq / in.h;
  TORCH_CHECK(o_full.is_contiguous() && o_full.numel() == B * HQ * D &&
                  (o_full.scalar_type() == torch::kFloat32 ||
                   o_full.scalar_type() == torch::kFloat16 ||
                   o_full.scalar_type() == torch::kBFloat16),
              "tier CPU decode merge: the full side's output must be contiguous float [B, HQ * D]");
  TORCH_CHECK(k_buffer.is_contiguous() && k_buffer.dim() == 3 && k_buffer.size(1) == H &&
                  k_buffer.size(2) == D,
              "tier CPU decode merge: the key buffer must be contiguous [tokens, ", H, ", ", D, "]");
  TORCH_CHECK(req_to_token.scalar_type() == torch::kInt32 && req_to_token.is_contiguous() &&
                  req_to_token.dim() == 2,
              "tier CPU decode merge: req_to_token must be contiguous int32 [rows, width]");
  TORCH_CHECK(rows.scalar_type() == torch::kInt64 && lens.scalar_type() == torch::kInt64 &&
                  rows.numel() == B && lens.numel() == B,
              "tier CPU decode merge: rows and lens must be int64 [", B, "]");
  FullInputs full;
  full.k = k_buffer.data_ptr();
  full.type = k_buffer.scalar_type();
  full.req_to_token = req_to_token.data_ptr<int32_t>();
  full.rows = rows.data_ptr<int64_t>();
  full.lens = lens.data_ptr<int64_t>();
  full.width = req_to_token.size(1);
  const int64_t tokens = k_buffer.size(0);
  for (int64_t r = 0; r < B; ++r) {  // every key the tasks will read, checked first
    if (in.counts[r] <= 0) continue;
    TORCH_CHECK(full.rows[r] >= 0 && full.rows[r] < req_to_token.size(0) && full.lens[r] >= 0 &&
                    full.lens[r] <= full.width,
                "tier CPU decode merge: request ", r, " names row ", full.rows[r], " of ",
                full.lens[r], " tokens outside req_to_token");
    const int32_t* slots = full.req_to_token + full.rows[r] * full.width;
    for (int64_t t = 0; t < full.lens[r]; ++t)
      TORCH_CHECK(slots[t] >= 0 && slots[t] < tokens, "tier CPU decode merge: request ", r,
                  " token ", t, " names slot ", slots[t], " of a pool of ", tokens);
  }
  auto o_tier = torch::empty({B, HQ, D}, q.options());
  auto lse_tier = torch::empty({B, HQ}, q.options());
  auto merged = torch::empty_like(o_full);
  in.o = o_tier.data_ptr<float>();
  in.lse = lse_tier.data_ptr<float>();
  const c10::ScalarType out_type = o_full.scalar_type();
  const void* src = o_full.data_ptr();
  void* dst = merged.data_ptr();
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch(in);
    FullScratch fs(in);
    std::vector<float> lse_full(P), row_full(D);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t row = i / H, head = i % H, first = (row * HQ + head * P) * D;
      if (in.counts[row] <= 0) {  // no tier: SGLang's output as it is
        std::memcpy(static_cast<char*>(dst) + first * merged.element_size(),
                    static_cast<const char*>(src) + first * merged.element_size(),
                    P * D * merged.element_size());
        continue;
      }
      attend_task(in, bits, row, head, scratch);
      full_lse(in, full, row, head, fs, lse_full.data());
      for (int64_t p = 0; p < P; ++p) {
        // merge_attention_states: the softmax over both sides' tokens
        const int64_t qh = row * HQ + head * P + p;
        const float la = lse_full[p], lb = in.lse[qh];
        const float mx = std::max(la, lb);
        const bool finite = std::isfinite(mx);
        const float base = finite ? mx : 0.f;
        const float wa = std::exp(la - base), wb = std::exp(lb - base);
        const float denom = finite ? wa + wb : 1.f;
        load_floats(src, out_type, qh * D, D, row_full.data());
        const float* ob = in.o + qh * D;
        for (int64_t c = 0; c < D; ++c)
          store_float(dst, out_type, qh * D + c, (row_full[c] * wa + ob[c] * wb) / denom);
      }
    }
  });
  return merged;
}

}  // namespace sglang_evict_tier

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("tier_attention", &sglang_evict_tier::tier_attention,
        "Decode attention over the quantized tier (float32 o, lse), on CPU");
  m.def("tier_decode_merge", &sglang_evict_tier::tier_decode_merge,
        "SGLang's decode output merged with the tier's attention (log-sum-exp), on CPU");
  m.def("tier_quantize", &sglang_evict_tier::tier_quantize,
        "Quantize-and-pack groups of tokens into the tier's store, on CPU (tier_quantize_cpu.cpp)");
}
