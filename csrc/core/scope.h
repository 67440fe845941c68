// Routing scopes: a process-wide default route and tag plus a per-thread stack of
// (route, tag) pushed and popped like `with` blocks.
//
// The stack is thread_local, so scopes on one thread never leak into another; the
// allocation path reads only the top entry (no lock).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tb {

constexpr int kRouteDefault = -1;  // "keep the route of the enclosing scope"
constexpr int kMaxScopeDepth = 64;

struct Scope {
  int route;  // kRouteVmm / kRoutePool / kRouteSync
  int tag;    // index into the tag registry, 0 = untagged
};

// Route used when no scope is open (set by install()).
void set_default_route(int route);
int default_route();
// Tag used when no scope is open, on every thread (0: untagged). false (kInvalidArgument) on an
// unknown tag.
bool set_default_tag(int tag);
int default_tag();

// The scope in force on this thread.
Scope current_scope();
// Pushes a scope; route kRouteDefault keeps the current route, tag < 0 keeps the
// current tag. Returns false (kInvalidArgument) on an unknown route or tag, and
// (kState) beyond kMaxScopeDepth nested scopes.
bool push_scope(int route, int tag);
// Pops the innermost scope; false (kState) when the stack is empty.
bool pop_scope();

// Tag registry: names to small integers, process-wide, never shrinks.
// Returns -1 (kInvalidArgument) on an empty name or when the table is full.
// Note [Tag families]: "X+suffix" belongs to X's family once both are registered.
int tag_id(const std::string& name);
// The family of tag `id`: the tag named by its name up to the first '+' ("kv" for
// "kv+cpu") when that is registered, else `id` itself; -1 for an id never registered.
// Lock-free: the allocation path asks it.
int tag_family(int id);
// The members of the family that tag `head` heads, as a bit per tag id (never `head` itself);
// 0 for a tag that heads none. Lock-free.
uint64_t tag_members(int head);
// The id of a registered tag, -1 when none has that name (registers nothing).
int tag_find(const std::string& name);
std::string tag_name(int id);
int tag_count();

}  // namespace tb
