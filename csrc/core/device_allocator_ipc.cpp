// Sharing blocks with other processes: Note [Sharing memory between processes] (ipc.h).
#include <unistd.h>

#include "device_allocator.h"
#include "error.h"

namespace tb {

bool DeviceAllocator::share(uintptr_t ptr, std::string* handle, size_t* offset) {
  std::lock_guard<std::mutex> lock(mu_);
  Block* b = live_.find(ptr);
  TB_REQUIRE(b != nullptr, kInvalidArgument,
             "cannot share memory that does not start a live allocation of torch_budget on device " +
                 std::to_string(ctx_.device),
             false);
  ShareHandle h;
  switch (b->route) {
    case kRouteVmm: {
      h.kind = kShareVmm;
      h.pid = static_cast<int32_t>(getpid());
      uintptr_t start = 0;
      if (!vmm_->export_block(*b->segment, b->ptr, b->size, &h.pieces, &start)) return false;
      *offset = b->ptr - start;
      break;
    }
    case kRouteSync: {
      TB_REQUIRE(driver()->ipcGetMemHandle != nullptr, kNotAvailable, "the driver has no cuIpcGetMemHandle", false);
      ContextGuard guard(ctx_.ctx);
      if (!guard.ok()) return false;
      h.kind = kShareCudaMalloc;
      TB_DRIVER_CHECK(driver()->ipcGetMemHandle(&h.cuda, b->segment->base), false);
      *offset = b->ptr - b->segment->base;
      break;
    }
    default:
      set_error(kNotAvailable,
                "memory of the stream-ordered pool route cannot be shared with another process (its pool is not "
                "exportable): allocate the tensors you share under torch_budget.route('vmm') or "
                "torch_budget.route('sync')");
      return false;
  }
  *handle = encode_share(h);
  b->shared = true;
  return true;
}

bool DeviceAllocator::open_shared(const std::string& bytes, OpenedShare* out) {
  ShareHandle h;
  if (!decode_share(bytes, &h)) return false;
  ContextGuard guard(ctx_.ctx);
  if (!guard.ok()) return false;
  const DriverApi* d = driver();
  out->device = ctx_.device;
  out->kind = h.kind;
  if (h.kind == kShareCudaMalloc) {
    TB_REQUIRE(d->ipcOpenMemHandle != nullptr, kNotAvailable, "the driver has no cuIpcOpenMemHandle", false);
    CUdeviceptr p = 0;
    TB_DRIVER_CHECK(d->ipcOpenMemHandle(&p, h.cuda, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS), false);
    out->ptr = p;
    return true;
  }
  TB_REQUIRE(caps_.vmm && d->memImportFromShareableHandle != nullptr, kNotAvailable,
             "device " + std::to_string(ctx_.device) + " cannot import VMM memory", false);
  std::vector<int> fds;
  if (!take_remote_fds(h.pid, h.pieces, &fds)) return false;
  for (const SharedPiece& p : h.pieces) out->bytes += p.bytes;
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
      r = d->memMap(base + at, h.pieces[i].bytes, 0, mh, 0);
      if (r != CUDA_SUCCESS) {
        d->memRelease(mh);
        break;
      }
      out->handles.emplace_back(mh, h.pieces[i].bytes);
      at += h.pieces[i].bytes;
    }
    if (r == CUDA_SUCCESS) {
      call = "cuMemSetAccess";
      std::vector<CUmemAccessDesc> access{read_write_access(ctx_.device)};
      {
        std::lock_guard<std::mutex> lock(mu_);
        for (int peer : peers_) access.push_back(read_write_access(peer));
      }
      r = d->memSetAccess(base, out->bytes, access.data(), access.size());
    }
  }
  for (int fd : fds) close(fd);
  if (r == CUDA_SUCCESS) return true;
  fail_driver(r, call, __FILE__, __LINE__);
  const std::string msg = last_error_message();
  close_shared(*out);
  set_error(kDriverError, msg);
  return false;
}

void DeviceAllocator::close_shared(OpenedShare& s) {
  ContextGuard guard(ctx_.ctx);
  if (!guard.ok()) return;
  const DriverApi* d = driver();
  if (s.kind == kShareCudaMalloc) {
    if (s.ptr != 0) d->ipcCloseMemHandle(s.ptr);
  } else if (s.ptr != 0) {
    // Work queued on the consumer's streams may still read the mapping.
    if (open_captures() == 0) d->ctxSynchronize();
    uintptr_t at = s.ptr;
    for (const auto& [mh, bytes] : s.handles) {
      d->memUnmap(at, bytes);
      d->memRelease(mh);
      at += bytes;
    }
    d->memAddressFree(s.ptr, s.bytes);
  }
  s = OpenedShare{};
}

}  // namespace tb
