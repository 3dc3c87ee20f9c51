// Weight-only int8 matmul for XLA:CPU, called through the XLA FFI (jaxinfer/cpu_int8_matmul.py).
//
// y[m, n] = scale[n] * sum_k x[m, k] * w[n, k], x float32 [M, K], w int8 [N, K] (both contracting
// on their minor axis), scale float32 [N], y float32 [M, N].
//
// Why this exists: XLA:CPU has no int8 weight-only dot. It converts the whole int8 weight to
// float32 in a separate loop fusion and then runs a float32 dot over the copy, so an int8 weight
// costs more memory traffic than a float32 one (1 byte read + 4 written + 4 read per element).
// Here each group of four weight rows is widened in registers and used by every row of x while it
// sits in L1, so the weight is read from memory once, as int8.
//
// Work is split over output rows (n) across at most `max_threads` threads of XLA's intra-op
// pool; the caller thread takes one share and waits for the others.

#include <algorithm>
#include <cstdint>
#include <latch>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kLanes = 16;  // one AVX-512 register of floats (two AVX2 ones)
constexpr int64_t kRowsAtOnce = 4;  // independent accumulators: hides the add latency

// y[r, j..j+rows) for every r: `rows` (<= kRowsAtOnce) weight rows share each load of x, and
// their accumulators are independent chains (one chain is bound by the add's latency). With
// more than one row of x the group is widened once into `widened` (rows x K floats, L1-sized for
// K up to ~2k) instead of once per row of x.
template <int64_t rows>
void RowGroup(const float* __restrict x, const int8_t* __restrict w, const float* __restrict scale,
              float* __restrict y, int64_t m_rows, int64_t k, int64_t n, int64_t j, float* __restrict widened) {
  const int64_t k_main = k - k % kLanes;
  if (m_rows > 1) {
    for (int64_t q = 0; q < rows; ++q) {
      for (int64_t i = 0; i < k; ++i) widened[q * k + i] = static_cast<float>(w[(j + q) * k + i]);
    }
  }
  for (int64_t r = 0; r < m_rows; ++r) {
    const float* __restrict xr = x + r * k;
    float acc[rows][kLanes] = {};
    if (m_rows > 1) {
      for (int64_t k0 = 0; k0 < k_main; k0 += kLanes) {
        for (int64_t q = 0; q < rows; ++q) {
          const float* __restrict wq = widened + q * k + k0;
          for (int64_t l = 0; l < kLanes; ++l) acc[q][l] += xr[k0 + l] * wq[l];
        }
      }
    } else {
      for (int64_t k0 = 0; k0 < k_main; k0 += kLanes) {
        for (int64_t q = 0; q < rows; ++q) {
          const int8_t* __restrict wq = w + (j + q) * k + k0;
          for (int64_t l = 0; l < kLanes; ++l) acc[q][l] += xr[k0 + l] * static_cast<float>(wq[l]);
        }
      }
    }
    for (int64_t q = 0; q < rows; ++q) {
      float total = 0.0f;
      for (int64_t l = 0; l < kLanes; ++l) total += acc[q][l];
      for (int64_t i = k_main; i < k; ++i) total += xr[i] * static_cast<float>(w[(j + q) * k + i]);
      y[r * n + j + q] = total * scale[j + q];
    }
  }
}

// Rows [n_begin, n_end) of y.
void MatmulRows(const float* x, const int8_t* w, const float* scale, float* y, int64_t m_rows, int64_t k,
                int64_t n, int64_t n_begin, int64_t n_end) {
  std::vector<float> widened(m_rows > 1 ? kRowsAtOnce * k : 0);
  int64_t j = n_begin;
  for (; j + kRowsAtOnce <= n_end; j += kRowsAtOnce) {
    RowGroup<kRowsAtOnce>(x, w, scale, y, m_rows, k, n, j, widened.data());
  }
  for (; j < n_end; ++j) RowGroup<1>(x, w, scale, y, m_rows, k, n, j, widened.data());
}

ffi::Error Int8MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w,
                          ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y, int64_t max_threads) {
  auto x_dims = x.dimensions();
  auto w_dims = w.dimensions();
  if (x_dims.size() != 2 || w_dims.size() != 2 || scale.dimensions().size() != 1) {
    return ffi::Error::InvalidArgument("int8_matmul: x [M, K], w [N, K] and scale [N] expected");
  }
  const int64_t m_rows = x_dims[0], k = x_dims[1], n = w_dims[0];
  if (w_dims[1] != k || scale.dimensions()[0] != n) {
    return ffi::Error::InvalidArgument("int8_matmul: x, w and scale shapes do not fit");
  }
  const float* xp = x.typed_data();
  const int8_t* wp = w.typed_data();
  const float* sp = scale.typed_data();
  float* yp = y->typed_data();

  // Below ~64 KiB of weight the hand-off costs more than it saves.
  const int64_t threads = std::max<int64_t>(1, std::min(pool.num_threads(), max_threads));
  const int64_t shares = (n * k < (64 << 10)) ? 1 : std::min<int64_t>(threads, n);
  const int64_t per_share = (n + shares - 1) / shares;
  std::latch done(shares - 1);
  for (int64_t s = 1; s < shares; ++s) {
    const int64_t begin = s * per_share, end = std::min(n, begin + per_share);
    pool.Schedule([=, &done] {
      MatmulRows(xp, wp, sp, yp, m_rows, k, n, begin, end);
      done.count_down();
    });
  }
  MatmulRows(xp, wp, sp, yp, m_rows, k, n, 0, std::min(n, per_share));
  done.wait();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferInt8MatmulCpu, Int8MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("max_threads"));
