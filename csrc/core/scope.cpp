#include "scope.h"

#include <atomic>
#include <cstring>
#include <mutex>

#include "error.h"
#include "ledger.h"

namespace tb {
namespace {

// Plain storage only (no destructors): allocations and frees can arrive during
// process exit, after thread-local and static objects with destructors are gone.
std::atomic<int> g_default_route{kRouteSync};
std::atomic<int> g_default_tag{0};
thread_local Scope t_stack[kMaxScopeDepth];
thread_local int t_depth = 0;
// Scopes open on all threads together. While it is zero no thread has a scope, so the
// allocation path can skip the thread-local lookup (a call into the TLS resolver for a
// dlopen'ed library). A thread always sees its own pushes.
std::atomic<int> g_open_scopes{0};

constexpr size_t kTagBytes = 64;
std::mutex g_tags_mu;
char g_tags[kMaxTags][kTagBytes] = {"untagged"};
int g_tag_count = 1;
// Note [Tag families]: each registered tag's family id + 1 (its own for a head), 0 for an id
// never registered; "untagged" heads its own. Written under g_tags_mu when the tag is
// registered, and a member's again when its head is registered after it (its own id until
// then); read without the lock. Plain storage, as above.
std::atomic<int> g_family[kMaxTags] = {1};
// Each head's members, a bit per tag id; written under g_tags_mu, read without it.
static_assert(kMaxTags <= 64, "a family's members are one 64-bit mask");
std::atomic<uint64_t> g_members[kMaxTags] = {};

// The family head named by `name`'s part before its first '+' (-1: none, or not registered);
// under g_tags_mu.
int head_of(const std::string& name) {
  const size_t plus = name.find('+');
  if (plus == std::string::npos || plus == 0) return -1;
  for (int i = 0; i < g_tag_count; ++i)
    if (name.compare(0, plus, g_tags[i]) == 0 && g_tags[i][plus] == '\0') return i;
  return -1;
}

}  // namespace

void set_default_route(int route) { g_default_route.store(route, std::memory_order_relaxed); }
int default_route() { return g_default_route.load(std::memory_order_relaxed); }

bool set_default_tag(int tag) {
  TB_REQUIRE(tag >= 0 && tag < tag_count(), kInvalidArgument, "unknown tag id " + std::to_string(tag), false);
  g_default_tag.store(tag, std::memory_order_relaxed);
  return true;
}
int default_tag() { return g_default_tag.load(std::memory_order_relaxed); }

Scope current_scope() {
  if (g_open_scopes.load(std::memory_order_relaxed) == 0 || t_depth == 0) return Scope{default_route(), default_tag()};
  return t_stack[t_depth - 1];
}

bool push_scope(int route, int tag) {
  Scope cur = current_scope();
  if (route == kRouteDefault) route = cur.route;
  TB_REQUIRE(route >= 0 && route < kRouteCount, kInvalidArgument,
             "unknown route " + std::to_string(route) + " (expected vmm, pool or sync)", false);
  if (tag < 0) tag = cur.tag;
  TB_REQUIRE(tag < tag_count(), kInvalidArgument, "unknown tag id " + std::to_string(tag), false);
  TB_REQUIRE(t_depth < kMaxScopeDepth, kState,
             "route/tag scopes nested deeper than " + std::to_string(kMaxScopeDepth) + " on this thread", false);
  t_stack[t_depth++] = Scope{route, tag};
  g_open_scopes.fetch_add(1, std::memory_order_relaxed);
  return true;
}

bool pop_scope() {
  TB_REQUIRE(t_depth > 0, kState, "pop of an empty route/tag scope stack on this thread", false);
  --t_depth;
  g_open_scopes.fetch_sub(1, std::memory_order_relaxed);
  return true;
}

int tag_id(const std::string& name) {
  TB_REQUIRE(!name.empty(), kInvalidArgument, "a tag needs a non-empty name", -1);
  TB_REQUIRE(name.size() < kTagBytes, kInvalidArgument,
             "tag name '" + name + "' is longer than " + std::to_string(kTagBytes - 1) + " bytes", -1);
  std::lock_guard<std::mutex> lock(g_tags_mu);
  for (int i = 0; i < g_tag_count; ++i)
    if (name == g_tags[i]) return i;
  TB_REQUIRE(g_tag_count < kMaxTags, kInvalidArgument,
             "too many tags (at most " + std::to_string(kMaxTags - 1) + "): cannot add '" + name + "'", -1);
  const int id = g_tag_count++;
  std::memcpy(g_tags[id], name.c_str(), name.size() + 1);
  // Note [Tag families]: a member joins its head if that is registered; a head, once
  // registered, takes in the members registered before it.
  const int head = head_of(name);
  g_family[id].store((head >= 0 ? head : id) + 1);
  if (head >= 0) g_members[head].fetch_or(uint64_t{1} << id);
  for (int i = 1; i < id; ++i)
    if (head_of(g_tags[i]) == id) {
      g_members[id].fetch_or(uint64_t{1} << i);
      g_family[i].store(id + 1);
    }
  return id;
}

int tag_family(int id) {
  return id >= 0 && id < kMaxTags ? g_family[id].load(std::memory_order_acquire) - 1 : -1;
}

uint64_t tag_members(int head) {
  return head >= 0 && head < kMaxTags ? g_members[head].load(std::memory_order_acquire) : 0;
}

int tag_find(const std::string& name) {
  std::lock_guard<std::mutex> lock(g_tags_mu);
  for (int i = 0; i < g_tag_count; ++i)
    if (name == g_tags[i]) return i;
  return -1;
}

std::string tag_name(int id) {
  std::lock_guard<std::mutex> lock(g_tags_mu);
  if (id < 0 || id >= g_tag_count) return "";
  return g_tags[id];
}

int tag_count() {
  std::lock_guard<std::mutex> lock(g_tags_mu);
  return g_tag_count;
}

}  // namespace tb
