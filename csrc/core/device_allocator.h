// One device's allocator: the lock, the routes and the malloc / free path, with the budget
// and the ledger they charge.
//
// Note [The allocator and its collaborators]
// Everything else a device's memory takes part in is a collaborator that keeps its own
// state and runs under this allocator's lock, reached through a narrow interface:
// - StreamUses (stream_uses.h): frees waiting for the streams record_stream named, their
//   events, and reuse inside a capture;
// - TagArenas (tag_arenas.h): each tag's pools and sleep state, release and restore;
// - GraphPools (graph_pools.h): private pools of captures and MemPools, their uses;
// - pool checkpoints (pool_checkpoint.h): record and restore a private pool's layout,
//   asking the allocator (PoolOwner) to free, adopt and wait;
// - sharing (ipc.h): export a block's handle, open and close another process's;
// - segment views (segment_views.h): what snapshots and stats show of the segments.
// The allocator decides when to wait for the device (the collaborators never do) and
// owns every block's life: only it charges, indexes and retires blocks.
//
// Lock rule: mu_ guards every member except the ledger's counters (relaxed atomics,
// readable without it, or consistently with read_locked), the budget's limit
// (atomic) and the fields set by init().
// Backings and routes are only called with mu_ held. mu_ is never held across a
// call that waits for the device (context or stream synchronisation, cuMemFree):
// such calls run with the lock released and the state is re-checked after (see
// Note [Clean blocks]), open captures included: one may begin meanwhile. No driver
// call at all is made on the cache-hit path. Every driver call runs under a
// ContextGuard, so no entry point moves the caller's current device. Lock order: a
// thread holds at most one device's mu_, then possibly the EventCache's or the tag
// registry's mutex.
#pragma once

#include <cuda.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <vector>

#include "block_cache.h"
#include "budget.h"
#include "capture_graph.h"
#include "device_mutex.h"
#include "driver.h"
#include "graph_pools.h"
#include "ledger.h"
#include "ptr_map.h"
#include "route_pool.h"
#include "route_sync.h"
#include "route_user.h"
#include "pool_checkpoint.h"
#include "route_vmm.h"
#include "segment_views.h"
#include "stream_order.h"
#include "stream_uses.h"
#include "tag_arenas.h"
#include "tag_sleep.h"

namespace tb {

struct Capabilities {
  bool vmm = false;
  bool pools = false;
  size_t granularity = 0;  // VMM minimum granularity
  size_t total_bytes = 0;
};

// Reads a device's capabilities without creating a context.
bool probe_device(int device, Capabilities* caps);

// The one rule for falling back between routes: VMM, else the stream-ordered pool,
// else synchronous, by what the device supports.
int resolve_route(const Capabilities& caps, int route);

struct Settings {
  int64_t budget_bytes = -1;     // < 0: none (the whole card)
  double budget_fraction = -1;   // used when budget_bytes < 0 and fraction > 0
  bool reuse_before_grow = true; // see Note [Packing: reclaim before growth]
  // The longest mapping the allocation path makes (Note [Run mappings]); 0: the default.
  int64_t map_run_bytes = 0;
  // The share of wall-clock time packing may spend moving memory (Note [Packing time]).
  double packing_time = PackingTime::kDefaultShare;
  // Note [Tag budgets]: per tag, bytes >= 0 or a fraction (0, 1] of the card; else none.
  int64_t tag_bytes[kMaxTags];
  double tag_fraction[kMaxTags];
  Settings() {
    for (int t = 0; t < kMaxTags; ++t) {
      tag_bytes[t] = -1;
      tag_fraction[t] = -1;
    }
  }
};

// What a lookup by address tells about a live block.
struct BlockInfo {
  uintptr_t base;
  size_t size;
  size_t requested;
  int route;
  int tag;
};

// An allocation refused for want of memory, as its own call saw it under the device lock: the
// bridge tells torch's observers once the lock is gone, when another thread's allocation may have
// changed the Budget's record of the last refusal.
struct OomFigures {
  bool by_budget = false;  // the device's budget refused it (not the driver, nor a tag's budget)
  int64_t allocated = 0;   // bytes allocated on the device then
  int64_t reserved = 0;    // and reserved
};

// Note [An exception stops the process]
// The core throws nothing itself, but its containers do: std::bad_alloc when host memory runs
// out, or an exception from a filter torch hands to beginAllocateToPool. One thrown halfway
// through a change leaves the pools, the granule maps and the budget disagreeing (a block
// counted live that is not, a mapping without access, the packing flag left set), and torch
// would catch it and go on allocating from that state. So every method below that changes
// state is noexcept: such an exception ends the process (std::terminate names it) instead of
// letting a later allocation hand out memory the ledger got wrong. Methods that only read may
// throw; they change nothing. malloc is the one exception to the rule: its only caller,
// Allocator::malloc, is noexcept instead (marked here, it cost the round trip 14 instructions:
// tools/probe_footprint.py, 528 against 514). Creating the device stays outside it: Allocator::create_device.
class DeviceAllocator {
 public:
  // Once published by the Allocator, never destroyed: frees can arrive during
  // process exit, and driver resources are left to the driver then.
  explicit DeviceAllocator(int device);

