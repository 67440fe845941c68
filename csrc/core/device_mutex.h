// The device lock (DeviceAllocator::mu_).
//
// Note [The device lock]
// Every allocation and free takes the device lock once. std::mutex goes through
// pthread_mutex_lock / unlock, which check the mutex's kind and owner on every call:
// about 160 instructions a round trip (a free and an allocation), an eighth of the
// core's whole round trip over the host stand-in. The lock is never recursive and never
// waited on through a condition variable, so it needs no more than an atomic word:
// 0 free, 1 held, 2 held with a thread asleep on it. Taking a free lock is one
// compare-exchange and giving it back one exchange; a thread that finds it held spins
// briefly (the lock is held for well under a microsecond on the allocation path), then
// sleeps on the word with a futex, marking it 2 so that the holder wakes one sleeper
// when it lets go. Meets the standard's Lockable: std::unique_lock<DeviceMutex> works.
#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <mutex>

namespace tb {

class DeviceMutex {
 public:
  DeviceMutex() = default;
  DeviceMutex(const DeviceMutex&) = delete;
  DeviceMutex& operator=(const DeviceMutex&) = delete;

  void lock() {
    int expected = kFree;
    if (!word_.compare_exchange_strong(expected, kHeld, std::memory_order_acquire, std::memory_order_relaxed))
      lock_held();
  }
  bool try_lock() {
    int expected = kFree;
    return word_.compare_exchange_strong(expected, kHeld, std::memory_order_acquire, std::memory_order_relaxed);
  }
  void unlock() {
    if (word_.exchange(kFree, std::memory_order_release) == kSleeping) wake_one();
  }

 private:
  static constexpr int kFree = 0, kHeld = 1, kSleeping = 2;
  static constexpr int kSpins = 128;

  void lock_held() {
    for (int i = 0; i < kSpins; ++i) {
      relax();
      if (word_.load(std::memory_order_relaxed) == kFree && try_lock()) return;
    }
    // Marked 2 whoever held it: a thread that takes it here leaves it 2, so its unlock wakes
    // any other sleeper (at worst one futex call too many).
    while (word_.exchange(kSleeping, std::memory_order_acquire) != kFree)
      syscall(SYS_futex, reinterpret_cast<int*>(&word_), FUTEX_WAIT_PRIVATE, kSleeping, nullptr, nullptr, 0);
  }
  static void relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
  }
  void wake_one() { syscall(SYS_futex, reinterpret_cast<int*>(&word_), FUTEX_WAKE_PRIVATE, 1, nullptr, nullptr, 0); }

  std::atomic<int> word_{kFree};
  static_assert(sizeof(std::atomic<int>) == sizeof(int), "the futex waits on the atomic's word");
};

using DeviceLock = std::unique_lock<DeviceMutex>;

}  // namespace tb
