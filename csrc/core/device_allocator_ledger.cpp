// How the ledger follows blocks (Note [The ledger's layout], ledger.h): an allocation charged, a
// free released and retired, and the parked block's take-back as one cycle of each counter, or
// only counted while it repeats (Note [The parked block], device_allocator.h). All under the lock.
#include "device_allocator.h"

namespace tb {
namespace {

// torch's small_pool stats count requests of its small size class, wherever they lie.
bool is_small(const Block* b) { return b->small_request; }

}  // namespace

void DeviceAllocator::account_alloc(Block* b) {
  const bool small = is_small(b);
  const auto size = static_cast<int64_t>(b->size);
  const auto requested = static_cast<int64_t>(b->requested);
  for (BlockStats* k : {&ledger_.blocks[kAggregate], &ledger_.blocks[small ? kSmallPool : kLargePool]}) {
    k->allocation.add(1);
    k->active.add(1);
    k->allocated_bytes.add(size);
    k->active_bytes.add(size);
    k->requested_bytes.add(requested);
  }
  RouteStats& r = ledger_.route[b->route];
  bump(r.count);
  r.allocated.add(size);
  TagStats& t = ledger_.tag[b->tag];
  t.allocated.add(size);
  t.requested.add(requested);
  t.allocations.add(1);
  tags_.charge(*b);
}

void DeviceAllocator::account_release(Block* b) {
  const bool small = is_small(b);
  const auto size = static_cast<int64_t>(b->size);
  const auto requested = static_cast<int64_t>(b->requested);
  for (BlockStats* k : {&ledger_.blocks[kAggregate], &ledger_.blocks[small ? kSmallPool : kLargePool]}) {
    k->allocation.sub(1);
    k->allocated_bytes.sub(size);
    k->requested_bytes.sub(requested);
  }
  ledger_.route[b->route].allocated.sub(size);
  TagStats& t = ledger_.tag[b->tag];
  t.allocated.sub(size);
  t.requested.sub(requested);
  t.allocations.sub(1);
  tags_.uncharge(*b);
}

void DeviceAllocator::account_take_back(Block* b, size_t requested, bool small) {
  const auto size = static_cast<int64_t>(b->size);
  const auto out = static_cast<int64_t>(requested);
  const auto in = static_cast<int64_t>(b->requested);
  auto cycle = [&](BlockStats& k) {
    k.allocation.cycle(1, 1);
    k.active.cycle(1, 1);
    k.allocated_bytes.cycle(size, size);
    k.active_bytes.cycle(size, size);
    k.requested_bytes.cycle(out, in);
  };
  cycle(ledger_.blocks[kAggregate]);
  BlockStats& was = ledger_.blocks[small ? kSmallPool : kLargePool];
  BlockStats& now = ledger_.blocks[is_small(b) ? kSmallPool : kLargePool];
  if (&was == &now) {
    cycle(now);
  } else {  // its request moved it between torch's small and large stats
    was.allocation.sub(1);
    was.active.sub(1);
    was.allocated_bytes.sub(size);
    was.active_bytes.sub(size);
    was.requested_bytes.sub(out);
    now.allocation.add(1);
    now.active.add(1);
    now.allocated_bytes.add(size);
    now.active_bytes.add(size);
    now.requested_bytes.add(in);
  }
  RouteStats& r = ledger_.route[b->route];
  bump(r.count);
  r.allocated.cycle(size, size);
  TagStats& t = ledger_.tag[b->tag];
  t.allocated.cycle(size, size);
  t.requested.cycle(out, in);
  t.allocations.cycle(1, 1);
}

void DeviceAllocator::account_inactive(Block* b) {
  const bool small = is_small(b);
  for (BlockStats* k : {&ledger_.blocks[kAggregate], &ledger_.blocks[small ? kSmallPool : kLargePool]}) {
    k->active.sub(1);
    k->active_bytes.sub(static_cast<int64_t>(b->size));
  }
}

void DeviceAllocator::settle_tally() {
  const int64_t n = tally_.pending;
  if (n == 0) return;
  tally_.pending = 0;
  const int64_t bytes = n * tally_.size;
  const int64_t asked = n * tally_.requested;
  auto both = [](Stat& s, int64_t v) {  // cycle(v, v), as many times as counted: current and peak stay
    s.allocated.store(s.allocated.load(std::memory_order_relaxed) + v, std::memory_order_relaxed);
    s.freed.store(s.freed.load(std::memory_order_relaxed) + v, std::memory_order_relaxed);
  };
  for (BlockStats* k : {&ledger_.blocks[kAggregate], &ledger_.blocks[tally_.small ? kSmallPool : kLargePool]}) {
    both(k->allocation, n);
    both(k->active, n);
    both(k->allocated_bytes, bytes);
    both(k->active_bytes, bytes);
    both(k->requested_bytes, asked);
  }
  RouteStats& r = ledger_.route[tally_.route];
  bump(r.count, n);
  both(r.allocated, bytes);
  TagStats& t = ledger_.tag[tally_.tag];
  both(t.allocated, bytes);
  both(t.requested, asked);
  both(t.allocations, n);
}

}  // namespace tb
