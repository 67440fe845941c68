// The ledger and the segment map of one device as JSON, for Python (the C ABI hands
// these strings over; torch_budget.stats() and segments() parse them).
#pragma once

#include <string>

namespace tb {

class DeviceAllocator;

std::string stats_json(DeviceAllocator& device);
std::string segments_json(DeviceAllocator& device);

}  // namespace tb
