// How an allocation fails: the out-of-memory message (torch's head sentence, then the budget's
// account of the device), counted in the ledger and traced for torch's OOM observers.
#include "device_allocator.h"

#include "error.h"
#include "scope.h"

namespace tb {

void DeviceAllocator::fail_oom(size_t size, CUstream stream, int route, int tag, const std::string& cause,
                               bool by_budget, OomFigures* oom) {
  size_t free_b = 0;
  const std::string text = oom_text(size, route, tag, cause, by_budget, &free_b);
  report_oom(size, stream, route, tag, free_b, text, by_budget, oom);
}

void DeviceAllocator::fail_tag_oom(size_t size, size_t charged, CUstream stream, int route, int tag,
                                   OomFigures* oom) {
  size_t free_b = 0, total_b = 0;
  device_memory(&free_b, &total_b);
  report_oom(size, stream, route, tag, free_b,
             budget_.tag_oom_message(size, charged, tag, tag_name(tag), free_b, total_b), /*by_budget=*/false, oom);
}

void DeviceAllocator::report_oom(size_t size, CUstream stream, int route, int tag, size_t device_free,
                                 const std::string& text, bool by_budget, OomFigures* oom) {
  bump(ledger_.num_ooms);
  trace(TraceAction::kOom, ctx_.device, device_free, size, stream, {0, 0}, tag, route);
  set_error(kOutOfMemory, text);
  if (oom != nullptr)
    *oom = OomFigures{by_budget, ledger_.blocks[kAggregate].allocated_bytes.get(), budget_.reserved()};
}

void DeviceAllocator::device_memory(size_t* free_bytes, size_t* total_bytes) {
  mem_info(free_bytes, total_bytes);
  if (*total_bytes == 0) *total_bytes = caps_.total_bytes;
}

std::string DeviceAllocator::oom_text(size_t size, int route, int tag, const std::string& cause, bool by_budget,
                                      size_t* device_free, bool retried) {
  size_t free_b = 0, total_b = 0;
  device_memory(&free_b, &total_b);
  if (device_free != nullptr) *device_free = free_b;
  return budget_.oom_message(size, route, tag_name(tag), cause, by_budget, free_b, total_b, retried);
}

}  // namespace tb
