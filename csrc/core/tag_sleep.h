// Sleep and wake: releasing the physical memory behind a tag and restoring it at the
// same virtual addresses.
//
// Note [Tag arenas]
// On the VMM route every tag has its own BlockPool (its own reserved address ranges),
// and graph pools remember the tag in force when they were created; a block captured
// into a graph pool carries the pool's tag, whatever scope is open. So the memory
// of a tag is a set of segments whose granules can be unmapped as a whole while the
// address ranges stay reserved: tensors, views and captured graphs keep pointing at
// valid addresses, and a restore maps fresh memory behind the same addresses.
//
// Release (DeviceAllocator::release_tag, then TagArenas::release): the device is
// synchronised (with the lock released), then every mapped granule of the tag's segments is either dropped at
// once (it lies only under free blocks) or belongs to a live block: those granules are
// grouped into pieces of at most kPieceBytes, each piece is copied to its backup on a
// private stream, and a piece's granules are unmapped and given back to the driver
// (cuMemRelease, so mem_get_info shows them) as soon as its copy completed, while
// later pieces are still copying. Backups: none, memset (zeros on restore), cpu
// (pageable host memory), pinned (the HostPool) or disk (files, Note [Disk backups] in
// disk_backup.h). Pieces remember their place in the backup.
//
// Restore maps each piece (skipping granules that no live block covers any more:
// their tensors were freed during the sleep), one handle per run of granules (Note [Restore
// mappings]), and queues its copy (or memset) on the private stream, so mapping the next
// piece overlaps the copy of the last; it waits for the stream before returning. Pieces end
// at mapping boundaries, so a later release drops each run whole once its copy is done. When
// a mapping fails (the budget, the driver, out of memory), everything this restore mapped is
// unmapped and released again, the backup is kept and the tag stays released: a later
// restore starts over.
//
// Note [Restore mappings]
// A restore's run goes on across the pieces that continue each other in a segment, up to
// kRestoreRunBytes, so the next release drops fewer, larger mappings: the driver's teardown
// (unmap and release) costs per mapping as well as per byte. On an H200, tearing down 8 GiB
// took 158 ms as 2 MiB mappings, 6.6-7.0 ms as 64 MiB ones (the unmaps 2.1-2.4 ms of it) and
// 3.8-6.4 ms as 256 MiB ones (the unmaps 0.6-0.9 ms); mapping it took 5.4 ms and 1.9-2.5 ms.
// The release of 8 GiB of unchanged weights under a retained backup (132 tensors) took 4.9-5.0 ms
// with 256 MiB runs, 8.3-15.0 ms with 64 MiB ones and 4.3-6.2 ms with 1 GiB ones (medians of 7).
// A run goes back only whole (Note [Run mappings]): once the tag is live again, the tensors
// of one run must all be freed before its memory is. The release cuts its pieces again
// where runs end (cut_pieces), and a retained backup's pieces are cut the same way after the
// restore, so an unchanged tag finds its backup's pieces at the next release.
//
// Both hold the device lock while they copy: they wait only for their own stream,
// never for another thread's work, so the lock rule of device_allocator.h holds.
//
// Note [Retained backups]
// A release with a cpu or pinned backup may ask to retain it: the restore then keeps the
// backup and its pieces, and digests each restored granule on the device (digest.h: 128
// bits per granule, at memory speed). The next release that asks for the same backup again
// finds the same pieces (the tag's live blocks cover the same granules) and digests the
// device again: only granules whose digest changed are copied into the backup, the rest
// are dropped at once, so sleeping an unchanged model costs an unmap, not a copy over the
// link. When the pieces differ (the tag's allocations changed), the backup mode differs,
// the restore skipped granules freed during the sleep, or digests cannot be computed, the
// retained backup is dropped and the release copies everything, as without retention. A
// retained backup is counted in backup_bytes while the tag is live, and drop_retained()
// gives it back. The digests and the pieces they belong to: tag_retained.cpp.
//
// Note [Reading backups]
// A backup can be read from the host while it exists: while its tag is released, and while a
// live tag retains it (not for a block allocated after the restore that retained it: Block::born
// against TagState::kept_at; its bytes may lie where the backup holds a freed block's).
// TagArenas::backup_of() finds where the bytes of a range of one live block wait (spans of the
// backup space) and hands out a shared reference to that space, so a reader -- a copy in
// progress, or a zero-copy view owned by Python -- keeps the host memory alive past the restore
// that drops the backup (the space is freed, or its pinned extents go back to the HostPool,
// when its last reference goes, on whichever thread that is). A
// zero-copy view may be written to: while the tag sleeps the restore copies what the view
// holds, as torch_memory_saver's backups do. A view of a retained backup exposes it: the next
// release copies every granule into the space (digests only tell what the device changed),
// and the backup stays exposed while a view of it is alive.
//
// Note [Discardable blocks]
// A release may name live blocks of the tag whose contents the caller writes again after the
// restore (vLLM's discardable allocations: weights it reloads). Granules under such blocks only
// are not copied: their pieces take no backup space, are dropped once every copy of the release is
// done (a release that fails leaves them mapped, with their contents) and are mapped back at
// their addresses by the restore with whatever the new memory holds. A granule that also holds a
// byte of another live block keeps its contents, and since a mapping goes only whole (Note [Run
// mappings]) so does every granule of its mapping: pieces are cut where mappings change from
// kept to discarded, and a mapping holding both is copied whole. Such a backup has holes, so it
// is never retained, never written to disk and never read (Note [Reading backups]) where the
// caller said it did not care.
#pragma once