  bool init(const Settings& settings);
  // Budget and reuse setting, for a device created before install() configured it.
  void apply(const Settings& settings);
  int device() const { return ctx_.device; }
  const Capabilities& caps() const { return caps_; }
  const Ledger& ledger() const { return ledger_; }
  int64_t budget() const { return budget_.limit(); }
  // nullptr + error: kOutOfMemory (after one release-and-retry) carries the
  // quantified message, and `oom` (when given) its figures; kInvalidArgument for a zero size.
  Block* malloc(size_t size, CUstream stream, int route, int tag, OomFigures* oom = nullptr);

  // Note [A quiet first attempt]: while one lives on the calling thread, an allocation that would
  // reclaim cached memory (empty the cache and retry, borrow from a pool) or fail stops before
  // that, with kOutOfMemory and nothing counted, traced or reclaimed. The bridge asks so first,
  // runs torch's free-memory callbacks (what torch's allocator does before it reclaims), then
  // asks again in full: one failure counts one OOM, and the cache is emptied only if the memory
  // the callbacks freed did not do.
  class QuietAttempt {
   public:
    QuietAttempt();
    ~QuietAttempt();
    QuietAttempt(const QuietAttempt&) = delete;
    QuietAttempt& operator=(const QuietAttempt&) = delete;
  };
  // Frees a block torch handed back; checks it under the lock first.
  bool free(Block* block) noexcept;
  // Frees the live block at `ptr`; *found tells whether there was one.
  bool free_ptr(uintptr_t ptr, bool* found) noexcept;
  // The live block at `ptr` (exactly its base); false if none.
  bool lookup(uintptr_t ptr, BlockInfo* out);
  // Marks the live block at `ptr` as used on `stream` of `stream_device`.
  bool record_stream(uintptr_t ptr, CUstream stream, int stream_device, bool* found) noexcept;

  // Returns cached memory of the default pools to the driver.
  bool empty_cache() noexcept;
  // bytes >= 0, or a fraction (0, 1] of the card (see Budget::resolve).
  // `strict`: refuse a budget below what is allocated now. torch's memory fraction is
  // not strict: it is taken as it is, cached memory goes back as far as it can, and
  // allocations fail until enough is freed.
  bool set_budget(int64_t bytes, double fraction = -1, bool strict = true) noexcept;
  // Note [Tag budgets]: bytes >= 0 or a fraction (0, 1] of the card for `tag`; bytes < 0
  // and no fraction removes its budget. Refused below what the tag has allocated now.
  bool set_tag_budget(int tag, int64_t bytes, double fraction = -1) noexcept;
  int64_t tag_budget(int tag) const { return budget_.tag_limit(tag); }
  // Lets device `peer` access this device's memory, the VMM mappings of other processes' memory
  // it opened included (Note [Peer access to VMM memory]).
  bool grant_peer(int peer) noexcept;
  bool mem_info(size_t* free_bytes, size_t* total_bytes);
  size_t largest_free();
  // torch's cacheInfo for an allocation under `tag` (cuDNN sizes its benchmark workspaces from
  // it): the longest free stretch backed now or the free memory within the budget, whichever is
  // more, within the tag's budget (Note [What cacheInfo tells]).
  bool cache_info(size_t* largest, int tag);
  void reset_peaks() noexcept;
  void reset_accumulated() noexcept;
  // Note [Packing time]: the time that has passed until now earns no packing credit;
  // packing_refill(): the credit is a full burst again, as at the process's start.
  void packing_idle() noexcept;
  void packing_refill() noexcept;

