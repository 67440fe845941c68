#include "ledger_json.h"

#include <cinttypes>
#include <cstdio>

#include "device_allocator.h"
#include "scope.h"

namespace tb {
namespace {

// A minimal writer: objects and arrays of integers and strings, commas handled.
class Json {
 public:
  Json& key(const char* k) {
    comma();
    out_ += '"';
    escaped(k);
    out_ += "\":";
    after_key_ = true;
    return *this;
  }
  Json& num(int64_t v) {
    comma();
    char buf[32];
    std::snprintf(buf, sizeof buf, "%" PRId64, v);
    out_ += buf;
    return *this;
  }
  Json& str(const std::string& s) {
    comma();
    out_ += '"';
    escaped(s.c_str());
    out_ += '"';
    return *this;
  }
  Json& null() {
    comma();
    out_ += "null";
    return *this;
  }
  Json& open(char c) {
    comma();
    out_ += c;
    first_ = true;
    return *this;
  }
  Json& close(char c) {
    out_ += c;
    first_ = false;
    return *this;
  }
  Json& field(const char* k, int64_t v) { return key(k).num(v); }
  std::string take() { return std::move(out_); }

 private:
  void comma() {
    if (after_key_) {
      after_key_ = false;
      return;
    }
    if (!first_) out_ += ',';
    first_ = false;
  }
  void escaped(const char* s) {
    for (; *s; ++s) {
      if (*s == '"' || *s == '\\') out_ += '\\';
      out_ += *s;
    }
  }
  std::string out_;
  bool first_ = true;
  bool after_key_ = false;
};

void stat(Json& j, const char* name, const Stat& s) {
  j.key(name).open('{');
  j.field("current", s.get());
  j.field("peak", s.peak.load(std::memory_order_relaxed));
  j.field("allocated", s.allocated.load(std::memory_order_relaxed));
  j.field("freed", s.freed.load(std::memory_order_relaxed));
  j.close('}');
}

void stat3(Json& j, const char* name, const Stat& all, const Stat& small, const Stat& large) {
  j.key(name).open('{');
  stat(j, "all", all);
  stat(j, "small_pool", small);
  stat(j, "large_pool", large);
  j.close('}');
}

void stat3(Json& j, const char* name, const StatArray3& a) {
  stat3(j, name, a.s[kAggregate], a.s[kSmallPool], a.s[kLargePool]);
}

void stat3(Json& j, const char* name, const Ledger& l, Stat BlockStats::*s) {
  stat3(j, name, l.blocks[kAggregate].*s, l.blocks[kSmallPool].*s, l.blocks[kLargePool].*s);
}

}  // namespace

std::string stats_json(DeviceAllocator& d) {
  Json j;
  std::vector<TagView> views;
  for (int t = 0; t < tag_count(); ++t) views.push_back(d.tag_view(t));
  d.read_locked([&](const Ledger& l) {
    j.open('{');
    j.field("device", d.device());
    j.field("budget", d.budget() == Budget::kNone ? -1 : d.budget());
    j.field("total", static_cast<int64_t>(d.caps().total_bytes));
    stat3(j, "allocation", l, &BlockStats::allocation);
    stat3(j, "segment", l.segment);
    stat3(j, "active", l, &BlockStats::active);
    stat3(j, "allocated_bytes", l, &BlockStats::allocated_bytes);
    stat3(j, "reserved_bytes", l.reserved_bytes);
    stat3(j, "active_bytes", l, &BlockStats::active_bytes);
    stat3(j, "requested_bytes", l, &BlockStats::requested_bytes);
    stat(j, "graph_pool_reserved", l.graph_pool_reserved);
    j.field("num_alloc_retries", l.num_alloc_retries.load());
    j.field("num_ooms", l.num_ooms.load());
    j.field("num_device_alloc", l.num_device_alloc.load());
    j.field("num_device_free", l.num_device_free.load());
    j.field("num_sync_all_streams", l.num_sync_all_streams.load());
    j.field("num_stream_syncs", l.num_stream_syncs.load());
    j.field("num_reclaims", l.num_reclaims.load());
    j.field("num_moves", l.num_moves.load());
    j.field("num_adoptions", l.num_adoptions.load());
    j.field("num_take_backs", l.num_take_backs.load());
    j.field("mapping_ns", l.mapping_ns.load());
    j.field("packing_ns", l.packing_ns.load());
    j.key("routes").open('{');
    for (int r = 0; r < kRouteCount; ++r) {
      j.key(route_name(r)).open('{');
      stat(j, "allocated", l.route[r].allocated);
      stat(j, "reserved", l.route[r].reserved);
      j.field("count", l.route[r].count.load());
      j.close('}');
    }
    j.close('}');
    j.key("tags").open('{');
    const int ntags = static_cast<int>(views.size());
    for (int t = 0; t < ntags; ++t) {
      const std::string name = tag_name(t);
      j.key(name.c_str()).open('{');
      stat(j, "allocated", l.tag[t].allocated);
      stat(j, "requested", l.tag[t].requested);
      j.field("count", l.tag[t].allocations.allocated.load());
      stat(j, "allocations", l.tag[t].allocations);
      j.field("budget", d.tag_budget(t) == Budget::kNone ? -1 : d.tag_budget(t));
      j.key("state").str(tag_life_name(views[t].life));
      if (views[t].backup < 0) j.key("backup").null();
      else j.key("backup").str(backup_name(views[t].backup));
      j.field("resident", views[t].resident);
      j.field("released", views[t].released);
      j.field("backup_bytes", views[t].backup_bytes);
      j.field("retained", views[t].retained);
      j.close('}');
    }
    j.close('}');
    j.close('}');
  });
  return j.take();
}

std::string segments_json(DeviceAllocator& d) {
  Json j;
  j.open('[');
  for (const SegmentView& v : d.segments()) {
    j.open('{');
    j.field("address", static_cast<int64_t>(v.base));
    j.field("total_size", static_cast<int64_t>(v.size));
    j.field("mapped_size", static_cast<int64_t>(v.mapped));
    j.field("allocated_size", static_cast<int64_t>(v.allocated));
    j.field("requested_size", static_cast<int64_t>(v.requested));
    j.field("active_size", static_cast<int64_t>(v.active));
    j.field("stream", static_cast<int64_t>(reinterpret_cast<uintptr_t>(v.stream)));
    j.field("small", v.small);
    j.key("route").str(route_name(v.route));
    j.key("pool").open('[').num(static_cast<int64_t>(v.pool.first)).num(static_cast<int64_t>(v.pool.second)).close(']');
    j.key("blocks").open('[');
    for (const auto& b : v.blocks)
      j.open('[').num(static_cast<int64_t>(b.size)).num(static_cast<int64_t>(b.state != 0 ? b.requested : 0)).num(b.state).close(']');
    j.close(']');
    j.close('}');
  }
  j.close(']');
  return j.take();
}

}  // namespace tb
