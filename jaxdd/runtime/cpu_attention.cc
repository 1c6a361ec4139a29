// Tree-verify attention over pools of pages for XLA:CPU (loaded with cpu_kernels.cc by jaxdd/runtime/cpu_kernels.py):
// the contract of pallas_kernels/tree_attention.py's tree_attention_reference with page tables and log-sum-exp.
//
// XLA:CPU gathers each row's pages into a contiguous copy per layer before its score matmul, all of the row's table
// whatever its length. Here one task takes one row and a block of its query rows (token x head) and runs an online
// softmax over the row's committed slots, read in place a page at a time through the row's table (no slot at or past
// its length is read), then over the round's new rows under the ancestor mask.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpu_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace {

using namespace jaxdd;  // NOLINT: the shared helpers (cpu_kernels.h)

// Query rows per task: a row's all (each task widens its row's keys once per block: more tasks, more copies), split
// only so that every thread has a task, into blocks of kMinQueryRows or more; at most kMaxQueryRows (its scratch).
constexpr int64_t kMinQueryRows = 16, kMaxQueryRows = 256;
constexpr int64_t kKeys = 64;  // keys per block of the online softmax (and never two pages in one block)
constexpr float kNeg = -1e30f;  // pallas_kernels.tree_attention.NEG: a row that sees nothing

struct E4M3 {  // an 8-bit float (e4m3fn: no infinities, 0x7f and 0xff NaN), as the drafter's K/V may be stored
  uint8_t bits;
};

// Every e4m3fn value as an fp32 (exact: 3 mantissa bits), by its bits; built when the library loads.
const std::array<float, 256> kE4M3 = [] {
  std::array<float, 256> values{};
  for (int bits = 0; bits < 256; ++bits) {
    const int exponent = bits >> 3 & 15, mantissa = bits & 7;
    const float magnitude = exponent == 15 && mantissa == 7 ? NAN
                            : exponent == 0                 ? std::ldexp(mantissa / 8.0f, -6)
                                                            : std::ldexp(1.0f + mantissa / 8.0f, exponent - 7);
    values[bits] = bits & 128 ? -magnitude : magnitude;
  }
  return values;
}();
inline float to_float(E4M3 x) { return kE4M3[x.bits]; }
using jaxdd::to_float;  // fp32 and bf16 (cpu_kernels.h)

// The keys of one block: ``count`` consecutive rows of a latent and a rope buffer (one page's, or the new rows).
template <typename W>
struct Keys {
  const W* latent;  // [count, r]
  const W* rope;  // [count, dr]
  int64_t count;
};

// Tiles of kRows query rows by kVectors x 16 keys (scores) or values: accumulators in registers, each key or value
// vector loaded once per kRows rows, each query or probability broadcast once per kVectors vectors.
template <int kRows, int kVectors>
inline void score_tile(const float* q, int64_t width, const float* keys_t, float scale, float* scores) {
  Floats16 acc[kRows][kVectors] = {};
  for (int64_t d = 0; d < width; ++d) {
    Floats16 keys[kVectors];
    for (int v = 0; v < kVectors; ++v) keys[v] = load<Floats16>(keys_t + d * kKeys + 16 * v);
    for (int i = 0; i < kRows; ++i) {
      const float x = q[i * width + d];
      for (int v = 0; v < kVectors; ++v) acc[i][v] += x * keys[v];
    }
  }
  for (int i = 0; i < kRows; ++i) {
    for (int v = 0; v < kVectors; ++v) {
      const Floats16 scaled = acc[i][v] * scale;
      std::memcpy(scores + i * kKeys + 16 * v, &scaled, sizeof scaled);
    }
  }
}

