#include "net/token.h"

#include <fstream>
#include <sstream>

namespace th::net {

Result<std::string> read_token_file(const std::string& path) {
  std::ifstream file(path);
  if (!file) return make_error(Errc::kInvalidArgument, "cannot read the token file " + path);
  std::stringstream text;
  text << file.rdbuf();
  std::string token = text.str();
  while (!token.empty() && (token.back() == '\n' || token.back() == '\r' || token.back() == ' ')) token.pop_back();
  if (token.empty()) return make_error(Errc::kInvalidArgument, "the token file " + path + " is empty");
  return token;
}

}  // namespace th::net
