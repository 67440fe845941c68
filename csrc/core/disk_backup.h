// Disk backups: a released tag's contents in files instead of host memory.
//
// Note [Disk backups]
// Backup "disk" is for hosts whose memory cannot hold what sleeps: each piece of the release
// (about TagMover::kPieceBytes; it ends where a mapping ends, so it can reach that plus the
// longest mapping: TagMover::kRestoreRunBytes, Note [Restore mappings], or map_run when
// longer) is copied from the device into one pinned staging buffer taken from the HostPool,
// written to a file of its own in the directory the process named (tb_set_disk_backup_dir),
// and its granules are unmapped; the restore maps each piece, reads its file into the staging
// buffer, copies it to the device and deletes the file. So host memory is one staging buffer,
// only while a release or restore runs, and the files of a sleeping tag hold exactly its
// resident bytes (the same every cycle). Files are named
// tb-<pid>-<random>-<device>-<tag>-<piece>.bin (the random part keeps processes of other pid
// namespaces sharing the directory apart), written with plain buffered I/O and made durable only
// as far as the page cache: a backup that must survive the process is not what sleep is for, and
// the files of tags still released when the process exits are deleted then.
// Writes that fail (the disk full, the directory gone) fail the release, which puts back what
// it had dropped from the files already written, as a failed copy does; files are deleted
// whenever the backup they hold is dropped.
//
// Lock rule: the directory is process-wide behind its own mutex; the files of a tag are touched
// under the device lock of the tag's device only.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "host_pool.h"

namespace tb {

class DiskBackup {
 public:
  // The directory disk backups go to (it must exist and be writable); "" forgets it.
  // false + kInvalidArgument naming the problem.
  static bool set_dir(const std::string& dir);
  static std::string dir();

  // The file of piece `piece` of tag `tag` on `device`; false + kInvalidArgument when no
  // directory is set.
  static bool path(int device, int tag, size_t piece, std::string* out);
  // Writes `bytes` bytes of `from` (extents, in order) to a new file at `path` / reads them
  // back. false + error naming the file and the system's reason.
  static bool write(const std::string& path, const std::vector<HostExtent>& from, size_t bytes);
  static bool read(const std::string& path, const std::vector<HostExtent>& to, size_t bytes);
  // Deletes the files; those already gone are fine.
  static void remove(const std::vector<std::string>& paths);
};

}  // namespace tb
