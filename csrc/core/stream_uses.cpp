#include "stream_uses.h"

#include <algorithm>
#include <utility>

#include "events.h"

namespace tb {

void StreamUses::record(Block* b, CUstream stream, int stream_device, int own_device) {
  if (stream == b->stream && stream_device == own_device) return;
  for (const StreamRef& r : b->recorded)
    if (r.stream == stream && r.device == stream_device) return;
  b->recorded.push_back(StreamRef{stream, stream_device});
}

void StreamUses::finish_one(Block* b) {
  if (--b->pending == 0) retire_(b);
}

void StreamUses::hold(Block* b, bool capture_reuse) {
  b->pending = 1;
  held_.push_back(b);
  if (!capturing()) {
    // As torch's allocator: events now, their queries at a later allocation, so a free
    // after record_stream never completes within its own call (its trace entry then
    // carries the allocation's stack, whichever stream finished first).
    record_events();
    return;
  }
  // A block of a backing whose frees are stream-ordered (the pool route) would be freed
  // by cuMemFreeAsync on the capturing stream: it waits for the end of capture instead.
  if (!capture_reuse || b->recorded.empty() || b->segment->pool->release_on_free()) return;
  // Only a block allocated inside a capture has no use outside it (Note [Reuse during capture]).
  if (b->capture == 0) return;
  std::vector<CUstream> streams{b->stream};
  for (const StreamRef& r : b->recorded) streams.push_back(r.stream);
  std::vector<CUgraphNode> markers;
  uint64_t capture = 0;
  // No markers (a stream not capturing or in another capture, or nothing queued yet): the end
  // of capture frees it.
  if (capture_tails(streams, &markers, &capture) && capture == b->capture && !markers.empty())
    capture_frees_.push_back(CaptureFree{b, std::move(markers)});
}

void StreamUses::settle() {
  if (capturing()) return;  // no event record or query while a capture is open
  record_events();
  query_events();
}

void StreamUses::record_events() {
  EventCache& events = EventCache::get();
  for (size_t i = 0; i < held_.size();) {
    Block* b = held_[i];
    auto& rec = b->recorded;
    for (size_t k = 0; k < rec.size();) {
      CUevent e = events.record(rec[k].device, rec[k].stream);
      if (e == nullptr) {  // retried on the next pass
        ++k;
        continue;
      }
      events_.push_back(Outstanding{b, e, rec[k].device, rec[k].stream});
      b->pending++;
      rec.erase(rec.begin() + static_cast<long>(k));
    }
    if (!rec.empty()) {
      ++i;
      continue;
    }
    held_[i] = held_.back();
    held_.pop_back();
    finish_one(b);
  }
}

void StreamUses::query_events() {
  EventCache& events = EventCache::get();
  // Events of one stream complete in the order they were recorded: once one is not
  // ready, the later ones of its stream are not queried.
  std::vector<std::pair<CUstream, int>> waiting;
  for (auto it = events_.begin(); it != events_.end();) {
    const std::pair<CUstream, int> key{it->stream, it->device};
    if (std::find(waiting.begin(), waiting.end(), key) != waiting.end()) {
      ++it;
      continue;
    }
    if (events.query(it->event) != CUDA_SUCCESS) {  // not ready, or the query failed: later
      waiting.push_back(key);
      ++it;
      continue;
    }
    events.put(it->device, it->event);
    Block* b = it->block;
    it = events_.erase(it);
    finish_one(b);
  }
}

void StreamUses::reuse_in_capture(CUstream stream) {
  const std::unordered_set<CUgraphNode>* reached = nullptr;
  for (size_t i = 0; i < capture_frees_.size();) {
    CaptureFree& f = capture_frees_[i];
    if (f.block->stream != stream) {
      ++i;
      continue;
    }
    if (reached == nullptr && (reached = walks_.reached(stream)) == nullptr) return;
    bool after_every_use = true;
    for (CUgraphNode m : f.markers) after_every_use = after_every_use && reached->count(m) > 0;
    if (!after_every_use) {
      ++i;
      continue;
    }
    Block* b = f.block;
    if (i + 1 != capture_frees_.size()) f = std::move(capture_frees_.back());
    capture_frees_.pop_back();
    auto h = std::find(held_.begin(), held_.end(), b);
    if (h == held_.end()) continue;  // not held any more (cannot happen while capturing)
    held_.erase(h);
    b->recorded.clear();  // the graph orders the reuse: no event needed
    b->pending = 0;
    retire_(b);
  }
}

void StreamUses::captures_ended() {
  capture_frees_.clear();
  walks_.clear();
}

}  // namespace tb
