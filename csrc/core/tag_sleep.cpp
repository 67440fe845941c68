#include "tag_sleep.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <deque>

#include "budget.h"
#include "disk_backup.h"
#include "error.h"
#include "route_vmm.h"

namespace tb {

const char* backup_name(int backup) {
  static const char* const names[] = {"none", "memset", "cpu", "pinned", "disk"};
  return backup >= 0 && backup < kBackupModes ? names[backup] : "?";
}

const char* tag_life_name(int life) {
  static const char* const names[] = {"live", "released", "restoring"};
  return life >= 0 && life <= kTagRestoring ? names[life] : "?";
}

namespace {

constexpr size_t kWindow = 8;  // pieces in flight on the copy stream

// Calls fn(host, bytes) for the backup bytes [offset, offset + bytes), extent by extent.
template <typename Fn>
bool for_host(const std::vector<HostExtent>& host, size_t offset, size_t bytes, Fn fn) {
  size_t start = 0;
  for (const HostExtent& e : host) {
    if (bytes == 0) break;
    if (offset < start + e.bytes) {
      const size_t skip = offset - start;
      const size_t n = std::min(bytes, e.bytes - skip);
      if (!fn(e.ptr + skip, n)) return false;
      offset += n;
      bytes -= n;
    }
    start += e.bytes;
  }
  TB_REQUIRE(bytes == 0, kState,
             "the backup ends " + std::to_string(bytes) + " bytes before the range wanted from it: it does not "
             "match the tag's memory",
             false);
  return true;
}

}  // namespace

BackupSpace::~BackupSpace() {
  if (pageable) {
    for (const HostExtent& e : host) std::free(e.ptr);
  } else if (!has_holes()) {
    if (!host.empty()) HostPool::get().give_back(host);
  } else {  // the granules give_back() has not given back yet
    size_t total = 0;
    for (const HostExtent& e : host) total += e.bytes;
    give_back(0, (total + unit - 1) / unit, unit);
  }
}

size_t BackupSpace::give_back(size_t offset, size_t count, size_t granule) {
  if (unit != 0 && unit != granule) return 0;  // one unit per space
  unit = granule;
  std::vector<HostExtent> spans;
  size_t bytes = 0;
  for (size_t i = offset / granule; i < offset / granule + count; ++i) {
    if (i >= given.size()) given.resize(i + 1, false);
    if (given[i]) continue;
    given[i] = true;
    bytes += granule;
    for_host(host, i * granule, granule, [&](uint8_t* h, size_t n) {
      if (!spans.empty() && spans.back().ptr + spans.back().bytes == h) spans.back().bytes += n;
      else spans.push_back(HostExtent{h, n});
      return true;
    });
  }
  if (pageable) {
    // The buffer stays allocated (freed whole with the space); its pages go back.
    const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
    for (const HostExtent& e : spans) {
      const uintptr_t lo = (reinterpret_cast<uintptr_t>(e.ptr) + page - 1) / page * page;
      const uintptr_t hi = (reinterpret_cast<uintptr_t>(e.ptr) + e.bytes) / page * page;
      if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED);
    }
  } else if (!spans.empty()) {
    HostPool::get().give_back(spans);
  }
  return bytes;
}

void TagState::drop_backup() {
  space.reset();  // freed here unless a reader still holds it (Note [Reading backups])
  DiskBackup::remove(files);
  files.clear();
  exposed = false;
  backup_bytes = 0;
  kept.clear();
  digests.clear();
}

void cut_pieces(Segment* seg, size_t first, size_t end, size_t max_granules, std::vector<Piece>* out) {
  for (size_t i = first; i < end;) {
    size_t j = i + 1;
    while (j < end && (j - i < max_granules || seg->span[j] == 0)) ++j;
    out->push_back(Piece{seg, i, j - i, 0, seg->serial});
    i = j;
  }
}

