// Runs the q8 GEMV kernel body (csrc/q8_gemv.h) on the host, block by block and each warp in
// lock step (its lanes' copies into the shared-memory ring, then their arithmetic), with the
// launcher's plan and the kernel's reduction order (shuffles, warps, cluster ranks),
// against a double reference. It checks the tiling and indexing (split-K, partial tiles in K
// and N, padding, which rank writes which column, each column written once) and the int8
// conversion where there is no GPU; tests/test_q8.py compiles and runs it with nvcc.
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstring>
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
  for (int kk = 0; kk < k; ++kk) x[kk] = from_float<XT>(uniform());

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

  double err2 = 0, ref2 = 0;
  bool finite = true;
  for (int c = 0; c < n; ++c) {
    double ref = 0;
    for (int kk = 0; kk < k; ++kk)
      ref += static_cast<double>(to_float(x[kk])) * q[kk * npad + c] * s[(kk / group) * npad + c];
    const double got = to_float(y[c]);
    err2 += (got - ref) * (got - ref);
    ref2 += ref * ref;
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
  const double tol = sizeof(YT) == 4 ? 1e-5 : 1e-2;  // a 16-bit output rounds to ~3 digits
  const bool ok = rel < tol && finite;
  std::printf("%s %s n=%d k=%d group=%d grid=%dx%d units/split=%d rel=%.3g\n", ok ? "ok" : "FAIL", label, n, k, group,
              plan.col_blocks, plan.splits, plan.units_per_split, rel);
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

// The automatic split count's blocks-per-SM rule at the bandwidths per SM of an H100 and an H200.
static int check_blocks_per_sm() {
  const bool ok = blocks_per_sm_target(3352.0 / 132) == 1 && blocks_per_sm_target(4814.0 / 132) == 2 &&
                  blocks_per_sm_target(0.0) == 2;
  std::printf(ok ? "ok blocks per SM\n" : "FAIL blocks per SM\n");
  return ok ? 0 : 1;
}

int main() {
  int bad = check_byte_conversion() + check_blocks_per_sm();
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
    bad += run_case<float, float>(sh.n, sh.k, sh.group, auto_splits((sh.n + 63) / 64 * 64, units, 2 * 132),
                                  "x=f32 y=f32 auto");
    bad += run_case<__nv_bfloat16, float>(sh.n, sh.k, sh.group, 4, "x=bf16 y=f32 splits=4");
    bad += run_case<__nv_bfloat16, __nv_bfloat16>(sh.n, sh.k, sh.group, 8, "x=bf16 y=bf16 splits=8");
    bad += run_case<__half, __half>(sh.n, sh.k, sh.group, 2, "x=f16 y=f16 splits=2");
  }
  std::printf(bad ? "%d FAILED\n" : "all ok\n", bad);
  return bad ? 1 : 0;
}
