#include "tb_capi.h"

#include <cinttypes>
#include <climits>
#include <cstdio>
#include <string>

#include "core/allocator.h"
#include "core/error.h"
#include "core/scope.h"

using namespace tb;

namespace {

thread_local std::string t_json;

int code() { return last_error_code() == kOk ? kDriverError : last_error_code(); }

void put(std::string& s, const char* key, int64_t v, bool comma = true) {
  char buf[96];
  std::snprintf(buf, sizeof buf, "\"%s\":%" PRId64 "%s", key, v, comma ? "," : "");
  s += buf;
}

void put_stat(std::string& s, const char* key, const Stat& st, bool comma = true) {
  s += "\"";
  s += key;
  s += "\":{";
  put(s, "current", st.get());
  put(s, "peak", st.peak.load(std::memory_order_relaxed));
  put(s, "allocated", st.allocated.load(std::memory_order_relaxed));
  put(s, "freed", st.freed.load(std::memory_order_relaxed), false);
  s += comma ? "}," : "}";
}

void put_array(std::string& s, const char* key, const StatArray3& a) {
  s += "\"";
  s += key;
  s += "\":{";
  put_stat(s, "all", a.s[kAggregate]);
  put_stat(s, "small_pool", a.s[kSmallPool]);
  put_stat(s, "large_pool", a.s[kLargePool], false);
  s += "},";
}

std::string escape(const std::string& in) {
  std::string out;
  for (char c : in) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out;
}

}  // namespace

