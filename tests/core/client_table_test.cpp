// ClientTable against std::map as the model: random inserts, erases and lookups of keys that
// collide on purpose (few distinct keys, strided ids), which exercises backward-shift deletion.
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <map>

#include "core/client_table.h"

namespace th {
namespace {

RC_GTEST_PROP(ClientTable, BehavesLikeAMap, ()) {
  ClientTable<std::uint32_t> table;
  std::map<ClientId, std::uint32_t> model;
  const auto operations = *rc::gen::container<std::vector<std::tuple<int, std::uint32_t>>>(
      rc::gen::tuple(rc::gen::inRange(0, 3), rc::gen::inRange<std::uint32_t>(0, 300)));
  std::uint32_t stamp = 0;
  for (const auto& [operation, raw] : operations) {
    const ClientId key = static_cast<ClientId>(raw) * 4096;  // strided: stresses the hash
    switch (operation) {
      case 0:
        if (!model.contains(key)) {
          table.insert(key, ++stamp);
          model[key] = stamp;
        }
        break;
      case 1:
        RC_ASSERT(table.erase(key) == (model.erase(key) == 1));
        break;
      default: {
        const std::uint32_t* found = table.find(key);
        auto expected = model.find(key);
        RC_ASSERT((found != nullptr) == (expected != model.end()));
        if (found != nullptr) RC_ASSERT(*found == expected->second);
      }
    }
    RC_ASSERT(table.size() == model.size());
  }
  for (const auto& [key, value] : model) RC_ASSERT(*table.find(key) == value);
  std::size_t visited = 0;
  table.for_each([&](ClientId, std::uint32_t) { ++visited; });
  RC_ASSERT(visited == model.size());
}

TEST(ClientTable, InsertingAPresentKeyIsABug) {
  ClientTable<int> table;
  table.insert(7, 1);
  EXPECT_THROW(table.insert(7, 2), AssertionFailure);
  EXPECT_FALSE(table.erase(8));
  EXPECT_TRUE(table.erase(7));
  EXPECT_EQ(table.size(), 0u);
}

}  // namespace
}  // namespace th
