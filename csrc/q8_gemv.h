// q8 GEMV, the part shared by the CUDA kernel (q8_gemv.cu) and its host emulation test:
//   y[n] = sum_k x[k] * q[k, n] * s[k / group, n]
// q is int8 [K, Npad] (row k contiguous over n), s is f32 [K / group, Npad]; Npad % 16 == 0,
// K % 32 == 0, and x, q and s start on 16-byte boundaries.
//
// Tiling. A block is 4 warps over kBlockCols = 128 columns. A lane owns kCols = 16 adjacent
// columns, 16 bytes of a row; 8 lanes span the block's columns, so a warp covers 4 rows x 128
// contiguous bytes at a time. Rows go in units of kUnitRows = 32 (every supported group size
// is a multiple): lane row r (= lane / 8) takes rows 8r..8r+7 of a unit. Per unit a lane sums
// x[k] * q[k, n] over its 8 rows, then multiplies by the unit's group scale once and adds into
// float32. The warps of a block take interleaved units; the `splits` blocks along y take
// disjoint unit ranges (split-K).
//
// Loads. Each warp streams its units through a ring of kStages = 3 stages in shared memory
// with cp.async, two units ahead of its arithmetic, so loads and arithmetic overlap and no
// register is held by a load in flight. On the H200 this beat loading each unit into
// registers and then computing, at 2 or 3 blocks per SM, with or without L2 prefetches
// (bench/results/q8_gemv_variants_20261202.json; the README sums it up).
//
// The 8-row sums. With bf16 or f16 x (the decode path), in integers: the lane's 8 x become
// 16-bit integers against their largest magnitude (exact for bf16 x within 2^7 of it, f16
// within 2^4; else rounded to 2^-15 of it), one PRMT interleaves two rows' bytes and dp2a adds
// two products per instruction into an exact int32, converted to float once per unit: about
// half the instructions of the float sums (bench/results/q8_gemv_variants_20261202_d.json,
// run 9). With float32 x, in float32: byte b + 128 put under the exponent of 2^23 is the float
// 2^23 + 128 + b exactly, so one PRMT and one FADD convert it (I2F is quarter rate on sm_90).
//
// Reduction, in a fixed order so that results are bitwise reproducible: the 4 lane rows by
// shuffles (xor 8, then xor 16), the warps through shared memory in warp order, then the
// splits blocks, which form one thread-block cluster (sm_90), through distributed shared
// memory in rank order: rank r sums and writes columns [r * 128/splits, (r+1) * 128/splits).
// No global scratch and no second kernel.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <vector_types.h>

#define Q8_HD __host__ __device__ __forceinline__

namespace kestrel_q8 {

constexpr int kWarp = 32;
constexpr int kWarps = 4;                            // warps per block
constexpr int kThreads = kWarp * kWarps;
constexpr int kMinBlocksPerSm = 3;                   // what the ring's shared memory allows
constexpr int kCols = 16;                            // columns per lane: 16 bytes of a row
constexpr int kLanesN = 8;                           // lanes across a block's columns
constexpr int kLaneRows = kWarp / kLanesN;           // 4 lane rows per warp
constexpr int kBlockCols = kLanesN * kCols;          // 128 columns per block
constexpr int kRowsPerLane = 8;                      // rows of a unit per lane
constexpr int kUnitRows = kLaneRows * kRowsPerLane;  // 32 rows per work unit
constexpr int kMaxSplits = 8;                        // the portable cluster size
constexpr int kStages = 3;                           // the ring: units in flight + the one in use
static_assert(32 % kUnitRows == 0, "a unit must lie inside one group (every group is a multiple of 32)");

Q8_HD float to_float(float v) { return v; }
Q8_HD float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
Q8_HD float to_float(__half v) { return __half2float(v); }

template <typename T> Q8_HD T from_float(float v);
template <> Q8_HD float from_float<float>(float v) { return v; }
template <> Q8_HD __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16(v); }
template <> Q8_HD __half from_float<__half>(float v) { return __float2half(v); }

Q8_HD float bits_to_float(uint32_t v) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(v);
#else
  float f;
  std::memcpy(&f, &v, sizeof f);
  return f;
