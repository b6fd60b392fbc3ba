// The cluster token: th-server checks it at connect; clients and th-ctl present it. Kept in a file
// (not on a command line, where `ps` would show it).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "core/result.h"

namespace th::net {

// A token's bytes at most: a token travels in a client's first message, which th-server reads under
// the limit for connections that have not authenticated (64 KiB), so a longer one would reset the
// connection rather than be refused.
inline constexpr std::size_t kTokenBytesMax = 4096;
// kInvalidArgument naming `what` (e.g. "the cluster token") if `token` is empty or too long.
Status check_token_size(std::string_view token, const std::string& what);

// A token file (a regular file) holds one token per line (blanks around it, a byte order mark and
// empty lines ignored). A client
// presents the first; th-server accepts any of them, so that a token can be rotated: add the new
// line, SIGHUP th-server, move the clients over, remove the old line, SIGHUP again.
// kInvalidArgument if the file is unreadable, holds no token, or a token is too long.
Result<std::vector<std::string>> read_token_lines(const std::string& path);
// The first token of the file (what a client presents).
Result<std::string> read_token_file(const std::string& path);

}  // namespace th::net
