#include "error.h"

#include "driver.h"

namespace tb {
namespace {
thread_local ErrorCode t_code = kOk;
thread_local std::string t_message;
}  // namespace

void set_error(ErrorCode code, std::string message) {
  t_code = code;
  t_message = std::move(message);
}

ErrorCode last_error_code() { return t_code; }
const std::string& last_error_message() { return t_message; }

void clear_error() {
  t_code = kOk;
  t_message.clear();
}

bool fail_driver(CUresult r, const char* call, const char* file, int line) {
  ErrorCode code = r == CUDA_ERROR_OUT_OF_MEMORY ? kOutOfMemory : kDriverError;
  set_error(code, std::string(call) + " failed with " + driver_error_name(r) + " (" + file + ":" +
                      std::to_string(line) + ")");
  return false;
}

}  // namespace tb
