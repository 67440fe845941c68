#include "tb_capi.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/allocator.h"
#include "core/disk_backup.h"
#include "core/error.h"
#include "core/host_pool.h"
#include "core/ledger_json.h"
#include "core/scope.h"

using namespace tb;

namespace {

// The code of the failure just recorded; never kOk, and never the core's internal kNeedSync
// (a request the device allocator answers itself), whatever path it came from.
int code() {
  const ErrorCode c = last_error_code();
  if (c == kNeedSync) return kOutOfMemory;
  return c == kOk ? kDriverError : c;
}

// A call that only tells `device` something: done if the device has served, else nothing to tell.
template <typename Tell>
int tell_device(int device, Tell tell) {
  clear_error();
  if (DeviceAllocator* d = Allocator::get().device_if_ready(device)) tell(*d);
  return 0;
}

int64_t hand_over(const std::string& text, char* buffer, int64_t capacity) {
  const auto n = static_cast<int64_t>(text.size());
  if (buffer != nullptr && capacity > n) std::memcpy(buffer, text.c_str(), text.size() + 1);
  return n;
}

// Checkpoints handed out by tb_pool_checkpoint, by id; never destroyed (exit-time calls).
std::mutex checkpoints_mu;
std::vector<std::unique_ptr<PoolCheckpoint>>& checkpoints() {
  static auto* v = new std::vector<std::unique_ptr<PoolCheckpoint>>();
  return *v;
}

// False, with the error set, for a device the driver does not list (or a driver that cannot be read).
bool device_exists(int device) {
  const int n = Allocator::get().device_count();
  if (n < 0) return false;
  TB_REQUIRE(device >= 0 && device < n, kInvalidArgument,
             "device " + std::to_string(device) + " does not exist (" + std::to_string(n) + " visible)", false);
  return true;
}

bool probe(int device, Capabilities* caps) { return device_exists(device) && probe_device(device, caps); }

// What a call that empties caches answers for a device nothing was ever allocated on: nothing to
// do there, unless the device does not exist, which is refused as every other call refuses it.
int nothing_cached(int device) { return device_exists(device) ? 0 : code(); }

// What share and end_sharing say of a pointer that starts no live block (the free path's message
// spoke of a double free): kInvalidArgument.
int not_a_shared_start(void* ptr, const char* verb) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%p", ptr);
  set_error(kInvalidArgument, std::string("cannot ") + verb + " pointer " + buf +
                                  ": it does not start a live allocation (it lies inside one, was freed, or was not "
                                  "allocated by torch_budget); give the tensor whose storage was shared");
  return kInvalidArgument;
}

// The `n` addresses at `ptrs` (`what`, for the message); false + kInvalidArgument for a negative
// count, a null array or a count no host memory could hold (nothing here may throw or abort).
bool copy_addresses(const uint64_t* ptrs, int64_t n, const char* what, std::vector<uintptr_t>* out) {
  TB_REQUIRE(n >= 0 && (n == 0 || ptrs != nullptr), kInvalidArgument,
             std::string(what) + ": " + std::to_string(n) + " given at " + (ptrs ? "an array" : "a null pointer"),
             false);
  try {
    out->assign(ptrs, ptrs + n);
  } catch (const std::exception&) {
    set_error(kInvalidArgument, std::string(what) + ": " + std::to_string(n) + " is more than this host can hold");
    return false;
  }
  return true;
}

}  // namespace

