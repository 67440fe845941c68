// Best-fit block cache with split/coalesce and per-stream reuse.
//
// Note [Stream-ordered reuse]
// A block handed back by torch may still be read or written by kernels queued on
// its stream. Reusing it for another allocation on the *same* stream is safe: the
// new work is queued behind the old. Reusing it on another stream is not, so free
// blocks are indexed by (stream, size, address) and a lookup only ever matches its
// own stream. A block used on other streams (record_stream) is not returned to the
// free set at free time: the device allocator records an event on each of those
// streams (on their own devices) and frees the block once all of them completed
// (see device_allocator.cpp). Giving memory back to the driver follows Note [Clean
// blocks] (stream_order.h).
//
// A BlockPool does not know where memory comes from: a Backing (VMM, stream-ordered
// pool or synchronous route) creates segments and makes address ranges usable.
//
// Note [Adopting clean blocks]
// A free block whose stream has run every kernel queued before its free (clean, Note [Clean
// blocks]) holds no pending work: any stream may use it at once. So when a request finds no
// cached block of its own stream that it can use without new memory, a pool that allows it
// (the default and tag pools of the VMM and sync routes; never a graph pool, whose free blocks
// a captured graph may still address, nor the pool route, which frees on the segment's stream)
// takes a clean, fully backed free block of another stream and relabels it with its own, instead
// of mapping or allocating more. Two streams that take turns with the same memory (a decode
// step's side stream, a prefetch stream) then share it without a driver call and without
// waiting. A segment may hence hold blocks of several streams: free neighbours merge when they
// share a stream or when one of them is clean (the merged block takes the other's stream), so
// two adjacent free blocks of different streams, both dirty at the time, can coexist.
//
// Note [Placement by mapped memory]
// On the VMM route a free block may lie partly over unmapped address range (an arena is
// mostly unmapped; memory handed back leaves holes). Mapping costs tens of µs per
// mapping (create, map, access; unmap and release later), a cache hit nothing, so a
// request that the best-fit block cannot serve without new memory looks at the next
// few fitting blocks for one that can, and otherwise places itself, at the start or the
// end of one of them, where the fewest granules are missing.
#pragma once

#include <cuda.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <vector>

#include "stream_order.h"
#include "trace.h"

namespace tb {

constexpr size_t kMinBlockSize = 512;           // every size is rounded up to this
constexpr size_t kSmallSize = 1 << 20;          // requests up to this come from small segments
constexpr size_t kSmallSegment = 2 << 20;       // sync route: segment size for small requests
constexpr size_t kMidSegment = 20 << 20;        // sync route: segment size for requests < 10 MiB
constexpr size_t kMinLargeAlloc = 10 << 20;
constexpr size_t kRoundLarge = 2 << 20;

class BlockPool;
struct Block;

// The free blocks of a pool, ordered by (stream, size, address): best fit per stream.
struct BlockOrder {
  bool operator()(const Block* a, const Block* b) const;
};
using FreeSet = std::set<Block*, BlockOrder>;

// A stream named by record_stream, with the device it belongs to.
struct StreamRef {
  CUstream stream;
  int device;
};

struct Segment {
  uintptr_t base = 0;
  size_t size = 0;       // bytes of address range (VMM: reserved VA, else allocated)
  bool small = false;
  // VMM only: memory under a live block was lost or left without access (Note [A cut that
  // cannot be undone], route_vmm_share.cpp): its blocks are never taken back as they are freed,
  // so that each goes through ensure_backed before it serves again.
  bool lost_mapping = false;
  CUstream stream = nullptr;
  int route = 0;
  BlockPool* pool = nullptr;
  size_t live = 0;       // blocks allocated or waiting on events
  struct Block* head = nullptr;  // block at `base`; stable: merges keep the lower block
  // VMM only: the physical handle mapped at each granule, 0 where unmapped.
  std::vector<CUmemGenericAllocationHandle> granules;
  // VMM only: at the first granule of each mapping, how many granules it spans (one
  // handle, one cuMemMap); 0 elsewhere. See Note [Run mappings] (route_vmm.h).
  std::vector<uint32_t> span;
  // VMM only: the same mappings in address order (first granule -> granules), so a
  // range's mappings are found without walking its granules (an arena's unmapped
  // tail is most of the card). Changed only with `granules` and `span` (route_vmm.cpp).
  std::map<size_t, size_t> maps;
  // The mapping covering or following granule `first`, in address order.
  std::map<size_t, size_t>::const_iterator first_mapping(size_t first) const;
  size_t mapped = 0;     // granules mapped
  uint64_t unmaps = 0;   // VMM only: mappings unmapped so far; while it stays, every mapping stays as it is
  uint64_t serial = 0;   // no other segment of the process ever has it (set by add_segment)
};

// Block objects are owned by their device's BlockStore and recycled, never freed:
// a stale Block* (a double free through torch's deleter context) points at a valid
// object, so it can be checked under the device lock before anything trusts it.
struct Block {
  uintptr_t ptr = 0;
  size_t size = 0;        // rounded bytes owned by this block
  // Bytes the caller asked for. A free block keeps the figure of the last allocation
  // it absorbed, and a split hands it to the remainder, because torch's snapshot
  // reports exactly that for inactive blocks (its tools and tests read it).
  size_t requested = 0;
  CUstream stream = nullptr;
  Segment* segment = nullptr;
  Block* prev = nullptr;  // address-order neighbours inside the segment
  Block* next = nullptr;
  bool allocated = false;
  int pending = 0;        // recorded-stream events outstanding after free
  bool shared = false;    // handed to another process (Note [Sharing memory between processes]) since allocated
  // Allocated for a request of torch's small size class (rounded, up to kSmallSize), wherever it
  // lies: torch's stats count such blocks in small_pool (Note [Half-granule requests], route_vmm.h).
  bool small_request = false;
  int tag = 0;
  int route = 0;          // route charged in the ledger
  int device = 0;         // immutable: set by the BlockStore that owns the object
  uint64_t freed_at = 0;  // StreamClock stamp of the last free (Note [Clean blocks])
  uint64_t born = 0;      // its BlockStore's births() when it was last allocated (Note [Reading backups])
  // The capture its stream was in when it was allocated into a graph pool with capture reuse on;
  // 0 otherwise (Note [Reuse during capture]).
  uint64_t capture = 0;
  std::vector<StreamRef> recorded;  // streams still to record an event on at free
  // Its place in its pool's free set, while it is filed there (BlockPool::file): taken out
  // by position, not searched for again. Meaningless while it is not in the set.
  FreeSet::iterator where{};

