// Digests of device memory, granule by granule, computed on the device at memory speed
// (Note [Retained backups], tag_sleep.h): the kernel is csrc/kernels/digest.cu, shipped as
// PTX the driver compiles when it is first used, so nothing here needs the CUDA toolkit.
//
// Use: begin(n) makes room for n chunks; start() queues a batch of chunks on a stream (their
// addresses go to the device, one launch digests them, the digests come back into pinned host
// memory, an event marks the end) and returns at once; finish() waits for one batch. So the host
// can act on the first batches while the device digests the later ones. end() frees the device
// buffers (24 bytes per chunk), so between releases the driver holds nothing the ledger does not.
//
// Lock rule: owned by one device's TagMover, used under that device's lock.
#pragma once

#include <cuda.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "driver.h"

namespace tb {

using Digest = std::array<uint64_t, 2>;

// The digest of `n` 8-byte words, as the kernel computes it for one chunk.
Digest digest_host(const uint64_t* words, size_t n);

class Digester {
 public:
  explicit Digester(const DeviceContext& ctx) : ctx_(ctx) {}
  Digester(const Digester&) = delete;
  Digester& operator=(const Digester&) = delete;

  // Whether digests can be computed on this device (the PTX loads); *why says why not.
  bool available(std::string* why);
  // Room for `chunks` chunks in the batches that follow; forgets earlier batches. false + error.
  bool begin(size_t chunks);
  // Queues the digests of the chunks of `chunk_bytes` (a multiple of 8) at `addresses` on
  // `stream`; *batch: its number for finish(). false + error.
  bool start(CUstream stream, const std::vector<uintptr_t>& addresses, size_t chunk_bytes, size_t* batch);
  // Waits for `batch` and appends its digests, in the order of its addresses. false + error.
  bool finish(size_t batch, std::vector<Digest>* out);
  // Gives the device buffers back (they are outside the budget and the ledger: held only while
  // a release or restore digests), after waiting for what was queued on `stream`.
  void end(CUstream stream);

 private:
  // Frees the device buffers, keeping each the driver refuses (false + error) for a later call.
  bool free_buffers();
  struct Batch {
    size_t first, count;
    CUevent done;
  };
  const DeviceContext& ctx_;
  int state_ = 0;  // 0 not tried, 1 loaded, -1 unavailable
  std::string why_;
  CUmodule module_ = nullptr;
  CUfunction kernel_ = nullptr;
  size_t capacity_ = 0;          // chunks the device buffers hold
  size_t host_capacity_ = 0;     // chunks `results_` holds
  CUdeviceptr addresses_ = 0;    // device: 8 bytes per chunk
  CUdeviceptr digests_ = 0;      // device: 16 bytes per chunk
  uint64_t* results_ = nullptr;  // pinned host: 16 bytes per chunk
  size_t used_ = 0;
  std::vector<Batch> batches_;
  std::vector<CUevent> events_;  // one per batch, kept for the next begin()
};

}  // namespace tb
