// Runs the q8 GEMV kernel body (csrc/q8_gemv.h) on the host, block by block and each warp in
// lock step (its lanes' copies into the shared-memory ring, then their arithmetic), with the
// launcher's plan and the kernel's reduction order (shuffles, warps, cluster ranks),
// against a double reference. It checks the tiling and indexing (split-K, partial tiles in K
// and N, padding, which rank writes which column, each column written once), the int8
// conversion of the float path and the 16-bit fixed-point x of the dp2a path, and holds every
// column to a derived error bound, where there is no GPU; tests/test_q8.py compiles and runs it
// with nvcc.
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "q8_gemv.h"

using namespace kestrel_q8;

static uint64_t state = 0x9E3779B97F4A7C15ull;
static uint32_t next_u32() {
  state ^= state << 13;
  state ^= state >> 7;
  state ^= state << 17;
  return static_cast<uint32_t>(state >> 16);
}
static float uniform() { return (next_u32() & 0xffffff) / float(1 << 24) * 2.f - 1.f; }

template <typename XT, typename YT>
static int run_case(int n, int k, int group, int splits, const char* label) {
  const int64_t npad = (n + 63) / 64 * 64;
  const int units = k / kUnitRows;
  std::vector<int8_t> q(static_cast<size_t>(k) * npad, 0);
  std::vector<float> s(static_cast<size_t>(k / group) * npad, 0.f);
  std::vector<XT> x(k);
  for (int kk = 0; kk < k; ++kk)
    for (int c = 0; c < n; ++c) q[kk * npad + c] = static_cast<int8_t>(static_cast<int>(next_u32() % 256) - 128);
  for (int gi = 0; gi < k / group; ++gi)
    for (int c = 0; c < n; ++c) s[gi * npad + c] = 0.001f + 0.01f * (uniform() + 1.f);
  // 16-bit x spans 2^12 so that the fixed-point rounding (below 2^-7 of an 8-row maximum) is hit
  for (int kk = 0; kk < k; ++kk)
    x[kk] = from_float<XT>(sizeof(XT) == 2 ? std::ldexp(uniform(), -static_cast<int>(next_u32() % 12)) : uniform());

  const Plan plan = make_plan(npad, units, splits);
  const YT sentinel = from_float<YT>(12345.f);
  std::vector<YT> y(npad + 8, sentinel);
  std::vector<int> writes(npad + 8, 0);
  // One column strip bx at a time: its `splits` blocks (one cluster), as the kernel runs them.
  std::vector<float> block_sum(static_cast<size_t>(plan.splits) * kBlockCols);
  for (int bx = 0; bx < plan.col_blocks; ++bx) {
    for (int by = 0; by < plan.splits; ++by) {
      static float red[kWarps][kBlockCols];
      for (int w = 0; w < kWarps; ++w)
        for (int c = 0; c < kBlockCols; ++c) red[w][c] = NAN;  // lane row 0 must write every slot
      for (int warp = 0; warp < kWarps; ++warp) {
        float acc[kWarp][kCols];
        const int u_begin = split_begin(by, plan.units_per_split) + warp;
        const int u_end = split_end(by, plan.units_per_split, units);
        for (int lane = 0; lane < kWarp; ++lane)
          for (int c = 0; c < kCols; ++c) acc[lane][c] = 0.f;
        // the warp in lock step, phase by phase, as the kernel's __syncwarp()s order it
        std::vector<unsigned char> ring(kWarpRingBytes, 0xEE);
        for (int d = 0; d < kStages - 1; ++d)
          for (int lane = 0; lane < kWarp; ++lane) {
            const LaneSpot at = lane_spot(bx, lane);
            if (u_begin + d * kWarps < u_end)
              issue_unit(x.data(), q.data(), s.data(), npad, group, u_begin + d * kWarps, at, lane, at.n0 < npad,
                         stage_at(ring.data(), d));
          }
        int step = 0;
        for (int u = u_begin; u < u_end; u += kWarps, ++step) {
          const int ahead = u + (kStages - 1) * kWarps;
          for (int lane = 0; lane < kWarp; ++lane) {
            const LaneSpot at = lane_spot(bx, lane);
            if (ahead < u_end)
              issue_unit(x.data(), q.data(), s.data(), npad, group, ahead, at, lane, at.n0 < npad,
                         stage_at(ring.data(), step + kStages - 1));
          }
          for (int lane = 0; lane < kWarp; ++lane) {
            const LaneSpot at = lane_spot(bx, lane);
            if (at.n0 < npad) compute_stage<XT>(stage_at(ring.data(), step), at, lane, acc[lane]);
          }
        }
        // the butterfly of shuffles (xor kLanesN, 2 * kLanesN, ...), landing in lane row 0
        for (int offset = kLanesN; offset < kWarp; offset *= 2) {
          float next[kWarp][kCols];
          for (int lane = 0; lane < kWarp; ++lane)
            for (int c = 0; c < kCols; ++c) next[lane][c] = acc[lane][c] + acc[lane ^ offset][c];
          std::memcpy(acc, next, sizeof acc);
        }
        for (int lane = 0; lane < kLanesN; ++lane)
          for (int c = 0; c < kCols; ++c) red[warp][lane * kCols + c] = acc[lane][c];
      }
      for (int t = 0; t < kBlockCols; ++t) {
        float sum = 0.f;
        for (int w = 0; w < kWarps; ++w) sum += red[w][t];
        block_sum[by * kBlockCols + t] = sum;
      }
    }
    for (int rank = 0; rank < plan.splits; ++rank)
      for (int t = 0; t < rank_column_count(plan.splits); ++t) {
        const int j = rank_first_column(rank, plan.splits) + t;
        float total = 0.f;
        for (int r = 0; r < plan.splits; ++r) total += block_sum[r * kBlockCols + j];
        const int col = bx * kBlockCols + j;
        if (col < n) {
          y[col] = from_float<YT>(total);
          ++writes[col];
        }
      }
  }

  // Per column: |y - ref| <= what rounding 16-bit x to 2^-15 of its 8-row maximum can cost,
  // + float32 sums (a unit's term, K/32 adds into acc, 2 shuffles, 4 warps, 8 ranks; 2x slack)
  // + the output's own rounding.
  const double out_eps = sizeof(YT) == 4 ? 0.0 : (std::is_same<YT, __half>::value ? 0x1p-11 : 0x1p-8);
  std::vector<double> xmax(k / kRowsPerLane, 0.0);  // each lane's 8-row maximum |x|
  for (int kk = 0; kk < k; ++kk) xmax[kk / kRowsPerLane] = std::fmax(xmax[kk / kRowsPerLane], std::fabs(to_float(x[kk])));
  double err2 = 0, ref2 = 0, worst = 0;
  bool finite = true;
  for (int c = 0; c < n; ++c) {
    double ref = 0, absum = 0, xerr = 0;
    for (int kk = 0; kk < k; ++kk) {
      const double qs = static_cast<double>(q[kk * npad + c]) * s[(kk / group) * npad + c];
      ref += static_cast<double>(to_float(x[kk])) * qs;
      absum += std::fabs(to_float(x[kk]) * qs);
      if (sizeof(XT) == 2) xerr += std::fabs(qs) * xmax[kk / kRowsPerLane] * 0x1p-15;
    }
    const double got = to_float(y[c]);
    const double bound = xerr + (k / kUnitRows + 32) * 0x1p-23 * absum + out_eps * std::fabs(ref) * 1.01;
    err2 += (got - ref) * (got - ref);
    ref2 += ref * ref;
    worst = std::fmax(worst, std::fabs(got - ref) / (bound > 0 ? bound : 1e-30));
    if (!std::isfinite(got)) finite = false;
    if (writes[c] != 1) {
      std::printf("FAIL %s: y[%d] written %d times\n", label, c, writes[c]);
      return 1;
    }
  }
  for (int64_t c = n; c < npad + 8; ++c)
    if (to_float(y[c]) != to_float(sentinel) || writes[c] != 0) {
      std::printf("FAIL %s: wrote y[%lld] beyond N=%d\n", label, static_cast<long long>(c), n);
      return 1;
    }
  const double rel = std::sqrt(err2 / (ref2 > 0 ? ref2 : 1));
  const bool ok = worst <= 1.0 && finite;
  std::printf("%s %s n=%d k=%d group=%d grid=%dx%d units/split=%d rel=%.3g worst/bound=%.3g\n", ok ? "ok" : "FAIL", label, n,
              k, group, plan.col_blocks, plan.splits, plan.units_per_split, rel, worst);
  return ok ? 0 : 1;
}

