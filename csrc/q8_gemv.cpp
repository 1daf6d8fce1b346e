// The q8 GEMV as torch ops (torch.ops.kestrel.q8_gemv, q8_gemv_out) and a Python binding of its
// launch plan (kestrel_cuda.q8 builds it lazily with torch.utils.cpp_extension).
#include <torch/extension.h>
#include <torch/library.h>

#include <optional>
#include <vector>

void q8_gemv_cuda(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, int64_t group, at::Tensor& y,
                  int64_t splits);
std::vector<int64_t> q8_gemv_plan(int64_t K, int64_t npad, int64_t splits, int64_t device);
std::vector<double> q8_gemv_device_facts(int64_t device);

static bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// y[n] = sum_k x[k] * qweight[k, n] * scales[k / group, n] for n < y.numel(); writes y in place.
// splits: 0 picks the split-K count for the device; 1, 2, 4 or 8 forces one (for tests and tuning).
static void gemv(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, int64_t group, at::Tensor y,
                 int64_t splits) {
  TORCH_CHECK(x.is_cuda() && qweight.is_cuda() && scales.is_cuda() && y.is_cuda(), "q8_gemv: every tensor must be on a CUDA device");
  TORCH_CHECK(x.device() == qweight.device() && x.device() == scales.device() && x.device() == y.device(),
              "q8_gemv: tensors are on different devices");
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kChar && qweight.is_contiguous(),
              "q8_gemv: qweight must be a contiguous int8 [K, Npad] tensor");
  const int64_t K = qweight.size(0), npad = qweight.size(1);
  TORCH_CHECK(group > 0 && group % 32 == 0, "q8_gemv: group must be a positive multiple of 32, got ", group);
  TORCH_CHECK(K % group == 0, "q8_gemv: group ", group, " does not divide K=", K);
  TORCH_CHECK(npad % 16 == 0, "q8_gemv: Npad=", npad, " must be a multiple of 16");
  TORCH_CHECK(scales.dim() == 2 && scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.size(0) == K / group && scales.size(1) == npad,
              "q8_gemv: scales must be a contiguous float32 [", K / group, ", ", npad, "] tensor");
  TORCH_CHECK(x.dim() == 1 && x.numel() == K && x.is_contiguous(), "q8_gemv: x must be a contiguous vector of K=", K);
  TORCH_CHECK(y.dim() == 1 && y.is_contiguous() && y.numel() >= 1 && y.numel() <= npad,
              "q8_gemv: y must be a contiguous vector of N <= Npad=", npad);
  TORCH_CHECK(aligned16(qweight) && aligned16(scales), "q8_gemv: qweight and scales must start on 16-byte boundaries");
  TORCH_CHECK(K <= (int64_t(1) << 31) - 1 && npad <= (int64_t(1) << 31) - 1, "q8_gemv: K and Npad must fit in int32");
  TORCH_CHECK(splits >= 0 && splits <= 8, "q8_gemv: splits must be 0 (auto) or 1..8, got ", splits);
  // x is read with 16-byte vector loads; a view that starts mid-vector gets a fresh (aligned) copy.
  q8_gemv_cuda(aligned16(x) ? x : x.clone(), qweight, scales, group, y, splits);
}

// y = x @ W^T for one row x ([K] or [1, K]) into a new [..., n] tensor (x's dtype unless out_dtype says).
static at::Tensor q8_gemv_op(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, int64_t group,
                             int64_t n, int64_t splits, std::optional<at::ScalarType> out_dtype) {
  TORCH_CHECK(x.dim() >= 1 && x.numel() == x.size(-1), "q8_gemv: x must be one row ([K] or [1, K])");
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = n;
  at::Tensor y = at::empty(sizes, x.options().dtype(out_dtype.value_or(x.scalar_type())));
  gemv(x.reshape({-1}).contiguous(), qweight, scales, group, y.view({-1}), splits);
  return y;
}

static void q8_gemv_out_op(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, int64_t group,
                           at::Tensor y, int64_t splits) {
  gemv(x.reshape({-1}).contiguous(), qweight, scales, group, y, splits);
}

TORCH_LIBRARY(kestrel, m) {
  m.def("q8_gemv(Tensor x, Tensor qweight, Tensor scales, int group, int n, int splits=0, ScalarType? out_dtype=None) -> Tensor");
  m.def("q8_gemv_out(Tensor x, Tensor qweight, Tensor scales, int group, Tensor(a!) y, int splits=0) -> ()");
}

TORCH_LIBRARY_IMPL(kestrel, CUDA, m) {
  m.impl("q8_gemv", &q8_gemv_op);
  m.impl("q8_gemv_out", &q8_gemv_out_op);
}

static std::vector<int64_t> plan(int64_t K, int64_t npad, int64_t splits, int64_t device) {
  TORCH_CHECK(K > 0 && K % 32 == 0 && npad > 0 && npad % 16 == 0, "q8_gemv.plan: K must be a positive multiple of 32 and Npad of 16");
  return q8_gemv_plan(K, npad, splits, device);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kestrel q8 GEMV: int8 [K, Npad] weights with f32 [K/group, Npad] scales, float32 accumulation; "
            "the product itself is torch.ops.kestrel.q8_gemv";
  m.def("plan", &plan, "[col_blocks, splits, units_per_split] the launcher uses for K x Npad on a device",
        pybind11::arg("K"), pybind11::arg("npad"), pybind11::arg("splits") = 0, pybind11::arg("device") = 0);
  m.def("device_facts", &q8_gemv_device_facts, "[SMs, peak DRAM GB/s (0: unknown), blocks per SM the split choice aims at]",
        pybind11::arg("device") = 0);
}
