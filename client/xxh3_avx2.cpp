// XXH3-64 built for AVX2: this file alone is compiled with -mavx2 (client/CMakeLists.txt), and
// client/checksum.cpp uses it only on a CPU that has AVX2. The definition of XXH3 does not depend
// on the instruction set: every build gives the same digest (tests/gpu/checksum_parts_test.cpp
// compares them).
//
// Why: Debian's libxxhash is built for baseline x86-64 (SSE2). On the benchmark machine it hashes
// 6.0 GB/s from memory and 18.5 GB/s from cache, this 13.4 and 36.8: a reader hashes every byte
// it receives, and at loopback speeds (3-5 GB/s) the baseline build cost a third of a read.
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "client/xxh3_build_of_this_unit.h"

namespace th::client_impl {

const Xxh3Build& xxh3_avx2_build() { return build_of_this_unit(); }

}  // namespace th::client_impl
