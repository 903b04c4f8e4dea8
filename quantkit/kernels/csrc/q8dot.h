// quantkit's CPU WNA16 linear with int8-rounded activations (wna16_q8dot.cpp), for the other C++ kernels.
#pragma once
#include <ATen/core/Tensor.h>

namespace quantkit {

// y = x @ W^T (+ bias) with W in the cpu_q8 layout: x fp32/bf16/fp16 [M, K] -> [M, N] in x's dtype.
at::Tensor wna16_cpu_q8dot(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                           const c10::optional<at::Tensor>& zero, const c10::optional<at::Tensor>& bias);

}  // namespace quantkit
