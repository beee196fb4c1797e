"""A C++ paged attention for short queries (decode, speculative verify) on CPU.

The torch reference must gather every sequence's K/V into a padded tensor before SDPA can read it: per layer
that copies the whole KV of the batch and reads it twice more. This kernel walks the block tables and reads
each cached K and V row once, in float32 accumulation, one (sequence, KV head) pair per task on torch's own
thread pool. It is compiled on first use with torch's cpp_extension (a C++ compiler is needed; without one
the reference's gather + SDPA path is used instead).

Status: exact against float64 dense attention (tests/test_kernels.py), but not yet measured on a quiet
machine, so the CPU default stays the reference; select it with attention_backend="cpu".
"""

from __future__ import annotations

import logging
import threading

import torch

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>
#include <algorithm>

template <typename scalar_t>
static void run(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                const torch::Tensor& query_start_loc, const torch::Tensor& seq_ids, double scale,
                torch::Tensor& out) {
  const int64_t num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t table_stride = block_tables.size(1);
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const scalar_t* kp = k_cache.data_ptr<scalar_t>();
  const scalar_t* vp = v_cache.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int64_t* ids = seq_ids.data_ptr<int64_t>();
  const int64_t q_tok = q.stride(0), q_head = q.stride(1);
  const int64_t o_tok = out.stride(0), o_head = out.stride(1);
  const int64_t row = num_kv_heads * head_dim;  // one token's K (or V) in the cache
  const int64_t num_tasks = seq_ids.size(0) * num_kv_heads;

  at::parallel_for(0, num_tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf, scores, acc;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = ids[task / num_kv_heads], h = task % num_kv_heads;
      const int64_t q0 = qsl[s], q_len = qsl[s + 1] - q0, len = lens[s];
      const int64_t rows = q_len * group;  // every query token x every query head of this KV head
      qf.assign(rows * head_dim, 0.f);
      for (int64_t i = 0; i < q_len; ++i)
        for (int64_t g = 0; g < group; ++g) {
          const scalar_t* src = qp + (q0 + i) * q_tok + (h * group + g) * q_head;
          float* dst = qf.data() + (i * group + g) * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<float>(src[d]) * (float)scale;
        }
      scores.assign(rows * len, -INFINITY);
      const int32_t* table = tables + s * table_stride;
      for (int64_t pos = 0; pos < len; ++pos) {
        const scalar_t* krow = kp + ((int64_t)table[pos / block_size] * block_size + pos % block_size) * row
                               + h * head_dim;
        float kf[512];
        for (int64_t d = 0; d < head_dim; ++d) kf[d] = static_cast<float>(krow[d]);
        // query token i sits at position len - q_len + i and sees positions up to its own
        const int64_t first_i = std::max<int64_t>(0, pos - (len - q_len));
        for (int64_t i = first_i; i < q_len; ++i)
          for (int64_t g = 0; g < group; ++g) {
            const float* qr = qf.data() + (i * group + g) * head_dim;
            float dot = 0.f;
            for (int64_t d = 0; d < head_dim; ++d) dot += qr[d] * kf[d];
            scores[(i * group + g) * len + pos] = dot;
          }
      }
      for (int64_t r = 0; r < rows; ++r) {
        float* sr = scores.data() + r * len;
        float mx = -INFINITY;
        for (int64_t p = 0; p < len; ++p) mx = std::max(mx, sr[p]);
        float sum = 0.f;
        for (int64_t p = 0; p < len; ++p) { sr[p] = std::exp(sr[p] - mx); sum += sr[p]; }
        const float inv = 1.f / sum;
        for (int64_t p = 0; p < len; ++p) sr[p] *= inv;
      }
      acc.assign(rows * head_dim, 0.f);
      for (int64_t pos = 0; pos < len; ++pos) {
        const scalar_t* vrow = vp + ((int64_t)table[pos / block_size] * block_size + pos % block_size) * row
                               + h * head_dim;
        float vf[512];
        for (int64_t d = 0; d < head_dim; ++d) vf[d] = static_cast<float>(vrow[d]);
        const int64_t first_i = std::max<int64_t>(0, pos - (len - q_len));
        for (int64_t r = first_i * group; r < rows; ++r) {
          const float p = scores[r * len + pos];
          float* ar = acc.data() + r * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) ar[d] += p * vf[d];
        }
      }
      for (int64_t i = 0; i < q_len; ++i)
        for (int64_t g = 0; g < group; ++g) {
          scalar_t* dst = op + (q0 + i) * o_tok + (h * group + g) * o_head;
          const float* a = acc.data() + (i * group + g) * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(a[d]);
        }
    }
  });
}

void paged_attention_short(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor query_start_loc,
                           torch::Tensor seq_ids, double scale, torch::Tensor out) {
  TORCH_CHECK(q.size(2) <= 512, "head_dim above 512");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "head_dim must be the innermost dimension");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention_short", [&] {
    run<scalar_t>(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, seq_ids, scale, out);
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention_short", &paged_attention_short);
}
"""

_lock = threading.Lock()
_module: object | None = None
_failed = False


def load() -> object | None:
    """The compiled extension, or None when it cannot be built here (the caller falls back)."""
    global _module, _failed
    with _lock:
        if _module is None and not _failed:
            try:
                from torch.utils.cpp_extension import load_inline

                _module = load_inline(
                    name="specserve_cpu_paged_attention",
                    cpp_sources=_SOURCE,
                    # reassociation lets the dot products vectorise; no -ffast-math, whose
                    # finite-math assumption would break the -inf causal mask
                    extra_cflags=[
                        "-O3",
                        "-march=native",
                        "-fassociative-math",
                        "-fno-signed-zeros",
                        "-fno-trapping-math",
                        "-fno-math-errno",
                    ],
                    verbose=False,
                )
            except Exception as exc:  # no compiler, no headers: the gather + SDPA path still works
                log.warning("C++ paged attention unavailable (%s); using gather + SDPA", exc)
                _failed = True
        return _module


def paged_attention_short(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_ids: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> None:
    """Attention for the sequences in seq_ids (int64), written into out; the module must be loaded."""
    _module.paged_attention_short(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, seq_ids, scale, out
    )
