// GGUF K-quant blocks (Q4_K, Q6_K) times up to 8 rows of activations: the GEMV of decode and small batches, float32
// arithmetic on the values ggml stores (no activation quantization). The launcher (gguf_gemv.cu) and the torch op
// (gguf_gemv.cpp) sit around it; this header needs CUDA alone, so it compiles and disassembles without torch.
//
// Work split. A block owns R consecutive weight rows (R from the weight's shape alone, gguf_plan) and walks each row's
// super-blocks as *units* of 64 values: unit u is super-block u / 4, part u % 4. Thread t of the block takes units t,
// t + blockDim, ... in that order, for all R rows at once (the activation values a unit needs are loaded, widened and
// summed once, then serve every row). A unit's bytes: Q4_K part j is the 32 quant bytes 16 + 32j (low nibbles:
// values 64j + l, group 2j; high nibbles: 64j + 32 + l, group 2j + 1) and the 16-byte head (d, dmin, twelve bytes of
// 6-bit scales and mins); Q6_K part 2h + s is the 16 ql bytes at 64h + 16s and at 64h + 32 + 16s and the 16 qh bytes
// at 128 + 32h + 16s (values 128h + 32t + 16s + l, t = 0..3, each group of 16 its own int8 scale), and d.
//
// Arithmetic, per unit, row and activation row m: a group's quant values q (integers, exact as float32) meet x in one
// fused multiply-add chain, S = sum q * x in value order; X = sum x likewise; the group's term is
// d_g * S - m_g * X (Q4_K: d_g = d * scale, m_g = dmin * min) or d_g * S with q - 32 for q (Q6_K: d_g = d * scale). A unit's
// terms join the thread's running sum for (m, row) in group order; the block's threads are then summed by a fixed
// butterfly in each warp and the warps in warp order. Every one of these orders is fixed by the weight's shape, so a
// row's bits never depend on how many activation rows ran beside it (M), on the weight's address, or on anything
// but (type, N, K) and x.
//
// Integers become floats without I2F (a quarter-rate instruction): a byte b placed under the exponent of 128 by one
// PRMT is the float 32768 + b exactly, and one subtraction leaves b (or b - 32: Q6_K's offset). High nibbles stay in place (16 q) and the group's
// scale carries the 1/16 (a power of two: the same bits as scaling q).
#pragma once

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace kestrel_gguf {

constexpr int kWarp = 32;
constexpr int kMaxRows = 8;   // activation rows a launch
constexpr int kMaxWarps = 4;  // warps a block
constexpr int kQ4K = 12;      // ggml's type numbers
constexpr int kQ6K = 14;

// byte b of word, less OFFSET, as a float: the bits 0x47 00 <byte> 00 are the float 32768 + byte exactly (the byte
// fills mantissa bits 8-15 under the exponent of 2^15)
template <int OFFSET = 0>
__device__ __forceinline__ float byte_float(uint32_t word, int b) {
  return __uint_as_float(__byte_perm(word, 0x47000000u, 0x7604u | (static_cast<uint32_t>(b) << 4))) -
         static_cast<float>(32768 + OFFSET);
}

__device__ __forceinline__ float half_lo(uint32_t word) { return __half2float(__ushort_as_half(static_cast<unsigned short>(word & 0xffffu))); }

// 16 bytes at p: one vector load where p is 16-byte aligned (ALIGNED: the launcher checked the base and the row
// stride), else five aligned words shifted together (any even or odd address; the fifth word holds at least one byte
// of the 16, so it lies in the same allocation).
template <bool ALIGNED>
__device__ __forceinline__ uint4 load16(const uint8_t* p) {
  if constexpr (ALIGNED) {
    return __ldg(reinterpret_cast<const uint4*>(p));
  } else {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    const uint32_t* q = reinterpret_cast<const uint32_t*>(a & ~uintptr_t(3));
    const uint32_t sh = static_cast<uint32_t>(a & 3) * 8;
    const uint32_t w0 = __ldg(q), w1 = __ldg(q + 1), w2 = __ldg(q + 2), w3 = __ldg(q + 3);
    const uint32_t w4 = sh ? __ldg(q + 4) : 0u;
    return make_uint4(__funnelshift_r(w0, w1, sh), __funnelshift_r(w1, w2, sh), __funnelshift_r(w2, w3, sh),
                      __funnelshift_r(w3, w4, sh));
  }
}

__device__ __forceinline__ uint32_t word_of(const uint4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

// 8 consecutive activation values as float32 (x rows are 16-byte aligned: the launcher checked)
template <typename XT> __device__ __forceinline__ void load_x8(const XT* p, float* v);
template <> __device__ __forceinline__ void load_x8<float>(const float* p, float* v) {
  const float4 a = __ldg(reinterpret_cast<const float4*>(p)), b = __ldg(reinterpret_cast<const float4*>(p) + 1);
  v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}
template <> __device__ __forceinline__ void load_x8<__nv_bfloat16>(const __nv_bfloat16* p, float* v) {
  const uint4 a = __ldg(reinterpret_cast<const uint4*>(p));
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t w = word_of(a, i);
    v[2 * i] = __uint_as_float(w << 16);
    v[2 * i + 1] = __uint_as_float(w & 0xffff0000u);
  }
}
template <> __device__ __forceinline__ void load_x8<__half>(const __half* p, float* v) {
  const uint4 a = __ldg(reinterpret_cast<const uint4*>(p));
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t w = word_of(a, i);
    v[2 * i] = half_lo(w);
    v[2 * i + 1] = half_lo(w >> 16);
  }
}