extern "C" {

const char* tb_last_error(void) { return last_error_message(); }
int tb_last_error_code(void) { return last_error_code(); }

int tb_configure(int64_t budget_bytes, double budget_fraction, int default_route, int reuse_before_grow,
                 int64_t map_run_bytes) {
  clear_error();
  Settings s;
  s.budget_bytes = budget_bytes;
  s.budget_fraction = budget_fraction;
  s.reuse_before_grow = reuse_before_grow != 0;
  s.map_run_bytes = map_run_bytes;
  return Allocator::get().configure(s, default_route) ? 0 : code();
}

int tb_device_count(void) {
  clear_error();
  return Allocator::get().device_count();
}

int tb_capabilities(int device, int64_t out[4]) {
  clear_error();
  Capabilities caps;
  if (!probe(device, &caps)) return code();
  out[0] = caps.vmm;
  out[1] = caps.pools;
  out[2] = static_cast<int64_t>(caps.granularity);
  out[3] = static_cast<int64_t>(caps.total_bytes);
  return 0;
}

int tb_route_for(int device, int route) {
  clear_error();
  if (route < 0 || route >= kRouteCount) {
    set_error(kInvalidArgument, "unknown route " + std::to_string(route));
    return -kInvalidArgument;
  }
  Capabilities caps;
  if (!probe(device, &caps)) return -code();
  return resolve_route(caps, route);
}

void* tb_malloc(ssize_t size, int device, void* stream) {
  clear_error();
  if (size <= 0) {
    set_error(kInvalidArgument, "allocation size must be positive, got " + std::to_string(size));
    return nullptr;
  }
  Block* b = Allocator::get().malloc(static_cast<size_t>(size), device, static_cast<CUstream>(stream));
  return b ? reinterpret_cast<void*>(b->ptr) : nullptr;
}

void tb_free(void* ptr, ssize_t, int, void*) {
  clear_error();
  if (ptr != nullptr) Allocator::get().free_ptr(ptr);
}

int tb_free_checked(void* ptr) {
  clear_error();
  if (ptr == nullptr) {
    set_error(kInvalidArgument, "free of a null pointer");
    return kInvalidArgument;
  }
  return Allocator::get().free_ptr(ptr) ? 0 : code();
}

int tb_record_stream(void* ptr, void* stream, int stream_device) {
  clear_error();
  return Allocator::get().record_stream(ptr, static_cast<CUstream>(stream), stream_device) ? 0 : code();
}

int tb_push_scope(int route, int tag) {
  clear_error();
  return push_scope(route, tag) ? 0 : code();
}

int tb_set_default_tag(int tag) {
  clear_error();
  return set_default_tag(tag) ? 0 : code();
}

int tb_pop_scope(void) {
  clear_error();
  return pop_scope() ? 0 : code();
}

int tb_tag_id(const char* name) {
  clear_error();
  if (name == nullptr) {
    set_error(kInvalidArgument, "a tag needs a name");
    return -kInvalidArgument;
  }
  int id = tag_id(name);
  return id < 0 ? -code() : id;
}

int tb_set_budget(int device, int64_t bytes, double fraction) {
  clear_error();
  DeviceAllocator* d = Allocator::get().device(device);
  if (d == nullptr) return code();
  return d->set_budget(bytes, fraction) ? 0 : code();
}

int tb_set_tag_budget(int device, int tag, int64_t bytes, double fraction) {
  clear_error();
  DeviceAllocator* d = Allocator::get().device(device);
  if (d == nullptr) return code();
  return d->set_tag_budget(tag, bytes, fraction) ? 0 : code();
}

int tb_configure_tag_budget(int tag, int64_t bytes, double fraction) {
  clear_error();
  return Allocator::get().configure_tag_budget(tag, bytes, fraction) ? 0 : code();
}

int tb_set_later_budget(int tag, int64_t bytes, double fraction, int64_t* was_bytes, double* was_fraction) {
  clear_error();
  return Allocator::get().set_later_budget(tag, bytes, fraction, was_bytes, was_fraction) ? 0 : code();
}

int tb_configure_packing_time(double share) {
  clear_error();
  return Allocator::get().configure_packing_time(share) ? 0 : code();
}

int tb_packing_idle(int device) {
  return tell_device(device, [](DeviceAllocator& d) { d.packing_idle(); });
}

int tb_packing_refill(int device) {
  return tell_device(device, [](DeviceAllocator& d) { d.packing_refill(); });
}

int tb_reset_peak_stats(int device) {
  return tell_device(device, [](DeviceAllocator& d) { d.reset_peaks(); });
}

int tb_empty_cache(int device) {
  clear_error();
  DeviceAllocator* d = Allocator::get().device_if_ready(device);
  if (d == nullptr) return nothing_cached(device);
  return d->empty_cache() ? 0 : code();
}

int tb_empty_pool_cache(int device, uint64_t id0, uint64_t id1) {
  clear_error();
  DeviceAllocator* d = Allocator::get().device_if_ready(device);
  if (d == nullptr) return nothing_cached(device);
  return d->empty_pool_cache({id0, id1}) ? 0 : code();
}

int64_t tb_share(void* ptr, char* buf, int64_t cap, int64_t* offset) {
  clear_error();
  int device = -1;
  BlockInfo info{};
  if (!Allocator::get().lookup(ptr, &device, &info)) {
    not_a_shared_start(ptr, "share");
    return -1;
  }
  DeviceAllocator* d = Allocator::get().device_if_ready(device);
  std::string handle;
  size_t off = 0;
  // The room is checked before the block is marked shared: a handle nobody got must not pin its tag.
  const size_t room = cap > 0 ? static_cast<size_t>(cap) : 0;
  if (d == nullptr || !d->share(reinterpret_cast<uintptr_t>(ptr), &handle, &off, room)) return -1;
  std::memcpy(buf, handle.data(), handle.size());
  *offset = static_cast<int64_t>(off);
  return static_cast<int64_t>(handle.size());
}

int tb_end_sharing(void* ptr) {
  clear_error();
  int device = -1;
  BlockInfo info{};
  if (!Allocator::get().lookup(ptr, &device, &info)) return not_a_shared_start(ptr, "end sharing");
  DeviceAllocator* d = Allocator::get().device_if_ready(device);
  return d != nullptr && d->end_sharing(reinterpret_cast<uintptr_t>(ptr)) ? 0 : code();
}

int64_t tb_inject_driver_faults(double rate, uint64_t seed) {
  clear_error();
  if (!Allocator::get().load_driver() || !inject_driver_faults(rate, seed)) return -1;
  return injected_driver_faults();
}

int tb_cache_info(int device, int64_t* largest) {
  clear_error();
  *largest = 0;
  DeviceAllocator* d = Allocator::get().device(device);
  if (d == nullptr) return code();
  size_t out = 0;
  if (!d->cache_info(&out, current_scope().tag)) return code();
  *largest = static_cast<int64_t>(out);
  return 0;
}

int tb_inactive_split(int device, int64_t* count, int64_t* bytes) {
  clear_error();
  DeviceAllocator* d = Allocator::get().device(device);
  if (d == nullptr) return code();
  d->inactive_split(count, bytes);
  return 0;
}

int tb_grant_peer(int device, int peer) {
  clear_error();
  DeviceAllocator* d = Allocator::get().device(device);
  if (d == nullptr) return code();
  return d->grant_peer(peer) ? 0 : code();
}

int tb_tag_find(const char* name) {
  clear_error();
  return name == nullptr ? -1 : tag_find(name);
}

int tb_device_ready(int device) {
  clear_error();
  return Allocator::get().device_if_ready(device) != nullptr ? 1 : 0;
}

int tb_release_tag(int device, int tag, int backup) {
  clear_error();
  DeviceAllocator* d = Allocator::get().device(device);
  if (d == nullptr) return code();
  return d->release_tag(tag, backup) ? 0 : code();
}

int tb_release_tag_discarding(int device, int tag, int backup, const uint64_t* ptrs, int64_t n) {
  clear_error();
  std::vector<uintptr_t> discardable;
  if (!copy_addresses(ptrs, n, "discardable addresses", &discardable)) return code();
  DeviceAllocator* d = Allocator::get().device(device);
  if (d == nullptr) return code();
  return d->release_tag(tag, backup, discardable) ? 0 : code();
}

int tb_restore_tag(int device, int tag) {
  clear_error();
  DeviceAllocator* d = Allocator::get().device(device);
  if (d == nullptr) return code();
  return d->restore_tag(tag) ? 0 : code();
}

int tb_set_disk_backup_dir(const char* dir) {
  clear_error();
  return DiskBackup::set_dir(dir == nullptr ? "" : dir) ? 0 : code();
}

int tb_retain_tag_backup(int device, int tag, int on) {
  clear_error();
  DeviceAllocator* d = Allocator::get().device(device);
  if (d == nullptr) return code();
  return d->retain_tag_backup(tag, on != 0) ? 0 : code();
}

int tb_drop_tag_backup(int device, int tag) {
  clear_error();
  DeviceAllocator* d = Allocator::get().device(device);
  if (d == nullptr) return code();
  return d->drop_tag_backup(tag) ? 0 : code();
}

int tb_tag_info(int device, int tag, int64_t out[8]) {
  clear_error();
  DeviceAllocator* d = Allocator::get().device(device);
  if (d == nullptr) return code();
  if (tag < 0 || tag >= tag_count()) {
    set_error(kInvalidArgument, "unknown tag id " + std::to_string(tag));
    return kInvalidArgument;
  }
  const TagView v = d->tag_view(tag);
  const int64_t values[8] = {v.life,        v.backup,      v.resident,     v.released,
                             v.last_device, v.last_backup, v.backup_bytes, v.retained};
  std::copy(values, values + 8, out);
  return 0;
}

int tb_pool_tag(int device, uint64_t id0, uint64_t id1) {
  clear_error();
  DeviceAllocator* d = Allocator::get().device_if_ready(device);
  return d == nullptr ? -1 : d->pool_tag({id0, id1});
}

int tb_ptr_tag(void* ptr) {
  clear_error();
  int device = 0;
  BlockInfo info{};
  return Allocator::get().lookup(ptr, &device, &info) ? info.tag : -1;
}

int tb_ptr_device(void* ptr) {
  clear_error();
  int device = 0;
  BlockInfo info{};
  return Allocator::get().lookup(ptr, &device, &info) ? device : -1;
}

namespace {

// Note [Reading backups]: the backup of a range of the live block at `base`, on whichever device
// holds it. false + error; else *space null when there is none.
bool find_backup(void* base, int64_t offset, int64_t bytes, bool view, std::vector<HostExtent>* spans,
                 std::shared_ptr<BackupSpace>* space) {
  TB_REQUIRE(offset >= 0 && bytes >= 0, kInvalidArgument,
             "a backup range needs a non-negative offset and size, got offset " + std::to_string(offset) +
                 " and " + std::to_string(bytes) + " bytes",
             false);
  Allocator& a = Allocator::get();
  for (int i = 0; i < kMaxDevices; ++i) {
    DeviceAllocator* d = a.device_if_ready(i);
    bool found = false;
    if (d == nullptr) continue;
    if (!d->backup_of(reinterpret_cast<uintptr_t>(base), static_cast<size_t>(offset), static_cast<size_t>(bytes),
                      view, spans, space, &found))
      return false;
    if (found) return true;
  }
  set_error(kInvalidArgument, "no live block of torch_budget's starts at " +
                                  std::to_string(reinterpret_cast<uintptr_t>(base)));
  return false;
}

struct BackupView {
  std::shared_ptr<BackupSpace> space;
};

}  // namespace

int tb_backup_read(void* base, int64_t offset, int64_t bytes, void* dst, int* found) {
  clear_error();
  *found = 0;
  std::vector<HostExtent> spans;
  std::shared_ptr<BackupSpace> space;
  if (!find_backup(base, offset, bytes, false, &spans, &space)) return code();
  if (!space) return 0;
  auto* out = static_cast<uint8_t*>(dst);
  for (const HostExtent& s : spans) {  // outside every lock: the reference keeps the memory
    std::memcpy(out, s.ptr, s.bytes);
    out += s.bytes;
  }
  *found = 1;
  return 0;
}

int tb_backup_view(void* base, int64_t offset, int64_t bytes, void** host, void** view) {
  clear_error();
  *host = nullptr;
  *view = nullptr;
  std::vector<HostExtent> spans;
  std::shared_ptr<BackupSpace> space;
  // Counted as a view under the device lock (TagArenas::backup_of), ended by tb_backup_view_end.
  if (!find_backup(base, offset, bytes, true, &spans, &space)) return code();
  if (!space) return 0;
  *host = spans.empty() ? nullptr : spans[0].ptr;
  *view = new BackupView{std::move(space)};
  return 0;
}

void tb_backup_view_end(void* view) {
  auto* v = static_cast<BackupView*>(view);
  if (v == nullptr) return;
  v->space->views.fetch_sub(1);
  delete v;  // the last reference frees the space (Note [Reading backups])
}

int tb_trim_tag(int device, int tag, int64_t* returned) {
  clear_error();
  *returned = 0;
  DeviceAllocator* d = Allocator::get().device_if_ready(device);
  if (d == nullptr) return nothing_cached(device);
  return d->trim_tag(tag, returned) ? 0 : code();
}

int tb_host_pool_reserve(int64_t bytes) {
  clear_error();
  if (bytes < 0) {
    set_error(kInvalidArgument, "a host pool size must be >= 0 bytes, got " + std::to_string(bytes));
    return kInvalidArgument;
  }
  // Pinning needs a context, and the memory is portable: the caller's context where one is current
  // (a process that runs on device 1 alone starts none on device 0), else device 0's (before CUDA
  // started, as at install()).
  if (!Allocator::get().load_driver()) return code();
  CUcontext current = nullptr;
  if (driver()->ctxGetCurrent(&current) != CUDA_SUCCESS || current == nullptr) {
    DeviceAllocator* d = Allocator::get().device(0);
    if (d == nullptr) return code();
    current = d->context().ctx;
  }
  ContextGuard guard(current);
  if (!guard.ok()) return code();
  return HostPool::get().reserve(static_cast<size_t>(bytes)) ? 0 : code();
}

int tb_host_pool_free(void) {
  clear_error();
  if (driver() == nullptr) return 0;
  return HostPool::get().free_unused() ? 0 : code();
}

int tb_host_pool_set_keep(int keep, int* was) {
  clear_error();
  if (keep != 0 && keep != 1) {
    set_error(kInvalidArgument, "keep must be 0 or 1, got " + std::to_string(keep));
    return kInvalidArgument;
  }
  const bool before = HostPool::get().set_keep(keep == 1);
  if (was != nullptr) *was = before ? 1 : 0;
  return 0;
}

int tb_host_pool_stats(int64_t out[8]) {
  clear_error();
  HostPool& pool = HostPool::get();
  const HostPoolStats s = pool.stats();
  const int64_t values[8] = {s.bytes, s.used, s.chunks, s.pinned_at_release, s.pin_ns, s.registered,
                             pool.keeps() ? 1 : 0, 0};
  std::copy(values, values + 8, out);
  return 0;
}

int tb_begin_pool(int device, uint64_t id0, uint64_t id1, void* stream) {
  clear_error();
  DeviceAllocator* d = Allocator::get().device(device);
  if (d == nullptr) return code();
  auto s = static_cast<CUstream>(stream);
  return d->begin_allocate_to_pool({id0, id1}, [s](CUstream x) { return x == s; }) ? 0 : code();
}

int tb_end_pool(int device, uint64_t id0, uint64_t id1) {
  clear_error();
  return Allocator::get().end_pool(device, {id0, id1}) ? 0 : code();
}

void tb_capture_reuse(int on) { DeviceAllocator::set_capture_reuse(on != 0); }

int tb_release_pool(int device, uint64_t id0, uint64_t id1) {
  clear_error();
  DeviceAllocator* d = Allocator::get().device(device);
  if (d == nullptr) return code();
  return d->release_pool({id0, id1}) ? 0 : code();
}

int tb_pool_checkpoint(int device, uint64_t id0, uint64_t id1) {
  clear_error();
  DeviceAllocator* d = Allocator::get().device(device);
  if (d == nullptr) return -code();
  PoolCheckpoint cp;
  if (!d->checkpoint_pool({id0, id1}, &cp)) return -code();
  std::lock_guard<std::mutex> lock(checkpoints_mu);
  checkpoints().push_back(std::make_unique<PoolCheckpoint>(std::move(cp)));
  return static_cast<int>(checkpoints().size() - 1);
}

int tb_pool_restore(int device, int checkpoint, uint64_t* freed, int64_t* n_freed, uint64_t* created,
                    int64_t* n_created, int64_t capacity) {
  clear_error();
  DeviceAllocator* d = Allocator::get().device(device);
  if (d == nullptr) return code();
  PoolCheckpoint cp;
  {
    std::lock_guard<std::mutex> lock(checkpoints_mu);
    if (checkpoint < 0 || static_cast<size_t>(checkpoint) >= checkpoints().size() || !checkpoints()[checkpoint]) {
      set_error(kInvalidArgument, "unknown checkpoint " + std::to_string(checkpoint));
      return kInvalidArgument;
    }
    cp = *checkpoints()[checkpoint];
  }
  std::vector<uintptr_t> f;
  std::vector<Block*> c;
  const bool ok = d->restore_checkpoint(cp, &f, &c);
  // Written on failure too: the blocks freed before it are gone all the same.
  *n_freed = static_cast<int64_t>(f.size());
  *n_created = static_cast<int64_t>(c.size());
  for (size_t i = 0; i < f.size() && static_cast<int64_t>(i) < capacity; ++i) freed[i] = f[i];
  for (size_t i = 0; i < c.size() && static_cast<int64_t>(i) < capacity; ++i) created[i] = c[i]->ptr;
  return ok ? 0 : code();
}

int tb_pool_checkpoint_drop(int checkpoint) {
  clear_error();
  std::lock_guard<std::mutex> lock(checkpoints_mu);
  if (checkpoint >= 0 && static_cast<size_t>(checkpoint) < checkpoints().size()) checkpoints()[checkpoint].reset();
  return 0;
}

int tb_pool_live_matches(int device, uint64_t id0, uint64_t id1, const uint64_t* ptrs, int64_t n) {
  clear_error();
  DeviceAllocator* d = Allocator::get().device(device);
  if (d == nullptr) return -code();
  std::vector<uintptr_t> expected;
  if (!copy_addresses(ptrs, n, "expected live addresses", &expected)) return -code();
  bool match = false;
  if (!d->pool_live_matches({id0, id1}, expected, &match)) return -code();
  return match ? 1 : 0;
}

int tb_pool_options(int device, uint64_t id0, uint64_t id1, int use_on_oom, int no_split) {
  clear_error();
  DeviceAllocator* d = Allocator::get().device(device);
  if (d == nullptr) return code();
  return d->set_pool_options({id0, id1}, use_on_oom, no_split != 0) ? 0 : code();
}

int64_t tb_stats_json(int device, char* buffer, int64_t capacity) {
  clear_error();
  DeviceAllocator* d = Allocator::get().device(device);
  if (d == nullptr) return -code();
  return hand_over(stats_json(*d), buffer, capacity);
}

int64_t tb_segments_json(int device, char* buffer, int64_t capacity) {
  clear_error();
  DeviceAllocator* d = Allocator::get().device(device);
  if (d == nullptr) return -code();
  return hand_over(segments_json(*d), buffer, capacity);
}

}  // extern "C"
