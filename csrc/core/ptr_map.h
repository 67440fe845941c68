// Live blocks by address: an open-addressing hash map (linear probing, backward-shift
// deletion), because a node-based map costs a heap allocation per allocation on the
// hot path. Not thread-safe: the owning DeviceAllocator's mutex guards it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace tb {

struct Block;

class PtrMap {
 public:
  PtrMap() : slots_(1024) {}

  Block* find(uintptr_t key) const {
    for (size_t i = index(key);; i = (i + 1) & mask()) {
      const Slot& s = slots_[i];
      if (s.key == key) return s.value;
      if (s.key == 0) return nullptr;
    }
  }

  void insert(uintptr_t key, Block* value) {
    if ((size_ + 1) * 4 > slots_.size() * 3) grow();
    place(key, value);
    ++size_;
  }

  bool erase(uintptr_t key) { return take(key) != nullptr; }

  // Removes the entry of `key` and returns its value, in one probe; nullptr if none.
  Block* take(uintptr_t key) {
    size_t i = index(key);
    for (;; i = (i + 1) & mask()) {
      if (slots_[i].key == key) break;
      if (slots_[i].key == 0) return nullptr;
    }
    Block* const value = slots_[i].value;
    // Backward-shift: move later entries of the probe run into the hole.
    size_t hole = i;
    for (size_t j = (i + 1) & mask(); slots_[j].key != 0; j = (j + 1) & mask()) {
      const size_t home = index(slots_[j].key);
      const bool movable = hole <= j ? (home <= hole || home > j) : (home <= hole && home > j);
      if (movable) {
        slots_[hole] = slots_[j];
        hole = j;
      }
    }
    slots_[hole] = Slot{};
    --size_;
    return value;
  }

  size_t size() const { return size_; }

  template <typename Fn>
  void for_each(Fn fn) const {
    for (const Slot& s : slots_)
      if (s.key != 0) fn(s.key, s.value);
  }

 private:
  struct Slot {
    uintptr_t key = 0;  // 0 = empty (no allocation lives at address 0)
    Block* value = nullptr;
  };
  size_t mask() const { return slots_.size() - 1; }
  size_t index(uintptr_t key) const { return static_cast<size_t>((key >> 9) * 0x9E3779B97F4A7C15ull >> 20) & mask(); }
  void place(uintptr_t key, Block* value) {
    size_t i = index(key);
    while (slots_[i].key != 0) i = (i + 1) & mask();
    slots_[i] = Slot{key, value};
  }
  void grow() {
    std::vector<Slot> old(slots_.size() * 2);
    old.swap(slots_);
    for (const Slot& s : old)
      if (s.key != 0) place(s.key, s.value);
  }

  std::vector<Slot> slots_;
  size_t size_ = 0;
};

}  // namespace tb
