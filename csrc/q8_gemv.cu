// q8 GEMV for batch-1 decode: int8 weights with fused per-group dequant, float32 accumulation.
// The tiling and the reduction order are described in q8_gemv.h; checks on the arguments
// live in q8_gemv.cpp. Only c10's light CUDA headers: no cuBLAS/cuSPARSE headers are needed.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cooperative_groups.h>

#include <mutex>

#include "q8_gemv.h"

namespace kestrel_q8 {

template <typename XT, typename YT>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm)
q8_gemv_kernel(const XT* __restrict__ x, const int8_t* __restrict__ q, const float* __restrict__ s,
               YT* __restrict__ y, int n, int64_t npad, int group, int units, int units_per_split) {
  __shared__ __align__(16) float red[kWarps][kBlockCols];
  __shared__ float block_sum[kBlockCols];
  const int warp = threadIdx.y, lane = threadIdx.x;
  const LaneSpot at = lane_spot(blockIdx.x, lane);
  const int splits = gridDim.y;

  float acc[kCols];
#pragma unroll
  for (int c = 0; c < kCols; ++c) acc[c] = 0.f;
  const int u_begin = split_begin(blockIdx.y, units_per_split) + warp;
  const int u_end = split_end(blockIdx.y, units_per_split, units);
  const bool active = at.n0 < npad;
  // The ring: kStages - 1 units in flight while the arithmetic runs on the oldest.
  extern __shared__ __align__(16) unsigned char ring_smem[];
  unsigned char* ring = ring_smem + warp * kWarpRingBytes;
#pragma unroll
  for (int d = 0; d < kStages - 1; ++d) {
    const int u = u_begin + d * kWarps;
    if (u < u_end) issue_unit(x, q, s, npad, group, u, at, lane, active, stage_at(ring, d));
    async_commit();  // one group per unit, empty or not, so the wait below counts right
  }
  int step = 0;
  for (int u = u_begin; u < u_end; u += kWarps, ++step) {
    __syncwarp();  // every lane is done with the stage the next issue refills
    const int ahead = u + (kStages - 1) * kWarps;
    if (ahead < u_end) issue_unit(x, q, s, npad, group, ahead, at, lane, active, stage_at(ring, step + kStages - 1));
    async_commit();
    async_wait<kStages - 1>();  // this lane's copies of unit u have landed
    __syncwarp();               // and so have the other lanes' (scales, x)
    if (active) compute_stage<XT>(stage_at(ring, step), at, lane, acc);
  }
  async_wait<0>();

  // The lane rows into lane row 0 (every lane takes part in the shuffles).
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
#pragma unroll
    for (int offset = kLanesN; offset < kWarp; offset *= 2) acc[c] += __shfl_xor_sync(0xffffffffu, acc[c], offset);
  }
  if (at.lane_row == 0) {
    float4* dst = reinterpret_cast<float4*>(&red[warp][(lane % kLanesN) * kCols]);
#pragma unroll
    for (int i = 0; i < kCols / 4; ++i) dst[i] = make_float4(acc[4 * i], acc[4 * i + 1], acc[4 * i + 2], acc[4 * i + 3]);
  }
  __syncthreads();

  // The warps, in warp order: thread t owns block columns t, t + kThreads, ...
  const int t = warp * kWarp + lane;
  auto warps_sum = [&](int j) {
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum += red[w][j];
    return sum;
  };
  if (splits == 1) {
    for (int j = t; j < kBlockCols; j += kThreads) {
      const int col = blockIdx.x * kBlockCols + j;
      if (col < n) y[col] = from_float<YT>(warps_sum(j));
    }
    return;
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  for (int j = t; j < kBlockCols; j += kThreads) block_sum[j] = warps_sum(j);
  // The splits, in rank order, through distributed shared memory.
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();  // every rank's block_sum is written
  const int rank = static_cast<int>(cluster.block_rank());
  for (int i = t; i < rank_column_count(splits); i += kThreads) {
    const int j = rank_first_column(rank, splits) + i;
    float total = 0.f;
    for (int r = 0; r < splits; ++r) total += cluster.map_shared_rank(block_sum, r)[j];
    const int col = blockIdx.x * kBlockCols + j;
    if (col < n) y[col] = from_float<YT>(total);
  }
  cluster.sync();  // no block leaves while another rank may still read its shared memory
#endif
}

struct DeviceFacts {
  int sms = 0;
  int major = 0;
  int mem_clock_khz = 0;  // peak DRAM clock; 0 where the driver does not say
  int bus_width_bits = 0;
  double peak_gbps() const { return 2.0 * mem_clock_khz * 1e3 * (bus_width_bits / 8) / 1e9; }  // double data rate; reported, not used
};