template <int M, int R>
__device__ __forceinline__ void zero(float (&acc)[M][R]) {
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int r = 0; r < R; ++r) acc[m][r] = 0.f;
}

template <typename YT> __device__ __forceinline__ YT from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16(v); }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half(v); }

// The block's partial sums acc[m][r] into out[m * ldo + row0 + r] (float32, or rounded once to bfloat16 or float16):
// each warp's lanes by a butterfly (lane 0's sum kept), the warps in warp order.
template <int M, int R, typename YT>
__device__ __forceinline__ void store_rows(float (&acc)[M][R], YT* __restrict__ out, int64_t ldo, int n, int row0,
                                           int mrows) {
  __shared__ float red[kMaxWarps][M][R];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float v = acc[m][r];
#pragma unroll
      for (int off = kWarp / 2; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
      if (lane == 0) red[warp][m][r] = v;
    }
  __syncthreads();
  if (threadIdx.x < M * R) {
    const int m = threadIdx.x / R, r = threadIdx.x % R;
    float total = red[0][m][r];
    for (int w = 1; w < warps; ++w) total += red[w][m][r];
    if (m < mrows && row0 + r < n) out[static_cast<int64_t>(m) * ldo + row0 + r] = from_float<YT>(total);
  }
}

// Q4_K: out[m * ldo + row] = sum_k x[m, k] W[row, k] for rows [blockIdx.x * R, + R) and m < mrows (M >= mrows, a compiled
// size; rows past mrows read row mrows - 1 of x and are not stored).
template <int M, int R, bool ALIGNED, typename XT, typename YT>
__global__ void __launch_bounds__(kMaxWarps * kWarp)
q4k_rows(const XT* __restrict__ x, const uint8_t* __restrict__ w, YT* __restrict__ out, int64_t ldo, int n, int k,
         int64_t row_bytes, int mrows) {
  const int row0 = blockIdx.x * R;
  const int units = (k / 256) * 4;
  float acc[M][R];
  zero(acc);
  for (int u = threadIdx.x; u < units; u += blockDim.x) {
    const int sb = u >> 2, j = u & 3;
    uint4 head[R], qa[R], qb[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int row = min(row0 + r, n - 1);  // a row past n is read (row n - 1) and never stored
      const uint8_t* p = w + static_cast<int64_t>(row) * row_bytes + sb * 144;
      head[r] = load16<ALIGNED>(p);
      qa[r] = load16<ALIGNED>(p + 16 + 32 * j);
      qb[r] = load16<ALIGNED>(p + 32 + 32 * j);
    }
    // the scales and mins of groups 2j (low nibbles) and 2j + 1 (high): ggml's get_scale_min_k4
    float dl[R], ml[R], dh[R], mh[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float d = half_lo(head[r].x), dmin = half_lo(head[r].x >> 16);
      const uint32_t s0 = head[r].y, s1 = head[r].z, s2 = head[r].w;  // scale bytes 0-3, 4-7, 8-11
      const int g = 2 * j;
      uint32_t scl, mnl, sch, mnh;
      if (j < 2) {
        scl = (s0 >> (8 * g)) & 63;
        mnl = (s1 >> (8 * g)) & 63;
        sch = (s0 >> (8 * g + 8)) & 63;
        mnh = (s1 >> (8 * g + 8)) & 63;
      } else {
        const int h = g - 4;
        scl = ((s2 >> (8 * h)) & 15) | (((s0 >> (8 * h + 6)) & 3) << 4);
        mnl = ((s2 >> (8 * h + 4)) & 15) | (((s1 >> (8 * h + 6)) & 3) << 4);
        sch = ((s2 >> (8 * h + 8)) & 15) | (((s0 >> (8 * h + 14)) & 3) << 4);
        mnh = ((s2 >> (8 * h + 12)) & 15) | (((s1 >> (8 * h + 14)) & 3) << 4);
      }
      dl[r] = d * byte_float(scl, 0);
      ml[r] = dmin * byte_float(mnl, 0);
      dh[r] = (d * byte_float(sch, 0)) * 0.0625f;  // the high nibbles stay 16 q
      mh[r] = dmin * byte_float(mnh, 0);
    }
#pragma unroll
    for (int m = 0; m < M; ++m) {
      const XT* xp = x + static_cast<int64_t>(min(m, mrows - 1)) * k + sb * 256 + 64 * j;
      float sl[R], sh[R], xl = 0.f, xh = 0.f;
#pragma unroll
      for (int r = 0; r < R; ++r) sl[r] = sh[r] = 0.f;
#pragma unroll
      for (int c = 0; c < 4; ++c) {  // 8 values of each half at a time: bytes 8c .. 8c + 7
        float vl[8], vh[8];
        load_x8<XT>(xp + 8 * c, vl);
        load_x8<XT>(xp + 32 + 8 * c, vh);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          xl += vl[i];
          xh += vh[i];
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const uint32_t w0 = word_of(c < 2 ? qa[r] : qb[r], (2 * c) % 4);
          const uint32_t w1 = word_of(c < 2 ? qa[r] : qb[r], (2 * c) % 4 + 1);
          const uint32_t lo0 = w0 & 0x0f0f0f0fu, lo1 = w1 & 0x0f0f0f0fu;
          const uint32_t hi0 = w0 & 0xf0f0f0f0u, hi1 = w1 & 0xf0f0f0f0u;
#pragma unroll
          for (int b = 0; b < 4; ++b) sl[r] = fmaf(byte_float(lo0, b), vl[b], sl[r]);
#pragma unroll
          for (int b = 0; b < 4; ++b) sl[r] = fmaf(byte_float(lo1, b), vl[4 + b], sl[r]);
#pragma unroll
          for (int b = 0; b < 4; ++b) sh[r] = fmaf(byte_float(hi0, b), vh[b], sh[r]);
#pragma unroll
          for (int b = 0; b < 4; ++b) sh[r] = fmaf(byte_float(hi1, b), vh[4 + b], sh[r]);
        }
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const float lo = __fsub_rn(__fmul_rn(dl[r], sl[r]), __fmul_rn(ml[r], xl));
        const float hi = __fsub_rn(__fmul_rn(dh[r], sh[r]), __fmul_rn(mh[r], xh));
        acc[m][r] = __fadd_rn(acc[m][r], __fadd_rn(lo, hi));
      }
    }
  }
  store_rows<M, R, YT>(acc, out, ldo, n, row0, mrows);
}