#endif
}
Q8_HD uint32_t float_bits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t v;
  std::memcpy(&v, &f, sizeof v);
  return v;
#endif
}

// PTX prmt in its default mode, for selector nibbles 0..7: byte i of the result is byte
// (sel >> 4i) & 7 of the 8-byte value b:a.
Q8_HD uint32_t byte_perm(uint32_t a, uint32_t b, uint32_t sel) {
#ifdef __CUDA_ARCH__
  return __byte_perm(a, b, sel);
#else
  const uint64_t v = (static_cast<uint64_t>(b) << 32) | a;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= static_cast<uint32_t>((v >> (8 * ((sel >> (4 * i)) & 7))) & 0xff) << (8 * i);
  return r;
#endif
}

// The 4 signed bytes of v (byte 0 first) as floats, exactly.
Q8_HD void bytes_to_floats(uint32_t v, float out[4]) {
  const uint32_t biased = v ^ 0x80808080u;  // each byte b -> b + 128, as unsigned
#pragma unroll
  for (int i = 0; i < 4; ++i)
    out[i] = bits_to_float(byte_perm(biased, 0x4B000000u, 0x7440u | i)) - 8388736.f;  // (2^23 + 128 + b) - (2^23 + 128)
}

// Where a thread works: its 16 columns start at n0; lane_row picks its 8 rows of each unit.
struct LaneSpot {
  int n0;
  int lane_row;
};
Q8_HD LaneSpot lane_spot(int bx, int lane) {
  return {bx * kBlockCols + (lane % kLanesN) * kCols, lane / kLanesN};
}

// Units [begin, end) of split `by`.
Q8_HD int split_begin(int by, int units_per_split) { return by * units_per_split; }
Q8_HD int split_end(int by, int units_per_split, int units) {
  const int e = (by + 1) * units_per_split;
  return e < units ? e : units;
}

// The arithmetic of one unit for one lane: 8 rows of 16 int8 weights, their 8 x values and
// the unit's 16 group scales, added into acc.
Q8_HD void unit_math(const int4 w[kRowsPerLane], const float xv[kRowsPerLane], const float4 sv[kCols / 4],
                     float acc[kCols]) {
  float part[kCols];
#pragma unroll
  for (int c = 0; c < kCols; ++c) part[c] = 0.f;
#pragma unroll
  for (int r = 0; r < kRowsPerLane; ++r) {
    const uint32_t words[4] = {static_cast<uint32_t>(w[r].x), static_cast<uint32_t>(w[r].y),
                               static_cast<uint32_t>(w[r].z), static_cast<uint32_t>(w[r].w)};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float f[4];
      bytes_to_floats(words[j], f);
#pragma unroll
      for (int b = 0; b < 4; ++b) part[4 * j + b] = fmaf(xv[r], f[b], part[4 * j + b]);
    }
  }
#pragma unroll
  for (int i = 0; i < kCols / 4; ++i) {
    acc[4 * i + 0] = fmaf(part[4 * i + 0], sv[i].x, acc[4 * i + 0]);
    acc[4 * i + 1] = fmaf(part[4 * i + 1], sv[i].y, acc[4 * i + 1]);
    acc[4 * i + 2] = fmaf(part[4 * i + 2], sv[i].z, acc[4 * i + 2]);
    acc[4 * i + 3] = fmaf(part[4 * i + 3], sv[i].w, acc[4 * i + 3]);
  }
}

Q8_HD int64_t lane_first_row(int u, LaneSpot at) { return static_cast<int64_t>(u) * kUnitRows + at.lane_row * kRowsPerLane; }
// The unit's row of scales. 32-bit arithmetic (a 64-bit division is a long call), and for 1, 2,
// 4, ... units per group a shift rather than a 32-bit division (about 20 instructions a unit).
Q8_HD int64_t scale_row(int u, int group) {
  const int upg = group / kUnitRows;
  if ((upg & (upg - 1)) == 0) {
#ifdef __CUDA_ARCH__
    return u >> (31 - __clz(upg));
#else
    return u >> (31 - __builtin_clz(static_cast<unsigned>(upg)));
#endif
  }
  return u / upg;
}

