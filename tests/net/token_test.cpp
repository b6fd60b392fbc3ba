// The token file: one token per line, what editors add around them ignored, only regular files.
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "net/token.h"

namespace th::net {
namespace {

class TokenFile : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() / ("th-token-" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string write(const std::string& text) {
    const auto path = dir_ / "token";
    std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
    return path.string();
  }
  std::filesystem::path dir_;
};

TEST_F(TokenFile, TakesOneTokenPerLineWithoutWhatEditorsAdd) {
  const auto tokens = read_token_lines(write("\xEF\xBB\xBF  old-token \r\n\n\tnew-token\t\r\n   \n"));
  ASSERT_TRUE(tokens.ok()) << tokens.error().detail;
  EXPECT_EQ(tokens.value(), (std::vector<std::string>{"old-token", "new-token"}));
  EXPECT_EQ(read_token_file(write("only\n")).value(), "only");
  EXPECT_EQ(read_token_file(write("first\nsecond\n")).value(), "first");  // what a client presents
}

TEST_F(TokenFile, RefusesEmptyFilesAndWhatIsNotARegularFile) {
  EXPECT_NE(read_token_lines(write(" \r\n\n")).error().detail.find("is empty"), std::string::npos);
  EXPECT_NE(read_token_lines(dir_.string()).error().detail.find("not a regular file"), std::string::npos);
  const auto fifo = dir_ / "fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  // (Opening it would block until a writer came: it is refused before that.)
  EXPECT_NE(read_token_lines(fifo.string()).error().detail.find("not a regular file"), std::string::npos);
  EXPECT_EQ(read_token_lines((dir_ / "missing").string()).error().code, Errc::kInvalidArgument);
}

}  // namespace
}  // namespace th::net