// Q6_K: as q4k_rows; a super-block is 210 bytes (ql[128], qh[64], int8 scales[16], d), so its bytes sit at any even
// address and are read as words shifted together.
template <int M, int R, typename XT, typename YT>
__global__ void __launch_bounds__(kMaxWarps * kWarp)
q6k_rows(const XT* __restrict__ x, const uint8_t* __restrict__ w, YT* __restrict__ out, int64_t ldo, int n, int k,
         int64_t row_bytes, int mrows) {
  const int row0 = blockIdx.x * R;
  const int units = (k / 256) * 4;
  float acc[M][R];
  zero(acc);
  for (int u = threadIdx.x; u < units; u += blockDim.x) {
    const int sb = u >> 2, h = (u >> 1) & 1, s = u & 1;
    uint4 la[R], lb[R], qh[R];
    float dg[R][4];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int row = min(row0 + r, n - 1);
      const uint8_t* p = w + static_cast<int64_t>(row) * row_bytes + sb * 210;
      la[r] = load16<false>(p + 64 * h + 16 * s);
      lb[r] = load16<false>(p + 64 * h + 32 + 16 * s);
      qh[r] = load16<false>(p + 128 + 32 * h + 16 * s);
      const uint4 tail = load16<false>(p + 192);  // scales[16]; d follows at 208, read as two bytes (p may be odd)
      const float d = half_lo(static_cast<uint32_t>(__ldg(p + 208)) | (static_cast<uint32_t>(__ldg(p + 209)) << 8));
      // group t's scale is int8 scales[8h + s + 2t]
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        const int at = 8 * h + s + 2 * t;
        const int8_t sc = static_cast<int8_t>((word_of(tail, at / 4) >> (8 * (at % 4))) & 0xffu);
        dg[r][t] = d * static_cast<float>(sc);
      }
    }
