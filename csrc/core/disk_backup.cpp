#include "disk_backup.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <random>

#include "error.h"

namespace tb {

namespace {

std::mutex dir_mu;  // guards the three below
std::string& dir_value() {
  static auto* d = new std::string();  // never destroyed: releases may run during exit
  return *d;
}
// Files written and not deleted yet -> the process that wrote them (a forked child inherits the
// parent's list, and must not delete the parent's files at its exit).
std::map<std::string, pid_t>& live_files() {
  static auto* m = new std::map<std::string, pid_t>();
  return *m;
}
// A name part no other process shares, even with the same pid (another pid namespace on the same
// directory): the pid and a random number, drawn again after a fork.
std::string& unique_part() {
  static auto* u = new std::string();
  static pid_t made_in = 0;
  if (made_in != ::getpid()) {
    made_in = ::getpid();
    std::random_device rd;
    char buf[64];
    std::snprintf(buf, sizeof buf, "%d-%08x", static_cast<int>(made_in), rd());
    *u = buf;
  }
  return *u;
}

// At exit, the files of backups still released (the memory they describe is gone with the process).
void remove_at_exit() {
  std::lock_guard<std::mutex> lock(dir_mu);
  for (const auto& [path, pid] : live_files())
    if (pid == ::getpid()) ::unlink(path.c_str());
}

bool fail_file(const std::string& what, const std::string& path) {
  set_error(kFileError, "disk backup: cannot " + what + " " + path + ": " + std::strerror(errno));
  return false;
}

}  // namespace

bool DiskBackup::set_dir(const std::string& dir) {
  if (!dir.empty()) {
    struct stat st {};
    TB_REQUIRE(::stat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode), kInvalidArgument,
               "disk backup directory " + dir + " is not a directory", false);
    TB_REQUIRE(::access(dir.c_str(), W_OK | X_OK) == 0, kInvalidArgument,
               "disk backup directory " + dir + " is not writable", false);
  }
  std::lock_guard<std::mutex> lock(dir_mu);
  dir_value() = dir;
  return true;
}

std::string DiskBackup::dir() {
  std::lock_guard<std::mutex> lock(dir_mu);
  return dir_value();
}

bool DiskBackup::path(int device, int tag, size_t piece, std::string* out) {
  std::lock_guard<std::mutex> lock(dir_mu);
  const std::string& d = dir_value();
  TB_REQUIRE(!d.empty(), kInvalidArgument,
             "a disk backup needs a directory: set one first (torch_budget.sleep.set_disk_backup_dir)", false);
  *out = d + "/tb-" + unique_part() + "-" + std::to_string(device) + "-" + std::to_string(tag) + "-" +
         std::to_string(piece) + ".bin";
  return true;
}

namespace {

// Writes (or reads) `bytes` bytes of `extents`, in order, through `fd`; false with errno set. A
// write that makes no progress is a full disk, a read that finds the end a file cut short.
bool transfer(int fd, const std::vector<HostExtent>& extents, size_t bytes, bool writing) {
  for (const HostExtent& e : extents) {
    const size_t n = std::min(e.bytes, bytes);
    for (size_t done = 0; done < n;) {
      const ssize_t r = writing ? ::write(fd, e.ptr + done, n - done) : ::read(fd, e.ptr + done, n - done);
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) {
        if (r == 0) errno = writing ? ENOSPC : EIO;
        return false;
      }
      done += static_cast<size_t>(r);
    }
    bytes -= n;
    if (bytes == 0) break;
  }
  return true;
}

}  // namespace

bool DiskBackup::write(const std::string& path, const std::vector<HostExtent>& from, size_t bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return fail_file("create", path);
  {
    std::lock_guard<std::mutex> lock(dir_mu);
    static const bool registered = std::atexit(remove_at_exit) == 0;
    (void)registered;
    live_files()[path] = ::getpid();
  }
  bool ok = transfer(fd, from, bytes, true) || fail_file("write", path);
  if (::close(fd) != 0 && ok) ok = fail_file("write", path);
  if (!ok) remove({path});
  return ok;
}

bool DiskBackup::read(const std::string& path, const std::vector<HostExtent>& to, size_t bytes) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return fail_file("open", path);
  const bool ok = transfer(fd, to, bytes, false) || fail_file("read", path);
  ::close(fd);
  return ok;
}

void DiskBackup::remove(const std::vector<std::string>& paths) {
  std::lock_guard<std::mutex> lock(dir_mu);
  for (const std::string& p : paths) {
    ::unlink(p.c_str());
    live_files().erase(p);
  }
}

}  // namespace tb
