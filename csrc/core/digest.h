// Digests of device memory, granule by granule, computed on the device at memory speed
// (Note [Retained backups], tag_sleep.h): the kernel is csrc/kernels/digest.cu, shipped as
// PTX the driver compiles when it is first used, so nothing here needs the CUDA toolkit.
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

// The digest of `words` 8-byte words, as the kernel computes it for one chunk.
Digest digest_host(const uint64_t* words, size_t n);

class Digester {
 public:
  explicit Digester(const DeviceContext& ctx) : ctx_(ctx) {}
  Digester(const Digester&) = delete;
  Digester& operator=(const Digester&) = delete;

  // Whether digests can be computed on this device (the PTX loads); *why says why not.
  bool available(std::string* why);
  // Appends the digests of the `chunks` chunks of `chunk_bytes` (a multiple of 8) from `va`,
  // computed on `stream`, which this waits for. false + error.
  bool digest(CUstream stream, uintptr_t va, size_t chunks, size_t chunk_bytes, std::vector<Digest>* out);

 private:
  const DeviceContext& ctx_;
  int state_ = 0;  // 0 not tried, 1 loaded, -1 unavailable
  std::string why_;
  CUmodule module_ = nullptr;
  CUfunction kernel_ = nullptr;
  CUdeviceptr scratch_ = 0;  // 16 bytes per chunk, grown as needed
  size_t scratch_chunks_ = 0;
  std::vector<uint64_t> host_;
};

}  // namespace tb
