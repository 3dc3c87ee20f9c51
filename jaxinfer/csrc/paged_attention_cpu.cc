// Ragged paged attention for XLA:CPU, called through the XLA FFI (jaxinfer/cpu_paged_attention.py).
//
// The contract of pallas_kernels/paged_attention/reference.py's ragged_paged_attention_reference:
// write this step's K/V into their pages, then attend each packed query token causally over its
// own sequence's pages.
//   q      float32 [T, Hq, D]        out float32 [T, Hq, D]
//   k_new, v_new   [T, Hkv, D]       in the pages' dtype (float32 or bfloat16)
//   k_pages, v_pages [Hkv, P, S, D]  updated in place (the FFI call aliases them to its outputs)
//   page_tables int32 [B, W], cu_q_lens int32 [B + 1], kv_lens int32 [B]
// Token t belongs to the last sequence b with cu_q_lens[b] <= t (padding: t >= cu_q_lens[B]);
// its position is kv_lens[b] - q_len[b] + (t - cu_q_lens[b]); it sees positions 0..position
// (the last `sliding_window` of them when that is > 0). Padding tokens write nothing and attend
// to nothing (their output is 0, as the reference's).
//
// Why this exists: on XLA:CPU the plain-JAX path (pallas_kernels/paged_attention/cpu.py) is a
// scatter, a loop over token blocks and a loop over context chunks per layer: a few dozen small
// ops, each with its own dispatch, and a batch-1 decode pays for a block of 8 tokens. Here one
// call per layer writes the token's K/V and reads exactly its visible positions.
//
// Work (tokens x KV heads) is split over XLA's intra-op pool only when there is enough of it
// (a prefill); a decode step's few hundred positions run on the calling thread.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

inline float ToFloat(float x) { return x; }
inline float ToFloat(uint16_t bf16) {
  const uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

struct Geometry {
  int64_t num_tokens, num_q_heads, num_kv_heads, head_dim, num_pages, page_size, num_seqs, table_width;
};

// (sequence, position) of token t; position -1 for padding.
inline void TokenPosition(const int32_t* cu_q_lens, const int32_t* kv_lens, int64_t num_seqs, int64_t t,
                          int64_t* seq, int64_t* position) {
  *seq = num_seqs;
  *position = -1;
  if (num_seqs == 0 || t >= cu_q_lens[num_seqs]) return;
  int64_t b = 0;
  while (b + 1 < num_seqs && cu_q_lens[b + 1] <= t) ++b;
  if (cu_q_lens[b] > t) return;
  *seq = b;
  *position = static_cast<int64_t>(kv_lens[b]) - (cu_q_lens[b + 1] - cu_q_lens[b]) + (t - cu_q_lens[b]);
  if (*position < 0) *position = -1;
}

// The page holding `position` of sequence `seq`, or -1 when the table has none in range.
inline int64_t PageOf(const int32_t* page_tables, const Geometry& g, int64_t seq, int64_t position) {
  const int64_t index = position / g.page_size;
  if (index >= g.table_width) return -1;
  const int64_t page = page_tables[seq * g.table_width + index];
  return (page >= 0 && page < g.num_pages) ? page : -1;
}

template <typename T>
void WriteKv(const T* k_new, const T* v_new, T* k_pages, T* v_pages, const int32_t* page_tables,
             const int32_t* cu_q_lens, const int32_t* kv_lens, const Geometry& g) {
  const int64_t d = g.head_dim;
  for (int64_t t = 0; t < g.num_tokens; ++t) {
    int64_t seq, position;
    TokenPosition(cu_q_lens, kv_lens, g.num_seqs, t, &seq, &position);
    if (position < 0) continue;
    const int64_t page = PageOf(page_tables, g, seq, position);
    if (page < 0) continue;  // the reference's scatter drops an out-of-range slot
    for (int64_t h = 0; h < g.num_kv_heads; ++h) {
      const int64_t slot = ((h * g.num_pages + page) * g.page_size + position % g.page_size) * d;
      std::memcpy(k_pages + slot, k_new + (t * g.num_kv_heads + h) * d, d * sizeof(T));
      std::memcpy(v_pages + slot, v_new + (t * g.num_kv_heads + h) * d, d * sizeof(T));
    }
  }
}

// Attention of token t's query heads of KV head h. `scores` holds group x (position + 1) floats.
template <typename T>
void AttendOne(const float* q, const T* k_pages, const T* v_pages, const int32_t* page_tables,
               const int32_t* cu_q_lens, const int32_t* kv_lens, const Geometry& g, float sm_scale,
               int64_t sliding_window, float soft_cap, int64_t t, int64_t h, float* scores, float* out) {
  const int64_t d = g.head_dim, group = g.num_q_heads / g.num_kv_heads;
  float* out_h = out + (t * g.num_q_heads + h * group) * d;
  std::fill(out_h, out_h + group * d, 0.0f);
  int64_t seq, position;
  TokenPosition(cu_q_lens, kv_lens, g.num_seqs, t, &seq, &position);
  if (position < 0) return;
  const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, position - sliding_window + 1) : 0;
  const int64_t len = position + 1 - first;
  const float* q_h = q + (t * g.num_q_heads + h * group) * d;
  std::vector<float> max_score(group, -std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < len; ++i) {
    const int64_t p = first + i;
    const int64_t page = PageOf(page_tables, g, seq, p);
    if (page < 0) {  // no page: the position stays invisible
      for (int64_t j = 0; j < group; ++j) scores[j * len + i] = -std::numeric_limits<float>::infinity();
      continue;
    }
    const T* k = k_pages + ((h * g.num_pages + page) * g.page_size + p % g.page_size) * d;
    for (int64_t j = 0; j < group; ++j) {
      const float* qj = q_h + j * d;
      float dot = 0.0f;
      for (int64_t e = 0; e < d; ++e) dot += qj[e] * ToFloat(k[e]);
      float s = dot * sm_scale;
      if (soft_cap > 0.0f) s = soft_cap * std::tanh(s / soft_cap);
      scores[j * len + i] = s;
      max_score[j] = std::max(max_score[j], s);
    }
  }
  std::vector<float> denom(group, 0.0f);
  for (int64_t j = 0; j < group; ++j) {
    if (!std::isfinite(max_score[j])) continue;  // nothing visible: the output stays 0
    for (int64_t i = 0; i < len; ++i) {
      const float w = std::exp(scores[j * len + i] - max_score[j]);  // exp(-inf) = 0 for a missing page
      scores[j * len + i] = w;
      denom[j] += w;
    }
  }
  for (int64_t i = 0; i < len; ++i) {
    const int64_t p = first + i;
    const int64_t page = PageOf(page_tables, g, seq, p);
    if (page < 0) continue;
    const T* v = v_pages + ((h * g.num_pages + page) * g.page_size + p % g.page_size) * d;
    for (int64_t j = 0; j < group; ++j) {
      if (!std::isfinite(max_score[j])) continue;
      const float w = scores[j * len + i];
      float* o = out_h + j * d;
      for (int64_t e = 0; e < d; ++e) o[e] += w * ToFloat(v[e]);
    }
  }
  for (int64_t j = 0; j < group; ++j) {
    if (denom[j] > 0.0f) {
      const float inv = 1.0f / denom[j];
      for (int64_t e = 0; e < d; ++e) out_h[j * d + e] *= inv;
    }
  }
}

