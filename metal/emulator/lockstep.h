// Threadgroups of a GPU kernel run on the CPU, with the lanes of each SIMD group in lock-step.
//
// Every thread is a coroutine: the kernel language's shims turn the builtins where threads meet
// (a SIMD shuffle, a threadgroup barrier) into co_await on the objects below. The scheduler
// resumes each lane of a 32-lane SIMD group until it meets its group again: a shuffle completes
// only once all lanes sit at the same shuffle, having met as many times; a barrier only once every
// thread of the threadgroup sits at the same barrier. A lane that skips either, or finishes
// while others wait, aborts the run. SIMD groups run one at a time from barrier to barrier and
// threadgroup memory starts out as NaN bytes, so a missing barrier shows up as reads of NaN.
#pragma once

#include <cmath>
#include <coroutine>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace emu {

struct uint3 {
  uint32_t x, y, z;
};

// bfloat16 as the GPUs store it: the upper half of a float, rounded to nearest even.
struct bfloat16 {
  uint16_t bits;
  bfloat16() = default;
  bfloat16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    bits = std::isnan(f) ? uint16_t(0x7fc0) : uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  operator float() const {
    const uint32_t u = uint32_t(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};

// Where one thread sits in the launch, named as Metal's attribute variables.
struct Attributes {
  uint32_t dispatch_quadgroups_per_threadgroup, dispatch_simdgroups_per_threadgroup;
  uint3 dispatch_threads_per_threadgroup, grid_origin, grid_size;
  uint32_t quadgroup_index_in_threadgroup, quadgroups_per_threadgroup;
  uint32_t simdgroup_index_in_threadgroup, simdgroups_per_threadgroup;
  uint32_t thread_execution_width, thread_index_in_quadgroup, thread_index_in_simdgroup;
  uint32_t thread_index_in_threadgroup;
  uint3 thread_position_in_grid, thread_position_in_threadgroup, threadgroup_position_in_grid;
  uint3 threadgroups_per_grid, threads_per_grid;
  uint32_t threads_per_simdgroup;
  uint3 threads_per_threadgroup;
};

inline Attributes attributes(uint3 grid, uint3 tg, uint3 group, uint32_t i) {
  const uint32_t size = tg.x * tg.y * tg.z;
  const uint3 local = {i % tg.x, (i / tg.x) % tg.y, i / (tg.x * tg.y)};
  Attributes a;
  a.dispatch_quadgroups_per_threadgroup = a.quadgroups_per_threadgroup = (size + 3) / 4;
  a.dispatch_simdgroups_per_threadgroup = a.simdgroups_per_threadgroup = (size + 31) / 32;
  a.dispatch_threads_per_threadgroup = a.threads_per_threadgroup = tg;
  a.grid_origin = {0, 0, 0};
  a.grid_size = a.threads_per_grid = grid;
  a.quadgroup_index_in_threadgroup = i / 4;
  a.simdgroup_index_in_threadgroup = i / 32;
  a.thread_execution_width = a.threads_per_simdgroup = 32;
  a.thread_index_in_quadgroup = i % 4;
  a.thread_index_in_simdgroup = i % 32;
  a.thread_index_in_threadgroup = i;
  a.thread_position_in_grid = {group.x * tg.x + local.x, group.y * tg.y + local.y, group.z * tg.z + local.z};
  a.thread_position_in_threadgroup = local;
  a.threadgroup_position_in_grid = group;
  a.threadgroups_per_grid = {grid.x / tg.x, grid.y / tg.y, grid.z / tg.z};
  return a;
}

enum class Point { running, shuffle, barrier, done };

// One thread of the threadgroup: its coroutine, where it stopped, and its shuffle payload.
struct Thread {
  Attributes where;
  std::coroutine_handle<> handle;
  Point at = Point::running;
  int line = 0;
  uint64_t meetings = 0;  // shuffles and barriers reached so far
  uint64_t barriers = 0;  // barriers reached so far
  uint64_t send = 0;
  uint64_t receive = 0;
  unsigned mask = 0;
};

inline Thread* current = nullptr;        // the thread running now
inline std::coroutine_handle<> created;  // the coroutine the last kernel call made

// Suspends the running thread at a barrier until the scheduler resumes it.
struct Barrier {
  int line;
  bool await_ready() const noexcept { return false; }
  void await_suspend(std::coroutine_handle<>) const noexcept {
    current->at = Point::barrier;
    current->line = line;
    ++current->meetings;
    ++current->barriers;
  }
  void await_resume() const noexcept {}
};

// Suspends the running thread at a shuffle; it resumes with the value of lane (its lane ^ mask).
template <typename T>
struct Shuffle {
  T value;
  unsigned mask;
  int line;
  bool await_ready() const noexcept { return false; }
  void await_suspend(std::coroutine_handle<>) noexcept {
    static_assert(sizeof(T) <= sizeof(uint64_t), "a shuffle of a type over 8 bytes");
    std::memcpy(&current->send, &value, sizeof(T));
    current->mask = mask;
    current->at = Point::shuffle;
    current->line = line;
    ++current->meetings;
  }
  T await_resume() const noexcept {
    T out;
    std::memcpy(&out, &current->receive, sizeof(T));
    return out;
  }
};

template <typename T>
Shuffle<T> shuffle_xor(T value, unsigned mask, int line) {
  return {value, mask, line};
}

[[noreturn]] inline void fail(const char* what, int group, int thread, int line, int other_line) {
  std::fprintf(stderr,
               "emulation: threadgroup %d, thread %d (SIMD group %d, lane %d) %s: it is at line %d, "
               "the others at line %d\n",
               group, thread, thread / 32, thread % 32, what, line, other_line);
  std::exit(3);
}

}  // namespace emu

// A kernel returns void: this makes such a function a coroutine that starts suspended.
template <typename... Args>
struct std::coroutine_traits<void, Args...> {
  struct promise_type {
    promise_type() { emu::created = std::coroutine_handle<promise_type>::from_promise(*this); }
    void get_return_object() {}
    std::suspend_always initial_suspend() noexcept { return {}; }
    std::suspend_always final_suspend() noexcept { return {}; }
    void return_void() {}
    void unhandled_exception() { std::abort(); }
  };
};

// Threadgroup (shared) variables are function statics in one section, refilled with NaN bytes
// for each threadgroup.
#define EMU_THREADGROUP __attribute__((section("emu_threadgroup"))) static
extern "C" char __start_emu_threadgroup[] __attribute__((weak));
extern "C" char __stop_emu_threadgroup[] __attribute__((weak));

namespace emu {

// Runs lanes [first, last) of a SIMD group in lock-step until all sit at a barrier or are done.
inline void run_simdgroup(std::vector<Thread>& threads, int first, int last, int group) {
  for (;;) {
    for (int i = first; i < last; ++i) {
      Thread& t = threads[i];
      if (t.at == Point::running) {
        current = &t;
        t.handle.resume();
        if (t.handle.done()) {
          t.at = Point::done;
        }
      }
    }
    const Thread& lead = threads[first];
    for (int i = first + 1; i < last; ++i) {
      const Thread& t = threads[i];
      if (t.at != lead.at || (t.at != Point::done && (t.line != lead.line || t.meetings != lead.meetings))) {
        const char* what = t.at == Point::done          ? "finished while its SIMD group waits"
                           : lead.at == Point::done     ? "waits while its SIMD group finished"
                           : t.meetings < lead.meetings ? "skipped a shuffle or barrier its SIMD group met"
                           : t.meetings > lead.meetings ? "met a shuffle or barrier its SIMD group skipped"
                           : t.at == Point::shuffle     ? "is at a shuffle its SIMD group skipped"
                                                        : "is at a barrier its SIMD group skipped";
        fail(what, group, i, t.line, lead.line);
      }
    }
    if (lead.at != Point::shuffle) {
      return;
    }
    for (int i = first; i < last; ++i) {
      const int source = first + ((i - first) ^ int(threads[i].mask));
      if (source < first || source >= last) {
        fail("shuffles from a lane outside its SIMD group", group, i, threads[i].line, threads[i].line);
      }
      threads[i].receive = threads[source].send;
    }
    for (int i = first; i < last; ++i) {
      threads[i].at = Point::running;
    }
  }
}

// Runs one threadgroup; `call(attributes)` calls the kernel as the thread those attributes place.
template <typename Call>
void run_threadgroup(uint3 grid, uint3 tg, uint3 position, int group, Call& call) {
  if (__start_emu_threadgroup != nullptr) {
    std::memset(__start_emu_threadgroup, 0xff, size_t(__stop_emu_threadgroup - __start_emu_threadgroup));
  }
  const int size = int(tg.x * tg.y * tg.z);
  std::vector<Thread> threads(size);
  for (int i = 0; i < size; ++i) {
    threads[i].where = attributes(grid, tg, position, uint32_t(i));
    current = &threads[i];
    created = nullptr;
    call(threads[i].where);
    threads[i].handle = created;
    // A body with no shuffle or barrier is a plain function: the call above ran it.
    threads[i].at = created ? Point::running : Point::done;
  }
  for (;;) {
    for (int first = 0; first < size; first += 32) {
      run_simdgroup(threads, first, first + 32 < size ? first + 32 : size, group);
    }
    const Thread& lead = threads[0];
    for (int i = 32; i < size; i += 32) {
      if (threads[i].at != lead.at || threads[i].line != lead.line || threads[i].barriers != lead.barriers) {
        fail(threads[i].at == Point::done ? "finished while its threadgroup waits at a barrier"
                                          : "is at a barrier its threadgroup skipped",
             group, i, threads[i].line, lead.line);
      }
    }
    if (lead.at == Point::done) {
      break;
    }
    for (Thread& t : threads) {
      t.at = Point::running;
    }
  }
  for (Thread& t : threads) {
    if (t.handle) {
      t.handle.destroy();
    }
  }
}

// Runs every threadgroup of a grid given in threads (a whole number of threadgroups each way).
template <typename Call>
void dispatch(uint3 grid, uint3 tg, Call call) {
  int index = 0;
  for (uint32_t z = 0; z < grid.z / tg.z; ++z) {
    for (uint32_t y = 0; y < grid.y / tg.y; ++y) {
      for (uint32_t x = 0; x < grid.x / tg.x; ++x, ++index) {
        run_threadgroup(grid, tg, {x, y, z}, index, call);
      }
    }
  }
}

}  // namespace emu
