// Core failures as torch errors, for the bridge's files.
#pragma once

#include <cstddef>

namespace tb {
struct OomFigures;
}

namespace tb::bridge {

// Throws the core's last error on this thread as a c10 error: kOutOfMemory becomes
// torch.cuda.OutOfMemoryError, after torch's observers are told (when `device` >= 0) with the
// failed allocation's own figures (`oom`; without them, nothing is told of a budget refusal),
// anything else an error naming `what`.
[[noreturn]] void raise_last_error(const char* what, int device = -1, size_t size = 0,
                                   const OomFigures* oom = nullptr);

}  // namespace tb::bridge
