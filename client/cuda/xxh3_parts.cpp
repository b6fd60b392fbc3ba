// The default secret of XXH3, from xxhash.h itself: XXH3_kSecret is static, so only a unit that
// compiles xxhash's implementation sees it. XXH_INLINE_ALL gives this unit a private copy of that
// implementation (every name prefixed, so it cannot clash with libxxhash's), and lets it check
// xxh3_parts.h's constants against xxhash's own.
#include "client/cuda/xxh3_parts.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace th::cuda::xxh3 {

static_assert(sizeof(XXH3_kSecret) == kSecretBytes);
static_assert(XXH_SECRET_DEFAULT_SIZE == kSecretBytes);
static_assert(XXH_STRIPE_LEN == kStripeBytes);
static_assert(XXH_ACC_NB == kLanes);
static_assert(XXH_SECRET_CONSUME_RATE == kSecretBytesPerStripe);
static_assert(XXH3_MIDSIZE_MAX == kMidSizeMax);
static_assert(XXH_SECRET_DEFAULT_SIZE - XXH_STRIPE_LEN - XXH_SECRET_LASTACC_START == kLastStripeSecretOffset);
static_assert(XXH_SECRET_MERGEACCS_START == kMergeSecretOffset);
static_assert(XXH_PRIME32_1 == kPrime32_1);
static_assert(XXH_PRIME32_2 == kPrime32_2);
static_assert(XXH_PRIME32_3 == kPrime32_3);
static_assert(XXH_PRIME64_1 == kPrime64_1);
static_assert(XXH_PRIME64_2 == kPrime64_2);
static_assert(XXH_PRIME64_3 == kPrime64_3);
static_assert(XXH_PRIME64_4 == kPrime64_4);
static_assert(XXH_PRIME64_5 == kPrime64_5);

std::span<const std::uint8_t, kSecretBytes> default_secret() { return std::span<const std::uint8_t, kSecretBytes>(XXH3_kSecret); }

}  // namespace th::cuda::xxh3