bool TagState::locate(uintptr_t ptr, size_t bytes, size_t granule, std::vector<HostExtent>* spans) const {
  spans->clear();
  if (!space || bytes == 0) return true;
  // The backup's pieces: those waiting for a restore, else those a live tag retains.
  const std::vector<Piece>& from = life == kTagLive ? kept : pieces;
  for (uintptr_t at = ptr, end = ptr + bytes; at < end;) {
    const Piece* p = nullptr;
    for (const Piece& q : from) {
      if (q.discard) continue;  // Note [Discardable blocks]: not in the backup
      const uintptr_t lo = q.seg->base + q.first * granule;
      if (at >= lo && at < lo + q.count * granule) {
        p = &q;
        break;
      }
    }
    TB_REQUIRE(p != nullptr, kState, "the backup does not hold the bytes at offset " +
                                         std::to_string(at - ptr) + " of the range", false);
    const uintptr_t lo = p->seg->base + p->first * granule;
    const size_t n = std::min<uintptr_t>(end, lo + p->count * granule) - at;
    const bool whole = for_host(space->host, p->offset + (at - lo), n, [&](uint8_t* host, size_t len) {
      if (!spans->empty() && spans->back().ptr + spans->back().bytes == host) spans->back().bytes += len;
      else spans->push_back(HostExtent{host, len});
      return true;
    });
    if (!whole) return false;
    at += n;
  }
  return true;
}

bool TagMover::wait() {
  TB_DRIVER_CHECK(driver()->streamSynchronize(stream_), false);
  return true;
}

bool TagMover::ready() {
  if (stream_ != nullptr) return true;
  ContextGuard guard(ctx_.ctx);
  if (!guard.ok()) return false;
  const DriverApi* d = driver();
  CUstream s = nullptr;
  TB_DRIVER_CHECK(d->streamCreate(&s, CU_STREAM_NON_BLOCKING), false);
  std::vector<CUevent> events;
  for (size_t i = 0; i < kWindow; ++i) {
    CUevent e = nullptr;
    CUresult r = d->eventCreate(&e, CU_EVENT_DISABLE_TIMING);
    if (r != CUDA_SUCCESS) {
      for (CUevent x : events) d->eventDestroy(x);
      d->streamDestroy(s);
      return fail_driver(r, "cuEventCreate", __FILE__, __LINE__);
    }
    events.push_back(e);
  }
  stream_ = s;
  events_.swap(events);
  return true;
}

bool TagMover::copy(const Piece& p, bool to_device, const std::vector<HostExtent>& host, size_t offset,
                    const std::vector<bool>* only) {
  const size_t g = vmm_.granule();
  const DriverApi* d = driver();
  // Granules that are mapped now (a restore skips those no block needs) and asked for.
  auto wanted = [&](size_t k) { return p.seg->granules[p.first + k] != 0 && (only == nullptr || (*only)[k]); };
  size_t from = 0;
  while (from < p.count) {
    if (!wanted(from)) {
      ++from;
      continue;
    }
    size_t to = from;
    while (to < p.count && wanted(to)) ++to;
    uintptr_t va = p.seg->base + (p.first + from) * g;
    const bool ok = for_host(host, offset + from * g, (to - from) * g, [&](uint8_t* h, size_t bytes) {
      CUresult r = to_device ? d->memcpyHtoDAsync(va, h, bytes, stream_)
                             : d->memcpyDtoHAsync(h, va, bytes, stream_);
      va += bytes;
      if (r == CUDA_SUCCESS) copied_ += bytes;
      return r == CUDA_SUCCESS || fail_driver(r, to_device ? "cuMemcpyHtoDAsync" : "cuMemcpyDtoHAsync", __FILE__,
                                              __LINE__);
    });
    if (!ok) return false;
    from = to;
  }
  return true;
}

bool TagMover::fill_zero(const Piece& p) {
  const size_t g = vmm_.granule();
  for (size_t i = 0; i < p.count; ++i) {
    if (p.seg->granules[p.first + i] == 0) continue;
    TB_DRIVER_CHECK(driver()->memsetD8Async(p.seg->base + (p.first + i) * g, 0, g, stream_), false);
  }
  return true;
}

