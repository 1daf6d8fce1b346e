// GGUF block GEMV on the host's cores: y [M, N] float32 = x [M, K] @ W.T with W [N, K] held as ggml's blocks (Q8_0,
// Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K), the way ggml's CPU vec_dot computes it: each row of x quantized to 8
// bits a value (q8_0 for Q8_0, Q4_0, Q5_0: per 32 values d = max|x| / 127 stored as f16; q8_1 for Q4_1 and Q5_1: q8_0
// and each block's f16 s = d * sum(q); q8_K for the K-quants: per 256 values a float32 d and int16 sums per 16),
// integer dot products of the weight's block with x's, float32 terms a block.
// (backends/cpu_ref/host_gguf.py builds it lazily with torch.utils.cpp_extension and holds its numpy reference.)
//
// The arithmetic, bit for bit the same on every path (the scalar one, the AVX2 one, and the numpy reference):
// - each block b (a 32-value block or a 256-value super-block) of a weight row and of x's row gives exact int32 sums
//   (no overflow at any valid input: see each type's bound), then one float32 term, products in a fixed order
//   (Q8_0/Q4_0/Q5_0: (dx * dw) * float(isum); Q4_1/Q5_1: (dx * dw) * float(isum) + m * s; Q4_K/Q5_K: (dx * d) *
//   float(S) - (dx * dmin) * float(Mins); Q6_K: (dx * d) * float(S));
// - term b is added into lane b % 4 of four float32 accumulators, in b's order; the output is (l0 + l1) + (l2 + l3).
// Built with -ffp-contract=off: no product is fused into a sum, so the floats are the same on every path.
// The AVX2 functions carry __attribute__((target("avx2,fma,f16c"))): one build holds both paths, chosen at run time.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KESTREL_X86 1
#else
#define KESTREL_X86 0
#endif

