// Decode's matvecs for XLA:CPU (loaded by jaxdd/runtime/cpu_kernels.py).
//
// Gathered INT4 matvecs: out[p] = rows[p] @ W[chosen[p]]^T, where W is one projection's stacked routed experts in
// compressed-tensors pack-quantized form (jaxdd/models/quant.py). Each weight is dequantized in registers exactly as the
// XLA path does (bf16(q * scale), q = nibble - 8) and used once: the chosen experts' INT4 words are read once and
// nothing dense is written (XLA:CPU gathers, unpacks to a dense copy, then multiplies). AVX-512 hosts look each
// weight up in a table; elsewhere GCC/Clang vector extensions (-march=native: AVX2 or NEON) compute it.
//
// Dense matvecs: out = rows @ W for a few rows, W's rows split across XLA's threads.
//
// Row dots: out[g, p, n] = x[g, p] . w[g, n] for a few rows p of x, w's rows split across XLA's threads.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

// The table-lookup form needs AVX-512 F (512-bit permutes) with BW and VL (a masked load of 16-bit scales).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define JAXDD_TABLE_LOOKUP 1
#endif

#if defined(JAXDD_TABLE_LOOKUP) || defined(__FMA__)
#include <immintrin.h>
#endif

#include "cpu_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace {

using namespace jaxdd;  // NOLINT: the shared helpers (cpu_kernels.h)

constexpr int64_t kLanes = 8;  // INT4 values per int32 word
constexpr int64_t kQuad = 4 * kLanes;  // inputs per 4 words: one scale covers whole quads (groups of 32k)

#if defined(JAXDD_TABLE_LOOKUP)
// --- AVX-512: each weight is one lookup in its scale's 16-entry table -------------------------------------------
// A group's 32 weights are bf16(q x s) for one bf16 scale s and q = nibble - 8: lookups (vpermps) in the table of
// those 16 values. There is one table per bf16 bit pattern (4 MiB); a checkpoint's scales touch a few hundred.

// bf16(p) for fp32 p: round to nearest, ties to even, as XLA's f32 -> bf16 convert.
inline __m512 rounded_to_bf16(__m512 p) {
  const __m512i bits = _mm512_castps_si512(p);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i sum = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), odd);
  return _mm512_castsi512_ps(_mm512_and_si512(sum, _mm512_set1_epi32(int32_t(0xFFFF0000u))));
}

struct Tables {
  alignas(64) float value[1 << 16][16];  // [scale's bf16 bits][stored nibble]: bf16((nibble - 8) x scale)
  // Built by the first call, on XLA's thread: in its floating-point mode (subnormal scales read as zero on x86).
  Tables() {
    const __m512 q = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    for (uint32_t bits = 0; bits < (1u << 16); ++bits) {
      _mm512_store_ps(value[bits], rounded_to_bf16(_mm512_mul_ps(q, _mm512_set1_ps(bf16_to_float(bits)))));
    }
  }
};
const Tables& tables() {
  static const auto* built = new Tables();
  return *built;
}

// The layout dot_row reads: per quad, lane t of the first 16 floats is input 2t (the low nibble of byte t % 4 of
// word t / 4), of the second 16 input 2t + 1 (that byte's high nibble). k is a whole number of quads.
void lay_out(const float* x, int64_t k, float* xt) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  for (int64_t i = 0; i < k; i += kQuad) {
    const __m512 low = _mm512_loadu_ps(x + i), high = _mm512_loadu_ps(x + i + 16);
    _mm512_storeu_ps(xt + i, _mm512_permutex2var_ps(low, even, high));
    _mm512_storeu_ps(xt + i + 16, _mm512_permutex2var_ps(low, odd, high));
  }
}

// x (laid out) times the 32 weights of one quad, looked up in ``table``, added to ``even`` and ``odd``. The quad's
// 16 bytes go one per lane: the low nibbles are the even values, and vpermps reads only an index's low 4 bits
// (bytes and one immediate shift: variable shifts of 512-bit vectors are slow on AMD Zen 4).
inline void add_quad(const float* x, const uint32_t* words, const float* table, __m512& even, __m512& odd) {
  const __m512i bytes = _mm512_cvtepu8_epi32(load<__m128i>(words));
  const __m512 values = _mm512_load_ps(table);
  even = _mm512_fmadd_ps(_mm512_loadu_ps(x), _mm512_permutexvar_ps(bytes, values), even);
  odd = _mm512_fmadd_ps(_mm512_loadu_ps(x + 16), _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), values), odd);
}

