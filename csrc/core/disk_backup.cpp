#include "disk_backup.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <mutex>

#include "error.h"

namespace tb {

namespace {

std::mutex dir_mu;
std::string& dir_value() {
  static auto* d = new std::string();  // never destroyed: releases may run during exit
  return *d;
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
  const std::string d = dir();
  TB_REQUIRE(!d.empty(), kInvalidArgument,
             "a disk backup needs a directory: set one first (torch_budget.sleep.set_disk_backup_dir)", false);
  *out = d + "/tb-" + std::to_string(::getpid()) + "-" + std::to_string(device) + "-" + std::to_string(tag) + "-" +
         std::to_string(piece) + ".bin";
  return true;
}

bool DiskBackup::write(const std::string& path, const std::vector<HostExtent>& from, size_t bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return fail_file("create", path);
  for (const HostExtent& e : from) {
    for (size_t done = 0, n = std::min(e.bytes, bytes); done < n;) {
      const ssize_t w = ::write(fd, e.ptr + done, n - done);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) {
        if (w == 0) errno = ENOSPC;
        fail_file("write", path);
        ::close(fd);
        ::unlink(path.c_str());
        return false;
      }
      done += static_cast<size_t>(w);
    }
    bytes -= std::min(e.bytes, bytes);
    if (bytes == 0) break;
  }
  if (::close(fd) != 0) {
    fail_file("write", path);
    ::unlink(path.c_str());
    return false;
  }
  return true;
}

bool DiskBackup::read(const std::string& path, const std::vector<HostExtent>& to, size_t bytes) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return fail_file("open", path);
  for (const HostExtent& e : to) {
    for (size_t done = 0, n = std::min(e.bytes, bytes); done < n;) {
      const ssize_t r = ::read(fd, e.ptr + done, n - done);
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) {
        if (r == 0) errno = EIO;  // shorter than what was written
        fail_file("read", path);
        ::close(fd);
        return false;
      }
      done += static_cast<size_t>(r);
    }
    bytes -= std::min(e.bytes, bytes);
    if (bytes == 0) break;
  }
  ::close(fd);
  return true;
}

void DiskBackup::remove(const std::vector<std::string>& paths) {
  for (const std::string& p : paths) ::unlink(p.c_str());
}

}  // namespace tb