namespace {

constexpr int QT_Q4_0 = 2, QT_Q4_1 = 3, QT_Q5_0 = 6, QT_Q5_1 = 7, QT_Q8_0 = 8, QT_Q4_K = 12, QT_Q5_K = 13,
              QT_Q6_K = 14;  // ggml's type numbers

inline uint32_t f2u(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float u2f(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

// IEEE half -> float (exact) and float -> half (round to nearest even, as numpy's astype(float16))
inline float fp16_to_fp32(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  if (exp == 0x1F) return u2f(sign | 0x7F800000 | (man << 13));
  if (exp == 0) {
    if (man == 0) return u2f(sign);
    const float v = (float)man * 5.9604644775390625e-08f;  // man * 2^-24, exact
    return sign ? -v : v;
  }
  return u2f(sign | ((exp + 112) << 23) | (man << 13));
}

inline uint16_t fp32_to_fp16(float f) {  // ggml's portable conversion (FP16 library), round to nearest even
  const float scale_to_inf = u2f(0x77800000), scale_to_zero = u2f(0x08800000);
  float base = (std::fabs(f) * scale_to_inf) * scale_to_zero;
  const uint32_t w = f2u(f), shl1_w = w + w, sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = u2f((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = f2u(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u, mantissa_bits = bits & 0x00000FFFu;
  return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : exp_bits + mantissa_bits));
}

inline uint16_t load_u16(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return v; }
inline uint32_t load_u32(const uint8_t* p) { uint32_t v; std::memcpy(&v, p, 4); return v; }

// ---- x quantized -----------------------------------------------------------------------------------------------
// One row of x as 8-bit blocks: qs [K] int8, d [K / B] float32 (the f16 value for q8_0 and q8_1), bsums [K / 16]
// int16 (q8_K), s [K / 32] float32 (q8_1: each block's f16 s = d * sum(q), d = max|x| / 127 before its f16 rounding,
// as ggml's quantize_row_q8_1 forms it).
struct QRow {
  const int8_t* qs;
  const float* d;
  const int16_t* bsums;
  const float* s;
};

void quantize_row(const float* x, int64_t k, int block, bool f16_scale, int8_t* qs, float* d, int16_t* bsums,
                  float* s) {
  for (int64_t b = 0; b < k / block; ++b) {
    const float* xb = x + b * block;
    float amax = 0.f;
    for (int j = 0; j < block; ++j) amax = std::fmax(amax, std::fabs(xb[j]));
    const float id = amax != 0.f ? 127.f / amax : 0.f;
    for (int j = 0; j < block; ++j) {
      float v = std::nearbyint(xb[j] * id);  // the default rounding: to nearest, ties to even
      v = std::fmin(127.f, std::fmax(-127.f, v));
      qs[b * block + j] = (int8_t)v;
    }
    if (f16_scale) {
      d[b] = fp16_to_fp32(fp32_to_fp16(amax / 127.f));
      if (s) {  // q8_1: exact int sum, times the unrounded d, kept as f16
        int sum = 0;
        for (int j = 0; j < block; ++j) sum += qs[b * block + j];
        s[b] = fp16_to_fp32(fp32_to_fp16((amax / 127.f) * (float)sum));
      }
    } else {
      d[b] = amax != 0.f ? 1.f / id : 0.f;
    }
  }
  if (bsums) {
    for (int64_t g = 0; g < k / 16; ++g) {
      int s = 0;
      for (int j = 0; j < 16; ++j) s += qs[g * 16 + j];
      bsums[g] = (int16_t)s;
    }
  }
}

// ---- Q4_K scales -----------------------------------------------------------------------------------------------
inline void scale_min_k4(const uint8_t* q, int j, int& sc, int& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

inline float finish(const float* acc) { return (acc[0] + acc[1]) + (acc[2] + acc[3]); }

// ---- scalar path -----------------------------------------------------------------------------------------------
// Q8_0: 34 bytes (f16 d, int8 q[32]); |isum| <= 32 * 127 * 128.
float dot_q8_0_scalar(const uint8_t* w, const QRow& x, int64_t nb) {
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * 34;
    const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
    const int8_t* xq = x.qs + b * 32;
    int isum = 0;
    for (int j = 0; j < 32; ++j) isum += (int)q[j] * (int)xq[j];
    const float dd = x.d[b] * fp16_to_fp32(load_u16(blk));
    acc[b & 3] += dd * (float)isum;
  }
  return finish(acc);
}

// Q4_0: 18 bytes (f16 d, 16 bytes: value j the low nibble of byte j, value j + 16 the high one, each minus 8).
float dot_q4_0_scalar(const uint8_t* w, const QRow& x, int64_t nb) {
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * 18;
    const uint8_t* q = blk + 2;
    const int8_t* xq = x.qs + b * 32;
    int isum = 0;
    for (int j = 0; j < 16; ++j) {
      isum += ((int)(q[j] & 0xF) - 8) * (int)xq[j];
      isum += ((int)(q[j] >> 4) - 8) * (int)xq[j + 16];
    }
    const float dd = x.d[b] * fp16_to_fp32(load_u16(blk));
    acc[b & 3] += dd * (float)isum;
  }
  return finish(acc);
}

// Q4_1 (20 bytes: f16 d, f16 m, 16 bytes of nibbles), Q5_0 (22: f16 d, uint32 qh, nibbles) and Q5_1 (24: f16 d, f16
// m, qh, nibbles), as ggml's vec_dot_q4_1_q8_1, q5_0_q8_0 and q5_1_q8_1: value j (j < 16) the low nibble of byte j,
// value j + 16 its high nibble; Q5's fifth bit of value j is bit j of qh (little-endian). Q5_0's values minus 16; the
// types with a min (MIN) add m * s, x's q8_1 block sum: term (dx * dw) * float(isum) [+ m * s].
// |isum| <= 32 * 31 * 127.
template <int BYTES, bool MIN, bool QH>
struct Nib32 {
  static constexpr int QH_AT = MIN ? 4 : 2, QS_AT = BYTES - 16, OFFSET = MIN ? 0 : QH ? 16 : 8;
};

template <int BYTES, bool MIN, bool QH>
float dot_nib32_scalar(const uint8_t* w, const QRow& x, int64_t nb) {
  using L = Nib32<BYTES, MIN, QH>;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * BYTES;
    const uint8_t* q = blk + L::QS_AT;
    const uint32_t qh = QH ? load_u32(blk + L::QH_AT) : 0u;
    const int8_t* xq = x.qs + b * 32;
    int isum = 0;
    for (int j = 0; j < 16; ++j) {
      const int v0 = (int)(q[j] & 0xF) | (int)(((qh >> j) & 1u) << 4);
      const int v1 = (int)(q[j] >> 4) | (int)(((qh >> (j + 16)) & 1u) << 4);
      isum += (v0 - L::OFFSET) * (int)xq[j];
      isum += (v1 - L::OFFSET) * (int)xq[j + 16];
    }
    const float dd = x.d[b] * fp16_to_fp32(load_u16(blk));
    if (MIN) {
      acc[b & 3] += dd * (float)isum + fp16_to_fp32(load_u16(blk + 2)) * x.s[b];
    } else {
      acc[b & 3] += dd * (float)isum;
    }
  }
  return finish(acc);
}

// Q4_K: 144 bytes (f16 d, f16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles: 64-value chunk c is
// bytes 32c..32c+31, low nibbles its first 32 values, high ones the next). S = sum_s sc_s * dot_s (|S| < 2^25),
// Mins = sum_s m_s * (sum of x's 32 values of sub-block s).
// Q5_K (Q5 true): 176 bytes, as Q4_K's with 32 bytes of qh before the nibbles (bytes 16..47): the fifth bit of
// value 64c + l (l < 32) is bit 2c of qh[l], of value 64c + 32 + l bit 2c + 1; |S| <= 256 * 31 * 127 * 63 < 2^26.
template <bool Q5>
void qk_ints(const uint8_t* blk, const int8_t* xq, const int16_t* bs, int& S, int& Mins) {
  const uint8_t* scales = blk + 4;
  const uint8_t* qh = blk + 16;
  const uint8_t* qs = blk + (Q5 ? 48 : 16);
  S = 0;
  Mins = 0;
  for (int c = 0; c < 4; ++c) {
    int sc0, m0, sc1, m1;
    scale_min_k4(scales, 2 * c, sc0, m0);
    scale_min_k4(scales, 2 * c + 1, sc1, m1);
    int d0 = 0, d1 = 0;
    for (int l = 0; l < 32; ++l) {
      const int h0 = Q5 ? ((qh[l] >> (2 * c)) & 1) << 4 : 0, h1 = Q5 ? ((qh[l] >> (2 * c + 1)) & 1) << 4 : 0;
      d0 += ((int)(qs[32 * c + l] & 0xF) | h0) * (int)xq[64 * c + l];
      d1 += ((int)(qs[32 * c + l] >> 4) | h1) * (int)xq[64 * c + 32 + l];
    }
    S += sc0 * d0 + sc1 * d1;
    Mins += m0 * ((int)bs[4 * c] + bs[4 * c + 1]) + m1 * ((int)bs[4 * c + 2] + bs[4 * c + 3]);
  }
}

// A Q4_K block's float32 term, every path's: (dx * d) * float(S) - (dx * dmin) * float(Mins), d and dmin the block's
// two f16 scales as floats
inline float q4_k_term_of(float dx, float wd, float wdmin, int S, int Mins) {
  const float d = dx * wd, dmin = dx * wdmin;
  return d * (float)S - dmin * (float)Mins;
}

inline float q4_k_term(const uint8_t* blk, float dx, int S, int Mins) {
  return q4_k_term_of(dx, fp16_to_fp32(load_u16(blk)), fp16_to_fp32(load_u16(blk + 2)), S, Mins);
}

// Mins of a Q4_K block from its eight decoded mins and x's int16 sums of 16 (the vector paths; exact)
inline int q4_k_mins(const int* mn, const int16_t* bs) {
  int mins = 0;
  for (int j = 0; j < 8; ++j) mins += mn[j] * ((int)bs[2 * j] + bs[2 * j + 1]);
  return mins;
}

template <bool Q5>
float dot_qk_scalar(const uint8_t* w, const QRow& x, int64_t nb) {
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * (Q5 ? 176 : 144);
    int S, Mins;
    qk_ints<Q5>(blk, x.qs + b * 256, x.bsums + b * 16, S, Mins);
    acc[b & 3] += q4_k_term(blk, x.d[b], S, Mins);
  }
  return finish(acc);
}

// Q6_K: 210 bytes (ql[128], qh[64], int8 scales[16], f16 d); value v = 128h + 32c + l has low nibble ql[64h + 32(c&1)
// + l] (c < 2 low, else high), two high bits (qh[32h + l] >> 2c) & 3, minus 32; scale scales[v / 16].
// S = sum_v sc[v/16] (q_v - 32) x_v, |S| <= 16 * 128 * 16 * 32 * 127 < 2^27.
int q6_k_int(const uint8_t* blk, const int8_t* xq, const int16_t* bs) {
  const uint8_t* ql = blk;
  const uint8_t* qh = blk + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
  int S = 0;
  for (int h = 0; h < 2; ++h) {
    for (int c = 0; c < 4; ++c) {
      for (int half = 0; half < 2; ++half) {
        int dot = 0;
        for (int l = 16 * half; l < 16 * half + 16; ++l) {
          const uint8_t lo = ql[64 * h + 32 * (c & 1) + l];
          const int q = (c < 2 ? (lo & 0xF) : (lo >> 4)) | (((qh[32 * h + l] >> (2 * c)) & 3) << 4);
          dot += q * (int)xq[128 * h + 32 * c + l];
        }
        const int g = 8 * h + 2 * c + half;
        S += (int)sc[g] * (dot - 32 * (int)bs[g]);
      }
    }
  }
  return S;
}

float dot_q6_k_scalar(const uint8_t* w, const QRow& x, int64_t nb) {
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * 210;
    const int S = q6_k_int(blk, x.qs + b * 256, x.bsums + b * 16);
    const float d = x.d[b] * fp16_to_fp32(load_u16(blk + 208));
    acc[b & 3] += d * (float)S;
  }
  return finish(acc);
}

