// torch's shareIpcHandle / getIpcDevPtr over the core's sharing (Note [Sharing memory
// between processes], core/ipc.h).
#pragma once

#include <c10/cuda/CUDACachingAllocator.h>

#include <memory>
#include <string>

namespace tb::bridge {

c10::cuda::CUDACachingAllocator::ShareableHandle share_ipc_handle(void* ptr);

// One mapping per handle and device in this process, however often torch asks for it
// (torch caches by the handle's bytes too, but two tensors of one segment ask twice);
// it is closed when the last pointer to it goes.
std::shared_ptr<void> open_ipc_handle(const std::string& handle);

}  // namespace tb::bridge
