// When freed memory may be given back to the driver or remapped.
//
// Note [Clean blocks]
// A free block may still be read or written by work queued on its stream before the
// free. Handing it to a new allocation on the same stream is safe (see Note
// [Stream-ordered reuse]); unmapping its granules or returning it to the driver is
// not, until that work has run. The device lock is never held across a
// synchronisation (another thread, or a host callback on the device, may need the
// lock for the device to make progress), so instead every free is stamped from a
// counter. A synchronisation that starts when the counter reads T -- of one stream,
// or of the whole device -- makes every block freed at or before T (on that stream)
// "clean". Paths that release or remap memory take only clean blocks. When they
// need more, they ask for synchronisations (request()); the device allocator runs
// them with its lock released and retries.
// Waiting is the last resort: as frees happen, the clock records an event on the
// freeing stream now and then (at most one outstanding per stream; a new one kMarkInterval
// (set_mark_interval) after the last, looked at every eighth free so that a stream far behind
// the host costs no query per free; the slow path marks anew when it needs to know,
// refresh()), and an event found complete makes that stream clean up to the stamp it was
// recorded at. So memory freed a while ago is clean without anyone waiting for the device.
//
// Lock rule: used only under the owning DeviceAllocator's mutex (events come from the
// EventCache, whose own mutex nests inside it).
#pragma once

#include <cuda.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <utility>
#include <vector>

namespace tb {

class StreamClock {
 public:
  // `device`: whose streams these are; `open_captures`: while any capture is open,
  // events are neither recorded nor queried.
  StreamClock(int device, const std::atomic<int>& open_captures) : device_(device), open_captures_(open_captures) {}
  StreamClock(const StreamClock&) = delete;
  StreamClock& operator=(const StreamClock&) = delete;

  static constexpr std::chrono::microseconds kMarkInterval{500};
  // The interval for every device from now on (the host stand-in's tests set 0: a mark at every
  // eighth free whose last mark completed, so that a program's marks do not depend on its speed).
  static void set_mark_interval(std::chrono::microseconds interval) {
    mark_interval_us_.store(interval.count(), std::memory_order_relaxed);
  }

  uint64_t stamp() { return ++now_; }
  uint64_t now() const { return now_; }

  bool clean(CUstream stream, uint64_t freed_at) const {
    if (freed_at <= device_clean_) return true;
    for (const auto& [s, upto] : stream_clean_)
      if (s == stream) return freed_at <= upto;
    return false;
  }

  // Whether a synchronisation of the whole device started after stamp `t`.
  bool device_clean(uint64_t t) const { return t <= device_clean_; }

  void device_synced(uint64_t upto) {
    device_clean_ = std::max(device_clean_, upto);
    stream_clean_.erase(std::remove_if(stream_clean_.begin(), stream_clean_.end(),
                                       [this](const std::pair<CUstream, uint64_t>& e) {
                                         return e.second <= device_clean_;
                                       }),
                        stream_clean_.end());
  }

  void stream_synced(CUstream stream, uint64_t upto) {
    for (auto& [s, u] : stream_clean_) {
      if (s == stream) {
        u = std::max(u, upto);
        return;
      }
    }
    if (upto > device_clean_) stream_clean_.emplace_back(stream, upto);
  }

  // A block of `stream` was just freed (stamped): records a marking event now and then.
  void note_free(CUstream stream) {
    if (open_captures_.load(std::memory_order_acquire) > 0) return;
    Mark* m = nullptr;
    for (Mark& x : marks_)
      if (x.stream == stream) m = &x;
    // Looked at every eighth free only: the clock, and the outstanding event, which a stream
    // whose queued work runs far behind the host keeps incomplete for many frees.
    if (m != nullptr && (++m->frees & 7) != 0) return;
    note_eighth_free(stream, m);
  }
  // Queries the outstanding marking events; those complete make their stream clean.
  // Then records one on each stream with frees since its last and none outstanding, so
  // that the next look finds memory freed until now clean once the device got there.
  void refresh();

  // Requests, valid for the current attempt only.
  void allow_requests(bool allow) {
    allow_ = allow;
    requests_.clear();
  }
  bool requests_allowed() const { return allow_; }
  void request(CUstream stream) {
    if (std::find(requests_.begin(), requests_.end(), stream) == requests_.end()) requests_.push_back(stream);
  }
  std::vector<CUstream> take_requests() {
    std::vector<CUstream> out;
    out.swap(requests_);
    return out;
  }

 private:
  uint64_t now_ = 0;
  uint64_t device_clean_ = 0;
  std::vector<std::pair<CUstream, uint64_t>> stream_clean_;
  std::vector<CUstream> requests_;
  bool allow_ = false;

  struct Mark {
    CUstream stream;
    uint64_t upto;             // stamp when the event was recorded (0: none outstanding)
    CUevent event;
    std::chrono::steady_clock::time_point at;
    int frees;                 // since the last record
  };
  // Queries `m`'s event; true when it completed (the stream is then clean up to it).
  bool settle(Mark& m);
  // note_free's every eighth call on a stream (`m`: its mark, nullptr if it has none yet).
  void note_eighth_free(CUstream stream, Mark* m);
  void record(Mark& m, std::chrono::steady_clock::time_point now);
  const int device_;
  const std::atomic<int>& open_captures_;
  std::vector<Mark> marks_;
  static std::atomic<int64_t> mark_interval_us_;
};

}  // namespace tb