// ---- AVX2 path -------------------------------------------------------------------------------------------------
#if KESTREL_X86
#define AVX2 __attribute__((target("avx2,fma,f16c")))

// F16C's conversion: exact, the same float as fp16_to_fp32 for every non-NaN half
AVX2 inline float h2f(const uint8_t* p) { return _cvtsh_ss(load_u16(p)); }

AVX2 inline int hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// 8 int32 partial sums of 32 signed bytes a times b (ggml's trick: |a| times b with a's sign, maddubs of u8 x s8)
AVX2 inline __m256i dot_s8(__m256i a, __m256i b) {
  const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a));
  return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

// the 4 exact block sums of v0..v3 (each 8 int32 lanes), as one int32x4
AVX2 inline __m128i hsum4(__m256i v0, __m256i v1, __m256i v2, __m256i v3) {
  const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(v0, v1), _mm256_hadd_epi32(v2, v3));
  return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

AVX2 inline __m256i q4_0_bytes(const uint8_t* q) {  // 32 values -8..7 in order
  const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m256i v = _mm256_set_m128i(_mm_srli_epi16(t, 4), t);
  return _mm256_sub_epi8(_mm256_and_si256(v, _mm256_set1_epi8(0xF)), _mm256_set1_epi8(8));
}

// block b's 8 int32 partial sums of weight times x
template <int BYTES, bool Q4>
AVX2 inline __m256i block_ints(const uint8_t* w, const int8_t* xq, int64_t b) {
  const uint8_t* blk = w + b * BYTES;
  const __m256i q = Q4 ? q4_0_bytes(blk + 2) : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
  return dot_s8(q, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * 32)));
}

// 32 bytes 0x10 where bit j of the little-endian uint32 at p is set, else 0 (ggml's bytes_from_bits_32, masked)
AVX2 inline __m256i fifth_bits(const uint8_t* p) {
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)load_u32(p)), shuf);
  const __m256i bit = _mm256_set1_epi64x(0x8040201008040201);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit), _mm256_set1_epi8(0x10));
}

