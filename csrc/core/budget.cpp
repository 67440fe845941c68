#include "budget.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "error.h"
#include "scope.h"

namespace tb {

std::string format_size(uint64_t bytes) {
  char buf[64];
  const double b = static_cast<double>(bytes);
  if (bytes <= 1024) std::snprintf(buf, sizeof buf, "%llu bytes", static_cast<unsigned long long>(bytes));
  else if (bytes <= (uint64_t(1) << 20)) std::snprintf(buf, sizeof buf, "%.2f KiB", b / 1024.0);
  else if (bytes <= (uint64_t(1) << 30)) std::snprintf(buf, sizeof buf, "%.2f MiB", b / 1048576.0);
  else std::snprintf(buf, sizeof buf, "%.2f GiB", b / 1073741824.0);
  return buf;
}

int64_t Budget::resolve(int64_t bytes, double fraction, size_t total) {
  if (bytes >= 0) return bytes;
  // Rounded, not truncated: a fraction computed from a byte count gives that count back.
  if (fraction > 0) return static_cast<int64_t>(std::llround(fraction * static_cast<double>(total)));
  return kNone;
}

bool Budget::fits(size_t bytes) {
  const int64_t room = this->room();
  if (room < 0 || bytes > static_cast<uint64_t>(room)) {
    refused_ = true;
    set_error(kOutOfMemory, "budget");
    return false;
  }
  return true;
}

void Budget::place(size_t bytes, const Placement& where, bool add) {
  const auto n = static_cast<int64_t>(bytes);
  if (add) {
    ledger_.reserved_bytes.add(where.small, n);
    ledger_.route[where.route].reserved.add(n);
    if (where.graph_pool) ledger_.graph_pool_reserved.add(n);
  } else {
    ledger_.reserved_bytes.sub(where.small, n);
    ledger_.route[where.route].reserved.sub(n);
    if (where.graph_pool) ledger_.graph_pool_reserved.sub(n);
  }
}

bool Budget::charge(size_t bytes, const Placement& where) {
  if (!fits(bytes)) return false;
  place(bytes, where, true);
  return true;
}

void Budget::charge_unchecked(size_t bytes, const Placement& where) { place(bytes, where, true); }

void Budget::uncharge(size_t bytes, const Placement& where) { place(bytes, where, false); }

void Budget::move(size_t bytes, const Placement& from, const Placement& to) {
  const auto n = static_cast<int64_t>(bytes);
  if (from.small != to.small) {
    ledger_.reserved_bytes.s[from.small ? kSmallPool : kLargePool].sub(n);
    ledger_.reserved_bytes.s[to.small ? kSmallPool : kLargePool].add(n);
  }
  if (from.route != to.route) {
    ledger_.route[from.route].reserved.sub(n);
    ledger_.route[to.route].reserved.add(n);
  }
  if (from.graph_pool != to.graph_pool) {
    if (from.graph_pool) ledger_.graph_pool_reserved.sub(n);
    else ledger_.graph_pool_reserved.add(n);
  }
}

bool Budget::check_tag_setting(int tag, double fraction) {
  TB_REQUIRE(tag >= 0 && tag < kMaxTags, kInvalidArgument, "unknown tag id " + std::to_string(tag), false);
  TB_REQUIRE(fraction <= 1, kInvalidArgument, "a tag's budget is bytes or a fraction in (0, 1]", false);
  return true;
}

std::string Budget::torch_head(size_t size, size_t device_free, size_t device_total) const {
  return "CUDA out of memory. Tried to allocate " + format_size(size) + ". GPU " + std::to_string(device_) +
         " has a total capacity of " + format_size(device_total) + " of which " + format_size(device_free) +
         " is free. ";
}

int64_t Budget::family_used(int tag) const {
  int64_t used = tag_used(tag);
  for (uint64_t m = tag_members(tag); m != 0; m &= m - 1) used += tag_used(__builtin_ctzll(m));
  return used;
}

std::string Budget::family_holders(int tag) const {
  std::string out;
  if (family_used(tag) == tag_used(tag)) return out;
  for (uint64_t m = tag_members(tag) | uint64_t{1} << tag; m != 0; m &= m - 1) {
    const int t = __builtin_ctzll(m);
    if (tag_used(t) == 0) continue;
    out += (out.empty() ? "'" : ", '") + tag_name(t) + "' " + format_size(static_cast<uint64_t>(tag_used(t)));
  }
  return out;
}

std::string Budget::family_use(int tag) const {
  const std::string holders = family_holders(tag);
  return format_size(static_cast<uint64_t>(family_used(tag))) + (holders.empty() ? "" : ": " + holders);
}

int Budget::binding_tag(int tag) const {
  const int head = tag_family(tag);
  if (head < 0 || head == tag || tag_limit(head) == kNone) return tag;
  if (tag_limit(tag) == kNone) return head;
  return tag_limit(head) - family_used(head) < tag_limit(tag) - family_used(tag) ? head : tag;
}

int64_t Budget::tag_room(int tag) const {
  const int head = tag_family(tag);
  if (tag_limit(tag) == kNone && (head < 0 || head == tag || tag_limit(head) == kNone))
    return kNone;  // no budget to add up: the common case
  const int t = binding_tag(tag);  // a head's own budget bounds its family
  return tag_limit(t) - family_used(t);
}

std::string Budget::tag_oom_message(size_t size, size_t charged, int member, const std::string& member_name,
                                    size_t device_free, size_t device_total) const {
  const int tag = binding_tag(member);
  const std::string name = tag == member ? member_name : tag_name(tag);
  const int64_t limit = tag_limit(tag), used = family_used(tag);
  const int64_t room = limit > used ? limit - used : 0;
  const std::string counted =
      tag == member ? "" : " (this allocation is under '" + member_name + "', whose memory counts toward it)";
  // Note [Tag families]: what the family holds, tag by tag, when more tags than the head hold it.
  const std::string holders = family_holders(tag);
  const bool family = !holders.empty();
  return torch_head(size, device_free, device_total) + "torch_budget: tag '" + name + "'" + counted +
         " would exceed its budget of " + format_size(static_cast<uint64_t>(limit)) +
         (family ? ": it and its family have " : ": it has ") + format_size(static_cast<uint64_t>(used)) +
         " allocated" + (family ? " (" + holders + ")" : "") + ", " + format_size(static_cast<uint64_t>(room)) +
         " left, and this allocation counts " + format_size(charged) +
         (charged > size ? " (its block, rounded up)" : "") +
         ". Other tags are not affected. To allow more, raise the tag's budget: "
         "torch_budget.set_budget(..., tag='" + name + "'), torch_budget.install(budgets={'" + name +
         "': ...}) or TORCH_BUDGET_CONF=budget." + name + ":...; or free tensors allocated under " +
         (family ? "those tags." : "the tag.");
}

std::string Budget::describe() const {
  return limit() == kNone ? std::string("none (the whole card)") : format_size(static_cast<uint64_t>(limit()));
}

std::string Budget::oom_message(size_t size, int route, const std::string& tag, const std::string& cause,
                                bool by_budget, size_t device_free, size_t device_total, bool retried) const {
  std::string msg = torch_head(size, device_free, device_total);
  msg += "torch_budget: route " + std::string(route_name(route)) + ", tag '" + tag + "': ";
  msg += by_budget ? "it would exceed the budget of " + describe() + "."
                  : "the driver refused it (" + cause + ").";
  msg += " Allocated " + format_size(ledger_.blocks[kAggregate].allocated_bytes.get()) + ", reserved " +
         format_size(static_cast<uint64_t>(reserved())) + ", budget " + describe() + ", device free " +
         format_size(device_free) + " of " + format_size(device_total) +
         (retried ? "; cached memory was released and the allocation retried. " : ". ");
  msg += by_budget
             ? "To allow more, raise the budget: torch_budget.install(budget=...), TORCH_BUDGET_CONF=budget:..., "
               "torch_budget.set_budget() or torch.cuda.set_per_process_memory_fraction(); or free tensors."
             : "Other processes or memory outside torch hold the rest: lower the batch size or the KV cache, or "
               "free tensors.";
  return msg;
}

}  // namespace tb