  // Sleep and wake (Note [Tag arenas]): `backup` is a Backup. kState for a tag that is
  // not live / not released, during a capture, or with live memory off the VMM route.
  // backup: a Backup, with kBackupRetain or-ed in for cpu / pinned. `discardable`: addresses of live
  // blocks of the tag whose contents need not survive (Note [Discardable blocks], tag_sleep.h).
  bool release_tag(int tag, int backup, const std::vector<uintptr_t>& discardable = {}) noexcept;
  bool restore_tag(int tag) noexcept;
  bool drop_tag_backup(int tag) noexcept;          // Note [Retained backups]
  bool retain_tag_backup(int tag, bool on) noexcept;
  TagView tag_view(int tag);
  // Note [Reading backups] (tag_sleep.h): the backup of bytes [offset, offset + bytes) of the
  // live block at `base` (*found: it is one of this device's), as TagArenas::backup_of.
  bool backup_of(uintptr_t base, size_t offset, size_t bytes, bool view, std::vector<HostExtent>* spans,
                 std::shared_ptr<BackupSpace>* space, bool* found);
  // The tag a graph pool was created under, -1 for an unknown pool.
  int pool_tag(const PoolId& id);
  // Gives the clean cached memory of `tag`'s own pool back to the driver, after
  // synchronising the streams its free blocks were used on; *returned: bytes.
  bool trim_tag(int tag, int64_t* returned) noexcept;
  const DeviceContext& context() const { return ctx_; }

  // Graph capture (see Note [Interaction with CUDA graph capture]). kState for a pool that a
  // capture is open into already.
  bool begin_allocate_to_pool(const PoolId& id, StreamFilter filter) noexcept;
  bool end_allocate_to_pool(const PoolId& id) noexcept;
  bool release_pool(const PoolId& id) noexcept;
  // torch.cuda.MemPool: a pool that exists (and holds a use) outside any capture.
  // A new pool given a `source` takes its segments from it (route_user.h).
  void create_or_incref_pool(const PoolId& id, std::unique_ptr<SegmentSource> source = nullptr) noexcept;
  // torch's MemPool options: use_on_oom (-1 leaves it), no_split (never undone).
  bool set_pool_options(const PoolId& id, int use_on_oom, bool no_split) noexcept;
  // Gives the free segments of a pool with its own allocator back to that allocator, once no
  // graph or MemPool holds the pool and the device could be synchronised (else keeps them).
  bool empty_pool_cache(const PoolId& id) noexcept;
  int pool_use_count(const PoolId& id);
  // Note [Pool checkpoints]: the layout of a private pool; restoring it frees every
  // block allocated in the pool (*freed) and re-creates the checkpointed allocations
  // at their addresses (*created, allocated and charged).
  bool checkpoint_pool(const PoolId& id, PoolCheckpoint* out);
  bool restore_checkpoint(const PoolCheckpoint& cp, std::vector<uintptr_t>* freed,
                          std::vector<Block*>* created) noexcept;
  // *match: the pool's allocated blocks are exactly `expected` (torch's checkPoolLiveAllocations).
  bool pool_live_matches(const PoolId& id, const std::vector<uintptr_t>& expected, bool* match);
  // Note [Sharing memory between processes] (ipc.h): the handle bytes of the live block
  // at `ptr`, at most `room` of them, and its offset from what the handle maps (a first
  // share may wait for the device, with the lock released: Note [Sharing run mappings]);
  // opening such bytes in this process, on this device, and closing what was opened. The
  // block counts as shared only once its handle was handed out.
  bool share(uintptr_t ptr, std::string* handle, size_t* offset, size_t room = SIZE_MAX) noexcept;
  bool open_shared(const std::string& bytes, OpenedShare* out) noexcept;
  // While a capture is open, a VMM mapping's close waits for the last capture to end (Note
  // [Closing a share during a capture], device_allocator_ipc.cpp): end_allocate_to_pool calls
  // captures_ended, with no lock held, once none is open.
  void close_shared(OpenedShare& s) noexcept;
  static void captures_ended() noexcept;
  // The caller says no other process maps the live block at `ptr` any more (Note [Sharing memory
  // between processes]): it no longer keeps its tag from being released.
  bool end_sharing(uintptr_t ptr) noexcept;
  // Destroys the dead graph pools already clean (called when the last capture ended, on another
  // device's thread too): never waits for this device, whose queued work is not that capture's.
  void settle_pools() noexcept;