// --- the ring ---------------------------------------------------------------------------
// A stage holds one unit of a warp: its 8 x 32 weight vectors (each lane copies, and later
// reads, its own), the block columns' 128 scales (copied by lane row 0) and the unit's 32 x
// values (copied by the lane with lane_n == 0 of each lane row). A __syncwarp makes the shared
// parts visible before use and frees a stage before it is refilled.
constexpr int kStageWeightBytes = kRowsPerLane * kWarp * 16;
constexpr int kStageScaleBytes = kBlockCols * 4;
constexpr int kStageXBytes = kUnitRows * 4;  // room for float x
constexpr int kStageBytes = kStageWeightBytes + kStageScaleBytes + kStageXBytes;
constexpr int kWarpRingBytes = kStages * kStageBytes;
constexpr int kRingBytes = kWarps * kWarpRingBytes;  // dynamic shared memory per block

Q8_HD void copy16_async(void* smem_dst, const void* gmem_src) {
#ifdef __CUDA_ARCH__
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(gmem_src) : "memory");
#else
  std::memcpy(smem_dst, gmem_src, 16);
#endif
}
Q8_HD void async_commit() {
#ifdef __CUDA_ARCH__
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
// Wait until at most `pending` of this thread's committed groups are still in flight.
template <int pending>
Q8_HD void async_wait() {
#ifdef __CUDA_ARCH__
  asm volatile("cp.async.wait_group %0;" ::"n"(pending) : "memory");
#endif
}

Q8_HD unsigned char* stage_at(unsigned char* warp_ring, int i) { return warp_ring + (i % kStages) * kStageBytes; }

// Lane `lane`'s copies for unit u into one stage.
template <typename XT>
Q8_HD void issue_unit(const XT* __restrict__ x, const int8_t* __restrict__ q, const float* __restrict__ s,
                      int64_t npad, int group, int u, LaneSpot at, int lane, bool active, unsigned char* stage) {
  const int64_t k0 = lane_first_row(u, at);
  if (active) {
    const int8_t* row = q + k0 * npad + at.n0;
#pragma unroll
    for (int r = 0; r < kRowsPerLane; ++r) copy16_async(stage + (r * kWarp + lane) * 16, row + r * npad);
    if (at.lane_row == 0) {
      const float* srow = s + scale_row(u, group) * npad + at.n0;
#pragma unroll
      for (int i = 0; i < kCols / 4; ++i)
        copy16_async(stage + kStageWeightBytes + (lane % kLanesN) * kCols * 4 + 16 * i, srow + 4 * i);
    }
  }
  if (lane % kLanesN == 0) {  // lane_n 0 is active in every column block
    const unsigned char* src = reinterpret_cast<const unsigned char*>(x + k0);
    unsigned char* dst = stage + kStageWeightBytes + kStageScaleBytes + at.lane_row * kRowsPerLane * sizeof(XT);
#pragma unroll
    for (int b = 0; b < static_cast<int>(kRowsPerLane * sizeof(XT)); b += 16) copy16_async(dst + b, src + b);
  }
}

Q8_HD void read_x8(const float* p, float out[8]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) out[i] = p[i];
}

// --- 16-bit x: integer dot products (dp2a) ------------------------------------------------
// max(|a|, |b|), NaN if either is NaN (fmaxf would drop it).
Q8_HD float max_abs_nan(float m, float b) {
#ifdef __CUDA_ARCH__
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(m), "f"(fabsf(b)));
  return r;
#else
  return (m != m || b != b) ? bits_to_float(0x7fffffffu) : std::fmax(m, std::fabs(b));