template <typename T>
void Run(ffi::ThreadPool& pool, const float* q, const T* k_new, const T* v_new, T* k_pages, T* v_pages,
         const int32_t* page_tables, const int32_t* cu_q_lens, const int32_t* kv_lens, float* out,
         const Geometry& g, float sm_scale, int64_t sliding_window, float soft_cap, int64_t max_threads) {
  WriteKv(k_new, v_new, k_pages, v_pages, page_tables, cu_q_lens, kv_lens, g);
  // Work items: (token, KV head); the scratch of a share holds the longest visible context.
  int64_t longest = 0, positions = 0;
  for (int64_t t = 0; t < g.num_tokens; ++t) {
    int64_t seq, position;
    TokenPosition(cu_q_lens, kv_lens, g.num_seqs, t, &seq, &position);
    longest = std::max(longest, position + 1);
    positions += position + 1;
  }
  const int64_t group = g.num_q_heads / g.num_kv_heads;
  const int64_t items = g.num_tokens * g.num_kv_heads;
  const size_t scratch = static_cast<size_t>(std::max<int64_t>(1, group * longest));
  // Below ~256k multiply-adds the hand-off to another thread costs more than it saves.
  const int64_t work = positions * g.num_q_heads * g.head_dim * 2;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), max_threads));
  if (threads == 1 || items == 1 || work < (256 << 10)) {
    std::vector<float> scores(scratch);
    for (int64_t item = 0; item < items; ++item) {
      AttendOne(q, k_pages, v_pages, page_tables, cu_q_lens, kv_lens, g, sm_scale, sliding_window, soft_cap,
                item / g.num_kv_heads, item % g.num_kv_heads, scores.data(), out);
    }
    return;
  }
  // Items are claimed a chunk at a time from a shared counter (as in int8_matmul_cpu.cc), never
  // dealt out as fixed shares. The caller is often one of the pool's own threads: with fixed
  // shares, two calls running at once (the two devices of a tensor-parallel CPU run) each queued
  // a share, took both of a 2-core pool's threads and waited on their latches forever (2 hangs in
  // 34 runs of tests/test_static_activation_checkpoint.py's check under CPU load; none in 80
  // since). Now the caller runs every chunk no helper has started and waits only for chunks a
  // running helper has claimed. Dynamic chunks also balance causal prefill, whose later tokens
  // see more positions: a 2048-token prefill takes 137 ms against 189 with halves. The state
  // lives on the heap: a helper that starts after the call returned finds no chunk left and
  // touches nothing else.
  struct Chunks {
    std::atomic<int64_t> next{0}, done{0};
    int64_t count = 0;
  };
  const int64_t chunk_items = std::max<int64_t>(1, items / (threads * 8));
  auto chunks = std::make_shared<Chunks>();
  chunks->count = (items + chunk_items - 1) / chunk_items;
  auto attend = [=] {
    std::vector<float> scores;
    for (int64_t c = chunks->next.fetch_add(1); c < chunks->count; c = chunks->next.fetch_add(1)) {
      if (scores.empty()) scores.resize(scratch);
      for (int64_t item = c * chunk_items, end = std::min(items, item + chunk_items); item < end; ++item) {
        AttendOne(q, k_pages, v_pages, page_tables, cu_q_lens, kv_lens, g, sm_scale, sliding_window, soft_cap,
                  item / g.num_kv_heads, item % g.num_kv_heads, scores.data(), out);
      }
      if (chunks->done.fetch_add(1) + 1 == chunks->count) chunks->done.notify_all();
    }
  };
  for (int64_t s = 1; s < threads; ++s) pool.Schedule([attend] { attend(); });
  attend();
  for (int64_t done = chunks->done.load(); done < chunks->count; done = chunks->done.load()) {
    chunks->done.wait(done);
  }
}

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_new,
                              ffi::AnyBuffer v_new, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                              ffi::Buffer<ffi::S32> page_tables, ffi::Buffer<ffi::S32> cu_q_lens,
                              ffi::Buffer<ffi::S32> kv_lens, ffi::ResultBuffer<ffi::F32> out,
                              ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out, float sm_scale,
                              int64_t sliding_window, float soft_cap, int64_t max_threads) {
  auto qd = q.dimensions(), kd = k_new.dimensions(), pd = k_pages.dimensions(), td = page_tables.dimensions();
  if (qd.size() != 3 || kd.size() != 3 || pd.size() != 4 || td.size() != 2 || cu_q_lens.dimensions().size() != 1 ||
      kv_lens.dimensions().size() != 1) {
    return ffi::Error::InvalidArgument("paged_attention: q [T, Hq, D], k_new [T, Hkv, D], pages [Hkv, P, S, D], "
                                       "page_tables [B, W], cu_q_lens [B + 1], kv_lens [B] expected");
  }
  const Geometry g{qd[0], qd[1], pd[0], qd[2], pd[1], pd[2], td[0], td[1]};
  if (kd[0] != g.num_tokens || kd[1] != g.num_kv_heads || kd[2] != g.head_dim || pd[3] != g.head_dim ||
      g.num_q_heads % g.num_kv_heads != 0 || cu_q_lens.dimensions()[0] != g.num_seqs + 1 ||
      kv_lens.dimensions()[0] != g.num_seqs || k_new.element_type() != k_pages.element_type() ||
      v_new.element_type() != k_pages.element_type() || v_pages.element_type() != k_pages.element_type()) {
    return ffi::Error::InvalidArgument("paged_attention: the shapes or dtypes of q, k_new, v_new and the pages do not fit");
  }
  // The call aliases the pages to k_out / v_out; copy only if XLA handed over separate buffers.
  const size_t page_bytes = k_pages.size_bytes();
  if (k_out->untyped_data() != k_pages.untyped_data()) std::memcpy(k_out->untyped_data(), k_pages.untyped_data(), page_bytes);
  if (v_out->untyped_data() != v_pages.untyped_data()) std::memcpy(v_out->untyped_data(), v_pages.untyped_data(), page_bytes);
  const float cap = soft_cap > 0.0f ? soft_cap : 0.0f;
  switch (k_pages.element_type()) {
    case ffi::DataType::F32:
      Run(pool, q.typed_data(), static_cast<const float*>(k_new.untyped_data()),
          static_cast<const float*>(v_new.untyped_data()), static_cast<float*>(k_out->untyped_data()),
          static_cast<float*>(v_out->untyped_data()), page_tables.typed_data(), cu_q_lens.typed_data(),
          kv_lens.typed_data(), out->typed_data(), g, sm_scale, sliding_window, cap, max_threads);
      break;
    case ffi::DataType::BF16:
      Run(pool, q.typed_data(), static_cast<const uint16_t*>(k_new.untyped_data()),
          static_cast<const uint16_t*>(v_new.untyped_data()), static_cast<uint16_t*>(k_out->untyped_data()),
          static_cast<uint16_t*>(v_out->untyped_data()), page_tables.typed_data(), cu_q_lens.typed_data(),
          kv_lens.typed_data(), out->typed_data(), g, sm_scale, sliding_window, cap, max_threads);
      break;
    default:
      return ffi::Error::InvalidArgument("paged_attention: pages must be float32 or bfloat16");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferPagedAttentionCpu, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::AnyBuffer>()         // k_new
                                  .Arg<ffi::AnyBuffer>()         // v_new
                                  .Arg<ffi::AnyBuffer>()         // k_pages
                                  .Arg<ffi::AnyBuffer>()         // v_pages
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // cu_q_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Ret<ffi::AnyBuffer>()         // k_pages, aliased
                                  .Ret<ffi::AnyBuffer>()         // v_pages, aliased
                                  .Attr<float>("sm_scale")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("max_threads"));
