// A read attempt hashes its big host tensors as their bytes arrive (ReadAttempt::hash_arrived, in
// receive steps smaller than a checksum block) and checks them from those digests: its verdicts
// must be those of hashing each tensor whole after the read (client/checksum.h's definition), for
// any sequence of progress reports, resumed reads included.
#include "client/receive.h"

#include <gtest/gtest.h>

#include <map>
#include <random>
#include <string>
#include <vector>

#include "client/checksum.h"

namespace th::client_impl {
namespace {

constexpr std::uint64_t kBlock = kChecksumBlockBytes;

// A shard of tensors of the given sizes in host memory ("t00", "t01", ... in layout order), the
// checksums of their bytes as published, and the plan a reader reads them with.
struct Shard {
  explicit Shard(const std::vector<std::uint64_t>& sizes, std::uint64_t seed) {
    std::mt19937_64 random(seed);
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      std::vector<std::byte> bytes(sizes[i]);
      for (std::byte& byte : bytes) byte = static_cast<std::byte>(random());
      memory.push_back(std::move(bytes));
    }
    std::map<std::string, Registered, std::less<>> registry;
    auto published = std::make_shared<Checksums>();
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      const std::string name = (i < 10 ? "t0" : "t") + std::to_string(i);
      registry[name] = Registered{memory[i].data(), TensorSpec{name, DType::kUInt8, sizes[i]}, nullptr, false};
      published->push_back(checksum(memory[i].data(), sizes[i]));
    }
    plan = make_plan(registry);
    checksums = published;
  }
  ReadAttempt attempt() { return ReadAttempt(plan, packed.data(), checksums, 7, /*scatter=*/true); }

  std::vector<std::vector<std::byte>> memory;  // per tensor, in layout order
  std::vector<std::byte> packed;  // (every tensor here has a region of its own)
  Plan plan;
  ChecksumsRef checksums;
};

// Every unit's verdict, each checked once.
std::vector<std::optional<std::size_t>> verdicts(const ReadAttempt& attempt) {
  std::vector<std::optional<std::size_t>> out;
  for (std::size_t unit = 0; unit < attempt.unit_end.size(); ++unit) out.push_back(attempt.check(unit));
  return out;
}

TEST(ReadAttemptHashing, VerdictsEqualHashingEachTensorWholeForAnyProgress) {
  for (std::uint64_t seed = 1; seed <= 12; ++seed) {
    std::mt19937_64 random(seed);
    // Big tensors (a region each) of whole blocks, a block and a bit, less than a block past two.
    std::vector<std::uint64_t> sizes;
    for (int i = 0; i < 4; ++i) sizes.push_back(2 * kBlock + random() % (3 * kBlock));
    sizes.push_back(3 * kBlock);
    Shard shard(sizes, seed);
    // Some tensors arrive wrong (a flipped byte, anywhere in them): the source sent bad bytes.
    std::vector<bool> bad(sizes.size());
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      if (random() % 3 != 0) continue;
      bad[i] = true;
      shard.memory[i][random() % sizes[i]] ^= std::byte{0x40};
    }
    ReadAttempt hashed = shard.attempt();
    hashed.hash_from(0);
    // Progress in steps of any size: a few bytes, mid-block, several blocks at once, unchanged.
    const std::uint64_t total = hashed.unit_end.back();
    for (std::uint64_t ready = 0; ready < total;) {
      const std::uint64_t step = random() % 4 == 0 ? random() % (3 * kBlock) : random() % (kBlock / 3);
      ready = std::min(total, ready + step);
      hashed.hash_arrived(ready);
    }
    hashed.hash_arrived(total);
    const ReadAttempt whole = shard.attempt();  // never told of progress: hashes each tensor whole
    const auto hashed_verdicts = verdicts(hashed);
    ASSERT_EQ(hashed_verdicts, verdicts(whole)) << "seed " << seed;
    for (std::size_t unit = 0; unit < hashed_verdicts.size(); ++unit) {
      const std::size_t tensor = shard.plan.big[unit - hashed.packed_units];
      EXPECT_EQ(hashed_verdicts[unit].has_value(), bad[tensor]) << "seed " << seed << " tensor " << tensor;
    }
  }
}