// Q4_1, Q5_0, Q5_1 block b's 8 int32 partial sums of weight times x (values 0..31 unsigned for the types with a min,
// -16..15 for Q5_0)
template <int BYTES, bool MIN, bool QH>
AVX2 inline __m256i nib32_ints(const uint8_t* w, const int8_t* xq, int64_t b) {
  using L = Nib32<BYTES, MIN, QH>;
  const uint8_t* blk = w + b * BYTES;
  const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + L::QS_AT));
  __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(0xF));
  if (QH) q = _mm256_or_si256(q, fifth_bits(blk + L::QH_AT));
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * 32));
  if (MIN) return _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), _mm256_set1_epi16(1));
  return dot_s8(_mm256_sub_epi8(q, _mm256_set1_epi8(L::OFFSET)), xv);
}

template <int BYTES, bool MIN, bool QH>
AVX2 float dot_nib32_avx2(const uint8_t* w, const QRow& x, int64_t nb) {
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  int64_t b = 0;
  __m128 acc4 = _mm_setzero_ps();
  for (; b + 4 <= nb; b += 4) {
    const __m128i s = hsum4(nib32_ints<BYTES, MIN, QH>(w, x.qs, b), nib32_ints<BYTES, MIN, QH>(w, x.qs, b + 1),
                            nib32_ints<BYTES, MIN, QH>(w, x.qs, b + 2), nib32_ints<BYTES, MIN, QH>(w, x.qs, b + 3));
    alignas(16) float dw[4], mw[4];
    for (int i = 0; i < 4; ++i) {
      dw[i] = h2f(w + (b + i) * BYTES);
      mw[i] = MIN ? h2f(w + (b + i) * BYTES + 2) : 0.f;
    }
    const __m128 dd = _mm_mul_ps(_mm_loadu_ps(x.d + b), _mm_load_ps(dw));
    __m128 t = _mm_mul_ps(dd, _mm_cvtepi32_ps(s));
    if (MIN) t = _mm_add_ps(t, _mm_mul_ps(_mm_load_ps(mw), _mm_loadu_ps(x.s + b)));
    acc4 = _mm_add_ps(acc4, t);
  }
  _mm_storeu_ps(acc, acc4);
  for (; b < nb; ++b) {
    const int isum = hsum_i32(nib32_ints<BYTES, MIN, QH>(w, x.qs, b));
    const float dd = x.d[b] * h2f(w + b * BYTES);
    if (MIN) {
      acc[b & 3] += dd * (float)isum + h2f(w + b * BYTES + 2) * x.s[b];
    } else {
      acc[b & 3] += dd * (float)isum;
    }
  }
  return finish(acc);
}

template <int BYTES, bool Q4>
AVX2 float dot_32_avx2(const uint8_t* w, const QRow& x, int64_t nb) {
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  int64_t b = 0;
  __m128 acc4 = _mm_setzero_ps();
  for (; b + 4 <= nb; b += 4) {
    const __m128i s = hsum4(block_ints<BYTES, Q4>(w, x.qs, b), block_ints<BYTES, Q4>(w, x.qs, b + 1),
                                block_ints<BYTES, Q4>(w, x.qs, b + 2), block_ints<BYTES, Q4>(w, x.qs, b + 3));
    alignas(16) float dw[4];
    for (int i = 0; i < 4; ++i) dw[i] = h2f(w + (b + i) * BYTES);
    const __m128 dd = _mm_mul_ps(_mm_loadu_ps(x.d + b), _mm_load_ps(dw));
    acc4 = _mm_add_ps(acc4, _mm_mul_ps(dd, _mm_cvtepi32_ps(s)));
  }
  _mm_storeu_ps(acc, acc4);
  for (; b < nb; ++b) {
    const int isum = hsum_i32(block_ints<BYTES, Q4>(w, x.qs, b));
    const float dd = x.d[b] * h2f(w + b * BYTES);
    acc[b & 3] += dd * (float)isum;
  }
  return finish(acc);
}

// Q5_K's fifth bits of chunk c: bit 2c of each qh byte (the low nibbles' values) or 2c + 1 (the high ones'), as 0x10
AVX2 inline __m256i q5_k_bit(__m256i qh, int bit) {
  return _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, bit), _mm256_set1_epi8(1)), 4);
}

template <bool Q5>
AVX2 float dot_qk_avx2(const uint8_t* w, const QRow& x, int64_t nb) {
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  const __m256i m4 = _mm256_set1_epi8(0xF);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * (Q5 ? 176 : 144);
    const uint8_t* qs = blk + (Q5 ? 48 : 16);
    const __m256i qh = Q5 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16)) : _mm256_setzero_si256();
    const int8_t* xq = x.qs + b * 256;
    const int16_t* bs = x.bsums + b * 16;
    int sc[8], mn[8];
    for (int j = 0; j < 8; ++j) scale_min_k4(blk + 4, j, sc[j], mn[j]);
    __m256i sumi = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));
      __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
      if (Q5) {
        lo = _mm256_or_si256(lo, q5_k_bit(qh, 2 * c));
        hi = _mm256_or_si256(hi, q5_k_bit(qh, 2 * c + 1));
      }
      const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 64 * c));
      const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 64 * c + 32));
      const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, x0), _mm256_set1_epi16((int16_t)sc[2 * c]));
      const __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, x1), _mm256_set1_epi16((int16_t)sc[2 * c + 1]));
      sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p0, p1));
    }
    acc[b & 3] += q4_k_term_of(x.d[b], h2f(blk), h2f(blk + 2), hsum_i32(sumi), q4_k_mins(mn, bs));
  }
  return finish(acc);
}

