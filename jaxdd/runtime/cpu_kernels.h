// What the CPU kernels share (jaxdd/runtime/cpu_kernels.cc, cpu_attention.cc): loads, bf16 widening and the
// parallel loop over XLA's intra-op threads.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxdd {

template <typename T>
inline T load(const void* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline float bf16_to_float(uint32_t bits) {
  uint32_t wide = bits << 16;
  float f;
  std::memcpy(&f, &wide, sizeof f);
  return f;
}

// Runs task(i) for i in [0, count) on the calling thread and on XLA's intra-op pool. Tasks are taken from a shared
// counter; the caller waits only for tasks already taken, never for a pool thread to start, so a busy pool cannot
// deadlock it (a pool thread that starts late finds nothing left and touches nothing but the counter).
template <typename Task>
void parallel_for(ffi::ThreadPool& pool, int64_t count, Task task) {
  struct Shared {
    Shared(Task task, int64_t count) : task(std::move(task)), count(count) {}
    Task task;
    int64_t count;
    std::atomic<int64_t> next{0}, finished{0};
    void work() {
      for (int64_t i; (i = next.fetch_add(1)) < count;) {
        task(i);
        finished.fetch_add(1, std::memory_order_release);
      }
    }
  };
  auto shared = std::make_shared<Shared>(std::move(task), count);
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), count) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([shared] { shared->work(); });
  shared->work();
  while (shared->finished.load(std::memory_order_acquire) < count) std::this_thread::yield();
}

typedef float Floats16 __attribute__((vector_size(16 * sizeof(float))));

inline Floats16 widen(const float* w) { return load<Floats16>(w); }
inline Floats16 widen(const uint16_t* w) {  // bf16 -> fp32 is a shift
  typedef uint16_t Halves16 __attribute__((vector_size(16 * sizeof(uint16_t))));
  typedef uint32_t Words16 __attribute__((vector_size(16 * sizeof(uint32_t))));
  return (Floats16)(__builtin_convertvector(load<Halves16>(w), Words16) << 16);
}
template <ffi::DataType kWeight>  // how a weight's elements are read: fp32, or bf16 as its 16 bits
using WeightBits = std::conditional_t<kWeight == ffi::DataType::F32, float, uint16_t>;
inline float to_float(float w) { return w; }
inline float to_float(uint16_t w) { return bf16_to_float(w); }

}  // namespace jaxdd
