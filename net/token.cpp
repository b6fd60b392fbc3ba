#include "net/token.h"

#include <fstream>
#include <sstream>

namespace th::net {

Result<std::vector<std::string>> read_token_lines(const std::string& path) {
  std::ifstream file(path);
  if (!file) return make_error(Errc::kInvalidArgument, "cannot read the token file " + path);
  std::vector<std::string> tokens;
  for (std::string line; std::getline(file, line);) {
    while (!line.empty() && (line.back() == '\r' || line.back() == ' ' || line.back() == '\t')) line.pop_back();
    if (!line.empty()) tokens.push_back(std::move(line));
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
