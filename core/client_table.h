// A map from ClientId to a small value, stored flat: open addressing with linear probing and
// backward-shift deletion, power-of-two capacity, at most half full. The hub looks up a client on
// every input, so this is on its hottest path; a node-based map costs a cache miss per node.
//
// Lookup only: there is deliberately no iteration in key order or insertion order, so nothing can
// depend on one (DESIGN.md §2). `for_each` exists for invariant checks, which only count.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "core/assert.h"
#include "core/types.h"

namespace th {

template <typename Value>
class ClientTable {
 public:
  std::size_t size() const { return size_; }

  Value* find(ClientId key) {
    if (slots_.empty()) return nullptr;
    for (std::size_t at = home(key);; at = next(at)) {
      Slot& slot = slots_[at];
      if (!slot.used) return nullptr;
      if (slot.key == key) return &slot.value;
    }
  }
  const Value* find(ClientId key) const { return const_cast<ClientTable*>(this)->find(key); }
  bool contains(ClientId key) const { return find(key) != nullptr; }

  // Inserts a key that is not present.
  void insert(ClientId key, Value value) {
    TH_ASSERT(!contains(key), "client", key, "is already in the table");
    if (2 * (size_ + 1) > slots_.size()) grow();
    place(key, std::move(value));
    ++size_;
  }

  // Removes a key if present; returns whether it was.
  bool erase(ClientId key) {
    if (slots_.empty()) return false;
    std::size_t hole = home(key);
    while (true) {
      if (!slots_[hole].used) return false;
      if (slots_[hole].key == key) break;
      hole = next(hole);
    }
    // Backward shift: move later entries of the probe run into the hole, so no tombstones remain.
    for (std::size_t at = next(hole); slots_[at].used; at = next(at)) {
      const std::size_t wanted = home(slots_[at].key);
      // Move the entry at `at` if its home is not in the cyclic range (hole, at].
      const bool stays = hole <= at ? (hole < wanted && wanted <= at) : (hole < wanted || wanted <= at);
      if (stays) continue;
      slots_[hole] = std::move(slots_[at]);
      hole = at;
    }
    slots_[hole] = Slot{};
    --size_;
    return true;
  }

  template <typename F>
  void for_each(F&& f) const {
    for (const Slot& slot : slots_) {
      if (slot.used) f(slot.key, slot.value);
    }
  }

 private:
  struct Slot {
    ClientId key = 0;
    Value value{};
    bool used = false;
  };

  // Fibonacci hashing: spreads dense and strided ids alike.
  std::size_t home(ClientId key) const { return (key * 0x9E3779B97F4A7C15ULL) >> shift_; }
  std::size_t next(std::size_t at) const { return (at + 1) & (slots_.size() - 1); }

  void place(ClientId key, Value value) {
    std::size_t at = home(key);
    while (slots_[at].used) at = next(at);
    slots_[at] = Slot{key, std::move(value), true};
  }

  void grow() {
    std::vector<Slot> old = std::move(slots_);
    const std::size_t capacity = old.empty() ? 64 : 2 * old.size();
    slots_.assign(capacity, Slot{});
    shift_ = 64 - static_cast<unsigned>(__builtin_ctzll(capacity));
    for (Slot& slot : old) {
      if (slot.used) place(slot.key, std::move(slot.value));
    }
  }

  std::vector<Slot> slots_;
  std::size_t size_ = 0;
  unsigned shift_ = 64;
};

}  // namespace th
