// Weight-only int8 matmul for XLA:CPU, called through the XLA FFI (jaxinfer/cpu_int8_matmul.py).
//
// One call computes several projections of the same input (q/k/v, gate/up):
//   y_p[m, n] = scale_p[n] * sum_k x[m, k] * w_p[n, k]
// x float32 [M, K]; for each projection p, w_p int8 [N_p, K] (both contracting on their minor
// axis), scale_p float32 [N_p], y_p float32 [M, N_p].
//
// Why this exists: XLA:CPU has no int8 weight-only dot. It converts the whole int8 weight to
// float32 in a separate loop fusion and then runs a float32 dot over the copy, so an int8 weight
// costs more memory traffic than a float32 one (1 byte read + 4 written + 4 read per element).
// Here a group of weight rows is widened in registers (AVX-512: 16 int8 -> 16 float32 per
// instruction pair) and used by every row of x while it sits in L1, so the weight is read from
// memory once, as int8, whatever M is; x (at most a few rows at decode) stays in L1/L2.
//
// Register blocking: a tile of up to 4 rows of x times a group of weight rows (8 at one row of
// x, 4 at more) keeps every accumulator in a register, and several independent accumulator chains
// hide the fused multiply-add's latency. The K tail (K not a multiple of 16) uses masked loads.
//
// Work is split over the output rows of all projections together (so three small projections
// balance as one), in chunks claimed by at most `max_threads` threads of XLA's intra-op pool
// (the calling thread among them) as each becomes free.

#include <algorithm>
#include <cstdint>
#include <atomic>
#include <memory>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define JAXINFER_AVX512 1
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Projection {
  const int8_t* w;     // [n, k]
  const float* scale;  // [n]
  float* y;            // [m, n]
  int64_t n;
};

// Rows a thread claims at a time: ~64 KiB of int8 weight (whole groups of 8 rows), long enough
// that claiming costs nothing, short enough that a late helper still finds work.
constexpr int64_t kChunkBytes = 64 << 10;

#ifdef JAXINFER_AVX512

constexpr int64_t kLanes = 16;

// y[r, j..j+G) for the R rows of x starting at x (row stride k; y row stride n).
template <int R, int G>
inline void Tile(const float* __restrict x, const int8_t* __restrict w, const float* __restrict scale,
                 float* __restrict y, int64_t k, int64_t n, int64_t j) {
  __m512 acc[R][G];
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < G; ++q) acc[r][q] = _mm512_setzero_ps();
  const int8_t* __restrict rows = w + j * k;
  int64_t k0 = 0;
  for (; k0 + kLanes <= k; k0 += kLanes) {
    __m512 xv[R];
    for (int r = 0; r < R; ++r) xv[r] = _mm512_loadu_ps(x + r * k + k0);
    // The group's rows are one contiguous block; fetch the next group's block while this one is
    // consumed (G rows x 16 bytes a step: G/4 cache lines of the next block per step).
    for (int l = 0; l < G / 4; ++l) {
      _mm_prefetch(reinterpret_cast<const char*>(rows + G * k + (k0 / kLanes) * G * 16 + l * 64), _MM_HINT_T0);
    }
    for (int q = 0; q < G; ++q) {
      const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows + q * k + k0));
      const __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(packed));
      for (int r = 0; r < R; ++r) acc[r][q] = _mm512_fmadd_ps(xv[r], wv, acc[r][q]);
    }
  }
  if (k0 < k) {  // the tail: masked loads read nothing past the row
    const __mmask16 mask = static_cast<__mmask16>((1u << (k - k0)) - 1u);
    __m512 xv[R];
    for (int r = 0; r < R; ++r) xv[r] = _mm512_maskz_loadu_ps(mask, x + r * k + k0);
    for (int q = 0; q < G; ++q) {
      const __m128i packed = _mm_maskz_loadu_epi8(mask, rows + q * k + k0);
      const __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(packed));
      for (int r = 0; r < R; ++r) acc[r][q] = _mm512_fmadd_ps(xv[r], wv, acc[r][q]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < G; ++q) y[r * n + j + q] = _mm512_reduce_add_ps(acc[r][q]) * scale[j + q];
}

#else  // portable fallback: the compiler vectorises what it can

template <int R, int G>
inline void Tile(const float* __restrict x, const int8_t* __restrict w, const float* __restrict scale,
                 float* __restrict y, int64_t k, int64_t n, int64_t j) {
  for (int r = 0; r < R; ++r) {
    for (int q = 0; q < G; ++q) {
      const int8_t* __restrict row = w + (j + q) * k;
      float total = 0.0f;
      for (int64_t i = 0; i < k; ++i) total += x[r * k + i] * static_cast<float>(row[i]);
      y[r * n + j + q] = total * scale[j + q];
    }
  }
}

#endif

