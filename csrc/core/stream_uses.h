// Blocks freed while other streams may still use them (torch's record_stream), and the
// events that say when they may be reused: Note [Stream-ordered reuse] (block_cache.h),
// Note [Reuse during capture] (capture_graph.h).
//
// Lock rule: every method runs under the owning device's lock (DeviceAllocator::mu_);
// nothing here takes a lock of its own, and the retire callback runs under that lock too.
// No method waits for the device.
#pragma once

#include <cuda.h>

#include <atomic>
#include <deque>
#include <functional>
#include <vector>

#include "block_cache.h"
#include "capture_graph.h"

namespace tb {

class StreamUses {
 public:
  using Retire = std::function<void(Block*)>;
  // `retire` takes back each block whose uses have all completed; `open_captures`
  // counts captures open in the process (no event is recorded or queried meanwhile).
  StreamUses(Retire retire, const std::atomic<int>& open_captures)
      : retire_(std::move(retire)), open_captures_(open_captures) {}

  // record_stream: `b` (live, of `own_device`) is used on `stream` of `stream_device`.
  static void record(Block* b, CUstream stream, int stream_device, int own_device);
  // Whether the free of `b` must wait for other streams: it was used on one, or it is a
  // stream-ordered free (`ordered_free`) while a capture is open.
  bool must_wait(const Block* b, bool ordered_free) const {
    // A stream-ordered free is a stream operation: none while a capture is open.
    return !b->recorded.empty() || (ordered_free && capturing());
  }
  // Holds the freed block `b` until its uses completed. `capture_reuse`: torch's
  // graph_capture_record_stream_reuse (Note [Reuse during capture]).
  void hold(Block* b, bool capture_reuse);
  // Records events for held blocks and retires each whose streams all passed their events.
  void settle();
  // Retires the blocks of `stream` freed during capture that the graph now orders after
  // every use.
  void reuse_in_capture(CUstream stream);
  // The captures of this device ended: their markers name nodes of finished graphs.
  void captures_ended();

  bool idle() const { return held_.empty() && events_.empty(); }
  size_t waiting() const { return held_.size() + events_.size(); }
  bool reusable_in_capture() const { return !capture_frees_.empty(); }

 private:
  struct Outstanding {
    Block* block;
    CUevent event;
    int device;  // the event's device
    CUstream stream;
  };
  struct CaptureFree {
    Block* block;  // in held_
    std::vector<CUgraphNode> markers;
  };
  bool capturing() const { return open_captures_.load(std::memory_order_acquire) > 0; }
  void record_events();  // on every recorded stream of held blocks
  void query_events();   // retires blocks whose events all completed
  void finish_one(Block* b);

  Retire retire_;
  const std::atomic<int>& open_captures_;
  // Invariant: a block is in held_ while it still has recorded streams to record an event
  // on (or waits for the end of captures); its `pending` counts that hold (1) plus each of
  // its events in events_. It goes back (retire_) when `pending` reaches zero.
  std::vector<Block*> held_;
  std::deque<Outstanding> events_;
  std::vector<CaptureFree> capture_frees_;  // held during this device's captures, with their markers
  CaptureWalks walks_;
};

}  // namespace tb
