#include "block_cache.h"

#include <algorithm>

#include "error.h"

namespace tb {
namespace {

// A remainder smaller than this stays inside the allocated block: splitting a large
// block for a sliver only fragments the free set.
size_t min_split_remainder(bool small) { return small ? kMinBlockSize : kSmallSize + 1; }

}  // namespace

BlockPool::~BlockPool() {
  // Every block object of every segment, free or not, is deleted through the chain.
  for (auto& seg : segments_) {
    Block* b = seg->head;
    while (b) {
      Block* next = b->next;
      delete b;
      b = next;
    }
  }
}

Block* BlockPool::add_segment(std::unique_ptr<Segment> seg) {
  auto* block = new Block();
  block->ptr = seg->base;
  block->size = seg->size;
  block->stream = seg->stream;
  block->segment = seg.get();
  block->route = route_;
  seg->pool = this;
  seg->head = block;
  free_set(seg->small).insert(block);
  segments_.push_back(std::move(seg));
  return block;
}

void BlockPool::remove_segment(Segment* seg) {
  FreeSet& fs = free_set(seg->small);
  // A segment without live blocks is a single free block: its head.
  fs.erase(seg->head);
  delete seg->head;
  segments_.erase(std::remove_if(segments_.begin(), segments_.end(),
                                 [seg](const std::unique_ptr<Segment>& s) { return s.get() == seg; }),
                  segments_.end());
}

Block* BlockPool::malloc(size_t size, CUstream stream) {
  const size_t rounded = round_size(size);
  const bool small = rounded <= kSmallSize;
  FreeSet& fs = free_set(small);
  Block key;
  key.stream = stream;
  key.size = rounded;
  key.ptr = 0;
  auto it = fs.lower_bound(&key);
  if (it == fs.end() || (*it)->stream != stream) {
    if (!backing_->grow(*this, rounded, small, stream)) return nullptr;
    it = fs.lower_bound(&key);
    if (it == fs.end() || (*it)->stream != stream) {
      set_error(kDriverError, "internal: a new segment did not provide a fitting block");
      return nullptr;
    }
  }
  Block* block = *it;
  fs.erase(it);

  if (block->size - rounded >= min_split_remainder(small)) {
    auto* rest = new Block();
    rest->ptr = block->ptr + rounded;
    rest->size = block->size - rounded;
    rest->stream = stream;
    rest->segment = block->segment;
    rest->route = route_;
    rest->prev = block;
    rest->next = block->next;
    if (block->next) block->next->prev = rest;
    block->next = rest;
    block->size = rounded;
    fs.insert(rest);
  }

  if (!backing_->ensure_backed(*block->segment, block->ptr, block->size)) {
    // Undo the split through the ordinary free path; the error is already recorded.
    block->allocated = true;
    block->segment->live++;
    live_++;
    free(block);
    return nullptr;
  }
  block->allocated = true;
  block->requested = size;
  block->segment->live++;
  live_++;
  return block;
}

void BlockPool::free(Block* block) {
  if (block == nullptr) return;
  block->allocated = false;
  block->pending = 0;
  block->requested = 0;
  block->recorded.clear();
  block->segment->live--;
  live_--;
  FreeSet& fs = free_set(block->segment->small);
  // Merge with free neighbours (same segment, so same stream).
  if (block->prev && block->prev->is_free()) {
    Block* p = block->prev;
    fs.erase(p);
    p->size += block->size;
    p->next = block->next;
    if (block->next) block->next->prev = p;
    delete block;
    block = p;
  }
  if (block->next && block->next->is_free()) {
    Block* n = block->next;
    fs.erase(n);
    block->size += n->size;
    block->next = n->next;
    if (n->next) n->next->prev = block;
    delete n;
  }
  fs.insert(block);
}

size_t BlockPool::largest_free() const {
  size_t best = 0;
  for (const Block* b : small_free_) best = std::max(best, b->size);
  for (const Block* b : large_free_) best = std::max(best, b->size);
  return best;
}

void BlockPool::for_each_block(const std::function<void(const Segment&, const Block&)>& fn) const {
  for (const auto& seg : segments_)
    for (const Block* b = seg->head; b; b = b->next) fn(*seg, *b);
}

}  // namespace tb
