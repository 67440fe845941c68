#include "error.h"

#include <algorithm>
#include <cstring>

#include "driver.h"

namespace tb {
namespace {
constexpr size_t kMessageBytes = 2048;
thread_local ErrorCode t_code = kOk;
thread_local char t_message[kMessageBytes];
}  // namespace

void set_error(ErrorCode code, const std::string& message) {
  t_code = code;
  const size_t n = std::min(message.size(), kMessageBytes - 1);
  std::memcpy(t_message, message.data(), n);
  t_message[n] = '\0';
}

ErrorCode last_error_code() { return t_code; }
const char* last_error_message() { return t_message; }

void clear_error() {
  t_code = kOk;
  t_message[0] = '\0';
}

bool fail_driver(CUresult r, const char* call, const char* file, int line) {
  ErrorCode code = r == CUDA_ERROR_OUT_OF_MEMORY ? kOutOfMemory : kDriverError;
  const char* base = std::strrchr(file, '/');
  set_error(code, std::string(call) + " failed with " + driver_error_name(r) + " (" + (base ? base + 1 : file) + ":" +
                      std::to_string(line) + ")");
  return false;
}

}  // namespace tb
