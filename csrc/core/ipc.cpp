#include "ipc.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "error.h"
#include "route_vmm.h"

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif

namespace tb {
namespace {

template <typename T>
void put(std::string& s, const T& v) {
  s.append(reinterpret_cast<const char*>(&v), sizeof v);
}

template <typename T>
bool get(const std::string& s, size_t* at, T* v) {
  if (*at + sizeof(T) > s.size()) return false;
  std::memcpy(v, s.data() + *at, sizeof(T));
  *at += sizeof(T);
  return true;
}

// The header of torch's expandable-segment handle (ExpandableSegment::ShareHeader), byte for
// byte: what a consumer on torch's own allocator reads.
struct TorchShareHeader {
  pid_t pid;
  size_t segment_size;
  size_t num_handles;
};
static_assert(sizeof(TorchShareHeader) == 24, "torch's ShareHeader is 24 bytes on 64-bit Linux");

// What encode_share writes for a handle of `kind` naming `fds` descriptors.
size_t encoded_bytes(char kind, size_t fds) {
  return 2 + (kind == kShareCudaMalloc ? sizeof(CUipcMemHandle) : sizeof(TorchShareHeader) + fds * sizeof(int));
}

bool fits(size_t room, size_t bytes) {
  TB_REQUIRE(bytes <= room, kInvalidArgument,
             "a buffer of " + std::to_string(room) + " bytes is too small for the handle of " + std::to_string(bytes) +
                 " bytes",
             false);
  return true;
}

}  // namespace

std::string encode_share(const ShareHandle& h) {
  std::string s;
  s.push_back(kShareVersion);
  s.push_back(h.kind);
  if (h.kind == kShareCudaMalloc) {
    put(s, h.cuda);
    return s;
  }
  TorchShareHeader header{};  // zero padding: the same bytes for the same memory
  header.pid = h.pid;
  header.segment_size = h.handle_bytes;
  header.num_handles = h.fds.size();
  put(s, header);
  for (int fd : h.fds) put(s, fd);
  return s;
}

bool decode_share(const std::string& bytes, ShareHandle* out) {
  const std::string bad = "not a CUDA memory handle torch_budget can open (" + std::to_string(bytes.size()) + " bytes)";
  *out = ShareHandle{};
  if (bytes.size() == sizeof(CUipcMemHandle)) {  // torch's legacy form: the bare handle
    out->kind = kShareCudaMalloc;
    std::memcpy(&out->cuda, bytes.data(), sizeof(CUipcMemHandle));
    return true;
  }
  TB_REQUIRE(bytes.size() >= 2, kInvalidArgument, bad, false);
  TB_REQUIRE(bytes[0] >= 1 && bytes[0] <= 3, kInvalidArgument,
             "CUDA memory handle of version " + std::to_string(bytes[0]) + ": " + bad, false);
  size_t at = 2;
  out->kind = bytes[1];
  if (out->kind == kShareCudaMalloc) {
    TB_REQUIRE(get(bytes, &at, &out->cuda), kInvalidArgument, bad, false);
    return true;
  }
  TB_REQUIRE(out->kind == kShareVmm, kInvalidArgument,
             std::string("CUDA memory handle of kind '") + out->kind + "': " + bad, false);
  TorchShareHeader header{};
  TB_REQUIRE(get(bytes, &at, &header) && header.segment_size > 0 && header.num_handles > 0 &&
                 header.num_handles < (size_t{1} << 24) && bytes.size() - at == header.num_handles * sizeof(int),
             kInvalidArgument, bad, false);
  // The consumer reserves segment_size * num_handles bytes of address range for them.
  TB_REQUIRE(header.segment_size <= SIZE_MAX / header.num_handles, kInvalidArgument,
             "a CUDA memory handle of " + std::to_string(header.num_handles) + " handles of " +
                 format_size(header.segment_size) + " each, more than the address space holds: " + bad,
             false);
  out->pid = header.pid;
  out->handle_bytes = header.segment_size;
  out->fds.resize(header.num_handles);
  for (int& fd : out->fds) get(bytes, &at, &fd);
  return true;
}

bool take_remote_fds(int32_t pid, const std::vector<int>& fds, std::vector<int>* out) {
  const long pidfd = syscall(SYS_pidfd_open, pid, 0);
  TB_REQUIRE(pidfd >= 0, kNotAvailable,
             "pidfd_open(" + std::to_string(pid) + ") failed: " + std::strerror(errno) +
                 " (sharing VMM memory needs Linux 5.6 and a producer that is still running)",
             false);
  for (int remote : fds) {
    const long fd = syscall(SYS_pidfd_getfd, pidfd, remote, 0);
    if (fd < 0) {
      const int err = errno;
      for (int f : *out) close(f);
      out->clear();
      close(static_cast<int>(pidfd));
      set_error(kNotAvailable, "pidfd_getfd from process " + std::to_string(pid) + " failed: " + std::strerror(err) +
                                   " (taking a descriptor needs ptrace rights over the producer: the same user, "
                                   "and kernel.yama.ptrace_scope 0, or CAP_SYS_PTRACE). Share tensors allocated "
                                   "under torch_budget.region(route='sync') instead, which need no descriptors");
      return false;
    }
    out->push_back(static_cast<int>(fd));
  }
  close(static_cast<int>(pidfd));
  return true;
}

bool export_block(const DeviceContext& ctx, VmmRoute* vmm, const Block& b, size_t room, std::string* handle,
                  size_t* offset) {
  ShareHandle h;
  switch (b.route) {
    case kRouteVmm: {
      h.kind = kShareVmm;
      h.pid = static_cast<int32_t>(getpid());
      VmmRoute::ShareCut cut;  // checked before anything is exported
      if (!vmm->plan_share(*b.segment, b.ptr, b.size, &cut) ||
          !fits(room, encoded_bytes(kShareVmm, (cut.hi - cut.lo) / cut.piece)))
        return false;
      uintptr_t start = 0;
      if (!vmm->export_block(*b.segment, b.ptr, b.size, &h.fds, &h.handle_bytes, &start)) return false;
      *offset = b.ptr - start;
      break;
    }
    case kRouteSync: {
      TB_REQUIRE(driver()->ipcGetMemHandle != nullptr, kNotAvailable, "the driver has no cuIpcGetMemHandle", false);
      if (!fits(room, encoded_bytes(kShareCudaMalloc, 0))) return false;
      ContextGuard guard(ctx.ctx);
      if (!guard.ok()) return false;
      h.kind = kShareCudaMalloc;
      TB_DRIVER_CHECK(driver()->ipcGetMemHandle(&h.cuda, b.segment->base), false);
      *offset = b.ptr - b.segment->base;
      break;
    }
    default:
      set_error(kNotAvailable,
                "memory of the stream-ordered pool route cannot be shared with another process (its pool is not "
                "exportable): allocate the tensors you share under torch_budget.region(route='vmm') or "
                "torch_budget.region(route='sync')");
      return false;
  }
  *handle = encode_share(h);
  return true;
}

bool open_share(const DeviceContext& ctx, size_t granularity, const std::vector<int>& peers, const std::string& bytes,
                OpenedShare* out) {
  ShareHandle h;
  if (!decode_share(bytes, &h)) return false;
  ContextGuard guard(ctx.ctx);
  if (!guard.ok()) return false;
  const DriverApi* d = driver();
  out->device = ctx.device;
  out->kind = h.kind;
  if (h.kind == kShareCudaMalloc) {
    TB_REQUIRE(d->ipcOpenMemHandle != nullptr, kNotAvailable, "the driver has no cuIpcOpenMemHandle", false);
    CUdeviceptr p = 0;
    TB_DRIVER_CHECK(d->ipcOpenMemHandle(&p, h.cuda, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS), false);
    out->ptr = p;
    return true;
  }
  TB_REQUIRE(granularity == 0 || h.handle_bytes % granularity == 0, kInvalidArgument,
             "a CUDA memory handle of handles of " + format_size(h.handle_bytes) +
                 " each, not a multiple of the VMM granularity of device " + std::to_string(ctx.device) + " (" +
                 format_size(granularity) + "): not a handle torch_budget can open",
             false);
  TB_REQUIRE(granularity != 0 && d->memImportFromShareableHandle != nullptr, kNotAvailable,
             "device " + std::to_string(ctx.device) + " cannot import VMM memory", false);
  std::vector<int> fds;
  if (!take_remote_fds(h.pid, h.fds, &fds)) return false;
  out->bytes = h.handle_bytes * h.fds.size();
  CUresult r = CUDA_SUCCESS;
  const char* call = "cuMemAddressReserve";
  CUdeviceptr base = 0;
  if ((r = d->memAddressReserve(&base, out->bytes, 0, 0, 0)) == CUDA_SUCCESS) {
    out->ptr = base;
    size_t at = 0;
    for (size_t i = 0; i < fds.size() && r == CUDA_SUCCESS; ++i) {
      CUmemGenericAllocationHandle mh = 0;
      call = "cuMemImportFromShareableHandle";
      r = d->memImportFromShareableHandle(&mh, reinterpret_cast<void*>(static_cast<uintptr_t>(fds[i])),
                                          CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
      if (r != CUDA_SUCCESS) break;
      call = "cuMemMap";
      r = d->memMap(base + at, h.handle_bytes, 0, mh, 0);
      if (r != CUDA_SUCCESS) {
        retry_driver([&] { return d->memRelease(mh); });
        break;
      }
      out->handles.emplace_back(mh, h.handle_bytes);
      at += h.handle_bytes;
    }
    if (r == CUDA_SUCCESS) {
      call = "cuMemSetAccess";
      std::vector<CUmemAccessDesc> access{read_write_access(ctx.device)};
      for (int peer : peers) access.push_back(read_write_access(peer));
      r = d->memSetAccess(base, out->bytes, access.data(), access.size());
    }
  }
  for (int fd : fds) close(fd);
  if (r == CUDA_SUCCESS) return true;
  fail_driver(r, call, __FILE__, __LINE__);
  const std::string msg = last_error_message();
  close_share(ctx, *out, false);  // nothing was queued on a mapping never handed out
  set_error(kDriverError, msg);
  return false;
}

bool close_share(const DeviceContext& ctx, OpenedShare& s, bool may_sync) {
  ContextGuard guard(ctx.ctx);
  if (!guard.ok()) return false;  // `s` kept, to be closed later
  const DriverApi* d = driver();
  // Retried as every unmap and release is: a refusal would hold the producer's memory (the
  // mapping keeps it) until this process exits.
  if (s.kind == kShareCudaMalloc) {
    if (s.ptr != 0) retry_driver([&] { return d->ipcCloseMemHandle(s.ptr); });
  } else if (s.ptr != 0) {
    // Work queued on the consumer's streams may still read the mapping.
    if (may_sync) d->ctxSynchronize();
    uintptr_t at = s.ptr;
    for (const auto& [mh, bytes] : s.handles) {
      retry_driver([&] { return d->memUnmap(at, bytes); });
      retry_driver([&] { return d->memRelease(mh); });
      at += bytes;
    }
    retry_driver([&] { return d->memAddressFree(s.ptr, s.bytes); });
  }
  s = OpenedShare{};
  return true;
}

}  // namespace tb
