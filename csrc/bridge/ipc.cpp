#include "ipc.h"

#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>

#include <map>
#include <mutex>
#include <utility>

#include "bridge/errors.h"
#include "core/allocator.h"
#include "core/error.h"

namespace tb::bridge {
namespace {

std::mutex mu;
// Never destroyed: consumers may drop mappings during exit.
auto* opened = new std::map<std::pair<std::string, int>, std::weak_ptr<void>>();

}  // namespace

c10::cuda::CUDACachingAllocator::ShareableHandle share_ipc_handle(void* ptr) {
  int device = -1;
  BlockInfo info{};
  if (!tb::Allocator::get().lookup(ptr, &device, &info)) raise_last_error("shareIpcHandle");
  c10::cuda::CUDACachingAllocator::ShareableHandle out{};
  size_t offset = 0;
  if (!tb::Allocator::get().device(device)->share(reinterpret_cast<uintptr_t>(ptr), &out.handle, &offset))
    raise_last_error("shareIpcHandle");
  out.offset = static_cast<ptrdiff_t>(offset);
  return out;
}

std::shared_ptr<void> open_ipc_handle(const std::string& handle) {
  const int device = c10::cuda::current_device();
  std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_pair(handle, device);
  auto it = opened->find(key);
  if (it != opened->end()) {
    if (auto sp = it->second.lock()) return sp;
    opened->erase(it);
  }
  tb::DeviceAllocator* d = tb::Allocator::get().device(device);
  if (d == nullptr) raise_last_error("getIpcDevPtr");
  auto* share = new OpenedShare();
  if (!d->open_shared(handle, share)) {
    delete share;
    raise_last_error("getIpcDevPtr");
  }
  std::shared_ptr<void> sp(reinterpret_cast<void*>(share->ptr), [d, share, key](void*) {
    {
      std::lock_guard<std::mutex> lock(mu);
      auto it = opened->find(key);
      if (it != opened->end() && it->second.expired()) opened->erase(it);
    }
    d->close_shared(*share);
    delete share;
  });
  (*opened)[key] = sp;
  return sp;
}

}  // namespace tb::bridge