AVX2 float dot_q6_k_avx2(const uint8_t* w, const QRow& x, int64_t nb) {
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  const __m256i m4 = _mm256_set1_epi8(0xF), m2 = _mm256_set1_epi8(3);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * 210;
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
    const int8_t* xq = x.qs + b * 256;
    const int16_t* bs = x.bsums + b * 16;
    __m256i sumi = _mm256_setzero_si256();
    for (int h = 0; h < 2; ++h) {
      const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h));
      const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h + 32));
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
      __m256i q[4];
      q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(qh, m2), 4));
      q[1] = _mm256_or_si256(_mm256_and_si256(l1, m4),
                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m2), 4));
      q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m2), 4));
      q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m2), 4));
      for (int c = 0; c < 4; ++c) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 128 * h + 32 * c));
        const int g = 8 * h + 2 * c;
        const __m256i s = _mm256_set_m128i(_mm_set1_epi16(sc[g + 1]), _mm_set1_epi16(sc[g]));
        sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(_mm256_maddubs_epi16(q[c], xv), s));
      }
    }
    // the -32 of every value: 32 * sum_g sc_g * bsum_g, from x's int16 sums
    const __m256i bsv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bs));
    const __m256i scv = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)));
    const int S = hsum_i32(sumi) - 32 * hsum_i32(_mm256_madd_epi16(bsv, scv));
    const float d = x.d[b] * h2f(blk + 208);
    acc[b & 3] += d * (float)S;
  }
  return finish(acc);
}

// The same arithmetic for MR rows of x at once: a block's quants and scales are decoded once and meet each row's
// int8 values in turn; each row's integer sums and float terms are the one-row function's, in its order, so each
// output is bitwise that function's (the rows share no float operation).
template <int MR, bool Q5>
AVX2 void rows_qk_avx2(const uint8_t* w, const QRow* x, int64_t nb, float* out) {
  float acc[MR][4] = {};
  const __m256i m4 = _mm256_set1_epi8(0xF);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * (Q5 ? 176 : 144);
    const uint8_t* qs = blk + (Q5 ? 48 : 16);
    const __m256i qh = Q5 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16)) : _mm256_setzero_si256();
    int sc[8], mn[8];
    for (int j = 0; j < 8; ++j) scale_min_k4(blk + 4, j, sc[j], mn[j]);
    __m256i lo[4], hi[4];
    for (int c = 0; c < 4; ++c) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));
      lo[c] = _mm256_and_si256(q, m4);
      hi[c] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
      if (Q5) {
        lo[c] = _mm256_or_si256(lo[c], q5_k_bit(qh, 2 * c));
        hi[c] = _mm256_or_si256(hi[c], q5_k_bit(qh, 2 * c + 1));
      }
    }
    const float wd = h2f(blk), wdmin = h2f(blk + 2);
    for (int m = 0; m < MR; ++m) {
      const int8_t* xq = x[m].qs + b * 256;
      const int16_t* bs = x[m].bsums + b * 16;
      __m256i sumi = _mm256_setzero_si256();
      for (int c = 0; c < 4; ++c) {
        const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 64 * c));
        const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 64 * c + 32));
        const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(lo[c], x0), _mm256_set1_epi16((int16_t)sc[2 * c]));
        const __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(hi[c], x1), _mm256_set1_epi16((int16_t)sc[2 * c + 1]));
        sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p0, p1));
      }
      acc[m][b & 3] += q4_k_term_of(x[m].d[b], wd, wdmin, hsum_i32(sumi), q4_k_mins(mn, bs));
    }
  }
  for (int m = 0; m < MR; ++m) out[m] = finish(acc[m]);
}

template <int MR>
AVX2 void rows_q6_k_avx2(const uint8_t* w, const QRow* x, int64_t nb, float* out) {
  float acc[MR][4] = {};
  const __m256i m4 = _mm256_set1_epi8(0xF), m2 = _mm256_set1_epi8(3);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * 210;
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
    __m256i q[2][4], s[2][4];
    for (int h = 0; h < 2; ++h) {
      const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h));
      const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h + 32));
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
      q[h][0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(qh, m2), 4));
      q[h][1] = _mm256_or_si256(_mm256_and_si256(l1, m4),
                                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m2), 4));
      q[h][2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m2), 4));
      q[h][3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m2), 4));
      for (int c = 0; c < 4; ++c) {
        const int g = 8 * h + 2 * c;
        s[h][c] = _mm256_set_m128i(_mm_set1_epi16(sc[g + 1]), _mm_set1_epi16(sc[g]));
      }
    }
    const __m256i scv = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)));
    const float wd = h2f(blk + 208);
    for (int m = 0; m < MR; ++m) {
      const int8_t* xq = x[m].qs + b * 256;
      __m256i sumi = _mm256_setzero_si256();
      for (int h = 0; h < 2; ++h)
        for (int c = 0; c < 4; ++c) {
          const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 128 * h + 32 * c));
          sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(_mm256_maddubs_epi16(q[h][c], xv), s[h][c]));
        }
      const __m256i bsv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[m].bsums + b * 16));
      const int S = hsum_i32(sumi) - 32 * hsum_i32(_mm256_madd_epi16(bsv, scv));
      const float d = x[m].d[b] * wd;
      acc[m][b & 3] += d * (float)S;
    }
  }
  for (int m = 0; m < MR; ++m) out[m] = finish(acc[m]);
}