#include <cuda.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "block_cache.h"
#include "digest.h"
#include "driver.h"
#include "host_pool.h"

namespace tb {

class VmmRoute;

enum Backup : int { kBackupNone = 0, kBackupMemset = 1, kBackupCpu = 2, kBackupPinned = 3, kBackupDisk = 4, kBackupModes = 5 };
// Or-ed into a cpu or pinned backup mode: retain the backup past the restore (Note [Retained backups]).
constexpr int kBackupRetain = 0x100;
enum TagLife : int { kTagLive = 0, kTagReleased = 1, kTagRestoring = 2 };
const char* backup_name(int backup);
const char* tag_life_name(int life);

// Granules [first, first + count) of a segment, and where their contents wait.
struct Piece {
  Segment* seg;
  size_t first;
  size_t count;
  size_t offset;    // into the tag's backup space (none for a discarded piece)
  uint64_t serial;  // seg's (Segment::serial): a retained piece whose segment is gone is told apart
  bool discard = false;  // Note [Discardable blocks]: mapped back by the restore, never copied
};

// Appends to `out` the pieces of granules [first, end) of `seg` (mapped, under live blocks): at
// most max_granules each, except that a piece ends only at a mapping boundary (a run mapping,
// Note [Run mappings], is dropped whole). Offsets are left 0: the caller numbers them.
void cut_pieces(Segment* seg, size_t first, size_t end, size_t max_granules, std::vector<Piece>* out);

// The host memory of one backup: pinned extents of the HostPool, or one pageable buffer.
// Shared by the tag that owns it and by readers of it (Note [Reading backups]); freed with
// the last reference.
struct BackupSpace {
  std::vector<HostExtent> host;  // in order of the backup's offsets
  bool pageable = false;
  std::atomic<int> views{0};     // zero-copy views alive (Note [Reading backups])
  // Note [Stale backups]: granules of `unit` bytes (from offset 0) whose host memory went back
  // before the space did; such a space is never retained.
  std::vector<bool> given;
  size_t unit = 0;
  // Gives back the host memory of `count` granules of `unit` bytes from backup offset `offset`
  // (pinned: to the HostPool; pageable: its whole pages to the system); returns the bytes of
  // granules not given back before.
  size_t give_back(size_t offset, size_t count, size_t unit);
  bool has_holes() const { return unit != 0; }
  BackupSpace() = default;
  BackupSpace(const BackupSpace&) = delete;
  BackupSpace& operator=(const BackupSpace&) = delete;
  ~BackupSpace();
};

struct TagState {
  TagLife life = kTagLive;
  Backup backup = kBackupNone;
  std::vector<Piece> pieces;            // released, waiting for a restore
  std::shared_ptr<BackupSpace> space;   // the backup's host memory; null: none
  size_t backup_bytes = 0;              // bytes of the backup space
  bool exposed = false;                 // a zero-copy view of the backup was taken (Note [Reading backups])
  std::vector<std::string> files;       // Note [Disk backups]: one per piece, in the order of `pieces`
  int id = 0;                           // the tag's id, which names its files
  int64_t last_device_bytes = 0;      // device bytes the last release / restore moved
  int64_t last_backup_bytes = 0;      // bytes it copied
  // Note [Retained backups]: whether the last release asked to retain its backup; while live,
  // the pieces a retained backup holds and the digest of each of their granules after the
  // restore (kept empty: nothing retained).
  bool retain = false;
  std::vector<Piece> kept;
  std::vector<Digest> digests;
  uint64_t kept_at = 0;  // the device's births() when the restore kept them: later blocks are not in the backup

