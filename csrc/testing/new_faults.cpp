// A failing operator new, preloaded by tests/test_core_exceptions.py: once armed with n, the
// n-th allocation made outside the host stand-in (which pauses it: host_driver.cpp) throws
// std::bad_alloc, as a process whose host memory ran out would see it. The two callers below
// stand in for torch, which would catch an exception out of the allocator and go on.
#include <atomic>
#include <cstdlib>
#include <new>

namespace {

std::atomic<long> countdown{0};  // 0: off
thread_local int paused = 0;

void* take(std::size_t n) {
  if (paused == 0 && countdown.load(std::memory_order_relaxed) > 0 && --countdown == 0) throw std::bad_alloc();
  if (void* p = std::malloc(n != 0 ? n : 1)) return p;
  throw std::bad_alloc();
}

}  // namespace

void* operator new(std::size_t n) { return take(n); }
void* operator new[](std::size_t n) { return take(n); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }

extern "C" {

void tb_new_faults_pause(int by) { paused += by; }
void tb_new_faults_arm(long n) { countdown.store(n); }
long tb_new_faults_left(void) { return countdown.load(); }

// 0: the call returned; 1: an exception came out of it.
int tb_new_faults_malloc(void* fn, long size, int device, void* stream, void** out) {
  try {
    *out = reinterpret_cast<void* (*)(long, int, void*)>(fn)(size, device, stream);
    return 0;
  } catch (...) {
    return 1;
  }
}

int tb_new_faults_free(void* fn, void* ptr) {
  try {
    reinterpret_cast<void (*)(void*, long, int, void*)>(fn)(ptr, 0, 0, nullptr);
    return 0;
  } catch (...) {
    return 1;
  }
}

}  // extern "C"
