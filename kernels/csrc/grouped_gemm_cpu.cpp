// The grouped product of a mixture-of-experts layer (kernels/grouped_gemm.py: grouped_mm_ref) with
// the experts, not the rows of one expert, spread over the threads.
//
// In a decode step each expert owns a few rows (64 tokens x top 2 over 8 experts: 16 each), and a
// product of 16 rows split across threads spends much of its time in the threads' fork and join and
// in re-reading the expert's weights per thread: torch's grouped product does exactly that, one
// threaded product per expert. Here each (expert, column block) is one task on one thread, running
// ATen's single-threaded product (inside a parallel region ATen does not nest threads), so each
// expert's weights are streamed once, by one core. Columns are split only when there are fewer
// experts than twice the threads, to keep every thread busy.
#include "cpu_ops.h"

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>

#include <algorithm>
#include <cstdint>

torch::Tensor grouped_mm_rows(torch::Tensor a, torch::Tensor b, torch::Tensor offs) {
  TORCH_CHECK(a.dim() == 2 && b.dim() == 3 && a.size(1) == b.size(1), "grouped_mm_rows: a [N, K], b [E, K, M]");
  TORCH_CHECK(offs.dim() == 1 && offs.size(0) == b.size(0), "grouped_mm_rows: offs [E]");
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "grouped_mm_rows: a and b of one dtype");
  const int64_t experts = b.size(0), cols = b.size(2);
  auto out = torch::empty({a.size(0), cols}, a.options());
  const auto ends = offs.to(torch::kInt64).contiguous();
  const int64_t* end = ends.data_ptr<int64_t>();
  TORCH_CHECK(experts == 0 || end[experts - 1] == a.size(0), "grouped_mm_rows: offs must end at a's rows");
  const int64_t threads = at::get_num_threads();
  const int64_t splits = std::max<int64_t>(1, (2 * threads + experts - 1) / std::max<int64_t>(experts, 1));
  const int64_t width = (cols + splits - 1) / splits;
  // ATen ops on the pool's threads need the caller's modes (inference mode: `out` is an inference
  // tensor that only code in inference mode may write).
  const at::ThreadLocalState caller;
  at::parallel_for(0, experts * splits, 1, [&](int64_t first, int64_t last) {
    const at::ThreadLocalStateGuard modes(caller);
    for (int64_t task = first; task < last; ++task) {
      const int64_t e = task / splits, lo = (task % splits) * width, hi = std::min(cols, lo + width);
      const int64_t start = e ? end[e - 1] : 0;
      if (end[e] <= start || hi <= lo) continue;
      auto dst = out.slice(0, start, end[e]).slice(1, lo, hi);
      at::mm_out(dst, a.slice(0, start, end[e]), b[e].slice(1, lo, hi));
    }
  });
  return out;
}
