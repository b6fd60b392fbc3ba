// Assertions that stay on in every build.
//
// Two macros, two meanings (after KJ_ASSERT / KJ_REQUIRE):
//   TH_ASSERT(cond, ...)  — our own bug. An invariant of this code does not hold.
//   TH_REQUIRE(cond, ...) — the caller's bug: a precondition of an API was violated by the code that
//                           calls it (for example the shell feeding a clock that runs backwards).
// Both throw, so that RapidCheck can shrink a failing case in core/ and so that a shell can log the
// message before it aborts. Neither is for expected outcomes: a client asking for a version that does
// not exist gets a typed `Error`, never an exception (see result.h).
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace th {

class AssertionFailure : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

class RequirementFailure : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

namespace detail {

inline void append_all(std::ostringstream&) {}

template <typename First, typename... Rest>
void append_all(std::ostringstream& out, const First& first, const Rest&... rest) {
  out << ' ' << first;
  append_all(out, rest...);
}

template <typename Failure, typename... Details>
[[noreturn]] void fail(const char* kind, const char* condition, const char* file, int line,
                       const Details&... details) {
  std::ostringstream out;
  out << file << ':' << line << ": " << kind << " failed: " << condition;
  if constexpr (sizeof...(details) > 0) {
    out << " —";
    append_all(out, details...);
  }
  throw Failure(out.str());
}

}  // namespace detail
}  // namespace th

#define TH_ASSERT(condition, ...)                                                                  \
  do {                                                                                             \
    if (!(condition)) [[unlikely]] {                                                               \
      ::th::detail::fail<::th::AssertionFailure>("assertion", #condition, __FILE__,               \
                                                 __LINE__ __VA_OPT__(, ) __VA_ARGS__);             \
    }                                                                                              \
  } while (false)

#define TH_REQUIRE(condition, ...)                                                                 \
  do {                                                                                             \
    if (!(condition)) [[unlikely]] {                                                               \
      ::th::detail::fail<::th::RequirementFailure>("requirement", #condition, __FILE__,           \
                                                   __LINE__ __VA_OPT__(, ) __VA_ARGS__);           \
    }                                                                                              \
  } while (false)