void TagMover::drop_piece(const Piece& p) {
  for (size_t i = p.first; i < p.first + p.count; ++i)
    if (p.seg->granules[i] != 0) vmm_.drop_granule(*p.seg, i);  // a refused unmap leaves it mapped, intact
}

bool TagMover::map_piece(const std::vector<Piece>& pieces, const std::vector<std::vector<bool>>& needed, size_t k,
                         std::vector<std::pair<Segment*, size_t>>* mapped) {
  // One handle per run of granules (Note [Restore mappings]); when the budget or the driver
  // refuses new memory, granule by granule, which can also take cached and clean granules.
  const Piece& p = pieces[k];
  Segment& seg = *p.seg;
  const size_t most = std::max<size_t>(1, kRestoreRunBytes / vmm_.granule());
  // Granules still mapped (a failed run or restore the driver would not unmap) are restored into
  // as they are: never while their own device cannot reach them (Note [Unreachable mappings]).
  auto reachable = [&]() { return vmm_.reach(seg, p.first, p.first + p.count - 1); };
  if (!reachable()) return false;
  for (size_t i = 0; i < p.count;) {
    if (!needed[k][i] || seg.granules[p.first + i] != 0) {
      ++i;
      continue;
    }
    // The run: needed, unmapped granules from here on, on into the pieces that continue this one.
    const size_t head = p.first + i;
    size_t end = head, l = k, at = i;
    while (end - head < most) {
      if (at == pieces[l].count) {
        if (l + 1 == pieces.size() || pieces[l + 1].seg != &seg || pieces[l + 1].first != end) break;
        ++l;
        at = 0;
      }
      if (!needed[l][at] || seg.granules[end] != 0) break;
      ++end;
      ++at;
    }
    if (!vmm_.map_run(seg, head, end - head)) {
      std::vector<size_t> want;
      for (size_t g = head; g < end; ++g) {
        if (seg.granules[g] == 0) want.push_back(g);
        else mapped->emplace_back(&seg, g);  // a failed run the driver would not unmap
      }
      if (!vmm_.map_granules(seg, want)) return false;
      for (size_t g : want) mapped->emplace_back(&seg, g);
      if (!reachable()) return false;
    } else {
      for (size_t g = head; g < end; ++g) mapped->emplace_back(&seg, g);
    }
    i = std::min(p.count, end - p.first);
  }
  return true;
}