  // `runs`: also each VMM arena's mapped ranges (a walk over its granules).
  std::vector<SegmentView> segments(bool runs = false);
  // The segments as torch's snapshot shows them: a VMM arena becomes one segment per
  // run of mapped granules, holding the parts of blocks that lie in it (as torch shows
  // its expandable segments), so blocks tile each segment exactly.
  std::vector<SegmentView> mapped_segments();
  // Free blocks carved from segments that still hold live blocks (torch's inactive_split), by
  // PoolKind: in all pools, and in the small and the large ones.
  void inactive_split(int64_t count[kPoolKinds], int64_t bytes[kPoolKinds]);
  // Runs `fn(ledger)` under the lock: a consistent view of every counter at once
  // (torch's memory_stats compares them), at the price of waiting for the lock.
  template <typename Fn>
  void read_locked(Fn fn) {
    auto lock = hold();
    settle_tally();
    fn(static_cast<const Ledger&>(ledger_));
  }

  // Captures open anywhere in the process: no synchronisation while any is.
  static int open_captures() { return open_captures_.load(std::memory_order_acquire); }
  // torch's graph_capture_record_stream_reuse, for the whole process: a block freed
  // during capture after record_stream is reused in the same capture once the graph
  // orders it after every use (Note [Reuse during capture], capture_graph.h).
  static void set_capture_reuse(bool on) { capture_reuse_.store(on, std::memory_order_relaxed); }
  // Note [The parked block] for every device (on by default); the stand-in's tests turn it
  // off to compare what the pools hand out with and without it.
  static void set_parking(bool on) { parking_.store(on, std::memory_order_relaxed); }

 private:
  class CheckpointHost;  // the allocator's side of a checkpoint restore (PoolOwner)
  struct DeadPool {
    PoolId id;
    uint64_t died_at;  // StreamClock stamp
    // Died while a capture was open: the graph being captured may use its memory (a
    // block freed during capture was read or written before), so, as torch does, it
    // is destroyed only by empty_cache or an out-of-memory retry.
    bool during_capture;
  };