// ---- AVX-512 (F, BW, VL, VNNI): the K-quants on 512-bit vectors --------------------------------------------------
// A zmm holds two 32-value groups (Q4_K, Q5_K: a chunk's low nibbles, group 2c, beside its high nibbles, group 2c + 1,
// against the 64 x bytes of those groups, which lie back to back; Q6_K: two consecutive 32-value runs); maddubs gives
// int16 pairs and VNNI's dpwssd multiplies them by the groups' int16 scales and adds into int32 lanes, without
// saturation (Q5_K's values reach 31: 2 * 31 * 127 fits int16). The block's integer sums are the AVX2 path's exactly
// (integers, any order), and every float step is that path's, so the bits are the same. The 32-value types (Q8_0,
// Q4_0, Q4_1, Q5_0, Q5_1) keep their AVX2 functions on this path.
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

AVX512 inline __m512i pair512(__m256i lo, __m256i hi) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

AVX512 inline __m512i scales512(int a, int b) {  // 16 x int16 a, then 16 x int16 b
  return pair512(_mm256_set1_epi16((int16_t)a), _mm256_set1_epi16((int16_t)b));
}

// a Q4_K (Q5_K) block's 4 chunks as 4 zmm: chunk c's low nibbles (group 2c) then its high nibbles (group 2c + 1),
// Q5_K's with their fifth bits
template <bool Q5>
AVX512 inline void qk_nibbles512(const uint8_t* blk, __m512i* v) {
  const __m256i m4 = _mm256_set1_epi8(0xF);
  const uint8_t* qs = blk + (Q5 ? 48 : 16);
  const __m256i qh = Q5 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16)) : _mm256_setzero_si256();
  for (int c = 0; c < 4; ++c) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));
    __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
    if (Q5) {
      lo = _mm256_or_si256(lo, q5_k_bit(qh, 2 * c));
      hi = _mm256_or_si256(hi, q5_k_bit(qh, 2 * c + 1));
    }
    v[c] = pair512(lo, hi);
  }
}

// a Q6_K block's 256 values (0..63) as 4 zmm in value order: h = 0, 1, each two zmm of 64 values (groups of 32 t)
AVX512 inline void q6_k_values512(const uint8_t* blk, __m512i* v) {
  const __m256i m4 = _mm256_set1_epi8(0xF), m2 = _mm256_set1_epi8(3);
  for (int h = 0; h < 2; ++h) {
    const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h));
    const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h + 32));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
    const __m256i q0 = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(qh, m2), 4));
    const __m256i q1 = _mm256_or_si256(_mm256_and_si256(l1, m4),
                                       _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m2), 4));
    const __m256i q2 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                       _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m2), 4));
    const __m256i q3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                       _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m2), 4));
    v[2 * h] = pair512(q0, q1);
    v[2 * h + 1] = pair512(q2, q3);
  }
}

// Q6_K's int8 scales of 16 values, for the zmm of values 64 i .. 64 i + 63 (groups 4i .. 4i + 3, 16 lanes of 16 bits a
// group): the AVX2 path's s[h][c] pairs, two at a time
AVX512 inline __m512i q6_k_scales512(const int8_t* sc, int i) {
  const __m256i a = _mm256_set_m128i(_mm_set1_epi16(sc[4 * i + 1]), _mm_set1_epi16(sc[4 * i]));
  const __m256i b = _mm256_set_m128i(_mm_set1_epi16(sc[4 * i + 3]), _mm_set1_epi16(sc[4 * i + 2]));
  return pair512(a, b);
}

AVX512 inline int hsum512(__m512i v) { return _mm512_reduce_add_epi32(v); }

template <int MR, bool Q5>
AVX512 void rows_qk_avx512(const uint8_t* w, const QRow* x, int64_t nb, float* out) {
  float acc[MR][4] = {};
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * (Q5 ? 176 : 144);
    int sc[8], mn[8];
    for (int j = 0; j < 8; ++j) scale_min_k4(blk + 4, j, sc[j], mn[j]);
    __m512i v[4], s[4];
    qk_nibbles512<Q5>(blk, v);
    for (int c = 0; c < 4; ++c) s[c] = scales512(sc[2 * c], sc[2 * c + 1]);
    const float wd = h2f(blk), wdmin = h2f(blk + 2);
    for (int m = 0; m < MR; ++m) {
      const int8_t* xq = x[m].qs + b * 256;
      const int16_t* bs = x[m].bsums + b * 16;
      __m512i sumi = _mm512_setzero_si512();
      for (int c = 0; c < 4; ++c) {
        const __m512i xv = _mm512_loadu_si512(xq + 64 * c);
        sumi = _mm512_dpwssd_epi32(sumi, _mm512_maddubs_epi16(v[c], xv), s[c]);
      }
      acc[m][b & 3] += q4_k_term_of(x[m].d[b], wd, wdmin, hsum512(sumi), q4_k_mins(mn, bs));
    }
  }
  for (int m = 0; m < MR; ++m) out[m] = finish(acc[m]);
}