bool TagMover::release(std::vector<Piece> pieces, Backup mode, bool retain, TagState* state, bool* recovered) {
  *recovered = true;  // until something is dropped, a failure leaves the tag as it was
  if (!ready()) return false;
  ContextGuard guard(ctx_.ctx);
  if (!guard.ok()) return false;
  const size_t g = vmm_.granule();
  size_t total = 0, device_total = 0;  // the backup's bytes; the device's
  bool holes = false;                  // Note [Discardable blocks]
  for (Piece& p : pieces) {
    p.offset = total;
    device_total += p.count * g;
    holes = holes || p.discard;
    if (!p.discard) total += p.count * g;
  }
  const bool copies = mode == kBackupCpu || mode == kBackupPinned;
  // Note [Retained backups]: the device digests every piece, batch by batch, while the host
  // drops the pieces whose granules all kept their digest and copies the granules that changed.
  const bool reuse = copies && !holes && reusable(pieces, mode, *state);
  std::vector<Digest> before;
  std::vector<size_t> batch_of;
  bool digested = false;
  struct EndDigests {  // the digest buffers go back however the release ends
    Digester& digester;
    CUstream stream;
    ~EndDigests() { digester.end(stream); }
  } end_digests{digester_, stream_};
  // Note [Reading backups]: a backup a zero-copy view exposed may hold what the view wrote.
  const bool exposed = reuse && (state->exposed || state->space->views.load() > 0);
  if (reuse) {
    before = std::move(state->digests);
    digested = !exposed && start_digests(pieces, &batch_of);
    if (!digested) clear_error();  // the backup is still whole: copy everything into it
    state->kept.clear();
    state->digests.clear();
  } else {
    state->drop_backup();  // a retained backup this release cannot use
  }
  state->pieces.clear();
  copied_ = 0;
  if (copies && total > 0 && !reuse) {
    auto space = std::make_shared<BackupSpace>();
    if (mode == kBackupPinned) {
      if (!HostPool::get().take(total, &space->host)) return false;
    } else {
      void* p = std::malloc(total);
      TB_REQUIRE(p != nullptr, kOutOfMemory,
                 "cannot allocate " + format_size(total) + " of host memory for a cpu backup", false);
      space->host.push_back(HostExtent{static_cast<uint8_t*>(p), total});
      space->pageable = true;
    }
    state->space = std::move(space);
    state->backup_bytes = total;
  }
  // Recorded once the backup's memory is there: a release refused for want of it left them as they were.
  state->backup = mode;
  state->retain = retain && copies && !holes;
  state->last_device_bytes = static_cast<int64_t>(device_total);
  state->last_backup_bytes = 0;
  if (state->space) state->exposed = state->space->views.load() > 0;
  if (mode == kBackupDisk) return to_disk(pieces, state) || recover(state, recovered);
  if (!copies) {
    for (const Piece& p : pieces) {
      drop_piece(p);
      state->pieces.push_back(p);
    }
    return true;
  }
  const DriverApi* d = driver();
  const size_t n = pieces.size(), w = events_.size();
  std::deque<std::pair<size_t, size_t>> pending;  // (piece, event slot) whose copy is queued
  size_t recorded = 0;
  auto settle = [&]() {  // the oldest queued copy is complete: drop its piece
    const auto [i, slot] = pending.front();
    pending.pop_front();
    CUresult r = d->eventSynchronize(events_[slot]);
    if (r != CUDA_SUCCESS) return fail_driver(r, "cuEventSynchronize", __FILE__, __LINE__);
    drop_piece(pieces[i]);
    state->pieces.push_back(pieces[i]);
    return true;
  };
  std::vector<Digest> now;
  std::vector<size_t> discarded;  // pieces of discardable blocks only, kept mapped while anything may fail
  size_t finished = 0, at = 0;  // digest batches waited for; digests of the pieces before this one
  std::vector<bool> stale;
  bool ok = true;
  for (size_t i = 0; i < n && ok; ++i) {
    const Piece& p = pieces[i];
    if (p.discard) {  // Note [Discardable blocks]: nothing to copy; dropped once every copy is done
      discarded.push_back(i);
      continue;
    }
    const std::vector<bool>* only = nullptr;
    if (digested) {
      while (digested && finished <= batch_of[i]) digested = digester_.finish(finished++, &now);
      if (!digested) {
        clear_error();  // from here on, copy every granule
      } else {
        stale.assign(p.count, false);
        bool any = false;
        for (size_t j = 0; j < p.count; ++j) any |= (stale[j] = now[at + j] != before[at + j]);
        only = &stale;
        if (!any) {  // unchanged since the restore: its backup is already right
          drop_piece(p);
          state->pieces.push_back(p);
          at += p.count;
          continue;
        }
      }
    }
    at += p.count;
    if (pending.size() >= w) ok = settle();
    if (ok) ok = copy(p, false, state->space->host, p.offset, only);
    if (ok) {
      const size_t slot = recorded++ % w;
      CUresult r = d->eventRecord(events_[slot], stream_);
      ok = r == CUDA_SUCCESS || fail_driver(r, "cuEventRecord", __FILE__, __LINE__);
      if (ok) pending.emplace_back(i, slot);
    }
  }
  while (ok && !pending.empty()) ok = settle();
  if (ok) {
    for (size_t i : discarded) drop_piece(pieces[i]);
    // Every piece is dropped: all of them, in the order of the backup, as the next release lists
    // them (reusable()).
    state->pieces = std::move(pieces);
    state->last_backup_bytes = static_cast<int64_t>(copied_);
    return true;
  }
  return recover(state, recovered);
}

