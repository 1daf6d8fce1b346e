// The GGUF K-quant GEMV as a torch op (torch.ops.kestrel_gguf.gemv_out) and a Python binding of its launch plan
// (backends/cuda/gguf_cuda.py builds it lazily with torch.utils.cpp_extension).
#include <torch/extension.h>
#include <torch/library.h>

#include <vector>

void gguf_gemv_cuda(const at::Tensor& x, const at::Tensor& w, int64_t qtype, int64_t n, int64_t k, at::Tensor& out,
                    int64_t warps);
std::vector<int64_t> gguf_gemv_plan(int64_t k, int64_t m, int64_t qtype);

static bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// out [M, n] (float32, or x's dtype: rounded once) = x [M, k] @ W.T for W [n, k] held as ggml blocks of qtype (12: Q4_K, 14: Q6_K) in w (uint8).
// warps: 0 takes the shape's own; 1, 2 or 4 forces one (a row's bits depend on it: for measuring).
static void gemv_out(const at::Tensor& x, const at::Tensor& w, int64_t qtype, int64_t n, int64_t k, at::Tensor out,
                     int64_t warps) {
  TORCH_CHECK(qtype == 12 || qtype == 14, "gguf_gemv: qtype must be 12 (Q4_K) or 14 (Q6_K), got ", qtype);
  TORCH_CHECK(x.is_cuda() && w.is_cuda() && out.is_cuda(), "gguf_gemv: x, w and out must be on a CUDA device");
  TORCH_CHECK(x.device() == w.device() && x.device() == out.device(), "gguf_gemv: tensors are on different devices");
  TORCH_CHECK(n > 0 && n <= (int64_t(1) << 31) - 1, "gguf_gemv: n must be in 1 .. 2^31 - 1, got ", n);
  TORCH_CHECK(k > 0 && k % 256 == 0 && k <= (int64_t(1) << 30), "gguf_gemv: k must be a positive multiple of 256, got ", k);
  const int64_t row_bytes = (k / 256) * (qtype == 12 ? 144 : 210);
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.numel() == n * row_bytes,
              "gguf_gemv: w must be contiguous uint8 of ", n * row_bytes, " bytes");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && x.size(0) >= 1 && x.is_contiguous(),
              "gguf_gemv: x must be a contiguous [M, ", k, "] tensor with M >= 1");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == n && out.stride(1) == 1 &&
                  out.stride(0) >= n && (out.scalar_type() == at::kFloat || out.scalar_type() == x.scalar_type()),
              "gguf_gemv: out must be a [", x.size(0), ", ", n, "] tensor of float32 or x's dtype whose rows are "
              "contiguous (a column slice of a wider output is fine)");
  TORCH_CHECK(warps == 0 || warps == 1 || warps == 2 || warps == 4, "gguf_gemv: warps must be 0 (auto), 1, 2 or 4, got ", warps);
  // x is read with 16-byte vector loads; a view that starts mid-vector gets a fresh (aligned) copy
  gguf_gemv_cuda(aligned16(x) ? x : x.clone(), w, qtype, n, k, out, warps);
}

TORCH_LIBRARY(kestrel_gguf, m) {
  m.def("gemv_out(Tensor x, Tensor w, int qtype, int n, int k, Tensor(a!) out, int warps=0) -> ()");
}

TORCH_LIBRARY_IMPL(kestrel_gguf, CUDA, m) { m.impl("gemv_out", &gemv_out); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kestrel GGUF K-quant GEMV (Q4_K, Q6_K): float32 arithmetic on ggml's blocks; the product itself is "
            "torch.ops.kestrel_gguf.gemv_out";
  m.def("plan", &gguf_gemv_plan, "[warps a block (from k alone), weight rows a block] for a weight of k columns and "
        "a chunk of m activation rows", pybind11::arg("k"), pybind11::arg("m") = 1, pybind11::arg("qtype") = 12);
}