// Per-device caches, filled once each (std::call_once: no lock on later launches; a fill that
// throws leaves its flag unset, so the next call tries again).
static DeviceFacts device_facts(int device) {
  static std::once_flag once[64];
  static DeviceFacts cached[64];
  if (device < 0 || device >= 64) device = 0;
  std::call_once(once[device], [device] {
    DeviceFacts f;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&f.sms, cudaDevAttrMultiProcessorCount, device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&f.major, cudaDevAttrComputeCapabilityMajor, device));
    if (f.sms < 1) f.sms = 1;
    // Reported to benchmarks (device_facts); a driver that lacks them leaves 0.
    if (cudaDeviceGetAttribute(&f.mem_clock_khz, cudaDevAttrMemoryClockRate, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&f.bus_width_bits, cudaDevAttrGlobalMemoryBusWidth, device) != cudaSuccess) {
      (void)cudaGetLastError();
      f.mem_clock_khz = f.bus_width_bits = 0;
    }
    cached[device] = f;
  });
  return cached[device];
}

// Lets an instantiation use the ring's dynamic shared memory (over the 48 KiB default), once
// per device; the attribute applies on the current device, which the caller's guard set.
template <typename XT, typename YT>
static void enable_ring(int device) {
  static std::once_flag once[64];
  if (device < 0 || device >= 64) device = 0;
  std::call_once(once[device], [] {
    C10_CUDA_CHECK(cudaFuncSetAttribute(q8_gemv_kernel<XT, YT>, cudaFuncAttributeMaxDynamicSharedMemorySize, kRingBytes));
  });
}

// Clusters need sm_90; below it split-K stays within a block's warps. With no split count
// given, auto_splits aims at kBlocksPerSmTarget blocks per SM.
static Plan choose_plan(int64_t npad, int units, int64_t splits, int device) {
  const DeviceFacts dev = device_facts(device);
  int want = static_cast<int>(splits);
  if (dev.major < 9) {
    want = 1;
  } else if (want <= 0) {
    want = auto_splits(npad, units, kBlocksPerSmTarget * dev.sms);
  }
  return make_plan(npad, units, want);
}

template <typename XT, typename YT>
static void launch(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, int group, at::Tensor& y,
                   int64_t splits, cudaStream_t stream) {
  const int64_t npad = qweight.size(1);
  const int n = static_cast<int>(y.numel());
  const int units = static_cast<int>(qweight.size(0) / kUnitRows);
  const Plan plan = choose_plan(npad, units, splits, x.get_device());
  enable_ring<XT, YT>(x.get_device());

  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(plan.col_blocks, plan.splits);
  config.blockDim = dim3(kWarp, kWarps);
  config.dynamicSmemBytes = kRingBytes;
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = 1;
  attr[0].val.clusterDim.y = plan.splits;
  attr[0].val.clusterDim.z = 1;
  config.attrs = attr;
  config.numAttrs = plan.splits > 1 ? 1 : 0;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, q8_gemv_kernel<XT, YT>, reinterpret_cast<const XT*>(x.data_ptr()),
                                    static_cast<const int8_t*>(qweight.data_ptr<int8_t>()),
                                    static_cast<const float*>(scales.data_ptr<float>()),
                                    reinterpret_cast<YT*>(y.data_ptr()), n, npad, group, units, plan.units_per_split));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename XT>
static void launch_for_output(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, int group,
                              at::Tensor& y, int64_t splits, cudaStream_t stream) {
  switch (y.scalar_type()) {
    case at::kFloat: return launch<XT, float>(x, qweight, scales, group, y, splits, stream);
    case at::kBFloat16: return launch<XT, __nv_bfloat16>(x, qweight, scales, group, y, splits, stream);
    case at::kHalf: return launch<XT, __half>(x, qweight, scales, group, y, splits, stream);
    default: TORCH_CHECK(false, "q8_gemv: output dtype must be float32, bfloat16 or float16, got ", y.scalar_type());
  }
}

}  // namespace kestrel_q8

void q8_gemv_cuda(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, int64_t group, at::Tensor& y,
                  int64_t splits) {
  using namespace kestrel_q8;
  const c10::cuda::CUDAGuard guard(x.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.get_device()).stream();
  const int g = static_cast<int>(group);
  switch (x.scalar_type()) {
    case at::kFloat: return launch_for_output<float>(x, qweight, scales, g, y, splits, stream);
    case at::kBFloat16: return launch_for_output<__nv_bfloat16>(x, qweight, scales, g, y, splits, stream);
    case at::kHalf: return launch_for_output<__half>(x, qweight, scales, g, y, splits, stream);
    default: TORCH_CHECK(false, "q8_gemv: x dtype must be float32, bfloat16 or float16, got ", x.scalar_type());
  }
}

// The plan the launcher uses (for tests and benchmarks):
// {col_blocks, splits, units_per_split}.
std::vector<int64_t> q8_gemv_plan(int64_t K, int64_t npad, int64_t splits, int64_t device) {
  using namespace kestrel_q8;
  const Plan p = choose_plan(npad, static_cast<int>(K / kUnitRows), splits, static_cast<int>(device));
  return {p.col_blocks, p.splits, p.units_per_split};
}

// What the split heuristic saw on a device: {SMs, peak DRAM GB/s (0: unknown), blocks per SM aimed at}.
std::vector<double> q8_gemv_device_facts(int64_t device) {
  using namespace kestrel_q8;
  const DeviceFacts dev = device_facts(static_cast<int>(device));
  return {static_cast<double>(dev.sms), dev.peak_gbps(), static_cast<double>(kBlocksPerSmTarget)};
}