bool TagMover::recover(TagState* state, bool* recovered) {
  // What was dropped has a complete backup: try to put it back at once.
  const ErrorCode code = last_error_code();
  const std::string msg = last_error_message();
  driver()->streamSynchronize(stream_);
  std::vector<std::vector<bool>> all;
  for (const Piece& p : state->pieces) all.emplace_back(p.count, true);
  *recovered = state->pieces.empty() || restore(state, all);
  if (*recovered) {
    state->pieces.clear();
    state->drop_backup();
  }
  set_error(code, msg + (*recovered ? "" : "; the part released so far stays released with its backup: restore it"));
  return false;
}

namespace {

// A staging buffer of the HostPool for disk backups, given back however the caller ends.
struct Staging {
  std::vector<HostExtent> host;
  ~Staging() {
    if (!host.empty()) HostPool::get().give_back(host);
  }
  bool take(size_t bytes) {
    bytes = (bytes + HostPool::kUnit - 1) / HostPool::kUnit * HostPool::kUnit;
    return bytes == 0 || HostPool::get().take(bytes, &host);
  }
};

size_t largest_piece(const std::vector<Piece>& pieces, size_t granule) {
  size_t n = 0;
  for (const Piece& p : pieces) n = std::max(n, p.count * granule);
  return n;
}

}  // namespace

bool TagMover::to_disk(const std::vector<Piece>& pieces, TagState* state) {
  const size_t g = vmm_.granule();
  Staging staging;
  if (!staging.take(largest_piece(pieces, g))) return false;
  for (size_t i = 0; i < pieces.size(); ++i) {
    const Piece& p = pieces[i];
    std::string path;
    if (!DiskBackup::path(ctx_.device, state->id, i, &path)) return false;
    if (!copy(p, false, staging.host, 0)) {
      driver()->streamSynchronize(stream_);  // what was queued lands before the buffer goes back
      return false;
    }
    if (!wait() || !DiskBackup::write(path, staging.host, p.count * g)) return false;
    state->files.push_back(path);
    drop_piece(p);
    state->pieces.push_back(p);
    state->backup_bytes += p.count * g;
  }
  state->last_backup_bytes = static_cast<int64_t>(copied_);
  return true;
}

bool TagMover::restore(TagState* state, const std::vector<std::vector<bool>>& needed) {
  if (!ready()) return false;
  ContextGuard guard(ctx_.ctx);
  if (!guard.ok()) return false;
  const DriverApi* d = driver();
  std::vector<std::pair<Segment*, size_t>> mapped;
  copied_ = 0;
  bool ok = true;
  Staging staging;  // Note [Disk backups]: each file goes through it, one piece at a time
  if (state->backup == kBackupDisk) ok = staging.take(largest_piece(state->pieces, vmm_.granule()));
  for (size_t k = 0; k < state->pieces.size() && ok; ++k) {
    const Piece& p = state->pieces[k];
    ok = map_piece(state->pieces, needed, k, &mapped);
    if (!ok) break;
    if (p.discard) {
      continue;  // Note [Discardable blocks]: the caller writes it again
    } else if (state->backup == kBackupMemset) {
      ok = fill_zero(p);
    } else if (state->backup == kBackupDisk) {
      // wait(): the next piece reuses the buffer
      ok = DiskBackup::read(state->files[k], staging.host, p.count * vmm_.granule()) &&
           copy(p, true, staging.host, 0) && wait();
    } else if (state->space) {
      // Only granules a block needs: the others' host memory may have gone (Note [Stale backups]).
      ok = copy(p, true, state->space->host, p.offset, &needed[k]);
    }
  }
  if (ok) ok = wait();
  state->last_device_bytes = static_cast<int64_t>(mapped.size() * vmm_.granule());
  if (ok) {
    state->last_backup_bytes = static_cast<int64_t>(copied_);
    if (state->retain && state->space) keep_digests(state);
    return true;
  }
  const ErrorCode code = last_error_code();
  const std::string msg = last_error_message();
  d->streamSynchronize(stream_);
  for (auto& [seg, i] : mapped)
    if (seg->granules[i] != 0) vmm_.drop_granule(*seg, i);
  state->last_device_bytes = 0;
  set_error(code, msg);
  return false;
}

}  // namespace tb