template <int kRows, int kVectors>
inline void value_tile(const float* probs, const float* correction, const float* values, int64_t r, int64_t count,
                       float* out) {
  Floats16 acc[kRows][kVectors];
  for (int i = 0; i < kRows; ++i) {
    for (int v = 0; v < kVectors; ++v) acc[i][v] = load<Floats16>(out + i * r + 16 * v) * correction[i];
  }
  for (int64_t j = 0; j < count; ++j) {
    Floats16 value[kVectors];
    for (int v = 0; v < kVectors; ++v) value[v] = load<Floats16>(values + j * r + 16 * v);
    for (int i = 0; i < kRows; ++i) {
      const float p = probs[i * kKeys + j];
      for (int v = 0; v < kVectors; ++v) acc[i][v] += p * value[v];
    }
  }
  for (int i = 0; i < kRows; ++i) std::memcpy(out + i * r, acc[i], sizeof acc[i]);
}

// One row's block of queries and their running softmax: queries [rows, r + dr] (latent then rope), acc [rows, r].
struct Softmax {
  int64_t rows, r, width;
  float scale;
  // keys_t [width, kKeys], values [kKeys, r] (a block's keys transposed and its values, in fp32), scores [rows, kKeys]
  std::vector<float> q, acc, max, sum, correction, keys_t, values, scores;

  Softmax(const float* q_latent, const float* q_rope, int64_t rows, int64_t r, int64_t dr, float scale)
      : rows(rows), r(r), width(r + dr), scale(scale), q(rows * (r + dr)), acc(rows * r, 0.0f), max(rows, kNeg),
        sum(rows, 0.0f), correction(rows), keys_t((r + dr) * kKeys), scores(rows * kKeys) {
    for (int64_t i = 0; i < rows; ++i) {
      std::copy_n(q_latent + i * r, r, q.data() + i * width);
      std::copy_n(q_rope + i * dr, dr, q.data() + i * width + r);
    }
  }

  template <int kVectors>
  void score_rows() {
    int64_t i = 0;
    for (; i + 4 <= rows; i += 4) {
      score_tile<4, kVectors>(q.data() + i * width, width, keys_t.data(), scale, scores.data() + i * kKeys);
    }
    for (; i < rows; ++i) {
      score_tile<1, kVectors>(q.data() + i * width, width, keys_t.data(), scale, scores.data() + i * kKeys);
    }
  }

  template <int kVectors>
  void value_columns(int64_t c, const float* values, int64_t count) {  // output columns [c, c + 16 x kVectors)
    int64_t i = 0;
    for (; i + 4 <= rows; i += 4) {
      value_tile<4, kVectors>(scores.data() + i * kKeys, correction.data() + i, values + c, r, count,
                              acc.data() + i * r + c);
    }
    for (; i < rows; ++i) {
      value_tile<1, kVectors>(scores.data() + i * kKeys, correction.data() + i, values + c, r, count,
                              acc.data() + i * r + c);
    }
  }

  void value_rows(const float* values, int64_t count) {
    int64_t c = 0;
    for (; c + 64 <= r; c += 64) value_columns<4>(c, values, count);
    if (c + 32 <= r) value_columns<2>(c, values, count), c += 32;
    if (c + 16 <= r) value_columns<1>(c, values, count), c += 16;
    for (int64_t i = 0; i < rows; ++i) {  // columns past the last 16
      for (int64_t k = c; k < r; ++k) {
        float value = acc[i * r + k] * correction[i];
        for (int64_t j = 0; j < count; ++j) value += scores[i * kKeys + j] * values[j * r + k];
        acc[i * r + k] = value;
      }
    }
  }

