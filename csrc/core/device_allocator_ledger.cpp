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
  const auto size = static_cast<int64_t>(b->size);
  const auto requested = static_cast<int64_t>(b->requested);
  ledger_.blocks[kAggregate].charge(size, requested);
  ledger_.pool_kind(is_small(b)).charge(size, requested);
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
  const auto size = static_cast<int64_t>(b->size);
  const auto requested = static_cast<int64_t>(b->requested);
  ledger_.blocks[kAggregate].release(size, requested);
  ledger_.pool_kind(is_small(b)).release(size, requested);
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
  ledger_.blocks[kAggregate].cycle(1, size, out, in);
  BlockStats& was = ledger_.pool_kind(small);
  BlockStats& now = ledger_.pool_kind(is_small(b));
  if (&was == &now) {
    now.cycle(1, size, out, in);
  } else {  // its request moved it between torch's small and large stats
    was.release(size, out);
    was.retire(size);
    now.charge(size, in);
  }
  RouteStats& r = ledger_.route[b->route];
  bump(r.count);
  r.allocated.cycle(size, size);
  ledger_.tag[b->tag].cycle(1, size, out, in);
}

void DeviceAllocator::account_inactive(Block* b) {
  const auto size = static_cast<int64_t>(b->size);
  ledger_.blocks[kAggregate].retire(size);
  ledger_.pool_kind(is_small(b)).retire(size);
}

void DeviceAllocator::settle_tally() {
  const int64_t n = tally_.pending;
  if (n == 0) return;
  tally_.pending = 0;
  const int64_t bytes = n * tally_.size;
  const int64_t asked = n * tally_.requested;
  // n cycles of the same block and request: current values and peaks stay, the counts grow.
  ledger_.blocks[kAggregate].cycle(n, bytes, asked, asked);
  ledger_.pool_kind(tally_.small).cycle(n, bytes, asked, asked);
  RouteStats& r = ledger_.route[tally_.route];
  bump(r.count, n);
  r.allocated.cycle(bytes, bytes);
  ledger_.tag[tally_.tag].cycle(n, bytes, asked, asked);
}

}  // namespace tb
