"""Running a quantized model on the CPU: the C++ decode loop (`CpuDecoder`), the token-by-token loop
around it, sampling, and the `generate` a CPU model gets from `quantkit.load`.

Stands on `quantkit.modules`, `quantkit.kernels` and `quantkit.core`.
"""
