// Checkpoints of a private pool's layout, for torch's CUDA graph trees.
//
// Note [Pool checkpoints]
// torch.compile(mode="reduce-overhead") records several graphs into one private pool,
// one path of a tree at a time. Before it replays or records another path it puts the
// pool back into the state it had when the path's last graph was recorded:
// getCheckpointState records, per segment of the pool, every block in address order
// (pointer, size, stream, allocated or not); setCheckpointPoolState then frees every
// block allocated in the pool now -- tensors still alive included: torch swaps their
// deleters first -- and carves each checkpointed segment back into exactly the
// recorded blocks, allocating those that were allocated. Addresses must come back
// exactly: the recorded graphs have them baked in, and torch matches the re-created
// allocations to its tensors by pointer. Segments created after the checkpoint stay,
// as cached free memory of the pool. A checkpointed segment that no longer exists, a
// pool whose tag is released (its memory is unmapped, Note [Tag arenas]), a block used on
// a stream of another device, or one still waiting on a recorded stream after a device
// synchronisation (or when a capture open anywhere forbids one), is an error found before
// anything is freed: it changes nothing torch can see. checkPoolLiveAllocations compares the
// pool's allocated blocks with the pointers torch believes alive.
#pragma once

#include <cuda.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "trace.h"

namespace tb {

struct CheckpointBlock {
  uintptr_t ptr;
  size_t size;
  size_t requested;  // what the caller asked for, so the ledger's requested bytes come back too
  CUstream stream;
  bool allocated;
};

struct CheckpointSegment {
  uintptr_t base;
  std::vector<CheckpointBlock> blocks;  // every block of the segment, in address order
};

struct PoolCheckpoint {
  PoolId pool;
  std::vector<CheckpointSegment> segments;
};

struct Block;
struct PrivatePool;

// What restoring a checkpoint asks of the allocator that owns the pool. Every call runs
// under that allocator's lock, as do the functions below.
class PoolOwner {
 public:
  // The pool, or nullptr once it is gone (looked up again after each wait).
  virtual PrivatePool* find_pool(const PoolId& id) = 0;
  // Frees a live block of the pool as torch's deleter would (record_stream respected).
  virtual void free_live(Block* b) = 0;
  // Retires the frees whose recorded streams completed.
  virtual void settle() = 0;
  // Waits for the whole device, the lock released meanwhile; false while a capture is open.
  virtual bool wait_for_device() = 0;
  // A block carved back at its address becomes live: charged, indexed and traced.
  virtual void adopt(Block* b) = 0;
  // Whether `tag` is live: a released tag's pools have no memory to carve from.
  virtual bool tag_live(int tag) = 0;
  // The device the pool's memory is on (wait_for_device waits for it alone).
  virtual int device() const = 0;

 protected:
  ~PoolOwner() = default;
};

// The layout of `pool` (settled frees first, by the caller).
void record_checkpoint(const PoolId& id, const PrivatePool& pool, PoolCheckpoint* out);
// Note [Pool checkpoints]: frees every block allocated in the pool (*freed) and re-creates
// the checkpointed allocations at their addresses (*created). `where` names the pool for
// messages. A failure part-way frees what it re-created, keeping the error.
bool restore_checkpoint(PoolOwner& owner, const PoolCheckpoint& cp, const std::string& where,
                        std::vector<uintptr_t>* freed, std::vector<Block*>* created);
// Whether the pool's allocated blocks are exactly `expected` (torch's checkPoolLiveAllocations).
bool live_allocations_match(const PrivatePool& pool, const std::vector<uintptr_t>& expected);

}  // namespace tb
