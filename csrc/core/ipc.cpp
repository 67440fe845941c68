#include "ipc.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "error.h"

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif

namespace tb {
namespace {

template <typename T>
void put(std::string& s, const T& v) {
  s.append(reinterpret_cast<const char*>(&v), sizeof v);
}

template <typename T>
bool get(const std::string& s, size_t* at, T* v) {
  if (*at + sizeof(T) > s.size()) return false;
  std::memcpy(v, s.data() + *at, sizeof(T));
  *at += sizeof(T);
  return true;
}

}  // namespace

std::string encode_share(const ShareHandle& h) {
  std::string s;
  s.push_back(kShareVersion);
  s.push_back(h.kind);
  if (h.kind == kShareCudaMalloc) {
    put(s, h.cuda);
    return s;
  }
  put(s, h.pid);
  put(s, static_cast<uint32_t>(h.pieces.size()));
  for (const SharedPiece& p : h.pieces) {
    put(s, static_cast<int32_t>(p.fd));
    put(s, static_cast<uint64_t>(p.bytes));
  }
  return s;
}

bool decode_share(const std::string& bytes, ShareHandle* out) {
  const std::string bad = "not a CUDA memory handle torch_budget can open (" + std::to_string(bytes.size()) + " bytes)";
  *out = ShareHandle{};
  if (bytes.size() == sizeof(CUipcMemHandle)) {  // torch's legacy form: the bare handle
    out->kind = kShareCudaMalloc;
    std::memcpy(&out->cuda, bytes.data(), sizeof(CUipcMemHandle));
    return true;
  }
  TB_REQUIRE(bytes.size() >= 2, kInvalidArgument, bad, false);
  TB_REQUIRE(bytes[0] >= 1 && bytes[0] <= 3, kInvalidArgument,
             "CUDA memory handle of version " + std::to_string(bytes[0]) + ": " + bad, false);
  size_t at = 2;
  out->kind = bytes[1];
  if (out->kind == kShareCudaMalloc) {
    TB_REQUIRE(get(bytes, &at, &out->cuda), kInvalidArgument, bad, false);
    return true;
  }
  TB_REQUIRE(out->kind == kShareVmm, kInvalidArgument,
             std::string("CUDA memory handle of kind '") + out->kind +
                 "' (torch's expandable segments share as 'e': open those with torch's own allocator): " + bad,
             false);
  uint32_t count = 0;
  TB_REQUIRE(get(bytes, &at, &out->pid) && get(bytes, &at, &count) && count > 0 && count < (1u << 20),
             kInvalidArgument, bad, false);
  for (uint32_t i = 0; i < count; ++i) {
    int32_t fd = 0;
    uint64_t n = 0;
    TB_REQUIRE(get(bytes, &at, &fd) && get(bytes, &at, &n) && n > 0, kInvalidArgument, bad, false);
    out->pieces.push_back(SharedPiece{fd, static_cast<size_t>(n)});
  }
  TB_REQUIRE(at == bytes.size(), kInvalidArgument, bad, false);
  return true;
}

bool take_remote_fds(int32_t pid, const std::vector<SharedPiece>& pieces, std::vector<int>* out) {
  const long pidfd = syscall(SYS_pidfd_open, pid, 0);
  TB_REQUIRE(pidfd >= 0, kNotAvailable,
             "pidfd_open(" + std::to_string(pid) + ") failed: " + std::strerror(errno) +
                 " (sharing VMM memory needs Linux 5.6 and a producer that is still running)",
             false);
  for (const SharedPiece& p : pieces) {
    const long fd = syscall(SYS_pidfd_getfd, pidfd, p.fd, 0);
    if (fd < 0) {
      const int err = errno;
      for (int f : *out) close(f);
      out->clear();
      close(static_cast<int>(pidfd));
      set_error(kNotAvailable, "pidfd_getfd from process " + std::to_string(pid) + " failed: " + std::strerror(err) +
                                   " (taking a descriptor needs ptrace rights over the producer: the same user, "
                                   "and kernel.yama.ptrace_scope 0, or CAP_SYS_PTRACE). Share tensors allocated "
                                   "under torch_budget.route('sync') instead, which need no descriptors");
      return false;
    }
    out->push_back(static_cast<int>(fd));
  }
  close(static_cast<int>(pidfd));
  return true;
}

}  // namespace tb