// The exponent trick against a plain cast, for every byte value in every position.
static int check_byte_conversion() {
  for (int v = 0; v < 256; ++v)
    for (int pos = 0; pos < 4; ++pos) {
      const uint32_t word = (static_cast<uint32_t>(v) << (8 * pos)) | (0x5Au << (8 * ((pos + 1) % 4)));
      float f[4];
      bytes_to_floats(word, f);
      if (f[pos] != static_cast<float>(static_cast<int8_t>(v))) {
        std::printf("FAIL byte %d at %d: %g\n", v, pos, f[pos]);
        return 1;
      }
    }
  std::printf("ok byte conversion\n");
  return 0;
}

// 16-bit x as integers (fixed_x8): exact for bf16 within 2^7 of the 8-row maximum, rounded to
// half a step below it, and NaN or inf anywhere makes the step NaN.
static int check_fixed_x() {
  for (int trial = 0; trial < 20000; ++trial) {
    const int spread = trial % 12;  // binades below the maximum
    float xv[kRowsPerLane];
    for (int r = 0; r < kRowsPerLane; ++r) {
      const float v = std::ldexp(uniform(), -static_cast<int>(next_u32() % (spread + 1)) + static_cast<int>(trial % 40) - 20);
      xv[r] = to_float(from_float<__nv_bfloat16>(v));
    }
    uint32_t xp[kRowsPerLane / 2];
    const float back = fixed_x8(xv, xp);
    float m = 0.f;
    for (float v : xv) m = std::fmax(m, std::fabs(v));
    for (int r = 0; r < kRowsPerLane; ++r) {
      const int16_t xi = static_cast<int16_t>(r % 2 ? xp[r / 2] >> 16 : xp[r / 2] & 0xffff);
      const double err = std::fabs(static_cast<double>(xi) * back - xv[r]);
      const bool exact_expected = std::fabs(xv[r]) * 128 >= m || xv[r] == 0.f;
      if ((exact_expected && err != 0) || err > 0.5 * back || std::fabs(static_cast<double>(xi)) >= 32768) {
        std::printf("FAIL fixed x: %g -> %d * %g (max %g)\n", xv[r], xi, back, m);
        return 1;
      }
    }
  }
  for (float bad : {INFINITY, -INFINITY, NAN}) {
    float xv[kRowsPerLane] = {1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f, 8.f};
    xv[5] = bad;
    uint32_t xp[kRowsPerLane / 2];
    if (!std::isnan(fixed_x8(xv, xp))) {
      std::printf("FAIL fixed x: %g in x does not make the step NaN\n", bad);
      return 1;
    }
  }
  float zeros[kRowsPerLane] = {};
  uint32_t xp[kRowsPerLane / 2];
  const float back = fixed_x8(zeros, xp);
  if (!(back > 0 && std::isfinite(back)) || xp[0] || xp[1] || xp[2] || xp[3]) {
    std::printf("FAIL fixed x: all-zero x\n");
    return 1;
  }
  std::printf("ok fixed x\n");
  return 0;
}