  bool is_free() const { return !allocated && pending == 0; }
};

class BlockStore {
 public:
  explicit BlockStore(int device) : device_(device) {}
  int device() const { return device_; }
  Block* make();
  void recycle(Block* b);
  // Allocations made on the device so far: a block allocated later has a higher Block::born.
  uint64_t births() const { return births_; }
  uint64_t birth() { return ++births_; }

 private:
  static constexpr size_t kChunk = 256;
  int device_;
  uint64_t births_ = 0;
  std::vector<Block*> free_;
  std::vector<std::unique_ptr<Block[]>> chunks_;
};

inline bool BlockOrder::operator()(const Block* a, const Block* b) const {
  if (a->stream != b->stream) return reinterpret_cast<uintptr_t>(a->stream) < reinterpret_cast<uintptr_t>(b->stream);
  if (a->size != b->size) return a->size < b->size;
  return a->ptr < b->ptr;
}

class Backing {
 public:
  virtual ~Backing() = default;
  // Adds a segment to `pool` that can hold at least `size` bytes on `stream`,
  // covered by one free block. false + error on failure.
  virtual bool grow(BlockPool& pool, size_t size, bool small, CUstream stream) = 0;
  // Makes [ptr, ptr+size) of `seg` usable. false + error on failure (nothing changed).
  virtual bool ensure_backed(Segment& seg, uintptr_t ptr, size_t size) = 0;
  // Gives back what `pool` holds beyond its live blocks, taking only clean free
  // blocks; segments left empty are removed from the pool.
  virtual void release_cached(BlockPool& pool) = 0;
  // Gives back a segment without live blocks and removes it from its pool. false
  // when the driver refused: the segment stays (still charged) to be retried.
  virtual bool destroy_segment(Segment& seg) = 0;
  // The driver caches for this backing (the pool route): a block's memory goes
  // back as soon as the block is freed.
  virtual bool release_on_free() const { return false; }
  // Rounded requests up to this many bytes come from small segments, larger ones from large
  // segments (torch's rule: up to kSmallSize). See Note [Half-granule requests] (route_vmm.h).
  virtual size_t small_max() const { return kSmallSize; }
  // Granules [ptr, ptr+size) of `seg` still lacks: what handing it out would map
  // (0 where all memory is backed; see Note [Placement by mapped memory]).
  virtual size_t unbacked(const Segment& /*seg*/, uintptr_t /*ptr*/, size_t /*size*/) const { return 0; }
  // For pools that never split (torch's MemPool(no_split=True)): the bytes a block for a request
  // of `rounded` bytes spans when it is carved out of address range that is not a segment of its
  // own (an arena); 0 where every segment is one (the block is then its whole free block).
  virtual size_t whole_block(size_t /*rounded*/) const { return 0; }
  // The longest usable stretch of free block `b` (torch's cacheInfo: cuDNN sizes its
  // workspaces from it): the block itself where all memory is backed.
  virtual size_t usable(const Block& b) const { return b.size; }
  // Lets device `peer` read and write every mapping of this backing, present and
  // future.
  virtual bool grant_peer(int /*peer*/) { return true; }
};

class BlockPool {
 public:
  BlockPool(Backing* backing, int route, bool graph_pool, BlockStore* store, StreamClock* clock)
      : backing_(backing), route_(route), graph_pool_(graph_pool), release_on_free_(backing->release_on_free()),
        small_max_(backing->small_max()), store_(store), clock_(clock) {}
  ~BlockPool();
  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;