// All row tiles of x for the weight rows [j, j + G): the group is read from memory once and
// stays in L1 while each tile of x uses it.
template <int G>
inline void Group(const float* x, int64_t m, int64_t k, const Projection& p, int64_t j) {
  int64_t r = 0;
  for (; r + 4 <= m; r += 4) Tile<4, G>(x + r * k, p.w, p.scale, p.y + r * p.n, k, p.n, j);
  switch (m - r) {
    case 3: Tile<3, G>(x + r * k, p.w, p.scale, p.y + r * p.n, k, p.n, j); break;
    case 2: Tile<2, G>(x + r * k, p.w, p.scale, p.y + r * p.n, k, p.n, j); break;
    case 1: Tile<1, G>(x + r * k, p.w, p.scale, p.y + r * p.n, k, p.n, j); break;
    default: break;
  }
}

// Output rows [begin, end) of one projection.
void Rows(const float* x, int64_t m, int64_t k, const Projection& p, int64_t begin, int64_t end) {
  int64_t j = begin;
  if (m == 1) {  // 8 independent accumulators: one row of x leaves registers for them
    for (; j + 8 <= end; j += 8) Group<8>(x, m, k, p, j);
  }
  for (; j + 4 <= end; j += 4) Group<4>(x, m, k, p, j);
  for (; j < end; ++j) Group<1>(x, m, k, p, j);
}

// Rows [begin, end) of the projections' output rows laid end to end.
void Share(const float* x, int64_t m, int64_t k, const std::vector<Projection>& projections, int64_t begin,
           int64_t end) {
  int64_t offset = 0;
  for (const Projection& p : projections) {
    const int64_t lo = std::max(begin, offset), hi = std::min(end, offset + p.n);
    if (lo < hi) Rows(x, m, k, p, lo - offset, hi - offset);
    offset += p.n;
  }
}

ffi::Error Int8MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs weights,
                          ffi::RemainingRets outputs, int64_t max_threads) {
  auto x_dims = x.dimensions();
  if (x_dims.size() != 2) return ffi::Error::InvalidArgument("int8_matmul: x [M, K] expected");
  const int64_t m = x_dims[0], k = x_dims[1];
  if (weights.size() % 2 != 0 || weights.size() / 2 != outputs.size() || outputs.size() == 0) {
    return ffi::Error::InvalidArgument("int8_matmul: (payload, scale) pairs and one output per pair expected");
  }
  std::vector<Projection> projections;
  int64_t total_rows = 0;
  for (size_t i = 0; i < outputs.size(); ++i) {
    auto w = weights.get<ffi::Buffer<ffi::S8>>(2 * i);
    auto scale = weights.get<ffi::Buffer<ffi::F32>>(2 * i + 1);
    auto y = outputs.get<ffi::Buffer<ffi::F32>>(i);
    if (!w.has_value() || !scale.has_value() || !y.has_value()) {
      return ffi::Error::InvalidArgument("int8_matmul: payloads int8, scales and outputs float32 expected");
    }
    auto w_dims = w->dimensions();
    if (w_dims.size() != 2 || w_dims[1] != k || scale->dimensions().size() != 1 ||
        scale->dimensions()[0] != w_dims[0] || (*y)->dimensions().size() != 2 || (*y)->dimensions()[0] != m ||
        (*y)->dimensions()[1] != w_dims[0]) {
      return ffi::Error::InvalidArgument("int8_matmul: x [M, K], payload [N, K], scale [N], y [M, N] expected");
    }
    projections.push_back({w->typed_data(), scale->typed_data(), (*y)->typed_data(), w_dims[0]});
    total_rows += w_dims[0];
  }
  const float* xp = x.typed_data();

  // Below ~64 KiB of weight the hand-off costs more than it saves.
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), max_threads));
  if (threads == 1 || total_rows * k < (64 << 10)) {
    Share(xp, m, k, projections, 0, total_rows);
    return ffi::Error::Success();
  }
  // Chunks of rows claimed from a shared counter: the calling thread starts at once, and a
  // helper that the pool runs late (its core busy with another process: the machine may be
  // shared) takes what is left when it starts, or nothing. A static split would make the caller
  // wait for the helper's whole share. The caller waits only for chunks a helper has claimed.
  // The state lives on the heap: a helper that starts after the call returned touches nothing else.
  struct Chunks {
    std::atomic<int64_t> next{0}, done{0};
    int64_t count = 0;
  };
  const int64_t chunk_rows = std::max<int64_t>(8, 8 * ((kChunkBytes / std::max<int64_t>(k, 1)) / 8));
  auto chunks = std::make_shared<Chunks>();
  chunks->count = (total_rows + chunk_rows - 1) / chunk_rows;
  auto work = [=](const std::vector<Projection>& ps) {
    for (int64_t c = chunks->next.fetch_add(1); c < chunks->count; c = chunks->next.fetch_add(1)) {
      Share(xp, m, k, ps, c * chunk_rows, std::min(total_rows, (c + 1) * chunk_rows));
      if (chunks->done.fetch_add(1) + 1 == chunks->count) chunks->done.notify_all();
    }
  };
  for (int64_t s = 1; s < threads; ++s) {
    pool.Schedule([work, chunks, projections] { work(projections); });
  }
  work(projections);
  for (int64_t done = chunks->done.load(); done < chunks->count; done = chunks->done.load()) {
    chunks->done.wait(done);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferInt8MatmulCpu, Int8MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("max_threads"));
