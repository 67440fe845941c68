// How much time the VMM route may spend moving memory to pack it.
//
// Note [Packing time]
// Packing (Note [Packing: reclaim before growth], route_vmm.h) moves memory: clean free
// mappings go back to the driver so that a new one stays within the packing line. A move
// costs driver time, about 50 us plus 2 us per MiB per mapping on an H200 (measured with
// torch-budget replay's device-call counts). A tight loop of large churn (lognormal sizes
// around 16 MiB, a move on most large allocations) spent 1.6x the native allocator's time
// that way. So moves draw on a budget of wall-clock time: credit accrues at `share` of the
// time that passes, up to kBurst, and each move spends what it took. Without credit, an
// allocation grows past the line instead, and what it maps serves later allocations without
// moving. A workload with kernels between its allocations never runs out; a tight loop of
// churn spends at most about `share` of its time packing, and packs looser. The budget's
// refusals are not moves: they reclaim whatever the credit.
//
// Lock rule: used only under the owning DeviceAllocator's mutex.
#pragma once

#include <algorithm>
#include <chrono>

namespace tb {

class PackingTime {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr double kDefaultShare = 0.05;
  static constexpr std::chrono::milliseconds kBurst{20};

  // share <= 0: never move; share >= 1: always.
  void set_share(double share) { share_ = share; }
  double share() const { return share_; }

  // Whether a move may start now; moved() when it is done.
  bool may_move() {
    const Clock::time_point now = Clock::now();
    start_ = now;
    if (share_ >= 1.0) return true;
    if (share_ <= 0.0) return false;
    credit_ = std::min<Clock::duration>(
        credit_ + std::chrono::duration_cast<Clock::duration>((now - last_) * share_), kBurst);
    last_ = now;
    return credit_.count() > 0;
  }
  void moved() {
    const Clock::time_point now = Clock::now();
    if (share_ < 1.0) credit_ -= now - start_;
    last_ = now;  // time spent moving earns no credit
  }

 private:
  double share_ = kDefaultShare;
  Clock::duration credit_ = kBurst;
  Clock::time_point last_ = Clock::now();
  Clock::time_point start_;
};

}  // namespace tb
