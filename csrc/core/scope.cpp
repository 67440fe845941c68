#include "scope.h"

#include <atomic>
#include <mutex>

#include "error.h"
#include "ledger.h"

namespace tb {
namespace {

std::atomic<int> g_default_route{kRouteSync};
thread_local std::vector<Scope> t_stack;
// Scopes open on all threads together. While it is zero no thread has a scope, so the
// allocation path can skip the thread-local lookup (a call into the TLS resolver for a
// dlopen'ed library). A thread always sees its own pushes.
std::atomic<int> g_open_scopes{0};

std::mutex g_tags_mu;
std::vector<std::string>& tags() {
  static std::vector<std::string> names{"untagged"};
  return names;
}

}  // namespace

void set_default_route(int route) { g_default_route.store(route, std::memory_order_relaxed); }
int default_route() { return g_default_route.load(std::memory_order_relaxed); }

Scope current_scope() {
  if (g_open_scopes.load(std::memory_order_relaxed) == 0 || t_stack.empty()) return Scope{default_route(), 0};
  return t_stack.back();
}

bool push_scope(int route, int tag) {
  Scope cur = current_scope();
  if (route == kRouteDefault) route = cur.route;
  TB_REQUIRE(route >= 0 && route < kRouteCount, kInvalidArgument,
             "unknown route " + std::to_string(route) + " (expected vmm, pool or sync)", false);
  if (tag < 0) tag = cur.tag;
  TB_REQUIRE(tag < tag_count(), kInvalidArgument, "unknown tag id " + std::to_string(tag), false);
  t_stack.push_back(Scope{route, tag});
  g_open_scopes.fetch_add(1, std::memory_order_relaxed);
  return true;
}

bool pop_scope() {
  TB_REQUIRE(!t_stack.empty(), kState, "pop of an empty route/tag scope stack on this thread", false);
  t_stack.pop_back();
  g_open_scopes.fetch_sub(1, std::memory_order_relaxed);
  return true;
}

int scope_depth() { return static_cast<int>(t_stack.size()); }

int tag_id(const std::string& name) {
  TB_REQUIRE(!name.empty(), kInvalidArgument, "a tag needs a non-empty name", -1);
  std::lock_guard<std::mutex> lock(g_tags_mu);
  auto& names = tags();
  for (size_t i = 0; i < names.size(); ++i)
    if (names[i] == name) return static_cast<int>(i);
  TB_REQUIRE(names.size() < static_cast<size_t>(kMaxTags), kInvalidArgument,
             "too many tags (at most " + std::to_string(kMaxTags - 1) + "): cannot add '" + name + "'", -1);
  names.push_back(name);
  return static_cast<int>(names.size() - 1);
}

std::string tag_name(int id) {
  std::lock_guard<std::mutex> lock(g_tags_mu);
  auto& names = tags();
  if (id < 0 || id >= static_cast<int>(names.size())) return "";
  return names[id];
}

int tag_count() {
  std::lock_guard<std::mutex> lock(g_tags_mu);
  return static_cast<int>(tags().size());
}

}  // namespace tb
