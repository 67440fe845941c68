// Sharing device memory with other processes (torch's shareIpcHandle / getIpcDevPtr).
//
// Note [Sharing memory between processes]
// torch sends a CUDA tensor to another process as (handle bytes, offset); the
// consumer asks the allocator to open the handle once (torch caches the mapping by
// the handle's bytes) and adds the offset. What a handle holds depends on the route
// of the block:
// - sync route: the block's cuMemAlloc segment, in torch's own format (version byte,
//   'c', the 64-byte cudaIpcMemHandle), so a consumer on torch's native allocator can
//   open it too; offset = block - segment base.
// - VMM route: torch's own expandable-segment format (version byte, 'e', a header of the
//   producer's pid, the bytes of each handle and their count, then each handle's POSIX file
//   descriptor, a number in the producer), so a consumer on torch's native allocator opens
//   it too; offset = block - start of the first handle. The consumer takes each descriptor
//   out of the producer with pidfd_getfd (Linux 5.6; it needs ptrace rights over the
//   producer, as torch's expandable segments do), imports it and maps the handles in order,
//   each `segment bytes` long, in a fresh address range. That format needs every handle
//   under the block to be the same size, which run mappings are not (Note [Run mappings],
//   route_vmm.h): see Note [Sharing run mappings] (route_vmm_share.cpp). The producer keeps
//   a handle's descriptor open for as long as the handle lives.
// - stream-ordered pool route: refused with an error naming the routes to use. Its memory
//   has no handle torch's formats can carry: on an H200 (driver 580, tools/probe_vmm.py), even
//   a pool made with POSIX-descriptor handles answers cuMemRetainAllocationHandle with
//   CUDA_ERROR_INVALID_VALUE, at an allocation's start and inside it, and cuIpcGetMemHandle is
//   for cuMemAlloc memory only; a pool's own export needs a consumer that imports pools.
// The consumer's mapping holds the physical memory itself; torch's IPC reference
// count keeps the producer's block allocated while a consumer holds it. A block once shared
// keeps its tag from being released for as long as it lives (Note [Tag arenas]): the producer
// cannot see when the consumers closed their mappings. One that keeps the tensor (weights sent
// for an RL weight sync) says so with end_sharing, after which the tag may be released again.
#pragma once

#include <cuda.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace tb {

constexpr char kShareVersion = 2;  // torch's SHAREABLE_HANDLE_VERSION; we read up to 3
constexpr char kShareCudaMalloc = 'c';
constexpr char kShareVmm = 'e';  // torch's SHAREABLE_CUDA_EXPANDABLE_SEGMENT

struct ShareHandle {
  char kind = 0;
  CUipcMemHandle cuda{};   // kShareCudaMalloc
  int32_t pid = 0;         // kShareVmm: the producer
  size_t handle_bytes = 0; // kShareVmm: each handle's size
  std::vector<int> fds;    // kShareVmm: the handles' descriptors, numbers in the producer, in address order
};

std::string encode_share(const ShareHandle& h);
// false + kInvalidArgument for bytes that are not a handle we can open (sizes that
// overflow included).
bool decode_share(const std::string& bytes, ShareHandle* out);

// What a consumer opened: released with close_shared.
struct OpenedShare {
  int device = -1;
  char kind = 0;
  uintptr_t ptr = 0;
  size_t bytes = 0;
  std::vector<std::pair<CUmemGenericAllocationHandle, size_t>> handles;  // VMM: mapped in order from ptr
};

struct Block;
struct DeviceContext;
class VmmRoute;

// The producer's side: the handle bytes of the live block `b`, at most `room` of them
// (else kInvalidArgument, nothing exported), and its offset from what the handle maps. A
// VMM block's mappings must be cut to one size first (Note [Sharing run mappings],
// route_vmm_share.cpp). false + error (kNotAvailable for the stream-ordered pool route).
bool export_block(const DeviceContext& ctx, VmmRoute* vmm, const Block& b, size_t room, std::string* handle,
                  size_t* offset);
// The consumer's side, on the device of `ctx` (`granularity`: its VMM granularity, 0 when
// it cannot import VMM memory), granting `peers` access too; bytes from another process
// are checked before anything is opened (kInvalidArgument). close_share undoes it
// (`may_sync`: wait for work queued on the mapping first, impossible while a capture is open:
// DeviceAllocator::close_shared then keeps the mapping until the captures end); false, with `s`
// kept, when the device's context cannot be made current.
bool open_share(const DeviceContext& ctx, size_t granularity, const std::vector<int>& peers, const std::string& bytes,
                OpenedShare* out);
bool close_share(const DeviceContext& ctx, OpenedShare& s, bool may_sync);

// Descriptors of another process (pidfd_open + pidfd_getfd); false + error.
bool take_remote_fds(int32_t pid, const std::vector<int>& fds, std::vector<int>* out);

}  // namespace tb