int main() {
  int bad = check_byte_conversion() + check_fixed_x();
  struct Shape { int n, k, group; };
  const Shape shapes[] = {
      {1, 32, 32}, {7, 64, 32}, {64, 128, 64}, {130, 96, 32}, {256, 256, 128}, {999, 4160, 64},
      {300, 1024, 128}, {2049, 384, 32}, {4096, 12288 / 16, 128}, {5, 4096, 32},
  };
  for (const Shape& sh : shapes) {
    const int units = sh.k / kUnitRows;
    bad += run_case<float, float>(sh.n, sh.k, sh.group, 1, "x=f32 y=f32 splits=1");
    bad += run_case<float, float>(sh.n, sh.k, sh.group, 2, "x=f32 y=f32 splits=2");
    bad += run_case<float, float>(sh.n, sh.k, sh.group, 8, "x=f32 y=f32 splits=8");
    bad += run_case<float, float>(sh.n, sh.k, sh.group, auto_splits((sh.n + 63) / 64 * 64, units, kBlocksPerSmTarget * 132),
                                  "x=f32 y=f32 auto");
    bad += run_case<__nv_bfloat16, float>(sh.n, sh.k, sh.group, 4, "x=bf16 y=f32 splits=4");
    bad += run_case<__nv_bfloat16, __nv_bfloat16>(sh.n, sh.k, sh.group, 8, "x=bf16 y=bf16 splits=8");
    bad += run_case<__half, __half>(sh.n, sh.k, sh.group, 2, "x=f16 y=f16 splits=2");
  }
  std::printf(bad ? "%d FAILED\n" : "all ok\n", bad);
  return bad ? 1 : 0;
}
