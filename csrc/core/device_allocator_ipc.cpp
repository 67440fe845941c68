// DeviceAllocator: sharing its blocks with other processes (Note [Sharing memory between
// processes], ipc.h, which does the work).
#include <algorithm>
#include <mutex>
#include <shared_mutex>
#include <utility>
#include <vector>

#include "allocator.h"
#include "device_allocator.h"
#include "error.h"
#include "scope.h"

namespace tb {

namespace {

// Times a share starts again because other threads changed its segment's mappings while
// it waited for the device (Note [Sharing run mappings]).
constexpr int kShareRestarts = 3;

// Note [Closing a share during a capture]: a consumer's VMM mapping closed while a capture is
// open anywhere in the process waits here, with its device, for the last capture to end; work
// queued on the consumer's streams may still read it, and the device cannot be synchronised nor
// memory unmapped under a capture. So does a close whose device context could not be made
// current: it is tried again at the next close. Closes hold DeviceAllocator::close_gate() shared
// from their check of open_captures() to their last driver call, and begin_allocate_to_pool
// takes it exclusively before it counts a capture: no capture begins in the middle of a close.
// Process-wide, as open_captures_ is; never destroyed (closes may come at exit).
std::mutex g_deferred_mu;  // taken under the gate, never the other way round
auto* g_deferred = new std::vector<std::pair<DeviceContext, OpenedShare>>();

void defer_close(const DeviceContext& ctx, OpenedShare& s) {
  std::lock_guard<std::mutex> l(g_deferred_mu);
  g_deferred->emplace_back(ctx, std::move(s));
  s = OpenedShare{};
}

// Closes what waited, the gate held shared and no capture open; what fails again waits again.
void close_deferred_shares() {
  std::vector<std::pair<DeviceContext, OpenedShare>> due;
  {
    std::lock_guard<std::mutex> l(g_deferred_mu);
    due.swap(*g_deferred);
  }
  for (auto& [ctx, s] : due)
    if (!close_share(ctx, s, true)) defer_close(ctx, s);
}

}  // namespace

bool DeviceAllocator::share(uintptr_t ptr, std::string* handle, size_t* offset, size_t room) noexcept {
  if (Allocator::get().refuse_in_fork_child()) return false;  // Note [Fork]
  auto lock = hold();
  Block* b = live_.find(ptr);
  TB_REQUIRE(b != nullptr, kInvalidArgument,
             "cannot share memory that does not start a live allocation of torch_budget on device " +
                 std::to_string(ctx_.device),
             false);
  if (b->route == kRouteVmm && !cut_for_share(lock, ptr, &b)) return false;
  if (!export_block(ctx_, vmm_.get(), *b, room, handle, offset)) return false;
  b->shared = true;  // its tag cannot be released while it lives (Note [Tag arenas])
  return true;
}

bool DeviceAllocator::end_sharing(uintptr_t ptr) noexcept {
  auto lock = hold();
  Block* b = live_.find(ptr);
  TB_REQUIRE(b != nullptr, kInvalidArgument,
             "end_sharing: the address does not start a live allocation of torch_budget on device " +
                 std::to_string(ctx_.device) + " (give the tensor whose storage was shared)",
             false);
  b->shared = false;
  return true;
}

bool DeviceAllocator::cut_for_share(DeviceLock& lock, uintptr_t ptr, Block** block) {
  const uint64_t born = (*block)->born;
  const std::string device = std::to_string(ctx_.device);
  const std::string capture = "sharing this tensor first maps its memory again, which needs a device "
                              "synchronisation, impossible while a CUDA graph capture is open on device " +
                              device + ": share it before or after capturing";
  VmmRoute::StagedCut staged;
  auto fail = [&](ErrorCode code, const std::string& msg) {
    vmm_->drop_staged(&staged);
    set_error(code, msg);
    return false;
  };
  for (int restarts = 0;; ++restarts) {
    Block* b = *block;
    TB_REQUIRE(tags_.live(b->tag), kState,
               "cannot share memory of tag '" + tag_name(b->tag) + "' on device " + device +
                   " while the tag is released: restore it first",
               false);
    VmmRoute::ShareCut cut;
    if (!vmm_->plan_share(*b->segment, b->ptr, b->size, &cut)) return false;
    if (cut.recut.empty()) return true;
    TB_REQUIRE(restarts <= kShareRestarts, kState,
               "sharing this tensor maps its memory again, and other threads changed the mappings of its arena "
               "on device " + device + " each of the " + std::to_string(kShareRestarts + 1) +
                   " times it waited for the device: share it again, or share tensors allocated under "
                   "torch_budget.region(route='sync')",
               false);
    TB_REQUIRE(open_captures() == 0, kState, capture, false);
    for (;;) {
      // Nothing may still write what is copied next, and what was copied must be done: the
      // device is synchronised with the lock released, and everything is checked again after.
      const bool synced = sync_device(lock);
      b = live_.find(ptr);
      if (b == nullptr || b->born != born)
        return fail(kState, "the tensor was freed by another thread while it was being shared on device " + device);
      *block = b;
      if (open_captures() > 0) return fail(kState, capture);
      if (!synced)
        return fail(kState, "sharing this tensor maps its memory again, and device " + device +
                                " could not be synchronised for it");
      // Another thread unmapped memory of the arena, or exported the mapping staged to be cut
      // (an export changes no mapping, but an exported handle must stay): plan again.
      if (cut.unmaps != b->segment->unmaps || vmm_->staged_exported(staged)) {
        vmm_->drop_staged(&staged);
        break;
      }
      if (staged.charged && !vmm_->commit_cut(*b->segment, &staged)) return false;
      if (!vmm_->plan_share(*b->segment, b->ptr, b->size, &cut)) return false;
      if (cut.recut.empty()) return true;
      if (!vmm_->stage_cut(*b->segment, cut.recut.front(), cut.piece, &staged)) return false;
    }
  }
}

bool DeviceAllocator::open_shared(const std::string& bytes, OpenedShare* out) noexcept {
  if (Allocator::get().refuse_in_fork_child()) return false;  // Note [Fork]
  std::vector<int> peers;
  {
    auto lock = hold();
    peers = peers_;
  }
  if (!open_share(ctx_, caps_.vmm ? caps_.granularity : 0, peers, bytes, out)) return false;
  if (out->kind != kShareVmm) return true;  // cuIpcOpenMemHandle's mapping follows peer access itself
  auto lock = hold();
  // Note [Peer access to VMM memory]: peers granted while it was opened, then every later one.
  for (int peer : peers_) {
    if (std::find(peers.begin(), peers.end(), peer) != peers.end() || grant_opened(out->ptr, out->bytes, peer))
      continue;
    const ErrorCode code = last_error_code();
    const std::string why = last_error_message();
    lock.unlock();
    close_shared(*out);
    set_error(code, why);
    return false;
  }
  opened_.emplace_back(out->ptr, out->bytes);
  return true;
}

bool DeviceAllocator::grant_opened(uintptr_t ptr, size_t bytes, int peer) {
  ContextGuard guard(ctx_.ctx);
  if (!guard.ok()) return false;
  const CUmemAccessDesc desc = read_write_access(peer);
  TB_DRIVER_CHECK(driver()->memSetAccess(ptr, bytes, &desc, 1), false);
  return true;
}

std::shared_mutex& DeviceAllocator::close_gate() {
  static auto* gate = new std::shared_mutex();
  return *gate;
}

void DeviceAllocator::close_shared(OpenedShare& s) noexcept {
  if (Allocator::get().forked()) {  // the parent's mapping, on the parent's context: as a free, ignored (Note [Fork])
    s = OpenedShare{};
    return;
  }
  if (s.kind == kShareVmm && s.ptr != 0) {  // no peer is granted access to it from here on
    auto lock = hold();
    opened_.erase(std::remove(opened_.begin(), opened_.end(), std::make_pair(s.ptr, s.bytes)), opened_.end());
  }
  std::shared_lock<std::shared_mutex> gate(close_gate());  // Note [Closing a share during a capture]
  const bool capturing = open_captures() > 0;
  if (capturing && s.kind != kShareCudaMalloc && s.ptr != 0) return defer_close(ctx_, s);
  if (!capturing) close_deferred_shares();
  // (an IPC mapping of cudaMalloc memory closes under a capture too: its close is no stream work)
  if (!close_share(ctx_, s, !capturing)) defer_close(ctx_, s);  // the mapping holds the producer's memory
}

void DeviceAllocator::captures_ended() noexcept {
  if (Allocator::get().forked()) return;  // the parent's mappings: forgotten, as their closes are
  std::shared_lock<std::shared_mutex> gate(close_gate());
  if (open_captures() == 0) close_deferred_shares();
}

}  // namespace tb
