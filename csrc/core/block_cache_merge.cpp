// How a pool's free neighbours merge: at a free (coalesce), and later for pairs of two streams
// left apart until one side is clean (Note [Adopting clean blocks], merge_clean).
#include "block_cache.h"

#include <algorithm>

#include "stream_order.h"

namespace tb {

bool BlockPool::mergeable(const Block* a, const Block* b, CUstream* stream, uint64_t* freed_at) const {
  if (!b->is_free()) return false;
  if (a->stream == b->stream) {
    *stream = a->stream;
    *freed_at = std::max(a->freed_at, b->freed_at);
    return true;
  }
  // Note [Adopting clean blocks]: the merged block waits only for what the other side waits for.
  if (clock_->clean(b->stream, b->freed_at)) {
    *stream = a->stream;
    *freed_at = a->freed_at;
    return true;
  }
  if (clock_->clean(a->stream, a->freed_at)) {
    *stream = b->stream;
    *freed_at = b->freed_at;
    return true;
  }
  return false;
}

void BlockPool::absorb_next(Block* b, CUstream stream, uint64_t freed_at) {
  Block* n = b->next;
  b->size += n->size;
  b->next = n->next;
  if (n->next) n->next->prev = b;
  b->stream = stream;
  b->freed_at = freed_at;
  store_->recycle(n);
}

Block* BlockPool::coalesce(Block* block, FreeSet::node_type node) {
  FreeSet& fs = free_set(block->segment->small);
  // Merge with free neighbours, reusing a tree node.
  CUstream stream = nullptr;
  uint64_t stamp = 0;
  if (block->prev && mergeable(block, block->prev, &stream, &stamp)) {
    Block* p = block->prev;
    if (node.empty()) node = unfile(fs, p);
    else keep(unfile(fs, p));
    const size_t requested = block->requested;  // the block freed now carries its figure (Block::requested)
    absorb_next(p, stream, stamp);
    p->requested = requested;
    block = p;
  }
  if (block->next && mergeable(block, block->next, &stream, &stamp)) {
    if (node.empty()) node = unfile(fs, block->next);
    else keep(unfile(fs, block->next));
    absorb_next(block, stream, stamp);
  }
  file(fs, block, std::move(node));
  // A free neighbour left is another stream's and could not merge: merge_clean looks again.
  if (block->prev != nullptr) note_unmerged(block->prev);
  note_unmerged(block);
  if (unmerged_.size() > 64 + 2 * (small_free_.size() + large_free_.size())) prune_unmerged();
  return block;
}

bool BlockPool::unmerged_pair(const Block* b) const {
  // Two free neighbours of one stream merge at once; after a merge in merge_clean they may meet.
  return b->segment != nullptr && b->segment->pool == this && b->is_free() && b->next != nullptr &&
         b->next->is_free();
}

void BlockPool::note_unmerged(Block* b) {
  if (unmerged_pair(b)) unmerged_.push_back(b);
}

void BlockPool::prune_unmerged() {
  std::sort(unmerged_.begin(), unmerged_.end());
  unmerged_.erase(std::unique(unmerged_.begin(), unmerged_.end()), unmerged_.end());
  unmerged_.erase(std::remove_if(unmerged_.begin(), unmerged_.end(), [this](const Block* b) { return !unmerged_pair(b); }),
                  unmerged_.end());
}

void BlockPool::merge_clean() {
  if (unmerged_.empty()) return;
  prune_unmerged();
  std::vector<Block*> pairs;
  pairs.swap(unmerged_);
  for (Block* b : pairs) {
    // A merge below recycles the right block, which may be a later entry: checked again here.
    while (unmerged_pair(b)) {
      Block* n = b->next;
      CUstream stream = nullptr;
      uint64_t stamp = 0;
      if (!mergeable(b, n, &stream, &stamp)) {
        unmerged_.push_back(b);
        break;
      }
      FreeSet& fs = free_set(b->segment->small);
      FreeSet::node_type node = unfile(fs, b);
      keep(unfile(fs, n));
      absorb_next(b, stream, stamp);
      file(fs, b, std::move(node));  // and look at its new neighbour
    }
  }
}

}  // namespace tb
