// What a capturing stream has recorded so far, read from the graph being captured.
//
// Note [Reuse during capture]
// A block freed during capture after record_stream cannot wait for events: an event
// query is illegal while a stream captures. By default it stays unusable until every
// capture has ended (Note [Stream-ordered reuse]). torch's
// graph_capture_record_stream_reuse setting asks for more: reuse it inside the same
// capture as soon as the graph itself orders the reuse after every use.
//
// At the free, the nodes each stream touching the block currently ends in (its
// allocation stream and every recorded stream) are the block's free markers: every
// use of the block inside the capture lies at or before them. A use queued before a
// stream joined the capture is in no graph, so only a block allocated inside the capture
// it is freed in gets markers: its stream was capturing that capture when it was
// allocated (Block::capture, read at allocation while the setting is on). Any other may
// still be read by eager work queued earlier on a recorded stream: retired in the
// capture, it went to an eager allocation after it while that work ran. A MemPool's
// eager allocations (torch.cuda.use_mem_pool) land in a graph pool too, so the pool a
// block came from says nothing. When any of those streams is not capturing, or they
// capture another graph, there are no markers either, and the block waits for the end
// of capture as before.
//
// A stream's tails say where its uses lie only while its dependencies grow: a capture may
// set them anew (cudaStreamUpdateCaptureDependencies with SET), and uses queued before are
// then ordered before nothing the stream does next. A stream with no tails at the free is
// taken to have queued nothing in the capture (torch's reading, whose tests free a block its
// stream never used): one whose dependencies were set to none after it used the block is
// not told apart from it.
//
// Before a later allocation on the block's own stream, the nodes that stream ends in
// are walked back through their dependencies. Whatever that stream queues next
// depends on all of them, so when every marker is among the nodes reached, the new
// work runs after the block's last use on every stream: the block is free on that
// stream with no event at all. Only its own stream may take it (blocks are matched
// by stream), so the check is made on that stream only. The walk is kept per (capture,
// stream) and goes on from where it stopped: the nodes reached before are ancestors of
// the stream's new tails as long as its last tails are (its dependencies only grew). A
// walk that does not reach them again (they were set anew) starts over from the new
// tails. The walks are dropped when the device's captures end.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <unordered_set>
#include <vector>

namespace tb {

// The nodes `streams` currently end in, all of capture *id: false when one of them is
// not capturing, they capture different graphs, or the driver cannot say. Streams that
// have queued nothing in the capture yet add no node (Note [Reuse during capture]).
bool capture_tails(const std::vector<CUstream>& streams, std::vector<CUgraphNode>* out, uint64_t* id);

// The capture `stream` is in; 0 when it is not capturing or the driver cannot say.
uint64_t capture_id(CUstream stream);

// Whether `stream` may be capturing: true when it is, and when the driver cannot say.
bool may_be_capturing(CUstream stream);

class CaptureWalks {
 public:
  // Every node `stream` depends on so far in its capture, its current tails
  // included; nullptr when it is not capturing or has queued nothing yet.
  const std::unordered_set<CUgraphNode>* reached(CUstream stream);
  void clear() { walks_.clear(); }

 private:
  struct Walk {
    cuuint64_t capture;
    CUstream stream;
    std::unordered_set<CUgraphNode> seen;
    std::vector<CUgraphNode> tails;  // the stream's tails when `seen` was last walked from
  };
  std::vector<Walk> walks_;
};

}  // namespace tb
