// GPTQ's column walk inside one block of columns, on CPU (quantkit.algorithms.gptq walks the blocks).
//
// The block's weights are held transposed, w [B, N]: row i is the block's i-th column (in visit order),
// contiguous over the N output rows. For each column i in [start, stop):
//   q[i]   = the column rounded onto its group's grid (scale / zero / minimum rows of that group);
//   err[i] = (w[i] - dequantized q[i]) / u[i, i];
//   w[j]  -= u[i, j] * err[i]   for every later column j of the block (i < j < B).
// Output rows are independent, so threads split N into slices that stay in cache through the whole
// walk (the PyTorch loop it replaces streams the block's [B, N] rows from memory once per column).
//
// Numerics: the same IEEE operations in the same order as the pure-PyTorch walk (gptq._walk_columns_reference),
// so both give bit-identical levels: the products u[i, j] * err[i] are rounded before the subtraction (no
// fused multiply-add: contraction is off in this file), rounding is to nearest even (nearbyint under the
// default rounding mode, as torch.round).
#pragma GCC optimize("fp-contract=off")

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

// How a column's weights become levels (gptq.COLUMN_MODES).
enum Mode : int64_t {
  INT_SYMMETRIC = 0,   // q = clamp(round(w / s), qmin, qmax);          deq = q * s
  INT_ZERO_POINT = 1,  // q = clamp(round(w / s) + z, qmin, qmax);      deq = (q - z) * s
  GRID_OFFSET = 2,     // q = clamp(round(w / s) + offset, 0, qmax);   deq = q * s - m   (0 where s == 0)
  GRID_MINIMUM = 3,    // q = clamp(round((w + m) / s), 0, qmax);       deq = q * s - m   (0 where s == 0)
  GRID_VALUES = 4,     // q = nearest(values, (w + m) / s);              deq = values[q] * s - m
                       //   (a non-uniform grid, GGUF's IQ4_NL / IQ4_XS; the value nearest 0 where s == 0)
};

// ggml's best_index_int8 (ggml-quants.c) over n ascending values: the index of the value nearest x, a tie going
// to the upper one; below the lowest 0, above the highest (or NaN) n - 1.
inline int64_t best_index(const float* val, int64_t n, float x) {
  if (x <= val[0]) return 0;
  if (x >= val[n - 1]) return n - 1;
  int64_t ml = 0, mu = n - 1;
  while (mu - ml > 1) {
    const int64_t mav = (ml + mu) / 2;
    if (x < val[mav]) mu = mav; else ml = mav;
  }
  return x - val[mu - 1] < val[mu] - x ? mu - 1 : mu;
}

constexpr int64_t SLICE = 256;  // output rows per task: a [B, SLICE] fp32 slice of w, q and err is 3 x 128 KiB at B = 128

template <int64_t MODE>
void walk_slice(float* w, const float* u, int64_t u_row, int64_t u_col, float* q, float* err, const float* scale,
                const float* zero, const float* minimum, const float* values, int64_t n_values, const int64_t* group,
                int64_t n, int64_t rows, int64_t start, int64_t stop, int64_t n0, int64_t n1, float qmin, float qmax,
                float offset) {
  for (int64_t i = start; i < stop; ++i) {
    const int64_t g = group[i] * n;
    const float* s = scale + g;
    const float d = u[i * u_row + i * u_col];
    float* wi = w + i * n;
    float* qi = q + i * n;
    float* ei = err + i * n;
    for (int64_t c = n0; c < n1; ++c) {
      const float x = wi[c];
      float level, deq;
      if constexpr (MODE == INT_SYMMETRIC) {
        level = std::min(std::max(std::nearbyint(x / s[c]), qmin), qmax);
        deq = level * s[c];
      } else if constexpr (MODE == INT_ZERO_POINT) {
        const float z = zero[g + c];
        level = std::min(std::max(std::nearbyint(x / s[c]) + z, qmin), qmax);
        deq = (level - z) * s[c];
      } else if constexpr (MODE == GRID_VALUES) {
        const float m = minimum[g + c];
        const int64_t idx = best_index(values, n_values, s[c] != 0.0f ? (x + m) / s[c] : 0.0f);
        level = static_cast<float>(idx);
        deq = values[idx] * s[c] - m;
      } else {
        const float m = minimum[g + c];
        const float safe = s[c] != 0.0f ? s[c] : 1.0f;
        const float r = MODE == GRID_OFFSET ? std::nearbyint(x / safe) + offset : std::nearbyint((x + m) / safe);
        level = s[c] != 0.0f ? std::min(std::max(r, 0.0f), qmax) : 0.0f;
        deq = level * s[c] - m;
      }
      qi[c] = level;
      ei[c] = (x - deq) / d;
    }
    for (int64_t j = i + 1; j < rows; ++j) {
      const float f = u[i * u_row + j * u_col];
      float* wj = w + j * n;
      for (int64_t c = n0; c < n1; ++c) {
        const float t = f * ei[c];
        wj[c] = wj[c] - t;
      }
    }
  }
}