#endif
}
// a: two int16 (low half first); b: four int8. lo: a0*b0 + a1*b1, hi: a0*b2 + a1*b3; plus c.
Q8_HD int dp2a_lo(uint32_t a, uint32_t b, int c) {
#ifdef __CUDA_ARCH__
  return __dp2a_lo(static_cast<int>(a), static_cast<int>(b), c);
#else
  return c + int16_t(a & 0xffff) * int8_t(b & 0xff) + int16_t(a >> 16) * int8_t((b >> 8) & 0xff);
#endif
}
Q8_HD int dp2a_hi(uint32_t a, uint32_t b, int c) {
#ifdef __CUDA_ARCH__
  return __dp2a_hi(static_cast<int>(a), static_cast<int>(b), c);
#else
  return c + int16_t(a & 0xffff) * int8_t((b >> 16) & 0xff) + int16_t(a >> 16) * int8_t(b >> 24);
#endif
}
// The lane's 8 x as 16-bit integers against their largest magnitude m = 1.f * 2^E:
// x[r] ~ xi[r] * back with |xi| < 2^15, back = 2^(E - 14); exact for x within 2^7 of m in bf16
// (2^4 in f16), else rounded to the nearest back. xp[i] holds rows 2i (low half) and 2i + 1.
// NaN or inf anywhere gives back = NaN, so the lane's columns come out NaN.
Q8_HD float fixed_x8(const float xv[kRowsPerLane], uint32_t xp[kRowsPerLane / 2]) {
  float m = 0.f;
#pragma unroll
  for (int r = 0; r < kRowsPerLane; ++r) m = max_abs_nan(m, xv[r]);
  uint32_t e = float_bits(m) >> 23;  // the biased exponent of m (255: inf or NaN)
  e = e < 15 ? 15 : e;               // m below 2^-112: the step stays 2^-126, the smallest normal float
  const float to = bits_to_float((268u - e) << 23);  // 2^(141 - e): m -> [2^14, 2^15)
  const float back = e == 255 ? bits_to_float(0x7fffffffu) : bits_to_float((e - 14u) << 23);
  uint32_t b[kRowsPerLane];
#pragma unroll
  for (int r = 0; r < kRowsPerLane; ++r) b[r] = float_bits(fmaf(xv[r], to, 12582912.f));  // low 16 bits: round(x * to)
#pragma unroll
  for (int i = 0; i < kRowsPerLane / 2; ++i) xp[i] = byte_perm(b[2 * i], b[2 * i + 1], 0x5410);
  return back;
}
// unit_math for 16-bit x: per row pair one PRMT interleaves two rows' bytes, dp2a takes two
// products per instruction into an exact int32 sum over the lane's 8 rows, converted once.
Q8_HD void unit_math_dp(const int4 w[kRowsPerLane], const float xv[kRowsPerLane], const float4 sv[kCols / 4],
                        float acc[kCols]) {
  uint32_t xp[kRowsPerLane / 2];
  const float back = fixed_x8(xv, xp);
  int isum[kCols];
#pragma unroll
  for (int c = 0; c < kCols; ++c) isum[c] = 0;
#pragma unroll
  for (int r = 0; r < kRowsPerLane; r += 2) {
    const uint32_t a[4] = {static_cast<uint32_t>(w[r].x), static_cast<uint32_t>(w[r].y), static_cast<uint32_t>(w[r].z),
                           static_cast<uint32_t>(w[r].w)};
    const uint32_t b[4] = {static_cast<uint32_t>(w[r + 1].x), static_cast<uint32_t>(w[r + 1].y),
                           static_cast<uint32_t>(w[r + 1].z), static_cast<uint32_t>(w[r + 1].w)};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t lo = byte_perm(a[j], b[j], 0x5140);  // rows r, r+1 of columns 4j, 4j+1
      const uint32_t hi = byte_perm(a[j], b[j], 0x7362);  // and of columns 4j+2, 4j+3
      isum[4 * j + 0] = dp2a_lo(xp[r / 2], lo, isum[4 * j + 0]);
      isum[4 * j + 1] = dp2a_hi(xp[r / 2], lo, isum[4 * j + 1]);
      isum[4 * j + 2] = dp2a_lo(xp[r / 2], hi, isum[4 * j + 2]);
      isum[4 * j + 3] = dp2a_hi(xp[r / 2], hi, isum[4 * j + 3]);
    }
  }
