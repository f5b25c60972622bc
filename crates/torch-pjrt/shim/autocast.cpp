// torch.autocast("tpu"): CUDA's op policy, registered for AutocastPrivateUse1.
//
// The op lists are PyTorch's own (the AT_FORALL_* macros of ATen/autocast_mode.h, the
// lists CUDA registers), so the policy follows PyTorch releases instead of a copy of it:
// matrix products and convolutions run in the autocast dtype, numerically sensitive ops
// (exp/log/pow, norms, losses, softmax, sums) in float32, mixed-dtype ops in the widest
// input type. Every other op falls through (registered in shim.cpp).

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/library.h>

namespace {

// CUDA refuses binary_cross_entropy under autocast (its input is a probability that
// float16 rounds badly); the same refusal, with the same remedy, here.
at::Tensor binary_cross_entropy_refused(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                        int64_t) {
  TORCH_CHECK(false,
              "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
              "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
              "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
              "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
              "safe to autocast.");
}

}  // namespace

#define TPU_LOW_PRECISION_FP(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
#define TPU_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
#define TPU_FP32_SET_OPT_DTYPE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
#define TPU_DIFFERENT_REDISPATCH_SIGNATURE(...) KERNEL_DIFFERENT_REDISPATCH_SIGNATURE_PRIVATEUSEONE(__VA_ARGS__)
#define TPU_PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)

void tpu_register_autocast_policy(torch::Library& m) {
  // The lists name their signatures with unqualified ATen types.
  using at::Scalar;
  using at::ScalarType;
  using at::IntArrayRef;
  using at::Tensor;
  AT_FORALL_LOWER_PRECISION_FP(TPU_LOW_PRECISION_FP)
  AT_FORALL_FP32(TPU_FP32)
  AT_FORALL_FP32_SET_OPT_DTYPE(TPU_FP32_SET_OPT_DTYPE)
  AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(TPU_DIFFERENT_REDISPATCH_SIGNATURE)
  AT_FORALL_PROMOTE(TPU_PROMOTE)
  // Registered by CUDA outside the shared lists.
  KERNEL_PRIVATEUSEONE(linalg_matrix_sqrth, fp32)
  m.impl(TORCH_SELECTIVE_NAME("aten::binary_cross_entropy"), TORCH_FN(binary_cross_entropy_refused));
}
