// Python binding of the q8 GEMV (kestrel_cuda.q8 builds it lazily with torch.utils.cpp_extension).
#include <torch/extension.h>

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

static std::vector<int64_t> plan(int64_t K, int64_t npad, int64_t splits, int64_t device) {
  TORCH_CHECK(K > 0 && K % 32 == 0 && npad > 0 && npad % 16 == 0, "q8_gemv.plan: K must be a positive multiple of 32 and Npad of 16");
  return q8_gemv_plan(K, npad, splits, device);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kestrel q8 GEMV: int8 [K, Npad] weights with f32 [K/group, Npad] scales, float32 accumulation";
  m.def("gemv", &gemv, "y = x @ dequant(qweight, scales) for one row x (writes y)", pybind11::arg("x"),
        pybind11::arg("qweight"), pybind11::arg("scales"), pybind11::arg("group"), pybind11::arg("y"),
        pybind11::arg("splits") = 0);
  m.def("plan", &plan, "[col_blocks, splits, units_per_split] the launcher uses for K x Npad on a device",
        pybind11::arg("K"), pybind11::arg("npad"), pybind11::arg("splits") = 0, pybind11::arg("device") = 0);
  m.def("device_facts", &q8_gemv_device_facts, "[SMs, peak DRAM GB/s (0: unknown), blocks per SM the split choice aims at]",
        pybind11::arg("device") = 0);
}
