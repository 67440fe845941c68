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
// as cached free memory of the pool. A checkpointed segment that no longer exists, or
// a block still waiting on a recorded stream after a device synchronisation, is an
// error and changes nothing torch can see. checkPoolLiveAllocations compares the
// pool's allocated blocks with the pointers torch believes alive.
#pragma once

#include <cuda.h>

#include <cstddef>
#include <cstdint>
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

}  // namespace tb
