// libibverbs is opened at run time (rdma/verbs_loader.cpp): where it cannot be, the process still
// runs, finds no device, and an RDMA transport's error names the library and what to install.
// ctest runs this with TH_IBVERBS_LIBRARY naming a library that does not exist
// (rdma_verbs_missing_test), and one that is not libibverbs (rdma_verbs_not_libibverbs: libz).
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <string_view>

#include "rdma/verbs.h"
#include "rdma/verbs_loader.h"

namespace th::rdma {
namespace {

constexpr std::string_view kMissingLibrary = "libth-no-such-verbs.so.1";
constexpr std::string_view kNotVerbs = "libz.so.1";

TEST(VerbsLoader, AMissingLibibverbsIsNamedAndNothingElseFails) {
  const char* configured = std::getenv("TH_IBVERBS_LIBRARY");
  ASSERT_NE(configured, nullptr) << "ctest sets TH_IBVERBS_LIBRARY for this test";
  const std::string library = configured;
  ASSERT_TRUE(library == kMissingLibrary || library == kNotVerbs) << library;

  const std::optional<std::string> missing = verbs_unavailable();
  ASSERT_TRUE(missing.has_value());
  EXPECT_NE(missing->find(library), std::string::npos) << *missing;
  EXPECT_NE(missing->find("rdma-core"), std::string::npos) << *missing;
  if (library == kNotVerbs) {
    EXPECT_NE(missing->find("not libibverbs"), std::string::npos) << *missing;
  }

  EXPECT_TRUE(device_names().empty());
  EXPECT_TRUE(list_devices().empty());
  try {
    Device device("", 1);
    FAIL() << "a device opened without libibverbs";
  } catch (const VerbsError& error) {
    EXPECT_NE(std::string(error.what()).find(library), std::string::npos) << error.what();
  }
}

}  // namespace
}  // namespace th::rdma
