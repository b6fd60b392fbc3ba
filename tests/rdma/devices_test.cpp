// Which RDMA devices a process uses (rdma/verbs.h choose_devices): runs anywhere, no device needed.
#include <gtest/gtest.h>

#include "rdma/verbs.h"

namespace th::rdma {
namespace {

TEST(RdmaDevices, TheActiveOnesOnTheProcessesNumaNodeInNameOrder) {
  const std::vector<DeviceInfo> devices{
      {"mlx5_3", 1, true}, {"mlx5_0", 0, true}, {"mlx5_2", 1, true}, {"mlx5_1", 0, false}, {"mlx5_4", 0, true}};
  EXPECT_EQ(choose_devices(devices, 1), (std::vector<std::string>{"mlx5_2", "mlx5_3"}));
  EXPECT_EQ(choose_devices(devices, 0), (std::vector<std::string>{"mlx5_0", "mlx5_4"})) << "mlx5_1 is down";
}

TEST(RdmaDevices, EveryActiveOneWhenNoneIsNearOrTheNodeIsUnknown) {
  const std::vector<DeviceInfo> devices{{"rxe1", -1, true}, {"rxe0", -1, true}, {"rxe2", -1, false}};
  EXPECT_EQ(choose_devices(devices, 0), (std::vector<std::string>{"rxe0", "rxe1"}));
  EXPECT_EQ(choose_devices(devices, -1), (std::vector<std::string>{"rxe0", "rxe1"}));
  EXPECT_TRUE(choose_devices({{"mlx5_0", 0, false}}, 0).empty()) << "no active device: none";
  EXPECT_TRUE(choose_devices({}, 0).empty());
}

}  // namespace
}  // namespace th::rdma