  // The block's keys into every row's softmax; visible(i, j): whether row i sees key j.
  template <typename W, typename Visible>
  void add(const Keys<W>& keys, Visible visible) {
    const int64_t count = keys.count, dr = width - r, vectors = (count + 15) / 16;
    bool seen = false;  // a block no row sees (a tree's other branches, a causal chunk's later rows) is skipped
    for (int64_t i = 0; i < rows && !seen; ++i) {
      for (int64_t j = 0; j < count && !seen; ++j) seen = visible(i, j);
    }
    if (!seen) return;
    for (int64_t j = 0; j < 16 * vectors; ++j) {  // transposed, widened, zero past the block
      for (int64_t d = 0; d < r; ++d) keys_t[d * kKeys + j] = j < count ? to_float(keys.latent[j * r + d]) : 0.0f;
      for (int64_t d = 0; d < dr; ++d) {
        keys_t[(r + d) * kKeys + j] = j < count ? to_float(keys.rope[j * dr + d]) : 0.0f;
      }
    }
    switch (vectors) {
      case 1: score_rows<1>(); break;
      case 2: score_rows<2>(); break;
      case 3: score_rows<3>(); break;
      default: score_rows<4>(); break;
    }
    for (int64_t i = 0; i < rows; ++i) {
      float* s = scores.data() + i * kKeys;
      float top = kNeg;
      for (int64_t j = 0; j < count; ++j) {
        if (visible(i, j)) top = std::max(top, s[j]);
      }
      const float new_max = std::max(max[i], top);  // kNeg where the row has seen nothing yet
      correction[i] = std::exp(max[i] - new_max);
      float total = sum[i] * correction[i];
      for (int64_t j = 0; j < count; ++j) {
        s[j] = visible(i, j) && top != kNeg ? std::exp(s[j] - new_max) : 0.0f;
        total += s[j];
      }
      max[i] = new_max, sum[i] = total;
    }
    if constexpr (std::is_same_v<W, float>) {
      value_rows(keys.latent, count);
    } else {
      values.resize(kKeys * r);  // a narrower pool's values widened (fp32 ones are read in place)
      for (int64_t j = 0; j < count * r; ++j) values[j] = to_float(keys.latent[j]);
      value_rows(values.data(), count);
    }
  }

  // acc / sum into out [rows, r] and the log-sum-exp into lse [rows]; 0 and kNeg where a row saw nothing.
  void finish(float* out, float* lse) const {
    for (int64_t i = 0; i < rows; ++i) {
      const float inverse = sum[i] > 0.0f ? 1.0f / sum[i] : 0.0f;
      for (int64_t c = 0; c < r; ++c) out[i * r + c] = acc[i * r + c] * inverse;
      lse[i] = sum[i] > 0.0f ? max[i] + std::log(sum[i]) : kNeg;
    }
  }
};

// The operands a handler checked: queries [B, M = T x H, r | dr], pools [P, page, r | dr] (cache elements W), the
// lengths [B], the new rows [B, T, r | dr] and their mask [B, T, T], the tables [B / fold, row_pages]; out [B, M, r],
// lse [B, M].
struct Operands {
  const float *q_latent, *q_rope;
  const void *latent, *rope;
  const int32_t* length;
  const float *tail_latent, *tail_rope;
  const bool* tail_mask;
  const int32_t* pages;
  float *out, *lse;
  int64_t b, m, r, dr, t, pool_pages, page, row_pages, fold;
  float scale;
};

template <typename W>
void attend(ffi::ThreadPool& pool, const Operands& x) {
  const int64_t spread = (pool.num_threads() + x.b - 1) / x.b;  // tasks per row for every thread to have one
  const int64_t split =
      std::clamp<int64_t>(spread, (x.m + kMaxQueryRows - 1) / kMaxQueryRows, (x.m + kMinQueryRows - 1) / kMinQueryRows);
  const int64_t per_task = (x.m + split - 1) / split, blocks = (x.m + per_task - 1) / per_task;  // none empty
  const int64_t heads = x.m / x.t;
  const int64_t last_page = x.pool_pages - 1;  // pools of [P x fold, page, ..] where fold KV heads share a table
  const W* latent_pool = static_cast<const W*>(x.latent);
  const W* rope_pool = static_cast<const W*>(x.rope);
  parallel_for(pool, x.b * blocks, [&](int64_t task) {
    const int64_t row = task / blocks, first = task % blocks * per_task, at_query = row * x.m + first;
    Softmax softmax(x.q_latent + at_query * x.r, x.q_rope + at_query * x.dr, std::min(per_task, x.m - first),
                    x.r, x.dr, x.scale);
    const int64_t committed = std::clamp<int64_t>(x.length[row], 0, x.row_pages * x.page);
    const int32_t* own = x.pages + row / x.fold * x.row_pages;
    const auto all = [](int64_t, int64_t) { return true; };
    for (int64_t slot = 0; slot < committed;) {  // the committed slots, a block never past its page
      const int64_t id = std::clamp<int64_t>(int64_t{own[slot / x.page]} * x.fold + row % x.fold, 0, last_page);
      const int64_t count = std::min({kKeys, committed - slot, x.page - slot % x.page});
      const int64_t at = id * x.page + slot % x.page;
      softmax.add(Keys<W>{latent_pool + at * x.r, rope_pool + at * x.dr, count}, all);
      slot += count;
    }
    const bool* mask = x.tail_mask + row * x.t * x.t;
    for (int64_t j0 = 0; j0 < x.t; j0 += kKeys) {  // the new rows: token (first + i) / heads sees j where mask says
      const auto seen = [&](int64_t i, int64_t j) { return mask[(first + i) / heads * x.t + j0 + j]; };
      const int64_t at = row * x.t + j0;
      softmax.add(Keys<float>{x.tail_latent + at * x.r, x.tail_rope + at * x.dr, std::min(kKeys, x.t - j0)}, seen);
    }
    softmax.finish(x.out + at_query * x.r, x.lse + at_query);
  });
}

