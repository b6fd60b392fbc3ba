// The cluster token: th-server checks it at connect; clients and th-ctl present it. Kept in a file
// (not on a command line, where `ps` would show it).
#pragma once

#include <string>

#include "core/result.h"

namespace th::net {

// The file's contents without trailing whitespace; kInvalidArgument if unreadable or empty.
Result<std::string> read_token_file(const std::string& path);

}  // namespace th::net
