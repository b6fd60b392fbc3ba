#include "net/token.h"

#include <sys/stat.h>

#include <fstream>
#include <sstream>

namespace th::net {

Status check_token_size(std::string_view token, const std::string& what) {
  if (token.empty()) return make_error(Errc::kInvalidArgument, what + " is empty");
  if (token.size() > kTokenBytesMax) {
    return make_error(Errc::kInvalidArgument, what + " is " + std::to_string(token.size()) + " bytes; a token has at most " +
                                                  std::to_string(kTokenBytesMax));
  }
  return Unit{};
}

Result<std::vector<std::string>> read_token_lines(const std::string& path) {
  // Only a regular file: opening a FIFO would block th-server's loop (SIGHUP re-reads the file).
  struct stat status {};
  if (::stat(path.c_str(), &status) != 0) return make_error(Errc::kInvalidArgument, "cannot read the token file " + path);
  if (!S_ISREG(status.st_mode)) {
    return make_error(Errc::kInvalidArgument, "the token file " + path + " is not a regular file");
  }
  std::ifstream file(path);
  if (!file) return make_error(Errc::kInvalidArgument, "cannot read the token file " + path);
  std::vector<std::string> tokens;
  for (std::string line; std::getline(file, line);) {
    // Editors add a byte order mark, CRs and stray blanks; none is part of a token.
    if (tokens.empty() && line.rfind("\xEF\xBB\xBF", 0) == 0) line.erase(0, 3);
    const auto blank = [](char c) { return c == '\r' || c == ' ' || c == '\t'; };
    while (!line.empty() && blank(line.back())) line.pop_back();
    std::size_t first = 0;
    while (first < line.size() && blank(line[first])) ++first;
    line.erase(0, first);
    if (line.empty()) continue;
    if (Status size = check_token_size(line, "token " + std::to_string(tokens.size() + 1) + " of " + path); !size.ok()) {
      return size.error();
    }
    tokens.push_back(std::move(line));
  }
  if (tokens.empty()) return make_error(Errc::kInvalidArgument, "the token file " + path + " is empty");
  return tokens;
}

Result<std::string> read_token_file(const std::string& path) {
  auto tokens = read_token_lines(path);
  if (!tokens.ok()) return tokens.error();
  return std::move(tokens.value().front());
}

}  // namespace th::net
