// DeviceAllocator: sharing its blocks with other processes (Note [Sharing memory between
// processes], ipc.h, which does the work).
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
  if (!export_block(ctx_, vmm_.get(), *b, open_captures() == 0, handle, offset)) return false;
  b->shared = true;  // its tag cannot be released while it lives (Note [Tag arenas])
  return true;
}

bool DeviceAllocator::open_shared(const std::string& bytes, OpenedShare* out) {
  std::vector<int> peers;
  {
    std::lock_guard<std::mutex> lock(mu_);
    peers = peers_;
  }
  return open_share(ctx_, caps_.vmm, peers, bytes, out);
}

void DeviceAllocator::close_shared(OpenedShare& s) { close_share(ctx_, s, open_captures() == 0); }

}  // namespace tb
