// q8 GEMV, the part shared by the CUDA kernel (q8_gemv.cu) and its host emulation test:
//   y[n] = sum_k x[k] * q[k, n] * s[k / group, n]
// q is int8 [K, Npad] (row k contiguous over n), s is f32 [K / group, Npad], Npad % 8 == 0.
//
// Tiling: a thread owns kCols = 8 adjacent columns and reads them with one 8-byte load per
// row, so a warp reads 256 contiguous bytes of a row (coalesced over n). Rows go in units of
// kUnitRows = 32 (every supported group size is a multiple): a thread sums x[k] * q[k, n] over
// a unit in float32, then multiplies by the unit's group scale once. The kWarps warps of a
// block take interleaved units; blocks along y take disjoint unit ranges (split-K), and their
// partial sums are added in a fixed order, so results are deterministic run to run.
#pragma once

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <vector_types.h>

#define Q8_HD __host__ __device__ __forceinline__

#ifdef __CUDA_ARCH__
#define Q8_LOAD(p) __ldg(p)
#else
#define Q8_LOAD(p) (*(p))
#endif

namespace kestrel_q8 {

constexpr int kCols = 8;                   // columns per thread (one int2 load per row)
constexpr int kWarp = 32;
constexpr int kWarps = 8;                  // warps per block
constexpr int kBlockCols = kWarp * kCols;  // 256 columns per block
constexpr int kUnitRows = 32;              // rows per work unit

Q8_HD float to_float(float v) { return v; }
Q8_HD float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
Q8_HD float to_float(__half v) { return __half2float(v); }

template <typename T> Q8_HD T from_float(float v);
template <> Q8_HD float from_float<float>(float v) { return v; }
template <> Q8_HD __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16(v); }
template <> Q8_HD __half from_float<__half>(float v) { return __float2half(v); }

// Signed byte i (0..3) of a packed int, as float.
Q8_HD float byte_at(int v, int i) { return static_cast<float>(static_cast<int8_t>((v >> (8 * i)) & 0xff)); }

// One thread's share: for units u = u_begin, u_begin + u_step, ... < u_end, and c < kCols,
//   acc[c] += s[g(u), n0 + c] * sum_{r < kUnitRows} x[u*32 + r] * q[u*32 + r, n0 + c].
// Needs n0 % kCols == 0 and n0 + kCols <= npad.
template <typename XT>
Q8_HD void accumulate_units(const XT* __restrict__ x, const int8_t* __restrict__ q, const float* __restrict__ s,
                            int64_t npad, int group, int u_begin, int u_end, int u_step, int n0, float acc[kCols]) {
  for (int u = u_begin; u < u_end; u += u_step) {
    const int64_t k0 = static_cast<int64_t>(u) * kUnitRows;
    const int8_t* row = q + k0 * npad + n0;
    float part[kCols];
#pragma unroll
    for (int c = 0; c < kCols; ++c) part[c] = 0.f;
#pragma unroll 8
    for (int r = 0; r < kUnitRows; ++r) {
      const float xv = to_float(x[k0 + r]);
      const int2 packed = Q8_LOAD(reinterpret_cast<const int2*>(row + r * npad));
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        part[c] = fmaf(xv, byte_at(packed.x, c), part[c]);
        part[c + 4] = fmaf(xv, byte_at(packed.y, c), part[c + 4]);
      }
    }
    const float* srow = s + (k0 / group) * npad + n0;
    const float4 s0 = Q8_LOAD(reinterpret_cast<const float4*>(srow));
    const float4 s1 = Q8_LOAD(reinterpret_cast<const float4*>(srow + 4));
    acc[0] = fmaf(part[0], s0.x, acc[0]);
    acc[1] = fmaf(part[1], s0.y, acc[1]);
    acc[2] = fmaf(part[2], s0.z, acc[2]);
    acc[3] = fmaf(part[3], s0.w, acc[3]);
    acc[4] = fmaf(part[4], s1.x, acc[4]);
    acc[5] = fmaf(part[5], s1.y, acc[5]);
    acc[6] = fmaf(part[6], s1.z, acc[6]);
    acc[7] = fmaf(part[7], s1.w, acc[7]);
  }
}

// Shared-memory slot of (lane, column c) of one warp: [c][lane], conflict-free on the write.
Q8_HD int red_slot(int lane, int c) { return c * kWarp + lane; }
// The slot that holds block column j (= lane * kCols + c).
Q8_HD int red_slot_of_column(int j) { return red_slot(j / kCols, j % kCols); }

// The kernel body in two phases around its one __syncthreads(), so the host test can run the
// very same code block by block. red is the block's shared [kWarps][kBlockCols] array.
template <typename XT>
Q8_HD void block_phase1(const XT* __restrict__ x, const int8_t* __restrict__ q, const float* __restrict__ s,
                        int64_t npad, int group, int units, int units_per_split, int bx, int by, int warp, int lane,
                        float (*red)[kBlockCols]) {
  const int n0 = bx * kBlockCols + lane * kCols;
  const int u_begin = by * units_per_split;
  const int u_end = units < u_begin + units_per_split ? units : u_begin + units_per_split;
  float acc[kCols];
#pragma unroll
  for (int c = 0; c < kCols; ++c) acc[c] = 0.f;
  if (n0 < npad) accumulate_units(x, q, s, npad, group, u_begin + warp, u_end, kWarps, n0, acc);
#pragma unroll
  for (int c = 0; c < kCols; ++c) red[warp][red_slot(lane, c)] = acc[c];
}

// Thread j of the block sums block column j over the warps, in warp order, and writes it:
// straight to y when there is one split, else to partial[by, col] for the reduce pass.
template <typename YT>
Q8_HD void block_phase2(float* __restrict__ partial, YT* __restrict__ y, int n, int splits, int bx, int by, int j,
                        const float (*red)[kBlockCols]) {
  const int col = bx * kBlockCols + j;
  float sum = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) sum += red[w][red_slot_of_column(j)];
  if (col < n) {
    if (splits == 1)
      y[col] = from_float<YT>(sum);
    else
      partial[static_cast<int64_t>(by) * n + col] = sum;
  }
}

// The reduce pass: column col summed over the splits in split order (no atomics).
template <typename YT>
Q8_HD void reduce_column(const float* __restrict__ partial, YT* __restrict__ y, int n, int splits, int col) {
  float sum = 0.f;
  for (int i = 0; i < splits; ++i) sum += partial[static_cast<int64_t>(i) * n + col];
  y[col] = from_float<YT>(sum);
}

struct Plan {
  int col_blocks;       // gridDim.x
  int splits;           // gridDim.y: disjoint unit ranges, reduced afterwards when > 1
  int units_per_split;  // a multiple of kWarps unless one split covers every unit
};

// Enough blocks to fill the device (target_blocks, e.g. 4 per SM), splitting K only as needed.
inline Plan make_plan(int64_t npad, int units, int target_blocks) {
  Plan p;
  p.col_blocks = static_cast<int>((npad + kBlockCols - 1) / kBlockCols);
  int want = (target_blocks + p.col_blocks - 1) / p.col_blocks;
  if (want < 1) want = 1;
  int ups = (units + want - 1) / want;
  ups = (ups + kWarps - 1) / kWarps * kWarps;
  if (ups >= units) ups = units;
  if (ups < 1) ups = 1;
  p.units_per_split = ups;
  p.splits = (units + ups - 1) / ups;
  return p;
}

}  // namespace kestrel_q8
