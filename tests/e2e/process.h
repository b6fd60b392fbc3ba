// Child processes for the end-to-end tests: spawn with pipes, read their output line by line with
// deadlines, write to their stdin, kill -9. Every child is killed and reaped when its Process goes
// out of scope, so a failing test leaves nothing running.
#pragma once

#include <string>
#include <vector>

namespace th::e2e {

class Process {
 public:
  // Starts `argv[0]` with `argv`; stderr goes to `log_path` (kept for failure reports).
  Process(std::vector<std::string> argv, std::string log_path);
  ~Process();
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;

  // The next line that starts with `prefix`, skipping others (kept in lines()); "" if none came
  // within the timeout or the process closed its output first.
  std::string wait_for(const std::string& prefix, int timeout_ms);
  // Takes every complete line the process has written so far, without waiting (into lines()), so
  // that a long-running process never blocks on a full pipe.
  void read_available();
  void send_line(const std::string& line);
  void kill9();
  void signal(int signal_number);  // sends it, does not wait
  // Waits for the exit; returns the exit status, or -1 on timeout (the process is then killed).
  int wait_exit(int timeout_ms);

  const std::vector<std::string>& lines() const { return lines_; }
  std::string describe() const;  // its command, the lines seen and the tail of its stderr
  const std::string& log_path() const { return log_path_; }  // its stderr
  int pid() const { return pid_; }

 private:
  bool read_line(std::string& line, int timeout_ms);

  std::vector<std::string> argv_;
  std::string log_path_;
  int pid_ = -1;
  int stdin_fd_ = -1;
  int stdout_fd_ = -1;
  std::string buffer_;
  std::vector<std::string> lines_;
  bool exited_ = false;
  int exit_status_ = 0;
};

}  // namespace th::e2e
