// Gathered INT4 matvecs for XLA:CPU (loaded by jaxdd/int4_cpu.py): out[p] = rows[p] @ W[chosen[p]]^T, where W is
// one projection's stacked routed experts in compressed-tensors pack-quantized form (jaxdd/quant.py). Each weight
// is dequantized in registers exactly as the XLA path does (bf16(q * scale), q = nibble - 8) and used once: the
// chosen experts' INT4 words are read once and nothing dense is written (XLA:CPU gathers, unpacks to a dense
// copy, then multiplies).
//
// GCC/Clang vector extensions, not intrinsics (but for the FMA): -march=native picks AVX2, AVX-512 or NEON.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#ifdef __FMA__
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kLanes = 8;  // INT4 values per int32 word, and floats per vector
typedef float Floats __attribute__((vector_size(kLanes * sizeof(float))));
typedef uint32_t Words __attribute__((vector_size(kLanes * sizeof(uint32_t))));
typedef int32_t Ints __attribute__((vector_size(kLanes * sizeof(int32_t))));

constexpr int64_t kBlock = kLanes * kLanes;  // inputs per block: 8 words, lane j holding word j's 8 values
constexpr int64_t kRowsPerChunk = 64;  // output rows one task takes at a time
// Veltkamp's split c - (c - p), c = p * (2^16 + 1), is p rounded to bf16's 8 significant bits, ties to even (for
// all 16 x 65536 products q x scale, tests/test_int4_cpu.py); c overflows past this scale, where the bit form runs.
constexpr float kSplitLimit = 0x1p100f;

inline Floats fma(Floats a, Floats b, Floats c) {
#ifdef __FMA__
  return (Floats)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;  // compiled with -ffp-contract=off: the split below must not be fused
#endif
}

template <typename T>
inline T load(const void* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline float bf16_to_float(uint16_t bits) {
  uint32_t wide = uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof f);
  return f;
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

// One row's dot product: sum_k x[k] * bf16(q[k] * scale[group of k]), a block of 8 words at a time. ``xt`` is x
// transposed per block to match the words (vector i of a block, lane j = input 8j + i: value i of word j) and
// zero-padded to whole blocks; ``half_group`` maps each 4-word half-block to its scale group (groups are whole
// halves: a multiple of 32 inputs), so lanes 0-3 and 4-7 each need one scale.
float dot_row(const float* xt, const uint32_t* words, const uint16_t* scales, int64_t words_per_row,
              const int32_t* half_group) {
  Floats acc[2] = {};
  for (int64_t first = 0, b = 0; first < words_per_row; first += kLanes, ++b) {
    Words block;
    if (first + kLanes <= words_per_row) {
      block = load<Words>(words + first);
    } else {  // a partial last block: its padding words meet zero inputs
      uint32_t padded[kLanes] = {};
      std::copy(words + first, words + words_per_row, padded);
      block = load<Words>(padded);
    }
    const float lo = bf16_to_float(scales[half_group[2 * b]]), hi = bf16_to_float(scales[half_group[2 * b + 1]]);
    const Floats scale = {lo, lo, lo, lo, hi, hi, hi, hi};
    if (std::fabs(lo) < kSplitLimit && std::fabs(hi) < kSplitLimit) {
      dot_block<true>(block, xt + b * kBlock, scale, scale * 65537.0f, acc);
    } else {
      dot_block<false>(block, xt + b * kBlock, scale, scale, acc);
    }
  }
  const Floats sum = acc[0] + acc[1];
  float total = 0.0f;
  for (int i = 0; i < kLanes; ++i) total += sum[i];
  return total;
}

struct Problem {
  std::vector<float> xt;           // [P, blocks * 64]: each row transposed per block, zero-padded
  std::vector<int32_t> half_group;  // [blocks * 2]: the scale group of each 4-word half-block
  const uint32_t* packed;           // [E, N, K / 8]
  const uint16_t* scale;            // [E, N, K / group] bf16 bits
  const int32_t* chosen;            // [P]
  float* out;                       // [P, N]
  int64_t experts, n, words_per_row, groups, blocks;
};

// Output rows [begin, end) of the flattened [P, N] result.
void run_rows(const Problem& pr, int64_t begin, int64_t end) {
  for (int64_t row = begin; row < end; ++row) {
    const int64_t p = row / pr.n, n = row % pr.n;
    const int64_t e = std::clamp<int64_t>(pr.chosen[p], 0, pr.experts - 1);  // as XLA's gather clamps
    const int64_t weight_row = e * pr.n + n;
    pr.out[row] = dot_row(pr.xt.data() + p * pr.blocks * kBlock, pr.packed + weight_row * pr.words_per_row,
                          pr.scale + weight_row * pr.groups, pr.words_per_row, pr.half_group.data());
  }
}

// Chunks are taken from a shared counter by the calling thread and by tasks on XLA's intra-op pool; the caller
// waits only for chunks already taken, never for a task to start, so a busy pool cannot deadlock it.
struct Chunks {
  Problem problem;
  int64_t total_rows, count;
  std::atomic<int64_t> next{0}, finished{0};

  void work() {
    for (int64_t c; (c = next.fetch_add(1)) < count;) {
      run_rows(problem, c * kRowsPerChunk, std::min(total_rows, (c + 1) * kRowsPerChunk));
      finished.fetch_add(1, std::memory_order_release);
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
  const int64_t pairs = rd[0], k = rd[1], words_per_row = pd[2], blocks = (words_per_row + kLanes - 1) / kLanes;
  auto chunks = std::make_shared<Chunks>();
  Problem& pr = chunks->problem;
  pr = {std::vector<float>(pairs * blocks * kBlock, 0.0f),
        std::vector<int32_t>(blocks * 2),
        reinterpret_cast<const uint32_t*>(packed.typed_data()),
        scale.typed_data(),
        chosen.typed_data(),
        out->typed_data(),
        pd[0], pd[1], words_per_row, sd[2], blocks};
  const float* x = rows.typed_data();
  for (int64_t p = 0; p < pairs; ++p) {
    for (int64_t i = 0; i < k; ++i) {  // input i is value i % 8 of word i / 8: lane (i / 8) % 8 of vector i % 8
      const int64_t b = i / kBlock, word = (i / kLanes) % kLanes, value = i % kLanes;
      pr.xt[(p * blocks + b) * kBlock + value * kLanes + word] = x[p * k + i];
    }
  }
  const int64_t words_per_group = words_per_row / sd[2];
  for (int64_t h = 0; h < blocks * 2; ++h) pr.half_group[h] = std::min<int64_t>(4 * h / words_per_group, sd[2] - 1);
  chunks->total_rows = pairs * pd[1];
  chunks->count = (chunks->total_rows + kRowsPerChunk - 1) / kRowsPerChunk;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), chunks->count) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([chunks] { chunks->work(); });
  chunks->work();
  while (chunks->finished.load(std::memory_order_acquire) < chunks->count) std::this_thread::yield();
  return ffi::Error::Success();
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