template <int MR>
AVX512 void rows_q6_k_avx512(const uint8_t* w, const QRow* x, int64_t nb, float* out) {
  float acc[MR][4] = {};
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * 210;
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
    __m512i v[4], s[4];
    q6_k_values512(blk, v);
    for (int i = 0; i < 4; ++i) s[i] = q6_k_scales512(sc, i);
    const __m256i scv = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)));
    const float wd = h2f(blk + 208);
    for (int m = 0; m < MR; ++m) {
      const int8_t* xq = x[m].qs + b * 256;
      __m512i sumi = _mm512_setzero_si512();
      for (int i = 0; i < 4; ++i) {
        const __m512i xv = _mm512_loadu_si512(xq + 64 * i);
        sumi = _mm512_dpwssd_epi32(sumi, _mm512_maddubs_epi16(v[i], xv), s[i]);
      }
      const __m256i bsv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[m].bsums + b * 16));
      const int S = hsum512(sumi) - 32 * hsum_i32(_mm256_madd_epi16(bsv, scv));
      const float d = x[m].d[b] * wd;
      acc[m][b & 3] += d * (float)S;
    }
  }
  for (int m = 0; m < MR; ++m) out[m] = finish(acc[m]);
}

template <bool Q5>
AVX512 float dot_qk_avx512(const uint8_t* w, const QRow& x, int64_t nb) {
  float y;
  rows_qk_avx512<1, Q5>(w, &x, nb, &y);
  return y;
}

AVX512 float dot_q6_k_avx512(const uint8_t* w, const QRow& x, int64_t nb) {
  float y;
  rows_q6_k_avx512<1>(w, &x, nb, &y);
  return y;
}
#endif  // KESTREL_X86

bool cpu_has_avx2() {
#if KESTREL_X86 && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

using DotFn = float (*)(const uint8_t*, const QRow&, int64_t);
using RowsFn = void (*)(const uint8_t*, const QRow*, int64_t, float*);  // kRowsAtOnce rows of x, bitwise DotFn's

constexpr int kRowsAtOnce = 4;

struct TypeInfo {
  int block, bytes;
  bool k_quant;
  DotFn scalar, avx2;
  RowsFn avx2_rows = nullptr;  // where decoding a block once for several rows pays (the K-quants)
  DotFn avx512 = nullptr;      // nullptr: the avx2 function serves the avx512 path
  RowsFn avx512_rows = nullptr;
};

TypeInfo type_info(int64_t qtype) {
  switch (qtype) {
#if KESTREL_X86
    case QT_Q8_0: return {32, 34, false, dot_q8_0_scalar, dot_32_avx2<34, false>};
    case QT_Q4_0: return {32, 18, false, dot_q4_0_scalar, dot_32_avx2<18, true>};
    case QT_Q4_1: return {32, 20, false, dot_nib32_scalar<20, true, false>, dot_nib32_avx2<20, true, false>};
    case QT_Q5_0: return {32, 22, false, dot_nib32_scalar<22, false, true>, dot_nib32_avx2<22, false, true>};
    case QT_Q5_1: return {32, 24, false, dot_nib32_scalar<24, true, true>, dot_nib32_avx2<24, true, true>};
    case QT_Q4_K: return {256, 144, true, dot_qk_scalar<false>, dot_qk_avx2<false>, rows_qk_avx2<kRowsAtOnce, false>,
                          dot_qk_avx512<false>, rows_qk_avx512<kRowsAtOnce, false>};
    case QT_Q5_K: return {256, 176, true, dot_qk_scalar<true>, dot_qk_avx2<true>, rows_qk_avx2<kRowsAtOnce, true>,
                          dot_qk_avx512<true>, rows_qk_avx512<kRowsAtOnce, true>};
    case QT_Q6_K: return {256, 210, true, dot_q6_k_scalar, dot_q6_k_avx2, rows_q6_k_avx2<kRowsAtOnce>,
                          dot_q6_k_avx512, rows_q6_k_avx512<kRowsAtOnce>};
#else
    case QT_Q8_0: return {32, 34, false, dot_q8_0_scalar, nullptr};
    case QT_Q4_0: return {32, 18, false, dot_q4_0_scalar, nullptr};
    case QT_Q4_1: return {32, 20, false, dot_nib32_scalar<20, true, false>, nullptr};
    case QT_Q5_0: return {32, 22, false, dot_nib32_scalar<22, false, true>, nullptr};
    case QT_Q5_1: return {32, 24, false, dot_nib32_scalar<24, true, true>, nullptr};
    case QT_Q4_K: return {256, 144, true, dot_qk_scalar<false>, nullptr};
    case QT_Q5_K: return {256, 176, true, dot_qk_scalar<true>, nullptr};
    case QT_Q6_K: return {256, 210, true, dot_q6_k_scalar, nullptr};
#endif
    default:
      TORCH_CHECK(false, "host_gguf: type ", qtype,
                  " is not one this kernel computes (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K)");
  }
}

bool cpu_has_avx512() {
#if KESTREL_X86 && (defined(__GNUC__) || defined(__clang__))
  return cpu_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

// auto's path: AVX2 where the CPU has it (the AVX-512 path measured no faster on 2 cores of a Xeon with VNNI,
// bench/results/host-gemv_20261207T172219Z.json: it runs where asked for)
std::string best_isa() { return cpu_has_avx2() ? "avx2" : "scalar"; }

std::string resolve_isa(const std::string& isa) {
  if (isa.empty() || isa == "auto") return best_isa();
  TORCH_CHECK(isa == "scalar" || isa == "avx2" || isa == "avx512",
              "host_gguf: isa must be auto, scalar, avx2 or avx512, not ", isa);
  TORCH_CHECK(isa != "avx2" || cpu_has_avx2(), "host_gguf: this CPU lacks AVX2, FMA or F16C");
  TORCH_CHECK(isa != "avx512" || cpu_has_avx512(), "host_gguf: this CPU lacks AVX-512 F, BW, VL or VNNI");
  return isa;
}

// whether x pairs with qtype as q8_1 (the 32-value types with a min: their term adds m * x's block sum s)
bool pairs_q8_1(int64_t qtype) { return qtype == QT_Q4_1 || qtype == QT_Q5_1; }

// x [M, K] quantized: qs int8 [M, K], d float32 [M, K / block], bsums int16 [M, K / 16] (empty but for q8_K),
// s float32 [M, K / 32] (empty but for q8_1)
std::vector<at::Tensor> quantize_x(const at::Tensor& x, int64_t qtype) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "host_gguf: x must be a contiguous float32 [M, K] CPU tensor");
  const TypeInfo t = type_info(qtype);
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % t.block == 0, "host_gguf: K=", K, " is not a multiple of the block's ", t.block, " values");
  at::Tensor qs = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({M, K / t.block}, x.options());
  at::Tensor bs = at::empty({M, t.k_quant ? K / 16 : 0}, x.options().dtype(at::kShort));
  const bool q8_1 = pairs_q8_1(qtype);
  at::Tensor s = at::empty({M, q8_1 ? K / 32 : 0}, x.options());
  for (int64_t m = 0; m < M; ++m) {
    quantize_row(x.data_ptr<float>() + m * K, K, t.block, !t.k_quant, qs.data_ptr<int8_t>() + m * K,
                 d.data_ptr<float>() + m * (K / t.block), t.k_quant ? bs.data_ptr<int16_t>() + m * (K / 16) : nullptr,
                 q8_1 ? s.data_ptr<float>() + m * (K / 32) : nullptr);
  }
  return {qs, d, bs, s};
}