  // Rounds up to kMinBlockSize; callers bound `size` well below SIZE_MAX.
  static size_t round_size(size_t size) {
    return size < kMinBlockSize ? kMinBlockSize : (size + kMinBlockSize - 1) / kMinBlockSize * kMinBlockSize;
  }

  // Best fit on `stream`, growing through the backing when nothing fits (unless `grow`
  // is false: then nullptr + kOutOfMemory).
  Block* malloc(size_t size, CUstream stream, bool grow = true);
  // Blocks are never split (torch's MemPool(no_split=True)): a request takes a free block whole,
  // or, carved out of an arena, a block of Backing::whole_block() bytes.
  void set_no_split() { no_split_ = true; }
  // Note [Adopting clean blocks]: requests may take clean free blocks of other streams, each
  // counted in *count.
  void set_adopt_clean(bool on, std::atomic<int64_t>* count) {
    adopt_clean_ = on;
    adopted_ = count;
  }
  bool adopts_clean() const { return adopt_clean_; }
  std::atomic<int64_t>* adoption_count() const { return adopted_; }
  // Returns a block to the free set, merging with free neighbours; a backing that
  // releases on free gets the segment back at once.
  // `freed_at`: the block's free stamp when it was taken at its free (a parked block); 0:
  // stamped now.
  void free(Block* block, uint64_t freed_at = 0);
  // Note [The parked block] (device_allocator.h): if free(b) and then malloc(size) on b's
  // stream would hand out b again, at its address and size, leaving every other block as
  // the pair would (its stamps included), does that and returns b; else nullptr, nothing
  // changed. `b` was freed with stamp b->freed_at and has stayed out of the pool since.
  Block* take_back(Block* b, size_t size);

  // Registers a new segment of `size` bytes at `base`, covered by one free block (used by
  // backings); VMM arenas start with `granules` unmapped granule slots.
  Segment* add_segment(uintptr_t base, size_t size, bool small, CUstream stream, size_t granules = 0);
  // Removes a segment with no live blocks and its blocks (used by backings).
  void remove_segment(Segment* seg);

  FreeSet& free_set(bool small) { return small ? small_free_ : large_free_; }
  const FreeSet& free_set(bool small) const { return small ? small_free_ : large_free_; }
  const std::vector<std::unique_ptr<Segment>>& segments() const { return segments_; }
  Backing* backing() const { return backing_; }
  StreamClock& clock() const { return *clock_; }
  int route() const { return route_; }
  bool graph_pool() const { return graph_pool_; }
  int device() const { return store_->device(); }
  uint64_t births() const { return store_->births(); }
  // The private pool this is ({0,0} for the default and tag pools) and its ledger tag,
  // for the trace (Note [Allocator trace]).
  const PoolId& id() const { return id_; }
  int tag() const { return tag_; }
  void set_owner(const PoolId& id, int tag) {
    id_ = id;
    tag_ = tag;
  }
  bool release_on_free() const { return release_on_free_; }
  size_t live_blocks() const { return live_; }
  // Allocates exactly [ptr, ptr + size) out of the free block `block`, which holds it,
  // whatever the split rules: what lies before and after stays free. So the layout a
  // pool checkpoint recorded comes back exactly (Note [Pool checkpoints]), for a request of
  // `requested` bytes (its Block::requested and stats pool). nullptr + error when backing it
  // failed (nothing changed then but the splits).
  Block* carve(Block* block, uintptr_t ptr, size_t size, size_t requested);
  // Segments without live blocks whose last free is clean (Note [Clean blocks]): what a
  // backing may give back.
  std::vector<Segment*> idle_clean_segments() const;
  // The longest free stretch that needs no new memory (torch's cacheInfo).
  size_t largest_free() const;
  // Note [Adopting clean blocks]: merges the adjacent free blocks that could not merge when
  // freed (of two streams, neither clean then) and can now; before memory is given back, so a
  // mapping under both counts as free. Looks at those pairs only, not at every block.
  void merge_clean();