  BlockPool* default_pool(int route);
  bool check_tag(int tag, const char* what);
  Block* attempt(size_t size, CUstream stream, int route, int tag, bool allow_sync);
  // torch's use_on_oom: a free block of a pool that lends its memory, or nullptr.
  Block* borrow(size_t size, CUstream stream);
  // Records an out-of-memory failure: counted, traced, the error set and *oom filled (when given);
  // `by_budget`: the device's budget refused it, as the failed attempt found (not read again here:
  // the lock may have been let go since).
  void fail_oom(size_t size, CUstream stream, int route, int tag, const std::string& cause, bool by_budget,
                OomFigures* oom);
  // The tag's own budget refused `size` (Note [Tag budgets]).
  void fail_tag_oom(size_t size, size_t charged, CUstream stream, int route, int tag, OomFigures* oom);
  // Counts, traces and sets an out-of-memory failure with its message.
  void report_oom(size_t size, CUstream stream, int route, int tag, size_t device_free, const std::string& text,
                  bool by_budget, OomFigures* oom);
  // Free and total bytes of the device as messages quote them (the card's size if the driver cannot say).
  void device_memory(size_t* free_bytes, size_t* total_bytes);
  // The quantified message; *device_free (when given) gets the free bytes it quotes.
  std::string oom_text(size_t size, int route, int tag, const std::string& cause, bool by_budget,
                       size_t* device_free = nullptr, bool retried = true);
  // A block just taken from a pool becomes live: charged, indexed by address, traced.
  void adopt(Block* b);
  void account_alloc(Block* b);
  void account_release(Block* b);   // allocated -> not allocated
  void account_inactive(Block* b);  // active -> free
  // The parked block `b` taken back (Note [The parked block]): its free's account_release and
  // account_inactive, as the block was (`requested` bytes asked, `small` its stats pool), then its
  // account_alloc as it is now, counter by counter as one cycle.
  void account_take_back(Block* b, size_t requested, bool small);
  // A take-back like the last one accounted (the same bytes and request, stats pool, route and
  // tag) moves no current value and no peak: each adds the same counts to every counter's
  // cumulative pair, so they are counted here and added when the ledger is read (read_locked, the
  // only reader of cumulative counts), before reset_accumulated, or at a take-back unlike them.
  struct TakeBackTally {
    int64_t pending = 0;  // take-backs not yet added
    int64_t size = -1;
    int64_t requested = 0;
    bool small = false;
    int route = 0;
    int tag = 0;
  };
  TakeBackTally tally_;
  void settle_tally();
  // `may_park`: a free of the caller's, whose block may be parked (Note [The parked block]).
  void free_locked(Block* b, bool may_park = false);
  void free_taken(Block* b, bool may_park = false);  // free_locked of a block already taken out of live_
  // active -> back to its pool, or `park`ed out of it (Note [The parked block])
  void retire(Block* b, bool park = false);
  // Note [The parked block]
  // A round trip of one size on one stream -- free a block, allocate the same size again --
  // is a common pattern of torch programs, and splitting a block off a free one and merging it back
  // is most of its cost. So the block a free would hand back to its pool stays out of it,
  // "parked", until the next operation under the lock: an allocation of its size, stream,
  // route and tag, admitted by malloc's checks as any is, takes it back as it is; anything
  // else returns it to its pool first (unpark). Invariant: parked_ is set only between a free
  // and the next operation under the lock that looks at a pool, so every path sees the pools
  // exactly as without parking. Every lock is taken through hold(), which unparks, or by
  // malloc (which tries the take-back first and unparks otherwise) and free (through hold());
  // every wait that releases the lock unparks once it has it back. A parked block is out of live_,
  // but its pool still counts it handed out (allocated, its segment's live count), so no
  // neighbour's merge and no release of its segment touches it. The ledger still counts it too,
  // allocated and active, until unpark() accounts its free or the take-back its free and its
  // allocation as one cycle of each counter: only the pair's net change and the counts it adds
  // (a third of a round trip's instructions otherwise; repeated ones are only counted, see
  // TakeBackTally). Nothing reads the ledger in between: every reader takes the lock through
  // hold() (read_locked, the profiler's report), and malloc tries the take-back before any of
  // its checks, take_parked refusing what they would refuse (a released tag, a tag over its
  // budget) and creating nothing they would not (a tag's pool is looked up, never made). Only
  // blocks of the device's own pools (not a graph pool, not one that gives memory back at every
  // free) park; a block freed after record_stream never does.
  DeviceLock hold();
  void unpark();
  Block* take_parked(size_t size, CUstream stream, int route, int tag);
  void trace_block(TraceAction action, const Block* b);
  void note_if_dead(BlockPool* pool);
  // The four below take the lock held and return with it held, releasing it while
  // they wait for the device. sync_device is false when the device could not be waited
  // for, or when a capture is open once the lock is back (one may begin meanwhile).
  bool sync_device(DeviceLock& lock);
  void sync_streams(DeviceLock& lock, const std::vector<CUstream>& streams);
  void release_cached(DeviceLock& lock);
  // Note [Sharing run mappings]: cuts the mappings under the live VMM block at `ptr` (*block,
  // looked up again after each wait) to one handle size, waiting for the device with the
  // lock released. false + error, every mapping whole.
  bool cut_for_share(DeviceLock& lock, uintptr_t ptr, Block** block);
  // `may_wait`: synchronise the device for pools that died after its last synchronisation
  // (never on the free path: there only pools already clean go).
  // `tag` >= 0: only the dead pools of that tag (trim_tag).
  void destroy_dead_pools(DeviceLock& lock, bool all = false, bool may_wait = true, int tag = -1,
                          int64_t* freed = nullptr);
  bool has_dead_pool_of(int tag);
  bool dead_pool_of(const DeadPool& d, int tag);  // tag < 0: any
  // The route of a new private pool (Note [Private pool routes]).
  int private_route(int tag) const;
  Backing* private_backing(int tag);
  // Frees the segments the sync route and MemPools detached (cuMemFree waits for the device: the
  // lock is released meanwhile); returns the bytes that went back.
  int64_t free_detached(DeviceLock& lock);
  // Under the lock: the bytes free_detached would free now.
  int64_t detached_bytes() const;
  // Under the lock: read-write access for `peer` to the mapping of `bytes` at `ptr` that
  // open_shared made (Note [Peer access to VMM memory]); false + error.
  bool grant_opened(uintptr_t ptr, size_t bytes, int peer);

