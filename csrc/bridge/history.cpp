#include "history.h"

#include <c10/util/Exception.h>

#include <algorithm>


namespace tb::bridge {
namespace {

// The stack gathered for the next event this thread causes (Note [History]).
thread_local std::shared_ptr<c10::GatheredContext> t_pending;
// The stack of the free this thread's call is making, for its free_completed entry.
struct FreeStack {
  int device = -1;
  uintptr_t addr = 0;
  std::shared_ptr<c10::GatheredContext> ctx;
};
thread_local FreeStack t_free;
thread_local std::string t_user_metadata;
thread_local std::vector<std::string> t_compile_context;

constexpr const char* kActionNames[] = {"alloc",         "free_requested", "free_completed",
                                        "segment_alloc", "segment_free",   "segment_map",
                                        "segment_unmap", "snapshot",       "oom"};
constexpr int kActions = sizeof(kActionNames) / sizeof(kActionNames[0]);

}  // namespace

History& History::get() {
  static auto* h = new History();  // never destroyed: frees can come during exit
  return *h;
}

void History::record(bool enabled, cda::CreateContextFn recorder, size_t max_entries, cda::RecordContext when,
                     bool clear, const std::vector<std::string>& skip_actions) {
  TORCH_CHECK(when == cda::RecordContext::NEVER || recorder != nullptr,
              "torch_budget: recording memory history with stacks needs a context recorder");
  std::lock_guard<std::mutex> lock(mu_);
  std::fill(std::begin(skip_), std::end(skip_), false);
  for (const std::string& name : skip_actions)
    for (int a = 0; a < kActions; ++a)
      if (name == kActionNames[a]) skip_[a] = true;
  recorder_.store(enabled ? recorder : nullptr, std::memory_order_release);
  max_entries_ = std::max<size_t>(1, max_entries);
  when_.store(enabled ? static_cast<int>(when) : 0, std::memory_order_relaxed);
  if (!enabled || clear) rings_.clear();  // live blocks keep their stacks (Note [History])
  for (Ring& r : rings_) {
    if (r.entries.size() <= max_entries_) continue;
    std::rotate(r.entries.begin(), r.entries.begin() + static_cast<long>(r.next), r.entries.end());
    r.entries.erase(r.entries.begin(), r.entries.end() - static_cast<long>(max_entries_));
    r.next = 0;
  }
  enabled_.store(enabled, std::memory_order_release);
  update_sink();
}

void History::gather() {
  if (cda::CreateContextFn recorder = recorder_.load(std::memory_order_acquire)) t_pending = recorder();
}

void History::forget() {
  t_pending.reset();
  t_free.ctx.reset();
}

History::SetAside::SetAside() : kept_(std::move(t_pending)) { t_pending.reset(); }

History::SetAside::~SetAside() { t_pending = std::move(kept_); }

void History::set_user_metadata(const std::string& md) { t_user_metadata = md; }

std::string History::user_metadata() { return t_user_metadata; }

void History::push_compile_context(const std::string& region) { t_compile_context.push_back(region); }

void History::pop_compile_context() {
  if (!t_compile_context.empty()) t_compile_context.pop_back();
}

void History::attach_tracker(cda::AllocatorTraceTracker tracker) {
  std::lock_guard<std::mutex> lock(mu_);
  auto next = trackers_ ? std::make_shared<std::vector<cda::AllocatorTraceTracker>>(*trackers_)
                       : std::make_shared<std::vector<cda::AllocatorTraceTracker>>();
  next->push_back(std::move(tracker));
  trackers_ = std::move(next);
  update_sink();
}

void History::attach_oom_observer(cca::OutOfMemoryObserver observer) {
  std::lock_guard<std::mutex> lock(mu_);
  oom_observers_.push_back(std::move(observer));
}

void History::notify_oom(int device, size_t size, size_t limit, size_t device_free) {
  std::vector<cca::OutOfMemoryObserver> observers;
  {
    std::lock_guard<std::mutex> lock(mu_);
    observers = oom_observers_;
  }
  for (const auto& obs : observers) obs(device, size, limit, device_free);
}

void History::attach_rejection_observer(RejectionObserver observer) {
  std::lock_guard<std::mutex> lock(mu_);
  rejection_observers_.push_back(std::move(observer));
}

void History::notify_rejection(int device, size_t size, size_t allocated, size_t limit) {
  std::vector<RejectionObserver> observers;
  {
    std::lock_guard<std::mutex> lock(mu_);
    observers = rejection_observers_;
  }
  for (const auto& obs : observers) obs(device, size, allocated, limit);
}

void History::update_sink() {
  set_trace_sink(enabled_.load() || trackers_ || stacked_ > 0 ? &History::sink : nullptr);  // mu_ held
}

void History::sink(const TraceEvent& e) { get().on_event(e); }

void History::on_event(const TraceEvent& e) {
  const int when = when_.load(std::memory_order_relaxed);
  const int dev = std::clamp(e.device, 0, 63);
  std::shared_ptr<c10::GatheredContext> ctx;
  std::unique_lock<std::mutex> lock(mu_);  // one hold: stacks, then the ring
  auto& stacks = stacks_[dev];
  switch (e.action) {
    case TraceAction::kAlloc: {
      ctx = std::move(t_pending);
      t_pending.reset();
      auto it = stacks.find(e.addr);  // a block at this address earlier is gone
      if (it != stacks.end()) {
        stacks.erase(it);
        --stacked_;
      }
      if (ctx && when >= static_cast<int>(cda::RecordContext::STATE)) {
        stacks[e.addr] = ctx;
        ++stacked_;
      }
      break;
    }
    case TraceAction::kFreeRequested:
    case TraceAction::kFreeCompleted: {
      auto it = stacks.find(e.addr);
      if (e.action == TraceAction::kFreeRequested && t_pending) {
        ctx = std::move(t_pending);
        t_pending.reset();
        t_free = {e.device, e.addr, ctx};
      } else if (e.action == TraceAction::kFreeCompleted && t_free.ctx && t_free.addr == e.addr &&
                 t_free.device == e.device) {
        ctx = std::move(t_free.ctx);  // freed at once: the free's own stack
        t_free.ctx.reset();
      } else if (it != stacks.end()) {
        ctx = it->second;
      }
      if (e.action == TraceAction::kFreeCompleted && it != stacks.end()) {
        stacks.erase(it);
        if (--stacked_ == 0 && !enabled_.load(std::memory_order_relaxed)) update_sink();
      }
      break;
    }
    default:
      ctx = t_pending;  // a segment mapped for this thread's allocation carries its stack
      break;
  }
  std::shared_ptr<const std::vector<cda::AllocatorTraceTracker>> trackers = trackers_;
  const bool keep = enabled_.load(std::memory_order_relaxed) && !skip_[static_cast<int>(e.action)];
  if (!trackers && !keep) return;  // history off or this action skipped: only block stacks kept
  if (when < static_cast<int>(cda::RecordContext::ALLOC)) ctx.reset();
  cda::TraceEntry entry(static_cast<cda::TraceEntry::Action>(static_cast<int>(e.action)),
                        static_cast<c10::DeviceIndex>(e.device), e.addr, e.size, e.stream, {e.pool.first, e.pool.second},
                        c10::getApproximateTime(), std::move(ctx),
                        t_compile_context.empty() ? std::string("N/A") : t_compile_context.back(), t_user_metadata);
  if (keep) {
    if (rings_.size() <= static_cast<size_t>(dev)) rings_.resize(dev + 1);
    if (!trackers) {
      push(rings_[dev], std::move(entry));
      return;
    }
    push(rings_[dev], cda::TraceEntry(entry));
  }
  lock.unlock();
  for (const auto& t : *trackers) t(entry);
}

void History::push(Ring& r, cda::TraceEntry&& entry) {
  if (r.entries.size() < max_entries_) {
    r.entries.push_back(std::move(entry));
  } else {
    r.entries[r.next] = std::move(entry);
    r.next = (r.next + 1) % max_entries_;
  }
}

std::vector<std::vector<cda::TraceEntry>> History::traces(int devices, size_t total_active) {
  std::vector<std::vector<cda::TraceEntry>> out(static_cast<size_t>(std::max(devices, 0)));
  std::lock_guard<std::mutex> lock(mu_);
  auto to_us = clock_.makeConverter();
  for (size_t d = 0; d < out.size() && d < rings_.size(); ++d) {
    const Ring& r = rings_[d];
    out[d].reserve(r.entries.size());
    for (size_t k = 0; k < r.entries.size(); ++k) out[d].push_back(r.entries[(r.next + k) % r.entries.size()]);
    for (cda::TraceEntry& te : out[d]) te.time_.t_ = to_us(te.time_.approx_t_) / 1000;
  }
  if (enabled_.load() && !skip_[static_cast<int>(TraceAction::kSnapshot)]) {
    if (rings_.empty()) rings_.resize(1);
    push(rings_[0], cda::TraceEntry(cda::TraceEntry::SNAPSHOT, 0, 0, total_active, nullptr, {0, 0},
                                    c10::getApproximateTime()));
  }
  return out;
}

std::shared_ptr<c10::GatheredContext> History::stack_of(int device, uintptr_t ptr) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& stacks = stacks_[std::clamp(device, 0, 63)];
  auto it = stacks.find(ptr);
  return it == stacks.end() ? nullptr : it->second;
}

}  // namespace tb::bridge
