// The budget: one object per device that every route charges before it takes
// memory from the driver.
//
// Note [The budget is a layer]
// A route never decides on its own whether memory may be taken. It asks the
// device's Budget for a Charge (check and take the bytes at once, like RMM's limiting
// adaptor), asks the driver, and commits the Charge only when the driver said yes;
// a Charge that goes out of scope uncommitted gives the bytes back. The Budget alone
// writes the ledger's reserved counters (per route, small/large pool, graph pools)
// and alone explains an out-of-memory failure, so a new route cannot forget the
// limit or count memory in a way the others do not.
//
// Lock rule: used only under the owning DeviceAllocator's mutex; the limit itself is
// atomic so that stats can read it without the lock.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include "ledger.h"

namespace tb {

// Where reserved bytes are counted.
struct Placement {
  int route;
  bool small;       // small pool (segments for requests <= 1 MiB) vs large pool
  bool graph_pool;  // held by a private (graph / MemPool) pool
};

class Budget {
 public:
  Budget(int device, Ledger& ledger) : device_(device), ledger_(ledger) {}

  static constexpr int64_t kNone = INT64_MAX;
  // The one rule for a budget given as bytes or as a fraction of the card: bytes when
  // >= 0, else the fraction (0, 1] of `total`, else none.
  static int64_t resolve(int64_t bytes, double fraction, size_t total);
  int64_t limit() const { return limit_.load(std::memory_order_relaxed); }
  void set_limit(int64_t bytes) { limit_.store(bytes, std::memory_order_relaxed); }
  int64_t reserved() const { return ledger_.reserved_bytes.s[kAggregate].get(); }

  // Whether `bytes` more stays within the limit, for any size (no overflow). When
  // not, records kOutOfMemory and remembers that the budget refused.
  bool fits(size_t bytes);
  // Takes `bytes` of new driver memory at `where`; false (kOutOfMemory) if over.
  bool charge(size_t bytes, const Placement& where);
  // Counts bytes the driver already handed out (a pool that grew by more than was
  // asked); the caller rolls back what exceeds the limit.
  void charge_unchecked(size_t bytes, const Placement& where);
  void uncharge(size_t bytes, const Placement& where);
  // Moves reserved bytes between placements (a cached VMM granule mapped into an
  // arena); the total is unchanged.
  void move(size_t bytes, const Placement& from, const Placement& to);

  // Why the last failed charge failed: the budget (true) or something else.
  // Atomic: the bridge reads it after the allocation returned, without the device lock.
  bool refused() const { return refused_.load(std::memory_order_relaxed); }
  void clear_refusal() { refused_.store(false, std::memory_order_relaxed); }

  std::string describe() const;
  // torch's own first sentence, then ours: what was asked, why it failed, the
  // numbers, and the setting to change.
  std::string oom_message(size_t size, int route, const std::string& tag, const std::string& cause,
                          size_t device_free, size_t device_total) const;

 private:
  void place(size_t bytes, const Placement& where, bool add);

  const int device_;
  Ledger& ledger_;
  std::atomic<int64_t> limit_{kNone};
  std::atomic<bool> refused_{false};
};

// A charge that rolls back unless committed.
class Charge {
 public:
  Charge(Budget& budget, size_t bytes, const Placement& where)
      : budget_(budget), bytes_(bytes), where_(where), ok_(budget.charge(bytes, where)) {}
  ~Charge() {
    if (ok_ && !committed_) budget_.uncharge(bytes_, where_);
  }
  Charge(const Charge&) = delete;
  Charge& operator=(const Charge&) = delete;
  bool ok() const { return ok_; }
  void commit() { committed_ = true; }

 private:
  Budget& budget_;
  size_t bytes_;
  Placement where_;
  bool ok_;
  bool committed_ = false;
};

// Sizes the way torch prints them ("20.00 MiB", "512 bytes").
std::string format_size(uint64_t bytes);

}  // namespace tb