TEST(ReadAttemptHashing, ATensorHashedAsItArrivedIsNotReadAgain) {
  // The bytes below the reported prefix are final for the attempt, so the check does not hash them
  // a second time: a byte changed behind the reader's back after it arrived goes unseen by this
  // attempt, and one changed before it arrived is seen.
  Shard shard({3 * kBlock + 5, 2 * kBlock}, 3);
  ReadAttempt attempt = shard.attempt();
  attempt.hash_from(0);
  attempt.hash_arrived(3 * kBlock + 5 + kBlock / 2);  // all of tensor 0, half a block of tensor 1
  shard.memory[0][17] ^= std::byte{1};
  shard.memory[1][kBlock + 9] ^= std::byte{1};  // not arrived yet
  attempt.hash_arrived(attempt.unit_end.back());
  EXPECT_EQ(attempt.check(0), std::nullopt);
  EXPECT_EQ(attempt.check(1), std::optional<std::size_t>(1));
}

TEST(ReadAttemptHashing, AResumedAttemptHashesFromTheUnitThatHoldsItsStart) {
  Shard shard({2 * kBlock + 1, 2 * kBlock + 2, 2 * kBlock + 3}, 4);
  const std::vector<std::uint64_t> starts = {0, 2 * kBlock + 1, 2 * kBlock + 1 + kBlock};  // a unit's start, mid-unit
  for (std::uint64_t start : starts) {
    ReadAttempt attempt = shard.attempt();
    attempt.hash_from(start);
    for (std::uint64_t ready = start; ready < attempt.unit_end.back(); ready += 256 << 10) attempt.hash_arrived(ready);
    attempt.hash_arrived(attempt.unit_end.back());
    // (Units before the start were verified by the earlier attempt and are not checked again; if
    // one were, it is hashed whole, not judged from digests never taken.)
    for (std::size_t unit = 0; unit < attempt.unit_end.size(); ++unit) {
      EXPECT_EQ(attempt.check(unit), std::nullopt) << "start " << start << " unit " << unit;
    }
  }
}

TEST(ReadAttemptHashing, UnitsNotWhollyArrivedAreHashedWholeWhenChecked) {
  // A pull that reports no progress (or not its last bytes) leaves the check to hash the tensor.
  Shard shard({2 * kBlock + 7, 2 * kBlock}, 5);
  ReadAttempt attempt = shard.attempt();
  attempt.hash_from(0);
  attempt.hash_arrived(kBlock + 3);  // part of tensor 0
  EXPECT_EQ(attempt.check(0), std::nullopt);
  EXPECT_EQ(attempt.check(1), std::nullopt);
  shard.memory[1][0] ^= std::byte{1};
  EXPECT_EQ(attempt.check(1), std::optional<std::size_t>(1));
}

TEST(BlockHasher, PiecesGiveTheBlocksDigest) {
  std::vector<std::byte> block(kBlock);
  std::mt19937_64 random(6);
  for (std::byte& byte : block) byte = static_cast<std::byte>(random());
  BlockHasher hasher;
  for (std::uint64_t piece : {std::uint64_t{1}, std::uint64_t{240}, std::uint64_t{4096}, std::uint64_t{256 << 10},
                              kBlock}) {
    for (std::uint64_t at = 0; at < kBlock; at += piece) hasher.update(block.data() + at, std::min(piece, kBlock - at));
    EXPECT_EQ(hasher.finish(), checksum_block(block.data(), kBlock)) << "pieces of " << piece;
  }
  hasher.update(block.data(), 100);
  EXPECT_EQ(hasher.finish(), checksum_block(block.data(), 100));
  EXPECT_EQ(hasher.finish(), checksum_block(nullptr, 0));  // nothing fed since
  hasher.update(block.data(), kBlock);
  EXPECT_THROW(hasher.update(block.data(), 1), RequirementFailure);  // past a block
}

}  // namespace
}  // namespace th::client_impl