// One row's dot product: sum_k x[k] x bf16(q[k] x scale[group of k]), four FMA chains in flight (two per group, the
// groups alternating). Groups of 32 (every Kimi INT4 checkpoint) are one quad each, unrolled.
template <int64_t kWordsPerGroup>
__attribute__((always_inline)) inline float dot_groups(const float* xt, const uint32_t* words, const uint16_t* scales,
                                                       int64_t words_per_row, int64_t words_per_group) {
  const int64_t n = kWordsPerGroup ? kWordsPerGroup : words_per_group, groups = words_per_row / n;
  const auto& table_of = tables().value;
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  auto add_group = [&](int64_t group, __m512& even, __m512& odd) {
    const float* table = table_of[scales[group]];
    for (int64_t word = group * n; word < (group + 1) * n; word += 4) {
      add_quad(xt + word * kLanes, words + word, table, even, odd);
    }
  };
  int64_t group = 0;
  for (; group + 1 < groups; group += 2) {
    add_group(group, a0, a1);
    add_group(group + 1, a2, a3);
  }
  if (group < groups) add_group(group, a0, a1);
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

float dot_row(const float* xt, const uint32_t* words, const uint16_t* scales, int64_t words_per_row,
              int64_t words_per_group) {
  if (words_per_group == 4) return dot_groups<4>(xt, words, scales, words_per_row, 4);
  return dot_groups<0>(xt, words, scales, words_per_row, words_per_group);
}

#else
// --- Portable: GCC/Clang vector extensions (+ the FMA where there is one) -------------------------------------
typedef float Floats __attribute__((vector_size(kLanes * sizeof(float))));
typedef uint32_t Words __attribute__((vector_size(kLanes * sizeof(uint32_t))));
typedef int32_t Ints __attribute__((vector_size(kLanes * sizeof(int32_t))));

constexpr int64_t kBlock = kLanes * kLanes;  // inputs per block: 8 words, lane j holding word j's 8 values
// Veltkamp's split c - (c - p), c = p * (2^16 + 1), is p rounded to bf16's 8 significant bits, ties to even (for
// all 16 x 65536 products q x scale, tests/runtime/test_cpu_kernels.py); c overflows past this scale, where the bit form runs.
constexpr float kSplitLimit = 0x1p100f;

inline Floats fma(Floats a, Floats b, Floats c) {
#ifdef __FMA__
  return (Floats)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;  // compiled with -ffp-contract=off: the split below must not be fused
#endif
}

// bf16(q * scale) for the block's 8 x 8 values: the product is exact in fp32 (4 x 8 significant bits), then it is
// rounded to the nearest bf16, ties to even, as XLA's f32 -> bf16 convert.
template <bool kSplit>
inline Floats dequantized(Floats q, Floats scale, Floats split_scale) {
  const Floats p = q * scale;
  if (kSplit) {
    const Floats c = q * split_scale;  // = p * (2^16 + 1), rounded once: split_scale is exact
    return c - (c - p);
  }
  Words bits = (Words)p;
  bits = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  return (Floats)bits;
}

// acc += one block's 64 products x * bf16(q * scale): vector i of the block holds value i of each of its 8 words.
// Two accumulators (even and odd values) keep two FMA chains in flight.
template <bool kSplit>
inline void dot_block(Words words, const float* xs, Floats scale, Floats split_scale, Floats* acc) {
  words ^= 0x88888888u;  // each nibble now holds q = nibble - 8 as a signed 4-bit value
  for (int i = 0; i < kLanes; ++i) {
    const Ints q = (Ints)(words << (28 - 4 * i)) >> 28;  // value i of each word, sign-extended
    const Floats w = dequantized<kSplit>(__builtin_convertvector(q, Floats), scale, split_scale);
    acc[i % 2] = fma(load<Floats>(xs + i * kLanes), w, acc[i % 2]);
  }
}

// The layout dot_row reads: x transposed per block to match the words (vector i of a block, lane j = input
// 8j + i: value i of word j), zero-padded to whole blocks.
void lay_out(const float* x, int64_t k, float* xt) {
  for (int64_t i = 0; i < k; ++i) {
    const int64_t b = i / kBlock, word = (i / kLanes) % kLanes, value = i % kLanes;
    xt[b * kBlock + value * kLanes + word] = x[i];
  }
}

// One row's dot product: sum_k x[k] * bf16(q[k] * scale[group of k]), a block of 8 words at a time; each 4-word
// half-block lies in one scale group (groups are whole quads), so lanes 0-3 and 4-7 each need one scale.
float dot_row(const float* xt, const uint32_t* words, const uint16_t* scales, int64_t words_per_row,
              int64_t words_per_group) {
  Floats acc[2] = {};
  for (int64_t first = 0; first < words_per_row; first += kLanes) {
    Words block;
    if (first + kLanes <= words_per_row) {
      block = load<Words>(words + first);
    } else {  // a partial last block: its padding words meet zero inputs
      uint32_t padded[kLanes] = {};
      std::copy(words + first, words + words_per_row, padded);
      block = load<Words>(padded);
    }
    const int64_t last_group = (words_per_row - 1) / words_per_group;
    const float lo = bf16_to_float(scales[first / words_per_group]);
    const float hi = bf16_to_float(scales[std::min((first + 4) / words_per_group, last_group)]);
    const Floats scale = {lo, lo, lo, lo, hi, hi, hi, hi};
    if (std::fabs(lo) < kSplitLimit && std::fabs(hi) < kSplitLimit) {
      dot_block<true>(block, xt + first * kLanes, scale, scale * 65537.0f, acc);
    } else {
      dot_block<false>(block, xt + first * kLanes, scale, scale, acc);
    }
  }
  const Floats sum = acc[0] + acc[1];
  float total = 0.0f;
  for (int i = 0; i < kLanes; ++i) total += sum[i];
  return total;
}
#endif

// Floats per row in dot_row's layout: whole quads (AVX-512) or whole 8-word blocks.
inline int64_t laid_out_size(int64_t words_per_row) {
#if defined(JAXDD_TABLE_LOOKUP)
  return words_per_row * kLanes;
#else
  return (words_per_row + kLanes - 1) / kLanes * kLanes * kLanes;
#endif
}

// --- Gathered INT4 matvecs ---------------------------------------------------------------------------------------
constexpr int64_t kRowsPerTask = 64;  // output rows one task computes
constexpr int64_t kPrefetchRows = 8;  // the hardware prefetcher alone leaves the kernel waiting on memory

struct Gathered {
  std::vector<float> xt;  // [P, row_floats]: each row in dot_row's layout
  const uint32_t* packed;  // [E, N, K / 8]
  const uint16_t* scale;   // [E, N, K / group] bf16 bits
  const int32_t* chosen;   // [P]
  float* out;              // [P, N]
  int64_t experts, n, words_per_row, groups, row_floats, total_rows;

  int64_t weight_row(int64_t row) const {  // of the flattened [P, N] output row
    return std::clamp<int64_t>(chosen[row / n], 0, experts - 1) * n + row % n;  // as XLA's gather clamps
  }

  void run_rows(int64_t begin, int64_t end) const {
    for (int64_t row = begin; row < end; ++row) {
      if (row + kPrefetchRows < total_rows) {
        const int64_t ahead = weight_row(row + kPrefetchRows);
        const char* words = reinterpret_cast<const char*>(packed + ahead * words_per_row);
        for (int64_t byte = 0; byte < words_per_row * 4; byte += 64) __builtin_prefetch(words + byte);
        __builtin_prefetch(scale + ahead * groups);
      }
      const int64_t w = weight_row(row);
      out[row] = dot_row(xt.data() + row / n * row_floats, packed + w * words_per_row, scale + w * groups,
                         words_per_row, words_per_row / groups);
    }
  }
};

ffi::Error Int4GatheredMatvec(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> rows, ffi::Buffer<ffi::S32> packed,
                              ffi::Buffer<ffi::BF16> scale, ffi::Buffer<ffi::S32> chosen,
                              ffi::ResultBuffer<ffi::F32> out) {
  const auto rd = rows.dimensions(), pd = packed.dimensions(), sd = scale.dimensions();
  if (rd.size() != 2 || pd.size() != 3 || sd.size() != 3 || chosen.element_count() != rd[0] ||
      pd[2] * kLanes != rd[1] || sd[0] != pd[0] || sd[1] != pd[1] || sd[2] == 0 || pd[2] % (4 * sd[2]) != 0) {
    return ffi::Error::InvalidArgument(
        "int4 gathered matvec: rows [P, K], packed [E, N, K/8], scale [E, N, K/group], group a multiple of 32");
  }
  const int64_t pairs = rd[0], k = rd[1], row_floats = laid_out_size(pd[2]);
  Gathered problem{std::vector<float>(pairs * row_floats, 0.0f),
                         reinterpret_cast<const uint32_t*>(packed.typed_data()),
                         scale.typed_data(),
                         chosen.typed_data(),
                         out->typed_data(),
                         pd[0], pd[1], pd[2], sd[2], row_floats, pairs * pd[1]};
  for (int64_t p = 0; p < pairs; ++p) {
    lay_out(rows.typed_data() + p * k, k, problem.xt.data() + p * row_floats);
  }
  parallel_for(pool, (problem.total_rows + kRowsPerTask - 1) / kRowsPerTask, [&problem](int64_t task) {
    problem.run_rows(task * kRowsPerTask, std::min(problem.total_rows, (task + 1) * kRowsPerTask));
  });
  return ffi::Error::Success();
}

// --- Dense matvecs: out = x @ W for a few rows, W [K, N] fp32 or bf16 read once --------------------------------
// XLA:CPU runs a one-row matvec on one thread (~half this host's read bandwidth). Here tasks take fixed blocks of
// W's rows (contiguous reads), each sums its rows' products into its own partial [P, N] in row order, and the
// partials are added in block order: the same sums whichever thread runs which block.

constexpr int64_t kDenseRowsPerTask = 128;
constexpr int64_t kDenseTasksPerThread = 2;
constexpr int64_t kDenseNarrow = 512;  // output columns up to which a block reads one weight row at a time

// partial [P, N] = x[:, begin:end] @ w[begin:end], adding each row of w in order, kRows at a time.
template <int kRows, typename W>
void dense_block(const float* x, int64_t rows, const W* w, int64_t k, int64_t n, int64_t begin, int64_t end,
                 float* partial) {
  const int64_t vectors = n / 16;
  for (int64_t p = 0; p < rows; ++p) {
    float* out = partial + p * n;
    std::fill_n(out, n, 0.0f);
    for (int64_t i = begin; i < end; i += kRows) {
      const int64_t count = std::min<int64_t>(kRows, end - i);
      const W* r[kRows];
      float xs[kRows];
      for (int64_t j = 0; j < kRows; ++j) {  // missing rows repeat the last one with a zero input
        r[j] = w + (i + std::min(j, count - 1)) * n;
        xs[j] = j < count ? x[p * k + i + j] : 0.0f;
      }
      for (int64_t v = 0; v < vectors; ++v) {
        Floats16 sum = load<Floats16>(out + 16 * v);
        for (int j = 0; j < kRows; ++j) sum += xs[j] * widen(r[j] + 16 * v);
        std::memcpy(out + 16 * v, &sum, sizeof sum);
      }
      for (int64_t c = 16 * vectors; c < n; ++c) {
        for (int j = 0; j < kRows; ++j) out[c] += xs[j] * to_float(r[j][c]);
      }
    }
  }
}

template <ffi::DataType kWeight>
ffi::Error DenseMatvec(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> rows, ffi::Buffer<kWeight> weight,
                       ffi::ResultBuffer<ffi::F32> out) {
  const auto rd = rows.dimensions(), wd = weight.dimensions();
  if (rd.size() != 2 || wd.size() != 2 || rd[1] != wd[0]) {
    return ffi::Error::InvalidArgument("dense matvec: rows [P, K], weight [K, N]");
  }
  const int64_t p = rd[0], k = rd[1], n = wd[1];
  using W = WeightBits<kWeight>;
  const W* w = reinterpret_cast<const W*>(weight.typed_data());
  const int64_t blocks = std::clamp<int64_t>(k / kDenseRowsPerTask, 1, kDenseTasksPerThread * pool.num_threads());
  const int64_t rows_per_block = (k + blocks - 1) / blocks;
  float* o = out->typed_data();
  std::vector<float> partials((blocks - 1) * p * n);  // block 0 sums straight into out
  auto partial = [&](int64_t block) { return block ? partials.data() + (block - 1) * p * n : o; };
  const float* x = rows.typed_data();
  parallel_for(pool, blocks, [&](int64_t block) {
    const int64_t begin = block * rows_per_block;
    const int64_t end = std::min(k, begin + rows_per_block);
    // Narrow weights one row at a time (one sequential stream reads faster than four interleaved ones), wide
    // ones four (each output vector read and written once per four weight rows). The sums are the same.
    if (n <= kDenseNarrow) {
      dense_block<1>(x, p, w, k, n, begin, end, partial(block));
    } else {
      dense_block<4>(x, p, w, k, n, begin, end, partial(block));
    }
  });
  for (int64_t block = 1; block < blocks; ++block) {
    const float* sums = partial(block);
    for (int64_t i = 0; i < p * n; ++i) o[i] += sums[i];
  }
  return ffi::Error::Success();
}

// --- Row dots: out[g, p, n] = x[g, p, :] . w[g, n, :] for a few rows p, each row of w read once ---------------
// Decode attention's products with weights or cache rows stored [rows, K]: the absorbed key and value
// up-projections (g: heads) and the scores over the cache (g: the batch; p: heads). XLA:CPU runs each on one
// thread at a fraction of the read bandwidth.
constexpr int64_t kRowDotRowsPerTask = 64;

// out[p * n_out + i] = x[p] . w[i] for kRows rows of x (its row stride k) and w's rows [begin, end).
template <int kRows, typename W>
void row_dots(const float* x, const W* w, int64_t k, int64_t begin, int64_t end, float* out, int64_t n_out) {
  const int64_t vectors = k / 16;
  for (int64_t i = begin; i < end; ++i) {
    const W* row = w + i * k;
    Floats16 acc[kRows] = {};
    for (int64_t v = 0; v < vectors; ++v) {
      const Floats16 weights = widen(row + 16 * v);
      for (int r = 0; r < kRows; ++r) acc[r] += load<Floats16>(x + r * k + 16 * v) * weights;
    }
    for (int r = 0; r < kRows; ++r) {
      float sum = 0.0f;
      for (int lane = 0; lane < 16; ++lane) sum += acc[r][lane];
      for (int64_t c = 16 * vectors; c < k; ++c) sum += x[r * k + c] * to_float(row[c]);
      out[r * n_out + i] = sum;
    }
  }
}

template <ffi::DataType kWeight>
ffi::Error RowDot(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<kWeight> w,
                  ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 3 || wd.size() != 3 || xd[0] != wd[0] || xd[2] != wd[2]) {
    return ffi::Error::InvalidArgument("row dot: x [G, P, K], w [G, N, K]");
  }
  const int64_t groups = xd[0], rows = xd[1], k = xd[2], n = wd[1];
  const int64_t blocks = (n + kRowDotRowsPerTask - 1) / kRowDotRowsPerTask;
  using W = WeightBits<kWeight>;
  const float* xs = x.typed_data();
  const W* ws = reinterpret_cast<const W*>(w.typed_data());
  float* o = out->typed_data();
  parallel_for(pool, groups * blocks, [&](int64_t task) {
    const int64_t g = task / blocks, begin = task % blocks * kRowDotRowsPerTask;
    const int64_t end = std::min(n, begin + kRowDotRowsPerTask);
    const W* wg = ws + g * n * k;
    for (int64_t p = 0; p < rows;) {  // x's rows 8, 4, 2 or 1 at a time: accumulators in registers
      const float* xp = xs + (g * rows + p) * k;
      float* op = o + (g * rows + p) * n;
      const int64_t left = rows - p;
      if (left >= 8) {
        row_dots<8>(xp, wg, k, begin, end, op, n), p += 8;
      } else if (left >= 4) {
        row_dots<4>(xp, wg, k, begin, end, op, n), p += 4;
      } else if (left >= 2) {
        row_dots<2>(xp, wg, k, begin, end, op, n), p += 2;
      } else {
        row_dots<1>(xp, wg, k, begin, end, op, n), p += 1;
      }
    }
  });
  return ffi::Error::Success();
}

// The dense matvec's and the row dot's signature: fp32 rows and a weight of kWeight in, fp32 out.
template <ffi::DataType kWeight>
auto fp32_rows_times() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<kWeight>>()
      .template Ret<ffi::Buffer<ffi::F32>>();  // ``template``: the builder's type depends on kWeight
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdd_int4_gathered_matvec, Int4GatheredMatvec,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdd_dense_matvec_f32, DenseMatvec<ffi::DataType::F32>,
                              fp32_rows_times<ffi::DataType::F32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdd_dense_matvec_bf16, DenseMatvec<ffi::DataType::BF16>,
                              fp32_rows_times<ffi::DataType::BF16>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdd_row_dot_f32, RowDot<ffi::DataType::F32>, fp32_rows_times<ffi::DataType::F32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdd_row_dot_bf16, RowDot<ffi::DataType::BF16>, fp32_rows_times<ffi::DataType::BF16>());