extern "C" {

const char* tb_last_error(void) { return last_error_message().c_str(); }
int tb_last_error_code(void) { return last_error_code(); }

int tb_configure(int64_t budget_bytes, double budget_fraction, int default_route, int reuse_before_grow) {
  clear_error();
  Settings s;
  s.budget_bytes = budget_bytes;
  s.budget_fraction = budget_fraction;
  s.reuse_before_grow = reuse_before_grow != 0;
  return Allocator::get().configure(s, default_route) ? 0 : code();
}

int tb_device_count(void) {
  clear_error();
  return Allocator::get().device_count();
}

int tb_capabilities(int device, int64_t out[4]) {
  clear_error();
  if (!Allocator::get().load_driver()) return code();
  const int n = Allocator::get().device_count();
  if (n < 0) return code();
  if (device < 0 || device >= n) {
    set_error(kInvalidArgument, "device " + std::to_string(device) + " does not exist (" + std::to_string(n) +
                                    " visible)");
    return kInvalidArgument;
  }
  Capabilities caps;
  if (!probe_device(device, &caps)) return code();
  out[0] = caps.vmm;
  out[1] = caps.pools;
  out[2] = static_cast<int64_t>(caps.granularity);
  out[3] = static_cast<int64_t>(caps.total_bytes);
  return 0;
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

int tb_record_stream(void* ptr, void* stream) {
  clear_error();
  Block* b = Allocator::get().find(ptr);
  if (b == nullptr) return code();
  DeviceAllocator* d = Allocator::get().device_if_ready(b->device);
  return d->record_stream(b, static_cast<CUstream>(stream)) ? 0 : code();
}

int tb_push_scope(int route, int tag) {
  clear_error();
  return push_scope(route, tag) ? 0 : code();
}

int tb_pop_scope(void) {
  clear_error();
  return pop_scope() ? 0 : code();
}

int tb_scope_depth(void) { return scope_depth(); }
int tb_current_route(void) { return current_scope().route; }

int tb_tag_id(const char* name) {
  clear_error();
  if (name == nullptr) {
    set_error(kInvalidArgument, "a tag needs a name");
    return -kInvalidArgument;
  }
  int id = tag_id(name);
  return id < 0 ? -code() : id;
}

int tb_set_budget(int device, int64_t bytes) {
  clear_error();
  DeviceAllocator* d = Allocator::get().device(device);
  if (d == nullptr) return code();
  return d->set_budget(bytes) ? 0 : code();
}

int64_t tb_get_budget(int device) {
  clear_error();
  DeviceAllocator* d = Allocator::get().device(device);
  return d ? d->budget() : -1;
}

int tb_empty_cache(int device) {
  clear_error();
  DeviceAllocator* d = Allocator::get().device_if_ready(device);
  if (d == nullptr) return 0;  // nothing was ever allocated there
  return d->empty_cache() ? 0 : code();
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
  DeviceAllocator* d = Allocator::get().device(device);
  if (d == nullptr) return code();
  return d->end_allocate_to_pool({id0, id1}) ? 0 : code();
}

int tb_release_pool(int device, uint64_t id0, uint64_t id1) {
  clear_error();
  DeviceAllocator* d = Allocator::get().device(device);
  if (d == nullptr) return code();
  return d->release_pool({id0, id1}) ? 0 : code();
}

int tb_reset_peaks(int device) {
  clear_error();
  DeviceAllocator* d = Allocator::get().device_if_ready(device);
  if (d != nullptr) d->ledger().reset_peaks();
  return 0;
}

const char* tb_stats_json(int device) {
  clear_error();
  DeviceAllocator* d = Allocator::get().device(device);
  if (d == nullptr) return nullptr;
  Ledger& l = d->ledger();
  std::string& s = t_json;
  s = "{";
  put(s, "device", device);
  put(s, "budget", d->budget() == INT64_MAX ? -1 : d->budget());
  put(s, "total", static_cast<int64_t>(d->caps().total_bytes));
  put_array(s, "allocation", l.allocation);
  put_array(s, "segment", l.segment);
  put_array(s, "active", l.active);
  put_array(s, "allocated_bytes", l.allocated_bytes);
  put_array(s, "reserved_bytes", l.reserved_bytes);
  put_array(s, "active_bytes", l.active_bytes);
  put_array(s, "requested_bytes", l.requested_bytes);
  put_stat(s, "graph_pool_reserved", l.graph_pool_reserved);
  put(s, "num_alloc_retries", l.num_alloc_retries.load());
  put(s, "num_ooms", l.num_ooms.load());
  put(s, "num_device_alloc", l.num_device_alloc.load());
  put(s, "num_device_free", l.num_device_free.load());
  put(s, "num_sync_all_streams", l.num_sync_all_streams.load());
  s += "\"routes\":{";
  for (int r = 0; r < kRouteCount; ++r) {
    s += "\"";
    s += route_name(r);
    s += "\":{";
    put_stat(s, "allocated", l.route_allocated[r]);
    put_stat(s, "reserved", l.route_reserved[r]);
    put(s, "count", l.route_count[r].load(), false);
    s += r + 1 < kRouteCount ? "}," : "}";
  }
  s += "},\"tags\":{";
  const int ntags = tag_count();
  for (int t = 0; t < ntags; ++t) {
    s += "\"" + escape(tag_name(t)) + "\":{";
    put_stat(s, "allocated", l.tag_allocated[t]);
    put_stat(s, "requested", l.tag_requested[t]);
    put(s, "count", l.tag_count[t].load(), false);
    s += t + 1 < ntags ? "}," : "}";
  }
  s += "}}";
  return s.c_str();
}

const char* tb_segments_json(int device) {
  clear_error();
  DeviceAllocator* d = Allocator::get().device(device);
  if (d == nullptr) return nullptr;
  std::string& s = t_json;
  s = "[";
  bool first = true;
  for (const SegmentView& v : d->segments()) {
    if (!first) s += ",";
    first = false;
    s += "{";
    put(s, "address", static_cast<int64_t>(v.base));
    put(s, "total_size", static_cast<int64_t>(v.size));
    put(s, "mapped_size", static_cast<int64_t>(v.mapped));
    put(s, "allocated_size", static_cast<int64_t>(v.allocated));
    put(s, "requested_size", static_cast<int64_t>(v.requested));
    put(s, "active_size", static_cast<int64_t>(v.active));
    put(s, "stream", static_cast<int64_t>(reinterpret_cast<uintptr_t>(v.stream)));
    put(s, "small", v.small);
    s += std::string("\"route\":\"") + route_name(v.route) + "\",";
    s += "\"pool\":[" + std::to_string(v.pool.first) + "," + std::to_string(v.pool.second) + "],";
    s += "\"blocks\":[";
    for (size_t i = 0; i < v.blocks.size(); ++i) {
      s += "[" + std::to_string(v.blocks[i].size) + "," + std::to_string(v.blocks[i].requested) + "," +
           std::to_string(v.blocks[i].state) + "]";
      if (i + 1 < v.blocks.size()) s += ",";
    }
    s += "]}";
  }
  s += "]";
  return s.c_str();
}

}  // extern "C"