void gptq_walk(at::Tensor w, const at::Tensor& u, at::Tensor q, at::Tensor err, const at::Tensor& scale,
               const c10::optional<at::Tensor>& zero, const c10::optional<at::Tensor>& minimum,
               const at::Tensor& group, int64_t start, int64_t stop, int64_t mode, double qmin, double qmax,
               double offset, const c10::optional<at::Tensor>& values) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.is_contiguous(), "gptq_walk: w must be contiguous fp32 [B, N]");
  const int64_t rows = w.size(0), n = w.size(1);
  TORCH_CHECK(u.dim() == 2 && u.scalar_type() == at::kFloat && u.size(0) == rows && u.size(1) == rows,
              "gptq_walk: u must be fp32 [B, B]");
  for (const at::Tensor* t : {&q, &err})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->size(0) == rows && t->size(1) == n,
                "gptq_walk: q and err must be contiguous fp32 [B, N]");
  TORCH_CHECK(scale.dim() == 2 && scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.size(1) == n,
              "gptq_walk: scale must be contiguous fp32 [G, N]");
  TORCH_CHECK(group.scalar_type() == at::kLong && group.is_contiguous() && group.numel() >= rows, "gptq_walk: group must be int64 [B]");
  TORCH_CHECK(0 <= start && start <= stop && stop <= rows, "gptq_walk: need 0 <= start <= stop <= B");
  TORCH_CHECK(mode >= INT_SYMMETRIC && mode <= GRID_VALUES, "gptq_walk: unknown mode ", mode);
  const int64_t* grp = group.data_ptr<int64_t>();
  for (int64_t i = start; i < stop; ++i) TORCH_CHECK(0 <= grp[i] && grp[i] < scale.size(0), "gptq_walk: group index out of range");
  const float* zp = nullptr;
  const float* mp = nullptr;
  if (mode == INT_ZERO_POINT) {
    TORCH_CHECK(zero.has_value() && zero->scalar_type() == at::kFloat && zero->is_contiguous() && zero->sizes() == scale.sizes(),
                "gptq_walk: a zero point needs zero fp32 [G, N]");
    zp = zero->data_ptr<float>();
  }
  const float* vp = nullptr;
  int64_t n_values = 0;
  if (mode == GRID_VALUES) {
    TORCH_CHECK(values.has_value() && values->dim() == 1 && values->scalar_type() == at::kFloat &&
                    values->is_contiguous() && values->numel() >= 2,
                "gptq_walk: a non-uniform grid needs values fp32 [L] (ascending)");
    vp = values->data_ptr<float>();
    n_values = values->numel();
    for (int64_t i = 1; i < n_values; ++i) TORCH_CHECK(vp[i - 1] < vp[i], "gptq_walk: values must ascend");
  }
  if (mode == GRID_OFFSET || mode == GRID_MINIMUM || mode == GRID_VALUES) {
    TORCH_CHECK(minimum.has_value() && minimum->scalar_type() == at::kFloat && minimum->is_contiguous() &&
                    minimum->sizes() == scale.sizes(),
                "gptq_walk: a grid needs minimum fp32 [G, N]");
    mp = minimum->data_ptr<float>();
  }
  float* wp = w.data_ptr<float>();
  const float* up = u.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  float* ep = err.data_ptr<float>();
  const float* sp = scale.data_ptr<float>();
  const float lo = static_cast<float>(qmin), hi = static_cast<float>(qmax), off = static_cast<float>(offset);
  const int64_t ur = u.stride(0), uc = u.stride(1);
  at::parallel_for(0, (n + SLICE - 1) / SLICE, 1, [&](int64_t t0, int64_t t1) {
    const int64_t n0 = t0 * SLICE, n1 = std::min(n, t1 * SLICE);
    switch (mode) {
      case INT_SYMMETRIC:
        walk_slice<INT_SYMMETRIC>(wp, up, ur, uc, qp, ep, sp, zp, mp, vp, n_values, grp, n, rows, start, stop, n0, n1, lo, hi, off);
        break;
      case INT_ZERO_POINT:
        walk_slice<INT_ZERO_POINT>(wp, up, ur, uc, qp, ep, sp, zp, mp, vp, n_values, grp, n, rows, start, stop, n0, n1, lo, hi, off);
        break;
      case GRID_VALUES:
        walk_slice<GRID_VALUES>(wp, up, ur, uc, qp, ep, sp, zp, mp, vp, n_values, grp, n, rows, start, stop, n0, n1, lo, hi, off);
        break;
      case GRID_OFFSET:
        walk_slice<GRID_OFFSET>(wp, up, ur, uc, qp, ep, sp, zp, mp, vp, n_values, grp, n, rows, start, stop, n0, n1, lo, hi, off);
        break;
      default:
        walk_slice<GRID_MINIMUM>(wp, up, ur, uc, qp, ep, sp, zp, mp, vp, n_values, grp, n, rows, start, stop, n0, n1, lo, hi, off);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(quantkit, m) {
  m.def("gptq_walk(Tensor(a!) w, Tensor u, Tensor(b!) q, Tensor(c!) err, Tensor scale, Tensor? zero, Tensor? minimum, "
        "Tensor group, int start, int stop, int mode, float qmin, float qmax, float offset, Tensor? values=None) -> ()");
}

TORCH_LIBRARY_IMPL(quantkit, CPU, m) { m.impl("gptq_walk", &gptq_walk); }
