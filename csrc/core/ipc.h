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
// - VMM route: the physical handles of the mappings under the block (whole mappings:
//   a run mapping may reach past the block), exported as POSIX file descriptors --
//   handles are created exportable when the device supports it. Format: version byte,
//   't', the producer's pid and the mapping count, then per mapping its descriptor
//   (a number in the producer) and its bytes. The consumer takes each descriptor out
//   of the producer with pidfd_getfd (Linux 5.6; it needs ptrace rights over the
//   producer, as torch's expandable segments do), imports it, maps the mappings in
//   order in a fresh address range and grants its device access. The producer keeps
//   a handle's descriptor open for as long as the handle lives.
// - stream-ordered pool route: refused with an error naming the routes to use.
// The consumer's mapping holds the physical memory itself; torch's IPC reference
// count keeps the producer's block allocated while a consumer holds it.
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
constexpr char kShareVmm = 't';

struct SharedPiece {
  int fd;        // in the producer
  size_t bytes;
};

struct ShareHandle {
  char kind = 0;
  CUipcMemHandle cuda{};             // kShareCudaMalloc
  int32_t pid = 0;                   // kShareVmm
  std::vector<SharedPiece> pieces;   // kShareVmm
};

std::string encode_share(const ShareHandle& h);
// false + kInvalidArgument for bytes that are not a handle we can open.
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

// The producer's side: the handle bytes of the live block `b` and its offset from what
// the handle maps. false + error (kNotAvailable for the stream-ordered pool route).
bool export_block(const DeviceContext& ctx, VmmRoute* vmm, const Block& b, std::string* handle, size_t* offset);
// The consumer's side, on the device of `ctx` (`vmm`: it can import VMM memory), granting
// `peers` access too; close_share undoes it (`may_sync`: wait for work queued on the
// mapping first, impossible while a capture is open).
bool open_share(const DeviceContext& ctx, bool vmm, const std::vector<int>& peers, const std::string& bytes,
                OpenedShare* out);
void close_share(const DeviceContext& ctx, OpenedShare& s, bool may_sync);

// Descriptors of another process (pidfd_open + pidfd_getfd); false + error.
bool take_remote_fds(int32_t pid, const std::vector<SharedPiece>& pieces, std::vector<int>* out);

}  // namespace tb
