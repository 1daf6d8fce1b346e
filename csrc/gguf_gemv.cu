// The launcher of the GGUF K-quant GEMV (gguf_gemv.cuh): chunks of up to 8 activation rows, each chunk one launch of
// the kernel compiled for 1, 2, 4 or 8 rows. Checks on the arguments live in gguf_gemv.cpp.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "gguf_gemv.cuh"

namespace kestrel_gguf {

// Warps a block, from the weight's shape alone (a row's bits depend on it): a thread takes every warps*32-th unit of
// 64 values, so a long row gets more threads.
int default_warps(int64_t k) {
  const int64_t units = (k / 256) * 4;
  return units <= 64 ? 1 : units <= 192 ? 2 : 4;
}

// Weight rows a block for a chunk of m activation rows, as ``launch`` picks them: as many as the registers hold without
// spilling (the rows of a block share their activation loads; a row's bits do not depend on it); Q4_K's chunks of 5
// to 8 rows run as one-row launches.
int rows_per_block(int m, int qtype) { return m == 1 || (qtype == kQ4K && m > 4) ? 4 : m <= 4 ? 2 : 1; }

template <int M, int R, typename XT, typename YT>
static void launch_chunk(int qtype, const XT* x, const uint8_t* w, YT* out, int64_t ldo, int n, int k,
                         int64_t row_bytes, int mrows, int warps, bool aligned, cudaStream_t stream) {
  const dim3 grid((n + R - 1) / R), block(warps * kWarp);
  if (qtype == kQ4K) {
    if (aligned) {
      q4k_rows<M, R, true, XT, YT><<<grid, block, 0, stream>>>(x, w, out, ldo, n, k, row_bytes, mrows);
    } else {
      q4k_rows<M, R, false, XT, YT><<<grid, block, 0, stream>>>(x, w, out, ldo, n, k, row_bytes, mrows);
    }
  } else {
    q6k_rows<M, R, XT, YT><<<grid, block, 0, stream>>>(x, w, out, ldo, n, k, row_bytes, mrows);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename XT, typename YT>
static void launch(int qtype, const at::Tensor& x, const at::Tensor& w, at::Tensor& out, int n, int k, int warps,
                   cudaStream_t stream) {
  const int rows = static_cast<int>(x.size(0));
  const int64_t row_bytes = (k / 256) * (qtype == kQ4K ? 144 : 210);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const bool aligned = reinterpret_cast<uintptr_t>(wp) % 16 == 0 && row_bytes % 16 == 0;
  const XT* xp = reinterpret_cast<const XT*>(x.data_ptr());
  YT* op = reinterpret_cast<YT*>(out.data_ptr());
  const int64_t ldo = out.stride(0);
  for (int at = 0; at < rows; at += kMaxRows) {
    const int mr = std::min(kMaxRows, rows - at);
    const XT* xa = xp + static_cast<int64_t>(at) * k;
    YT* oa = op + static_cast<int64_t>(at) * ldo;
    if (mr == 1) {
      launch_chunk<1, 4, XT, YT>(qtype, xa, wp, oa, ldo, n, k, row_bytes, mr, warps, aligned, stream);
    } else if (mr == 2) {
      launch_chunk<2, 2, XT, YT>(qtype, xa, wp, oa, ldo, n, k, row_bytes, mr, warps, aligned, stream);
    } else if (mr <= 4) {
      launch_chunk<4, 2, XT, YT>(qtype, xa, wp, oa, ldo, n, k, row_bytes, mr, warps, aligned, stream);
    } else if (qtype == kQ4K) {
      // Q4_K's 8-row kernel (one weight row a block) measured slower than 8 one-row launches on an H100
      // (gguf-gemv_20261207T150648Z: 209.6 us against 18.3 a row at 12288 x 4096): a row's bits are the same either way
      for (int r = 0; r < mr; ++r) {
        launch_chunk<1, 4, XT, YT>(qtype, xa + static_cast<int64_t>(r) * k, wp, oa + static_cast<int64_t>(r) * ldo,
                                   ldo, n, k, row_bytes, 1, warps, aligned, stream);
      }
    } else {
      launch_chunk<8, 1, XT, YT>(qtype, xa, wp, oa, ldo, n, k, row_bytes, mr, warps, aligned, stream);
    }
  }
}

// out is float32 or x's own dtype (the checks in gguf_gemv.cpp)
template <typename XT>
static void launch_for_output(int qtype, const at::Tensor& x, const at::Tensor& w, at::Tensor& out, int n, int k,
                              int warps, cudaStream_t stream) {
  if (out.scalar_type() == at::kFloat) return launch<XT, float>(qtype, x, w, out, n, k, warps, stream);
  return launch<XT, XT>(qtype, x, w, out, n, k, warps, stream);
}

}  // namespace kestrel_gguf

void gguf_gemv_cuda(const at::Tensor& x, const at::Tensor& w, int64_t qtype, int64_t n, int64_t k, at::Tensor& out,
                    int64_t warps) {
  using namespace kestrel_gguf;
  const c10::cuda::CUDAGuard guard(x.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.get_device()).stream();
  const int wp = warps > 0 ? static_cast<int>(warps) : default_warps(k);
  const int q = static_cast<int>(qtype), nn = static_cast<int>(n), kk = static_cast<int>(k);
  switch (x.scalar_type()) {
    case at::kFloat: return launch<float, float>(q, x, w, out, nn, kk, wp, stream);
    case at::kBFloat16: return launch_for_output<__nv_bfloat16>(q, x, w, out, nn, kk, wp, stream);
    case at::kHalf: return launch_for_output<__half>(q, x, w, out, nn, kk, wp, stream);
    default: TORCH_CHECK(false, "gguf_gemv: x must be float32, bfloat16 or float16, not ", x.scalar_type());
  }
}

std::vector<int64_t> gguf_gemv_plan(int64_t k, int64_t m, int64_t qtype) {
  return {kestrel_gguf::default_warps(k),
          kestrel_gguf::rows_per_block(static_cast<int>(std::min<int64_t>(m, 8)), static_cast<int>(qtype))};
}