#pragma unroll
    for (int m = 0; m < M; ++m) {
      const XT* xp = x + static_cast<int64_t>(min(m, mrows - 1)) * k + sb * 256 + 128 * h + 16 * s;
      float st[R][4];
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int t = 0; t < 4; ++t) st[r][t] = 0.f;
#pragma unroll
      for (int t = 0; t < 4; ++t) {  // values 128h + 32t + 16s + l, l = 0..15
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          float v[8];
          load_x8<XT>(xp + 32 * t + 8 * c, v);
#pragma unroll
          for (int r = 0; r < R; ++r) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int wi = 2 * c + e;  // word of the 16 bytes: l = 4 wi .. 4 wi + 3
              const uint32_t lw = word_of(t % 2 == 0 ? la[r] : lb[r], wi);
              const uint32_t hw = word_of(qh[r], wi);
              // t = 0: la's low nibbles, qh bits 0-1; t = 1: lb's low, bits 2-3; t = 2: la's high, 4-5; t = 3: lb's high, 6-7
              const uint32_t low = t < 2 ? (lw & 0x0f0f0f0fu) : ((lw >> 4) & 0x0f0f0f0fu);
              const uint32_t q = low | (((hw >> (2 * t)) & 0x03030303u) << 4);
#pragma unroll
              for (int b = 0; b < 4; ++b) st[r][t] = fmaf(byte_float<32>(q, b), v[4 * e + b], st[r][t]);  // q - 32
            }
          }
        }
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        float term = 0.f;
#pragma unroll
        for (int t = 0; t < 4; ++t) term = __fadd_rn(term, __fmul_rn(dg[r][t], st[r][t]));
        acc[m][r] = __fadd_rn(acc[m][r], term);
      }
    }
  }
  store_rows<M, R, YT>(acc, out, ldo, n, row0, mrows);
}

}  // namespace kestrel_gguf
