// The instruction-set level the CPU kernels run at, detected once per process (cpuid), shared by the
// quantized linear (wna16_q8dot.cpp) and the decode attention (decode_attention_cpu.cpp), so that one
// forced level means the same path in both.
#pragma once
#include <cstdint>

namespace quantkit {

enum Isa : int64_t { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_AVX512_BF16 = 3, ISA_AVX512_BF16_VBMI = 4 };

// AVX-512: F, BW, DQ, VL and VNNI; AVX-512 BF16: those and AVX512_BF16 (bf16 dot products: the decode
// attention's bf16 / fp8 caches; the quantized linear runs its AVX-512 code there); AVX-512 BF16 VBMI: those
// and AVX512_VBMI (byte permutes: the decode attention's fp8 cache read without widening shuffles; Zen 4,
// Sapphire Rapids and later, not Cooper Lake); AVX2: AVX2, FMA and F16C (fp16 / fp8 conversion; every AVX2
// CPU has it).
inline int64_t detected_isa() {
  static const int64_t isa = [] {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512vnni"))
      return !__builtin_cpu_supports("avx512bf16")  ? (int64_t)ISA_AVX512
             : __builtin_cpu_supports("avx512vbmi") ? (int64_t)ISA_AVX512_BF16_VBMI
                                                    : (int64_t)ISA_AVX512_BF16;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
      return (int64_t)ISA_AVX2;
#endif
    return (int64_t)ISA_SCALAR;
  }();
  return isa;
}

}  // namespace quantkit
