// Runs the q8 GEMV kernel body (csrc/q8_gemv.h) on the host, block by block and thread by
// thread, with the same launch plan the CUDA launcher uses, against a double reference.
// It checks the tiling and indexing (split-K, partial tiles in K and N, padding, the
// reduction order) where there is no GPU; tests/test_q8.py compiles and runs it with nvcc.
#include <cmath>
#include <cstdio>
#include <cstdint>
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
static int run_case(int n, int k, int group, int target_blocks, const char* label) {
  const int64_t npad = (n + 63) / 64 * 64;
  const int units = k / kUnitRows;
  std::vector<int8_t> q(static_cast<size_t>(k) * npad, 0);
  std::vector<float> s(static_cast<size_t>(k / group) * npad, 0.f);
  std::vector<XT> x(k);
  for (int kk = 0; kk < k; ++kk)
    for (int c = 0; c < n; ++c) q[kk * npad + c] = static_cast<int8_t>(static_cast<int>(next_u32() % 255) - 127);
  for (int gi = 0; gi < k / group; ++gi)
    for (int c = 0; c < n; ++c) s[gi * npad + c] = 0.001f + 0.01f * (uniform() + 1.f);
  for (int kk = 0; kk < k; ++kk) x[kk] = from_float<XT>(uniform());

  const Plan plan = make_plan(npad, units, target_blocks);
  const YT sentinel = from_float<YT>(12345.f);
  std::vector<YT> y(npad + 8, sentinel);
  std::vector<float> partial(static_cast<size_t>(plan.splits) * n + 8, -777.f);
  static float red[kWarps][kBlockCols];
  for (int by = 0; by < plan.splits; ++by) {
    for (int bx = 0; bx < plan.col_blocks; ++bx) {
      for (int w = 0; w < kWarps; ++w)
        for (int c = 0; c < kBlockCols; ++c) red[w][c] = NAN;  // every slot must be written in phase 1
      for (int warp = 0; warp < kWarps; ++warp)
        for (int lane = 0; lane < kWarp; ++lane)
          block_phase1(x.data(), q.data(), s.data(), npad, group, units, plan.units_per_split, bx, by, warp, lane, red);
      for (int j = 0; j < kWarp * kWarps; ++j) block_phase2(partial.data(), y.data(), n, plan.splits, bx, by, j, red);
    }
  }
  if (plan.splits > 1)
    for (int col = 0; col < n; ++col) reduce_column(partial.data(), y.data(), n, plan.splits, col);

  double err2 = 0, ref2 = 0, worst = 0;
  for (int c = 0; c < n; ++c) {
    double ref = 0;
    for (int kk = 0; kk < k; ++kk)
      ref += static_cast<double>(to_float(x[kk])) * q[kk * npad + c] * s[(kk / group) * npad + c];
    const double got = to_float(y[c]);
    err2 += (got - ref) * (got - ref);
    ref2 += ref * ref;
    if (!std::isfinite(got)) worst = INFINITY;
  }
  for (int64_t c = n; c < npad + 8; ++c)
    if (to_float(y[c]) != to_float(sentinel)) {
      std::printf("FAIL %s: wrote y[%lld] beyond N=%d\n", label, static_cast<long long>(c), n);
      return 1;
    }
  if (partial[static_cast<size_t>(plan.splits) * n] != -777.f) {
    std::printf("FAIL %s: wrote past the partial buffer\n", label);
    return 1;
  }
  const double rel = std::sqrt(err2 / (ref2 > 0 ? ref2 : 1));
  const double tol = sizeof(YT) == 4 ? 1e-5 : 1e-2;  // a 16-bit output rounds to ~3 digits
  const bool ok = rel < tol && std::isfinite(worst);
  std::printf("%s %s n=%d k=%d group=%d grid=%dx%d units/split=%d rel=%.3g\n", ok ? "ok" : "FAIL", label, n, k, group,
              plan.col_blocks, plan.splits, plan.units_per_split, rel);
  return ok ? 0 : 1;
}

int main() {
  int bad = 0;
  const int sm90 = 4 * 132;  // the H200's target
  struct Shape { int n, k, group; };
  const Shape shapes[] = {
      {1, 32, 32}, {7, 64, 32}, {64, 128, 64}, {130, 96, 32}, {256, 256, 128}, {999, 4160, 64},
      {300, 1024, 128}, {2049, 384, 32}, {4096, 12288 / 16, 128}, {5, 4096, 32},
  };
  for (const Shape& sh : shapes) {
    bad += run_case<float, float>(sh.n, sh.k, sh.group, sm90, "x=f32 y=f32");
    bad += run_case<float, float>(sh.n, sh.k, sh.group, 1, "x=f32 y=f32 one-split");
    bad += run_case<float, float>(sh.n, sh.k, sh.group, 1 << 20, "x=f32 y=f32 max-split");
    bad += run_case<__nv_bfloat16, float>(sh.n, sh.k, sh.group, sm90, "x=bf16 y=f32");
    bad += run_case<__nv_bfloat16, __nv_bfloat16>(sh.n, sh.k, sh.group, sm90, "x=bf16 y=bf16");
    bad += run_case<__half, __half>(sh.n, sh.k, sh.group, sm90, "x=f16 y=f16");
  }
  std::printf(bad ? "%d FAILED\n" : "all ok\n", bad);
  return bad ? 1 : 0;
}
