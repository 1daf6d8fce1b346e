// q8 GEMV for batch-1 decode: int8 weights with fused per-group dequant, float32 accumulation.
// The tiling is described in q8_gemv.h; checks on the arguments live in q8_gemv.cpp.
// Only c10's light CUDA headers: no cuBLAS/cuSPARSE headers are needed to build it.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "q8_gemv.h"

namespace kestrel_q8 {

template <typename XT, typename YT>
__global__ void __launch_bounds__(kWarp * kWarps)
q8_gemv_kernel(const XT* __restrict__ x, const int8_t* __restrict__ q, const float* __restrict__ s,
               float* __restrict__ partial, YT* __restrict__ y, int n, int64_t npad, int group, int units,
               int units_per_split) {
  __shared__ float red[kWarps][kBlockCols];
  block_phase1(x, q, s, npad, group, units, units_per_split, blockIdx.x, blockIdx.y, threadIdx.y, threadIdx.x, red);
  __syncthreads();
  block_phase2(partial, y, n, gridDim.y, blockIdx.x, blockIdx.y, threadIdx.y * kWarp + threadIdx.x, red);
}

template <typename YT>
__global__ void q8_reduce_kernel(const float* __restrict__ partial, YT* __restrict__ y, int n, int splits) {
  const int col = blockIdx.x * blockDim.x + threadIdx.x;
  if (col < n) reduce_column(partial, y, n, splits, col);
}

static int sm_count(int device) {
  static int cached[64] = {0};
  if (device < 0 || device >= 64) device = 0;
  if (cached[device] == 0) {
    int sms = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    cached[device] = sms > 0 ? sms : 1;
  }
  return cached[device];
}

template <typename XT, typename YT>
static void launch(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, int group, at::Tensor& y,
                   cudaStream_t stream) {
  const int64_t K = qweight.size(0);
  const int64_t npad = qweight.size(1);
  const int n = static_cast<int>(y.numel());
  const int units = static_cast<int>(K / kUnitRows);
  const int sms = sm_count(x.get_device());
  const Plan plan = make_plan(npad, units, 4 * sms);
  at::Tensor partial;
  float* partial_ptr = nullptr;
  if (plan.splits > 1) {
    partial = at::empty({plan.splits, n}, x.options().dtype(at::kFloat));
    partial_ptr = partial.data_ptr<float>();
  }
  const dim3 grid(plan.col_blocks, plan.splits);
  const dim3 block(kWarp, kWarps);
  q8_gemv_kernel<XT, YT><<<grid, block, 0, stream>>>(
      reinterpret_cast<const XT*>(x.data_ptr()), qweight.data_ptr<int8_t>(), scales.data_ptr<float>(), partial_ptr,
      reinterpret_cast<YT*>(y.data_ptr()), n, npad, group, units, plan.units_per_split);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (plan.splits > 1) {
    const int threads = 256;
    q8_reduce_kernel<YT><<<(n + threads - 1) / threads, threads, 0, stream>>>(partial_ptr, reinterpret_cast<YT*>(y.data_ptr()),
                                                                            n, plan.splits);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

template <typename XT>
static void launch_for_output(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, int group,
                              at::Tensor& y, cudaStream_t stream) {
  switch (y.scalar_type()) {
    case at::kFloat: return launch<XT, float>(x, qweight, scales, group, y, stream);
    case at::kBFloat16: return launch<XT, __nv_bfloat16>(x, qweight, scales, group, y, stream);
    case at::kHalf: return launch<XT, __half>(x, qweight, scales, group, y, stream);
    default: TORCH_CHECK(false, "q8_gemv: output dtype must be float32, bfloat16 or float16, got ", y.scalar_type());
  }
}

}  // namespace kestrel_q8

void q8_gemv_cuda(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, int64_t group, at::Tensor& y) {
  using namespace kestrel_q8;
  const c10::cuda::CUDAGuard guard(x.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.get_device()).stream();
  const int g = static_cast<int>(group);
  switch (x.scalar_type()) {
    case at::kFloat: return launch_for_output<float>(x, qweight, scales, g, y, stream);
    case at::kBFloat16: return launch_for_output<__nv_bfloat16>(x, qweight, scales, g, y, stream);
    case at::kHalf: return launch_for_output<__half>(x, qweight, scales, g, y, stream);
    default: TORCH_CHECK(false, "q8_gemv: x dtype must be float32, bfloat16 or float16, got ", x.scalar_type());
  }
}
