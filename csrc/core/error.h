// Errors inside the core: a code plus a message kept per thread.
//
// Nothing in the core throws or aborts: a failing call returns false / nullptr after
// set_error(); the C ABI returns the code and Python (or the torch bridge) turns it
// into a real exception with last_error_message(). The per-thread state is plain
// storage (no destructor), so frees that arrive during process exit, after
// thread-local objects were destroyed, can still record an error safely.
#pragma once

#include <cuda.h>

#include <string>

namespace tb {

enum ErrorCode : int {
  kOk = 0,
  kInvalidArgument = 1,  // bad input from the caller (unknown pointer, negative size, ...)
  kOutOfMemory = 2,      // budget exceeded or the driver refused, after one retry
  kDriverError = 3,      // a driver call failed for another reason
  kNotAvailable = 4,     // no driver / capability missing / not initialised
  kState = 5,            // call not allowed in the current state (e.g. already installed)
  kFileError = 6,        // a disk backup's file could not be written or read (Note [Disk backups])
  // Internal, never returned by the C ABI: an attempt needs streams synchronised
  // (outside the device lock) before it is retried. See Note [Clean blocks].
  kNeedSync = 100,
};

// Cold: a failure's path (its message built inline by TB_REQUIRE) is laid out away from the
// hot code around it, which keeps the allocation path's instructions in fewer cache lines.
[[gnu::cold]] void set_error(ErrorCode code, const std::string& message);
ErrorCode last_error_code();
const char* last_error_message();
void clear_error();

// Keeps this thread's error across cleanup that may record its own: what was there (or no
// error) is put back when it goes.
class KeepError {
 public:
  KeepError() : code_(last_error_code()), message_(last_error_message()) {}
  ~KeepError() { set_error(code_, message_); }  // kOk with its empty message: no error
  KeepError(const KeepError&) = delete;
  KeepError& operator=(const KeepError&) = delete;

 private:
  ErrorCode code_;
  std::string message_;
};

// Records a failed driver call with the file:line and the driver's error name.
[[gnu::cold]] bool fail_driver(CUresult r, const char* call, const char* file, int line);

}  // namespace tb

// Evaluates a driver call; on failure records it and makes the enclosing function
// return `ret`.
#define TB_DRIVER_CHECK(call, ret)                                   \
  do {                                                               \
    CUresult tb_r_ = (call);                                         \
    if (__builtin_expect(tb_r_ != CUDA_SUCCESS, 0)) {                \
      ::tb::fail_driver(tb_r_, #call, __FILE__, __LINE__);           \
      return ret;                                                    \
    }                                                                \
  } while (0)

#define TB_REQUIRE(cond, code, msg, ret)                             \
  do {                                                               \
    if (__builtin_expect(!(cond), 0)) {                              \
      ::tb::set_error((code), (msg));                                \
      return ret;                                                    \
    }                                                                \
  } while (0)
