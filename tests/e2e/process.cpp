#include "process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <thread>

namespace th::e2e {

Process::Process(std::vector<std::string> argv, std::string log_path)
    : argv_(std::move(argv)), log_path_(std::move(log_path)) {
  int in[2];
  int out[2];
  if (::pipe2(in, O_CLOEXEC) != 0 || ::pipe2(out, O_CLOEXEC) != 0) throw std::runtime_error("pipe");
  pid_ = ::fork();
  if (pid_ < 0) throw std::runtime_error("fork");
  if (pid_ == 0) {
    ::dup2(in[0], 0);
    ::dup2(out[1], 1);
    const int log = ::open(log_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (log >= 0) ::dup2(log, 2);
    std::vector<char*> args;
    for (auto& arg : argv_) args.push_back(arg.data());
    args.push_back(nullptr);
    ::execv(args[0], args.data());
    std::perror("execv");
    ::_exit(127);
  }
  ::close(in[0]);
  ::close(out[1]);
  stdin_fd_ = in[1];
  stdout_fd_ = out[0];
}

Process::~Process() {
  if (!exited_) {
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
  }
  ::close(stdin_fd_);
  ::close(stdout_fd_);
}

bool Process::read_line(std::string& line, int timeout_ms) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  for (;;) {
    const auto newline = buffer_.find('\n');
    if (newline != std::string::npos) {
      line = buffer_.substr(0, newline);
      buffer_.erase(0, newline + 1);
      lines_.push_back(line);
      return true;
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return false;
    pollfd ready{stdout_fd_, POLLIN, 0};
    if (::poll(&ready, 1, static_cast<int>(left.count())) <= 0) continue;
    char chunk[4096];
    const ssize_t got = ::read(stdout_fd_, chunk, sizeof chunk);
    if (got <= 0) return false;  // closed: the process exited
    buffer_.append(chunk, static_cast<std::size_t>(got));
  }
}

std::string Process::wait_for(const std::string& prefix, int timeout_ms) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  std::string line;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0 || !read_line(line, static_cast<int>(left.count()))) return "";
    if (line.rfind(prefix, 0) == 0) return line;
  }
}

void Process::read_available() {
  for (;;) {
    pollfd ready{stdout_fd_, POLLIN, 0};
    if (::poll(&ready, 1, 0) <= 0) break;
    char chunk[4096];
    const ssize_t got = ::read(stdout_fd_, chunk, sizeof chunk);
    if (got <= 0) break;
    buffer_.append(chunk, static_cast<std::size_t>(got));
  }
  for (auto newline = buffer_.find('\n'); newline != std::string::npos; newline = buffer_.find('\n')) {
    lines_.push_back(buffer_.substr(0, newline));
    buffer_.erase(0, newline + 1);
  }
}

void Process::send_line(const std::string& line) {
  const std::string data = line + "\n";
  if (::write(stdin_fd_, data.data(), data.size()) != static_cast<ssize_t>(data.size())) {
    throw std::runtime_error("cannot write to " + argv_[0]);
  }
}

void Process::signal(int signal_number) { ::kill(pid_, signal_number); }

void Process::kill9() {
  ::kill(pid_, SIGKILL);
  wait_exit(10'000);
}

int Process::wait_exit(int timeout_ms) {
  if (exited_) return exit_status_;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (std::chrono::steady_clock::now() < deadline) {
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      exited_ = true;
      exit_status_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      return exit_status_;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ::kill(pid_, SIGKILL);
  ::waitpid(pid_, nullptr, 0);
  exited_ = true;
  exit_status_ = -1;
  return -1;
}

std::string Process::describe() const {
  std::ostringstream text;
  text << "$";
  for (const auto& arg : argv_) text << " " << arg;
  text << "\n  stdout:";
  for (const auto& line : lines_) text << "\n    " << line;
  std::ifstream log(log_path_);
  std::string all((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
  if (all.size() > 3000) all = "..." + all.substr(all.size() - 3000);
  text << "\n  stderr:\n" << all;
  return text.str();
}

}  // namespace th::e2e