at::Tensor gemv(const at::Tensor& x, const at::Tensor& w, int64_t qtype, int64_t n, int64_t k, const std::string& isa) {
  const TypeInfo t = type_info(qtype);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, "host_gguf: x must be [M, ", k, "]");
  TORCH_CHECK(n > 0 && k > 0 && k % t.block == 0, "host_gguf: K=", k, " must be a positive multiple of ", t.block);
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.device().is_cpu(),
              "host_gguf: the weight must be contiguous uint8 on the CPU");
  const int64_t nb = k / t.block, row_bytes = nb * t.bytes;
  TORCH_CHECK(w.numel() == n * row_bytes, "host_gguf: the weight holds ", w.numel(), " bytes, not ", n * row_bytes);
  const std::string chosen = resolve_isa(isa);
  const bool wide = chosen == "avx512" && t.avx512 != nullptr;
  const DotFn dot = wide ? t.avx512 : chosen == "scalar" ? t.scalar : t.avx2;
  const RowsFn many = wide ? t.avx512_rows : chosen == "scalar" ? nullptr : t.avx2_rows;
  TORCH_CHECK(dot != nullptr, "host_gguf: no ", chosen, " path on this architecture");
  auto q = quantize_x(x, qtype);
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, n}, x.options());
  const int8_t* qs = q[0].data_ptr<int8_t>();
  const float* qd = q[1].data_ptr<float>();
  const int16_t* qb = t.k_quant ? q[2].data_ptr<int16_t>() : nullptr;
  const float* qsum = pairs_q8_1(qtype) ? q[3].data_ptr<float>() : nullptr;
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  std::vector<QRow> rows(M);
  for (int64_t m = 0; m < M; ++m)
    rows[m] = {qs + m * k, qd + m * nb, qb ? qb + m * (k / 16) : nullptr, qsum ? qsum + m * nb : nullptr};
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, row_bytes));  // ~64 KiB of weight a task
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const uint8_t* wr = wp + i * row_bytes;
      int64_t m = 0;
      if (many != nullptr) {  // whole groups of kRowsAtOnce rows: each block decoded once a group
        float got[kRowsAtOnce];
        for (; m + kRowsAtOnce <= M; m += kRowsAtOnce) {
          many(wr, rows.data() + m, nb, got);
          for (int r = 0; r < kRowsAtOnce; ++r) yp[(m + r) * n + i] = got[r];
        }
      }
      for (; m < M; ++m) yp[m * n + i] = dot(wr, rows[m], nb);
    }
  });
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kestrel host GGUF GEMV: y = x @ W.T on ggml's blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, "
            "Q6_K), x quantized to 8 bits as "
            "ggml's vec_dot does, integer dots, float32 terms; AVX-512, AVX2 or scalar";
  m.def("gemv", &gemv, "y [M, n] float32 = x [M, k] float32 @ W.T, W the uint8 blocks of [n, k]", pybind11::arg("x"),
        pybind11::arg("w"), pybind11::arg("qtype"), pybind11::arg("n"), pybind11::arg("k"),
        pybind11::arg("isa") = "auto");
  m.def("quantize_x", &quantize_x,
        "x's 8-bit blocks as the kernel makes them: [qs int8, d float32, bsums int16, s float32 (q8_1)]",
        pybind11::arg("x"), pybind11::arg("qtype"));
  m.def("best_isa", &best_isa, "the path 'auto' takes on this CPU: avx2 or scalar");
  m.def("has_avx512", &cpu_has_avx512, "whether this CPU runs the avx512 path (AVX-512 F, BW, VL, VNNI)");
}
