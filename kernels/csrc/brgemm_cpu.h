// ATen's oneDNN micro-kernels (cpublas::brgemm) on bfloat16 pairs, where this torch has them and
// the CPU runs them (AMX tiles, else AVX-512 BF16): the check the kernels that call them share.
#pragma once
#include <ATen/native/CPUBlas.h>

#include <exception>
#include <vector>

// One small product, tried once per process.
inline bool bf16_pairs_run() {
  static const bool ok = [] {
    try {
      std::vector<at::BFloat16> a(32, 1.f), b(32 * 16, 1.f);
      std::vector<float> c(16);
      at::native::cpublas::brgemm(1, 16, 32, 32, 16, 16, false, a.data(), b.data(), c.data(), true);
      at::native::cpublas::brgemm_release(true);
      return c[0] == 32.f;
    } catch (const std::exception&) {
      return false;
    }
  }();
  return ok;
}