#pragma unroll
  for (int i = 0; i < kCols / 4; ++i) {
    acc[4 * i + 0] = fmaf(static_cast<float>(isum[4 * i + 0]) * back, sv[i].x, acc[4 * i + 0]);
    acc[4 * i + 1] = fmaf(static_cast<float>(isum[4 * i + 1]) * back, sv[i].y, acc[4 * i + 1]);
    acc[4 * i + 2] = fmaf(static_cast<float>(isum[4 * i + 2]) * back, sv[i].z, acc[4 * i + 2]);
    acc[4 * i + 3] = fmaf(static_cast<float>(isum[4 * i + 3]) * back, sv[i].w, acc[4 * i + 3]);
  }
}

// Lane `lane`'s arithmetic on a landed stage.
template <typename XT>
Q8_HD void compute_stage(const unsigned char* stage, LaneSpot at, int lane, float acc[kCols]) {
  int4 w[kRowsPerLane];
#pragma unroll
  for (int r = 0; r < kRowsPerLane; ++r) w[r] = *reinterpret_cast<const int4*>(stage + (r * kWarp + lane) * 16);
  float4 sv[kCols / 4];
  const float4* sp = reinterpret_cast<const float4*>(stage + kStageWeightBytes + (lane % kLanesN) * kCols * 4);
#pragma unroll
  for (int i = 0; i < kCols / 4; ++i) sv[i] = sp[i];
  if constexpr (sizeof(XT) == 2) {
    const uint4 raw = *reinterpret_cast<const uint4*>(stage + kStageWeightBytes + kStageScaleBytes +
                                                      at.lane_row * kRowsPerLane * sizeof(XT));
    XT v[kRowsPerLane];
    std::memcpy(v, &raw, sizeof v);
    float xd[kRowsPerLane];
#pragma unroll
    for (int r = 0; r < kRowsPerLane; ++r) xd[r] = to_float(v[r]);
    unit_math_dp(w, xd, sv, acc);
  } else {
    float xv[kRowsPerLane];  // float32 x: the float arithmetic (16 bits would round it)
    read_x8(reinterpret_cast<const float*>(stage + kStageWeightBytes + kStageScaleBytes) + at.lane_row * kRowsPerLane, xv);
    unit_math(w, xv, sv, acc);
  }
}

// The columns rank `rank` of a cluster of `splits` blocks sums and writes: [first, first + count).
Q8_HD int rank_first_column(int rank, int splits) { return rank * (kBlockCols / splits); }
Q8_HD int rank_column_count(int splits) { return kBlockCols / splits; }

struct Plan {
  int col_blocks;       // gridDim.x
  int splits;           // gridDim.y = the cluster size: 1, 2, 4 or 8
  int units_per_split;  // the last split may get fewer (or none)
};

Q8_HD int floor_pow2_splits(int s) {
  int p = 1;
  while (p * 2 <= s && p * 2 <= kMaxSplits) p *= 2;
  return p;
}

// splits: a requested count (rounded down to 1, 2, 4 or 8, and to at most one unit per split).
inline Plan make_plan(int64_t npad, int units, int splits) {
  Plan p;
  p.col_blocks = static_cast<int>((npad + kBlockCols - 1) / kBlockCols);
  if (splits > units) splits = units;
  p.splits = floor_pow2_splits(splits < 1 ? 1 : splits);
  p.units_per_split = (units + p.splits - 1) / p.splits;
  return p;
}

// The split count when the caller names none: the most splits (1, 2, 4 or 8) that keep the
// grid within target_blocks; the launcher passes kBlocksPerSmTarget x SMs.
inline int auto_splits(int64_t npad, int units, int target_blocks) {
  const int64_t col_blocks = (npad + kBlockCols - 1) / kBlockCols;
  int s = 1;
  while (s < kMaxSplits && col_blocks * s * 2 <= target_blocks) s *= 2;
  return make_plan(npad, units, s).splits;
}

// Blocks per SM the automatic split count aims at. With the dp2a arithmetic one block per SM
// was the fastest or within 3% of the fastest forced split count on every shape timed on the
// H200 (bench/results/q8_gemv_variants_20261202_d.json, run 9: 12288x4096 16.7 us at one split
// against 17.6 at two); with the float arithmetic before it the H100 already preferred one and
// the H200 two (q8_gemv_variants_20261202_c.json).
constexpr int kBlocksPerSmTarget = 1;

}  // namespace kestrel_q8
