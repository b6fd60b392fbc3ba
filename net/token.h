// The cluster token: th-server checks it at connect; clients and th-ctl present it. Kept in a file
// (not on a command line, where `ps` would show it).
#pragma once

#include <string>
#include <vector>

#include "core/result.h"

namespace th::net {

// A token file (a regular file) holds one token per line (blanks around it, a byte order mark and
// empty lines ignored). A client
// presents the first; th-server accepts any of them, so that a token can be rotated: add the new
// line, SIGHUP th-server, move the clients over, remove the old line, SIGHUP again.
// kInvalidArgument if the file is unreadable or holds no token.
Result<std::vector<std::string>> read_token_lines(const std::string& path);
// The first token of the file (what a client presents).
Result<std::string> read_token_file(const std::string& path);

}  // namespace th::net