 private:
  Block* split(Block* block, size_t rounded, FreeSet& fs, FreeSet::node_type node);
  // Merges free `block` (out of the free set, its node in `node` or empty) with its free
  // neighbours and files the result: a segment never holds two adjacent free blocks that
  // could merge (Note [Adopting clean blocks]).
  // Returns the merged block (`block` itself may be recycled).
  Block* coalesce(Block* block, FreeSet::node_type node);
  // Takes the last `rounded` bytes of free block `block` (out of the free set as `node`),
  // leaving its front free.
  Block* split_tail(Block* block, size_t rounded, FreeSet& fs, FreeSet::node_type node);
  // Note [Placement by mapped memory]: the block at `it` or a later fitting one, and
  // whether to serve from its end.
  FreeSet::iterator place(FreeSet& fs, FreeSet::iterator it, size_t rounded, bool* at_end, size_t* missing) const;
  // The first free block of `stream` in `fs` that holds `rounded` bytes: the best fit, as the
  // set is ordered by (stream, size, address). Past them (another stream's block, or end) if none.
  static FreeSet::iterator best_fit(FreeSet& fs, CUstream stream, size_t rounded);
  // Note [Adopting clean blocks]: the best-fitting clean free block of another stream that
  // serves `rounded` bytes from its front without new memory; fs.end() if none.
  FreeSet::iterator adoptable(FreeSet& fs, size_t rounded, CUstream stream) const;
  // `b` takes in its next neighbour (both out of the free sets), with the merged stream and stamp.
  void absorb_next(Block* b, CUstream stream, uint64_t freed_at);
  // Whether free neighbours a and b may merge, and the stream and free stamp the merged block takes.
  bool mergeable(const Block* a, const Block* b, CUstream* stream, uint64_t* freed_at) const;
  // The bytes handing out the front of free block `b` for a request of `rounded` bytes takes:
  // what split() cuts off, or all of `b`.
  size_t span(const Block* b, size_t rounded) const;
  // A remainder smaller than this stays inside the allocated block: splitting a large block
  // for a sliver no request of its free set can use only fragments the set.
  size_t min_split_remainder(bool small) const { return small ? kMinBlockSize : small_max_ + 1; }
  // A block out of the free set becomes allocated and backed (`backed`: the caller found
  // all its memory mapped already); nullptr + error (the block freed again) when backing it
  // failed.
  Block* activate(Block* block, size_t requested, bool backed = false);
  // Files free `b` in `fs`, in `node` (a tree node taken out of a free set) or a spare one,
  // and remembers where (Block::where): the hot path allocates no tree nodes.
  void file(FreeSet& fs, Block* b, FreeSet::node_type node);
  // Takes `b` out of `fs` by its position.
  FreeSet::node_type unfile(FreeSet& fs, Block* b) { return take_out(fs, b->where); }
  // Every change to the free sets goes through file() and take_out(), which count it in shape_
  // (remove_segment, which erases a whole segment's blocks, counts its own).
  FreeSet::node_type take_out(FreeSet& fs, FreeSet::iterator it) {
    ++shape_;
    return fs.extract(it);
  }
  // take_back's checks for `b`, `rounded` bytes of the `small` set; true with *next the free
  // neighbour the pair merges into b (nullptr if none) when b may be taken back, its effects
  // on the pool applied, and the verdict remembered when it holds while shape_ stays.
  bool may_take_back(Block* b, size_t rounded, bool small, Block** next);
  // A tree node that filed nothing, kept for the next file() (a few at most).
  void keep(FreeSet::node_type node);

  Backing* backing_;
  int route_;
  bool graph_pool_;
  bool release_on_free_;
  size_t small_max_;  // Backing::small_max()
  BlockStore* store_;
  StreamClock* clock_;
  FreeSet small_free_;
  FreeSet large_free_;
  std::vector<std::unique_ptr<Segment>> segments_;
  size_t live_ = 0;
  PoolId id_{0, 0};
  int tag_ = 0;
  bool no_split_ = false;
  bool adopt_clean_ = false;
  std::atomic<int64_t>* adopted_ = nullptr;
  // The left blocks of adjacent free pairs of two streams left apart (neither side clean when
  // they met), for merge_clean. Entries may be stale (merged since, allocated, or given back to
  // the BlockStore, whose objects are never freed) and repeat: each is checked when read.
  std::vector<Block*> unmerged_;
  // Whether `b` is still the left block of two free neighbours of this pool's.
  bool unmerged_pair(const Block* b) const;
  // Records `b` for merge_clean when it is the left block of such a pair.
  void note_unmerged(Block* b);
  // Drops the entries that no longer name such a pair, and repeats; merges nothing.
  void prune_unmerged();
  std::vector<FreeSet::node_type> spare_;  // see keep()
  // Note [The parked block]: changes to the free sets so far, and the block whose take-back
  // may_take_back last allowed leaving no notes and moving no neighbour, with shape_ then. While
  // shape_ stays, nothing take_back looks at changed: every neighbour and every free block is
  // as it was, so the same block of the same size is allowed again without looking.
  uint64_t shape_ = 0;
  const Block* taken_back_ = nullptr;
  uint64_t taken_back_shape_ = 0;
};

}  // namespace tb