  void drop_backup();  // drops a retained backup too
  // Note [Reading backups]: the spans of the backup space holding device bytes [ptr, ptr +
  // bytes) (granule: the VMM granule), merged where adjacent; false + kState when a part of the
  // range is in none of the backup's pieces.
  bool locate(uintptr_t ptr, size_t bytes, size_t granule, std::vector<HostExtent>* spans) const;
};

// The copy machinery of one device: a private stream and a window of events.
class TagMover {
 public:
  TagMover(const DeviceContext& ctx, VmmRoute& vmm) : ctx_(ctx), vmm_(vmm), digester_(ctx) {}
  static constexpr size_t kPieceBytes = 64 << 20;
  // The longest mapping a restore makes (Note [Restore mappings]).
  static constexpr size_t kRestoreRunBytes = 256 << 20;

  // `pieces` are mapped granule runs under live blocks. Backs them up as `mode` asks
  // (`retain`: keeping the backup past the restore, Note [Retained backups]) and drops them;
  // every piece dropped (even in part) moves to state->pieces. false + error on failure;
  // *recovered then tells whether the tag is whole again (nothing had been dropped, or what
  // was is mapped and copied back), else what was dropped stays recorded in state, with its
  // backup (the tag is released).
  bool release(std::vector<Piece> pieces, Backup mode, bool retain, TagState* state, bool* recovered);
  // Maps and refills state->pieces, skipping granules `needed` says no block covers; digests
  // them when the backup is retained. false + error: nothing this call mapped stays mapped.
  bool restore(TagState* state, const std::vector<std::vector<bool>>& needed);

 private:
  bool ready();
  // Waits for the copy stream; false + error when the driver fails.
  bool wait();
  // Copies the mapped granules of `p` between the device and `host` (its bytes from `offset`
  // on: the piece's place in a backup space, or 0 in a staging buffer; `only`: the granules it
  // marks).
  bool copy(const Piece& p, bool to_device, const std::vector<HostExtent>& host, size_t offset,
            const std::vector<bool>* only = nullptr);
  // Note [Disk backups]: each piece through a staging buffer into a file of its own, dropped
  // once written; false + error (what was dropped is in state, its files written).
  bool to_disk(const std::vector<Piece>& pieces, TagState* state);
  // A release failed: puts back at once what it dropped (*recovered), as release() describes.
  bool recover(TagState* state, bool* recovered);
  // Queues the digests of every granule of `pieces` (all mapped) in batches of about
  // kDigestBatchBytes; batch_of[i]: the batch holding piece i, for digester_.finish().
  static constexpr size_t kDigestBatchBytes = 256 << 20;
  bool start_digests(const std::vector<Piece>& pieces, std::vector<size_t>* batch_of);
  // After a restore of a retained backup: keeps its pieces and their digests when every
  // granule is mapped again (Note [Retained backups]).
  void keep_digests(TagState* state);
  // Whether state's retained backup can take `pieces` (Note [Retained backups]).
  bool reusable(const std::vector<Piece>& pieces, Backup mode, const TagState& state) const;
  bool fill_zero(const Piece& p);
  // Maps the needed, unmapped granules of pieces[k], a run continuing into the pieces after it
  // that continue it in its segment (Note [Restore mappings]); `mapped` gets every granule mapped.
  bool map_piece(const std::vector<Piece>& pieces, const std::vector<std::vector<bool>>& needed, size_t k,
                 std::vector<std::pair<Segment*, size_t>>* mapped);
  void drop_piece(const Piece& p);

  const DeviceContext& ctx_;
  VmmRoute& vmm_;
  CUstream stream_ = nullptr;
  std::vector<CUevent> events_;
  size_t copied_ = 0;  // bytes the current release / restore copied
  Digester digester_;
};

}  // namespace tb
