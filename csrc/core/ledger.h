// The ledger: what each device holds, per route and per tag.
//
// Lock rule: every counter is written only under its DeviceAllocator's mutex
// (resets included), and read without any lock (relaxed atomics), so stats never
// wait for the allocation path and never synchronise the device. A reader may see
// two counters from two different instants; each counter on its own is exact.
#pragma once

#include <atomic>
#include <cstdint>

namespace tb {

enum Route : int { kRouteVmm = 0, kRoutePool = 1, kRouteSync = 2, kRouteCount = 3 };
const char* route_name(int route);

constexpr int kMaxTags = 64;  // tag 0 is "untagged"

// current / peak / allocated (sum of increments) / freed (sum of decrements),
// the four numbers torch reports for every statistic.
struct Stat {
  std::atomic<int64_t> current{0};
  std::atomic<int64_t> peak{0};
  std::atomic<int64_t> allocated{0};
  std::atomic<int64_t> freed{0};

  void add(int64_t n) {
    int64_t c = current.load(std::memory_order_relaxed) + n;
    current.store(c, std::memory_order_relaxed);
    if (c > peak.load(std::memory_order_relaxed)) peak.store(c, std::memory_order_relaxed);
    allocated.store(allocated.load(std::memory_order_relaxed) + n, std::memory_order_relaxed);
  }
  void sub(int64_t n) {
    current.store(current.load(std::memory_order_relaxed) - n, std::memory_order_relaxed);
    freed.store(freed.load(std::memory_order_relaxed) + n, std::memory_order_relaxed);
  }
  // sub(out) then add(in), nothing between: the same four numbers (the peak was at least the
  // current before, so only what `in` adds past `out` can raise it).
  void cycle(int64_t out, int64_t in) {
    int64_t c = current.load(std::memory_order_relaxed) + (in - out);
    current.store(c, std::memory_order_relaxed);
    if (c > peak.load(std::memory_order_relaxed)) peak.store(c, std::memory_order_relaxed);
    allocated.store(allocated.load(std::memory_order_relaxed) + in, std::memory_order_relaxed);
    freed.store(freed.load(std::memory_order_relaxed) + out, std::memory_order_relaxed);
  }
  void reset_peak() { peak.store(current.load(std::memory_order_relaxed), std::memory_order_relaxed); }
  void reset_accumulated() {
    allocated.store(0, std::memory_order_relaxed);
    freed.store(0, std::memory_order_relaxed);
  }
  int64_t get() const { return current.load(std::memory_order_relaxed); }
};

// Index into the torch-compatible stat arrays: aggregate, small pool, large pool.
enum PoolKind : int { kAggregate = 0, kSmallPool = 1, kLargePool = 2, kPoolKinds = 3 };

struct StatArray3 {
  Stat s[kPoolKinds];
  void add(bool small, int64_t n) {
    s[kAggregate].add(n);
    s[small ? kSmallPool : kLargePool].add(n);
  }
  void sub(bool small, int64_t n) {
    s[kAggregate].sub(n);
    s[small ? kSmallPool : kLargePool].sub(n);
  }
  void reset_peak() {
    for (auto& x : s) x.reset_peak();
  }
  void reset_accumulated() {
    for (auto& x : s) x.reset_accumulated();
  }
};

// Note [The ledger's layout]
// An allocation and its free move about twenty counters. They sit together, so a round trip
// touches about nine cache lines of the ledger (each group starts a line): for each pool kind
// the five stats of blocks (`blocks[kAggregate]` and the small or large one), then the tag's
// and the route's. Called from Python, each round trip finds most of them out of the core's
// caches; spread over the arrays below they were sixteen lines.
struct alignas(64) BlockStats {
  Stat allocation;       // live allocations (count)
  Stat active;           // allocated or waiting on a recorded stream (count)
  Stat allocated_bytes;  // bytes of live blocks (rounded sizes)
  Stat active_bytes;
  Stat requested_bytes;  // bytes asked for by callers (unrounded)

  // A block of `size` bytes allocated for a request of `requested`; its free (no longer
  // allocated); its retirement (no longer active).
  void charge(int64_t size, int64_t requested) {
    allocation.add(1);
    active.add(1);
    allocated_bytes.add(size);
    active_bytes.add(size);
    requested_bytes.add(requested);
  }
  void release(int64_t size, int64_t requested) {
    allocation.sub(1);
    allocated_bytes.sub(size);
    requested_bytes.sub(requested);
  }
  void retire(int64_t size) {
    active.sub(1);
    active_bytes.sub(size);
  }
  // `n` blocks of `bytes` in all freed (asked for `out` bytes) and allocated again (for `in`),
  // nothing between: charge after release and retire, as one Stat::cycle each.
  void cycle(int64_t n, int64_t bytes, int64_t out, int64_t in) {
    allocation.cycle(n, n);
    active.cycle(n, n);
    allocated_bytes.cycle(bytes, bytes);
    active_bytes.cycle(bytes, bytes);
    requested_bytes.cycle(out, in);
  }
};

struct alignas(64) TagStats {
  Stat allocated;
  Stat requested;
  Stat allocations;  // live allocations (count); `allocated` of it counts every one served

  void cycle(int64_t n, int64_t bytes, int64_t out, int64_t in) {  // as BlockStats::cycle
    allocated.cycle(bytes, bytes);
    requested.cycle(out, in);
    allocations.cycle(n, n);
  }
};

struct alignas(64) RouteStats {
  std::atomic<int64_t> count{0};  // allocations served, cumulative
  Stat allocated;
  Stat reserved;
};

struct Ledger {
  // torch's names (see c10::CachingDeviceAllocator::DeviceStats): `allocation`, `active`,
  // `allocated_bytes`, `active_bytes` and `requested_bytes` of each pool kind are in blocks[kind].
  BlockStats blocks[kPoolKinds];
  BlockStats& pool_kind(bool small) { return blocks[small ? kSmallPool : kLargePool]; }
  StatArray3 segment;           // segments / VMM arenas (count)
  StatArray3 reserved_bytes;    // bytes held from the driver, cached included

  // per route and per tag
  RouteStats route[kRouteCount];
  TagStats tag[kMaxTags];
  Stat graph_pool_reserved;  // memory held by private (graph) pools

  std::atomic<int64_t> num_alloc_retries{0};
  std::atomic<int64_t> num_ooms{0};
  std::atomic<int64_t> num_device_alloc{0};
  std::atomic<int64_t> num_device_free{0};
  std::atomic<int64_t> num_sync_all_streams{0};
  std::atomic<int64_t> num_stream_syncs{0};  // single streams synchronised (budget pressure only)
  std::atomic<int64_t> num_reclaims{0};      // times clean free mappings went back for packing
  std::atomic<int64_t> num_moves{0};         // mappings made with handles a packing reclaim unmapped
  std::atomic<int64_t> num_adoptions{0};     // clean blocks of another stream taken (Note [Adopting clean blocks])
  std::atomic<int64_t> num_take_backs{0};    // freed blocks taken back as they were (Note [The parked block])
  // Wall time the VMM allocation path spent backing new allocations (giving back, creating and
  // mapping: the driver's calls), and the part of it that was packing moves (Note [Packing time]).
  std::atomic<int64_t> mapping_ns{0};
  std::atomic<int64_t> packing_ns{0};

  void reset_peaks();
  void reset_accumulated();
};

inline void bump(std::atomic<int64_t>& c, int64_t n = 1) {
  c.store(c.load(std::memory_order_relaxed) + n, std::memory_order_relaxed);
}

}  // namespace tb
