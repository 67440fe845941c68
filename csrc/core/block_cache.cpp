#include "block_cache.h"

#include <algorithm>
#include <iterator>

#include "error.h"

namespace tb {

Block* BlockStore::make() {
  if (free_.empty()) {
    chunks_.emplace_back(new Block[kChunk]);
    Block* chunk = chunks_.back().get();
    for (size_t i = 0; i < kChunk; ++i) free_.push_back(&chunk[kChunk - 1 - i]);
  }
  Block* b = free_.back();
  free_.pop_back();
  b->device = device_;
  return b;
}

void BlockStore::recycle(Block* b) {
  b->ptr = 0;
  b->size = 0;
  b->requested = 0;
  b->stream = nullptr;
  b->segment = nullptr;
  b->prev = b->next = nullptr;
  b->allocated = false;
  b->pending = 0;
  b->shared = false;
  b->small_request = false;
  b->tag = 0;
  b->route = 0;
  b->freed_at = 0;
  b->recorded.clear();
  free_.push_back(b);
}

BlockPool::~BlockPool() {
  for (auto& seg : segments_) {
    Block* b = seg->head;
    while (b) {
      Block* next = b->next;
      store_->recycle(b);
      b = next;
    }
  }
}

Segment* BlockPool::add_segment(uintptr_t base, size_t size, bool small, CUstream stream, size_t granules) {
  static std::atomic<uint64_t> serials{1};
  auto seg = std::make_unique<Segment>();
  seg->serial = serials.fetch_add(1, std::memory_order_relaxed);
  seg->base = base;
  seg->size = size;
  seg->small = small;
  seg->stream = stream;
  seg->route = route_;
  seg->granules.assign(granules, 0);
  seg->span.assign(granules, 0);
  Block* block = store_->make();
  block->ptr = seg->base;
  block->size = seg->size;
  block->stream = seg->stream;
  block->segment = seg.get();
  block->route = route_;
  seg->pool = this;
  seg->head = block;
  file(free_set(seg->small), block, FreeSet::node_type());
  segments_.push_back(std::move(seg));
  // A VMM arena is address range; its mappings are traced by the route.
  if (granules == 0) trace(TraceAction::kSegmentAlloc, device(), base, size, stream, id_, tag_, route_);
  return segments_.back().get();
}

void BlockPool::remove_segment(Segment* seg) {
  if (seg->granules.empty())
    trace(TraceAction::kSegmentFree, device(), seg->base, seg->size, seg->stream, id_, tag_, route_);
  // Without live blocks a segment is one free block; every block goes, whatever the layout.
  ++shape_;
  for (Block* b = seg->head; b != nullptr;) {
    Block* next = b->next;
    free_set(seg->small).erase(b);
    store_->recycle(b);
    b = next;
  }
  segments_.erase(std::remove_if(segments_.begin(), segments_.end(),
                                 [seg](const std::unique_ptr<Segment>& s) { return s.get() == seg; }),
                  segments_.end());
}

Block* BlockPool::split(Block* block, size_t rounded, FreeSet& fs, FreeSet::node_type node) {
  Block* rest = store_->make();
  rest->ptr = block->ptr + rounded;
  rest->size = block->size - rounded;
  rest->stream = block->stream;
  rest->segment = block->segment;
  rest->route = route_;
  rest->freed_at = block->freed_at;
  rest->requested = block->requested;  // see Block::requested
  rest->prev = block;
  rest->next = block->next;
  if (block->next) block->next->prev = rest;
  block->next = rest;
  block->size = rounded;
  file(fs, rest, std::move(node));  // in the tree node that held `block`
  // `block` may have been the left of a pair left apart: the remainder is now (merge_clean).
  note_unmerged(rest);
  return rest;
}

Block* BlockPool::split_tail(Block* block, size_t rounded, FreeSet& fs, FreeSet::node_type node) {
  Block* tail = store_->make();
  tail->size = rounded;
  tail->ptr = block->ptr + block->size - rounded;
  tail->stream = block->stream;
  tail->segment = block->segment;
  tail->route = route_;
  tail->freed_at = block->freed_at;
  tail->requested = block->requested;
  tail->prev = block;
  tail->next = block->next;
  if (block->next) block->next->prev = tail;
  block->next = tail;
  block->size -= rounded;
  file(fs, block, std::move(node));  // the front stays free, in the node that held the whole block
  return tail;
}

size_t BlockPool::span(const Block* b, size_t rounded) const {
  // All of `b` when the rest is too small to split. A pool that never splits takes a free block
  // whole, but out of an arena (one free block spanning the card) a block of its own size.
  size_t want = rounded;
  if (no_split_) {
    const size_t whole = backing_->whole_block(rounded);
    if (whole == 0 || whole >= b->size) return b->size;
    want = whole;
  }
  return b->size - want >= min_split_remainder(b->segment->small) ? want : b->size;
}

FreeSet::iterator BlockPool::place(FreeSet& fs, FreeSet::iterator it, size_t rounded, bool* at_end,
                                   size_t* missing) const {
  *at_end = false;
  // Fully backed: the hot path, no driver call and no further look.
  *missing = backing_->unbacked(*(*it)->segment, (*it)->ptr, span(*it, rounded));
  if (*missing == 0) return it;
  constexpr int kCandidates = 16;
  const CUstream stream = (*it)->stream;
  FreeSet::iterator best = fs.end();
  size_t best_missing = SIZE_MAX;
  int looked = 0;
  for (auto c = it; c != fs.end() && (*c)->stream == stream && looked < kCandidates; ++c, ++looked) {
    const Block* b = *c;
    const Segment& seg = *b->segment;
    const size_t front = backing_->unbacked(seg, b->ptr, span(b, rounded));
    // A block too small to split is handed out whole: only its front is a placement.
    const bool splits = span(b, rounded) == rounded && b->size > rounded;
    const size_t back = splits ? backing_->unbacked(seg, b->ptr + b->size - rounded, rounded) : SIZE_MAX;
    const size_t m = std::min(front, back);
    if (m < best_missing) {
      best = c;
      best_missing = m;
      *at_end = back < front;
      if (m == 0) break;
    }
  }
  *missing = best_missing;
  return best;
}

FreeSet::iterator BlockPool::best_fit(FreeSet& fs, CUstream stream, size_t rounded) {
  Block key;
  key.stream = stream;
  key.size = rounded;
  key.ptr = 0;
  return fs.lower_bound(&key);
}

FreeSet::iterator BlockPool::adoptable(FreeSet& fs, size_t rounded, CUstream stream) const {
  constexpr int kCandidates = 8;
  FreeSet::iterator best = fs.end();
  Block key;
  // Stream by stream, only those with free blocks: the set is ordered by (stream, size, address).
  for (auto group = fs.begin(); group != fs.end();) {
    const CUstream s = (*group)->stream;
    if (s != stream) {
      int looked = 0;
      for (auto c = best_fit(fs, s, rounded); c != fs.end() && (*c)->stream == s && looked < kCandidates; ++c, ++looked) {
        const Block* b = *c;
        if (best != fs.end() && b->size >= (*best)->size) break;
        if (clock_->clean(s, b->freed_at) && backing_->unbacked(*b->segment, b->ptr, span(b, rounded)) == 0) {
          best = c;
          break;
        }
      }
    }
    key.stream = s;
    key.size = SIZE_MAX;
    key.ptr = UINTPTR_MAX;
    group = fs.upper_bound(&key);
  }
  return best;
}

Block* BlockPool::malloc(size_t size, CUstream stream, bool grow) {
  const size_t rounded = round_size(size);
  const bool small = rounded <= small_max_;
  FreeSet& fs = free_set(small);
  auto it = best_fit(fs, stream, rounded);
  bool own = it != fs.end() && (*it)->stream == stream;
  bool at_end = false;
  size_t missing = SIZE_MAX;
  if (!own && !unmerged_.empty()) {  // Note [Adopting clean blocks]: neighbours left apart may fit together now
    clock_->refresh();
    merge_clean();
    it = best_fit(fs, stream, rounded);
    own = it != fs.end() && (*it)->stream == stream;
  }
  if (own) it = place(fs, it, rounded, &at_end, &missing);
  if (missing != 0 && adopt_clean_) {  // Note [Adopting clean blocks]
    clock_->refresh();  // what completed since: the alternative is new memory, tens of us
    auto other = adoptable(fs, rounded, stream);
    if (other != fs.end()) {
      Block* b = *other;
      FreeSet::node_type node = take_out(fs, other);
      // The remainder stays its old stream's, clean there.
      const size_t take = span(b, rounded);
      if (take < b->size) split(b, take, fs, std::move(node));
      else keep(std::move(node));
      b->stream = stream;  // clean: its old stream's work on it is done
      if (adopted_ != nullptr) adopted_->fetch_add(1, std::memory_order_relaxed);
      return activate(b, size, /*backed=*/true);  // adoptable() found it all mapped
    }
  }
  if (!own) {
    TB_REQUIRE(grow, kOutOfMemory, "no cached block fits", nullptr);
    if (!backing_->grow(*this, rounded, small, stream)) return nullptr;
    it = best_fit(fs, stream, rounded);
    if (it == fs.end() || (*it)->stream != stream) {
      set_error(kDriverError, "internal: a new segment did not provide a fitting block");
      return nullptr;
    }
    it = place(fs, it, rounded, &at_end, &missing);
  }
  Block* block = *it;
  FreeSet::node_type node = take_out(fs, it);
  // place() measured what is handed out: nothing missing means nothing to map.
  if (at_end) return activate(split_tail(block, rounded, fs, std::move(node)), size, missing == 0);
  const size_t take = span(block, rounded);
  if (take < block->size) split(block, take, fs, std::move(node));
  else keep(std::move(node));
  return activate(block, size, missing == 0);
}

std::map<size_t, size_t>::const_iterator Segment::first_mapping(size_t first) const {
  auto it = maps.upper_bound(first);
  if (it != maps.begin()) {
    auto prev = std::prev(it);
    if (prev->first + prev->second > first) return prev;
  }
  return it;
}

void BlockPool::file(FreeSet& fs, Block* b, FreeSet::node_type node) {
  ++shape_;
  if (node.empty() && !spare_.empty()) {
    node = std::move(spare_.back());
    spare_.pop_back();
  }
  if (node.empty()) {
    b->where = fs.insert(b).first;
  } else {
    node.value() = b;
    b->where = fs.insert(std::move(node)).position;
  }
}

void BlockPool::keep(FreeSet::node_type node) {
  constexpr size_t kSpares = 8;
  if (!node.empty() && spare_.size() < kSpares) spare_.push_back(std::move(node));
}

Block* BlockPool::activate(Block* block, size_t requested, bool backed) {
  block->allocated = true;
  block->born = store_->birth();
  block->capture = 0;
  block->segment->live++;
  live_++;
  if (!backed && !backing_->ensure_backed(*block->segment, block->ptr, block->size)) {
    // Undo the split through the ordinary free path; the error is already recorded.
    const KeepError kept;
    free(block);
    return nullptr;
  }
  block->requested = requested;
  block->small_request = round_size(requested) <= kSmallSize;  // Block::small_request
  return block;
}

Block* BlockPool::carve(Block* block, uintptr_t ptr, size_t size, size_t requested) {
  FreeSet& fs = free_set(block->segment->small);
  FreeSet::node_type node = unfile(fs, block);
  if (ptr > block->ptr) {  // the front stays free, in the node
    block = split_tail(block, block->ptr + block->size - ptr, fs, std::move(node));
    node = FreeSet::node_type();
  }
  if (block->size > size) split(block, size, fs, std::move(node));
  else keep(std::move(node));
  return activate(block, requested);
}

std::vector<Segment*> BlockPool::idle_clean_segments() const {
  std::vector<Segment*> idle;
  for (const auto& seg : segments_) {
    if (seg->live != 0) continue;
    // Every free block clean on its own stream (Note [Adopting clean blocks]: there can be several).
    bool clean = true;
    for (const Block* b = seg->head; b != nullptr && clean; b = b->next) clean = clock_->clean(b->stream, b->freed_at);
    if (clean) idle.push_back(seg.get());
  }
  return idle;
}

void BlockPool::free(Block* block, uint64_t freed_at) {
  block->allocated = false;
  block->pending = 0;
  block->recorded.clear();
  block->freed_at = freed_at != 0 ? freed_at : clock_->stamp();
  block->segment->live--;
  live_--;
  block = coalesce(block, FreeSet::node_type());
  // A refusal leaves the segment cached; release_cached retries it.
  if (release_on_free_ && block->segment->live == 0) backing_->destroy_segment(*block->segment);
}

Block* BlockPool::take_back(Block* b, size_t size) {
  const size_t rounded = round_size(size);
  const bool small = rounded <= small_max_;
  if (no_split_ || release_on_free_ || b->size != rounded || b->segment->small != small || b->segment->lost_mapping)
    return nullptr;
  Block* next = b->next != nullptr && b->next->is_free() ? b->next : nullptr;
  if (b != taken_back_ || shape_ != taken_back_shape_) {
    if (!may_take_back(b, rounded, small, &next)) return nullptr;
  } else if (next != nullptr) {  // of b's stream: the verdict's condition
    next->freed_at = std::max(next->freed_at, b->freed_at);
    next->requested = b->requested;  // Block::requested: the figure of the block freed last
  }
  b->born = store_->birth();
  b->capture = 0;
  b->requested = size;
  b->small_request = rounded <= kSmallSize;  // Block::small_request
  return b;
}

bool BlockPool::may_take_back(Block* b, size_t rounded, bool small, Block** merged_next) {
  CUstream stream = nullptr;
  uint64_t stamp = 0;
  // A free front neighbour would merge: the block handed out would start before b.
  if (b->prev != nullptr && mergeable(b, b->prev, &stream, &stamp)) return false;
  Block* next = nullptr;
  uint64_t next_stamp = 0;
  if (b->next != nullptr && mergeable(b, b->next, &stream, &next_stamp)) {
    // The merged block must stay b's stream's and split again where b ends.
    if (stream != b->stream || b->next->size < min_split_remainder(small)) return false;
    next = b->next;
  }
  *merged_next = next;
  const size_t merged = rounded + (next != nullptr ? next->size : 0);
  // Best fit: b (merged) is chosen unless another free block of its stream fits before it in
  // the set's order (stream, size, address). Its memory is mapped (it was live), so place()
  // takes it without looking further, and splits it where b ends.
  FreeSet& fs = free_set(small);
  auto it = best_fit(fs, b->stream, rounded);
  if (it != fs.end() && *it == next) ++it;
  if (it != fs.end() && (*it)->stream == b->stream) {
    const Block* other = *it;
    if (other->size < merged || (other->size == merged && other->ptr < b->ptr)) return false;
  }
  // What the pair leaves besides b: coalesce's notes of neighbours left apart (Note [Adopting
  // clean blocks]; stale ones are pruned later, as after the pair), and the remainder split()
  // cuts off the merged block: b's stream, the merged stamp and figure, noted in turn.
  Block* after = next != nullptr ? next->next : b->next;
  const bool apart_after = after != nullptr && after->is_free();
  const bool apart_before = b->prev != nullptr && b->prev->is_free();
  if (apart_before) unmerged_.push_back(b->prev);
  if (apart_after) unmerged_.push_back(b);
  if (unmerged_.size() > 64 + 2 * (small_free_.size() + large_free_.size())) prune_unmerged();
  const bool restreamed = next != nullptr && next->stream != stream;
  if (next != nullptr) {
    if (restreamed) {  // the set is ordered by stream first
      FreeSet::node_type node = unfile(fs, next);
      next->stream = stream;
      file(fs, next, std::move(node));
    }
    next->freed_at = next_stamp;
    next->requested = b->requested;  // Block::requested: the figure of the block freed last
    if (apart_after) unmerged_.push_back(next);
  }
  // Note [The parked block]'s verdict: it holds until the free sets change, unless it left notes
  // or moved a neighbour to b's stream. A free neighbour of another stream, whose work may
  // complete in between (the stream clock decides), always ends in one of those or in no.
  if (!apart_before && !apart_after && !restreamed) {
    taken_back_ = b;
    taken_back_shape_ = shape_;
  } else {
    taken_back_ = nullptr;
  }
  return true;
}

size_t BlockPool::largest_free() const {
  size_t best = 0;
  for (const FreeSet* fs : {&small_free_, &large_free_})
    for (const Block* b : *fs) best = std::max(best, backing_->usable(*b));
  return best;
}

}  // namespace tb