  DeviceContext ctx_;
  Capabilities caps_;
  Ledger ledger_;
  Budget budget_;

  DeviceMutex mu_;  // Note [The device lock]
  StreamClock clock_{ctx_.device, open_captures_};
  BlockStore store_;
  std::unique_ptr<VmmRoute> vmm_;
  std::unique_ptr<SyncRoute> sync_;
  UserFrees user_frees_;  // segments of MemPools' own allocators to free with the lock released
  // Routes of dead MemPools' own allocators, ended with the lock released (free_detached):
  // the route may hold the allocator's last reference, whose end may take the GIL.
  std::vector<std::unique_ptr<Backing>> ended_routes_;
  std::unique_ptr<PoolRoute> pool_;
  std::unique_ptr<BlockPool> vmm_pool_;
  std::unique_ptr<BlockPool> sync_pool_;
  std::unique_ptr<BlockPool> pool_pool_;
  GraphPools graphs_;
  std::vector<DeadPool> dead_;
  PtrMap live_;                   // every allocated block, by address
  Block* parked_ = nullptr;       // Note [The parked block]
  StreamUses uses_{[this](Block* b) { retire(b); }, open_captures_};  // frees waiting for other streams
  std::vector<int> peers_;        // devices granted access to this one
  // (address, bytes) of each VMM mapping of another process's memory that this device opened
  // (open_shared) and a consumer still holds: grant_peer reaches them too (Note [Peer access to
  // VMM memory]). Entered once opened, left as its close begins.
  std::vector<std::pair<uintptr_t, size_t>> opened_;
  TagArenas tags_{graphs_, store_, clock_};  // each tag's pools and sleep state (Note [Tag arenas])

  static std::atomic<int> open_captures_;
  // Closes of shares hold it shared, a capture's begin exclusively (Note [Closing a share during a
  // capture], device_allocator_ipc.cpp); taken before any device lock. Never destroyed: closes
  // may come during interpreter shutdown, after static objects are gone.
  static std::shared_mutex& close_gate();
  static std::atomic<bool> capture_reuse_;
  static std::atomic<bool> parking_;
};

}  // namespace tb
