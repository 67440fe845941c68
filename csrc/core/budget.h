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
// Note [Tag budgets]
// A tag may have a budget of its own: a limit on the bytes allocated under it (blocks
// as torch counts them), on every route and in the graph pools created under it. It is
// checked at each allocation under the tag or into one of those pools (whatever scope is
// open then), before any memory is taken and again on the exact block, and it only ever
// lowers what the device budget allows, which still holds
// for every allocation. Only freeing the tag's tensors makes room (emptying the cache
// does not); a released tag keeps its allocations counted, since a restore brings them
// back. A refusal is an out-of-memory error that names the tag, its budget, its use and
// the knob, and leaves every other tag serving.
//
// Note [Tag families]
// The adapters keep one stack tag's memory under several tags, one per backup mode ("kv" and
// "kv+cpu": a release backs a whole tag up one way), while a plan bounds the stack's tag
// as one line. So a tag named "X+suffix" belongs to X's family: its allocations count toward
// X's budget as well as its own, and the budget of X bounds X and every "X+..." together
// (the part before the first '+' names the family; a name without one heads its own). Each
// tag keeps its own figures in the ledger; a refusal by the family's budget names X and says
// the allocation's tag counts toward it.
//
// Lock rule: used only under the owning DeviceAllocator's mutex; the limits themselves
// are atomic so that stats can read them without the lock.
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
  Budget(int device, Ledger& ledger) : device_(device), ledger_(ledger) {
    for (auto& l : tag_limit_) l.store(kNone, std::memory_order_relaxed);
  }

  static constexpr int64_t kNone = INT64_MAX;
  // The one rule for a budget given as bytes or as a fraction of the card: bytes when
  // >= 0, else the fraction (0, 1] of `total`, else none.
  static int64_t resolve(int64_t bytes, double fraction, size_t total);
  int64_t limit() const { return limit_.load(std::memory_order_relaxed); }
  void set_limit(int64_t bytes) { limit_.store(bytes, std::memory_order_relaxed); }
  int64_t reserved() const { return ledger_.reserved_bytes.s[kAggregate].get(); }
  // What the limit still admits past what is reserved (negative when over it).
  int64_t room() const { return limit() - reserved(); }

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

  // Why the last failed charge failed: the budget (true) or something else. Under the device
  // lock, of whichever thread charged last: a caller that lets the lock go keeps what it read
  // before (DeviceAllocator::malloc, OomFigures).
  bool refused() const { return refused_; }
  void clear_refusal() { refused_ = false; }

  // Note [Tag budgets]: kNone for a tag without one.
  int64_t tag_limit(int tag) const { return tag_limit_[tag].load(std::memory_order_relaxed); }
  void set_tag_limit(int tag, int64_t bytes) { tag_limit_[tag].store(bytes, std::memory_order_relaxed); }
  int64_t tag_used(int tag) const { return ledger_.tag[tag].allocated.get(); }
  // Note [Tag families]: what `tag` and every tag of its family hold (tag_used for a tag
  // without members).
  int64_t family_used(int tag) const;
  // family_used as text, then, when its members hold any of it, each tag holding some, in id order
  // ("5.00 MiB: 'kv' 2.00 MiB, 'kv+cpu' 3.00 MiB").
  std::string family_use(int tag) const;
  // The list of family_use alone ("'kv' 2.00 MiB, 'kv+cpu' 3.00 MiB"); empty when `tag` holds all of it.
  std::string family_holders(int tag) const;
  // The arguments of a tag's budget: a known tag, a fraction at most 1. false + kInvalidArgument.
  static bool check_tag_setting(int tag, double fraction);
  // What `tag` may still allocate under its budget and its family's (Note [Tag families]):
  // kNone without either, negative when over one.
  int64_t tag_room(int tag) const;
  // The tag whose budget leaves `tag` the least room: `tag`, or the head of its family.
  int binding_tag(int tag) const;
  // Whether `bytes` more allocated under `tag` stays within the tag's budget.
  bool tag_fits(int tag, size_t bytes) const {
    const int64_t room = tag_room(tag);
    return room == kNone || (room >= 0 && bytes <= static_cast<uint64_t>(room));
  }
  // `charged`: the bytes the allocation would have counted (its block, rounded).
  std::string tag_oom_message(size_t size, size_t charged, int tag, const std::string& name, size_t device_free,
                              size_t device_total) const;

  std::string describe() const;
  // torch's own first sentence, then ours: what was asked, why it failed (`by_budget`: the
  // budget refused it, else the driver, for `cause`), the numbers, and the setting to change;
  // `retried`: an allocation that released the cache and tried again first (a tag's restore
  // does neither).
  std::string oom_message(size_t size, int route, const std::string& tag, const std::string& cause, bool by_budget,
                          size_t device_free, size_t device_total, bool retried = true) const;

 private:
  void place(size_t bytes, const Placement& where, bool add);
  // torch's own first sentence of an out-of-memory message.
  std::string torch_head(size_t size, size_t device_free, size_t device_total) const;

  const int device_;
  Ledger& ledger_;
  std::atomic<int64_t> limit_{kNone};
  bool refused_ = false;
  std::atomic<int64_t> tag_limit_[kMaxTags];  // set to kNone by the constructor
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