ffi::Error TreeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q_latent, ffi::Buffer<ffi::F32> q_rope,
                         ffi::AnyBuffer latent, ffi::AnyBuffer rope, ffi::Buffer<ffi::S32> length,
                         ffi::Buffer<ffi::F32> tail_latent, ffi::Buffer<ffi::F32> tail_rope,
                         ffi::Buffer<ffi::PRED> tail_mask, ffi::Buffer<ffi::S32> pages, float scale, int64_t fold,
                         ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> lse) {
  const auto qd = q_latent.dimensions(), rd = q_rope.dimensions(), pd = latent.dimensions();
  const auto pr = rope.dimensions(), td = tail_latent.dimensions(), tr = tail_rope.dimensions();
  const auto md = tail_mask.dimensions(), table = pages.dimensions();
  const bool ranks = qd.size() == 3 && rd.size() == 3 && pd.size() == 3 && pr.size() == 3 && td.size() == 3 &&
                     tr.size() == 3 && md.size() == 3 && table.size() == 2 && length.dimensions().size() == 1;
  if (!ranks || pd[0] == 0 || pd[2] != qd[2] || pr[0] != pd[0] || pr[1] != pd[1] || pr[2] != rd[2] ||
      rd[0] != qd[0] || rd[1] != qd[1] || td[0] != qd[0] || td[1] == 0 || qd[1] % td[1] != 0 || td[2] != qd[2] ||
      tr[0] != qd[0] || tr[1] != td[1] || tr[2] != rd[2] || md[0] != qd[0] || md[1] != td[1] || md[2] != td[1] ||
      length.dimensions()[0] != qd[0] || fold < 1 || table[0] * fold != qd[0] ||
      latent.element_type() != rope.element_type()) {
    return ffi::Error::InvalidArgument(
        "tree attention: q [B, T x H, r | dr], pools [P > 0, page, r | dr] of one dtype, length [B], "
        "tail [B, T, r | dr], mask [B, T, T], pages [B / fold, row_pages]");
  }
  const Operands x{q_latent.typed_data(), q_rope.typed_data(), latent.untyped_data(), rope.untyped_data(),
                   length.typed_data(), tail_latent.typed_data(), tail_rope.typed_data(), tail_mask.typed_data(),
                   pages.typed_data(), out->typed_data(), lse->typed_data(), qd[0], qd[1], qd[2], rd[2], td[1],
                   pd[0], pd[1], table[1], fold, scale};
  switch (latent.element_type()) {
    case ffi::DataType::F32: attend<float>(pool, x); break;
    case ffi::DataType::BF16: attend<uint16_t>(pool, x); break;
    case ffi::DataType::F8E4M3FN: attend<E4M3>(pool, x); break;
    default: return ffi::Error::InvalidArgument("tree attention: pools of fp32, bf16 or float8_e4m3fn");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdd_tree_attention, TreeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("fold")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
