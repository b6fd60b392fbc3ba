// Opens a handle against a server that is not there: the installed library must load, parse the
// options and answer with a typed error within the open deadline.
#include <tensorhub/client.h>

#include <iostream>

int main() {
  th::ClientOptions options;
  options.servers = {"127.0.0.1:1"};  // nothing listens on port 1
  options.token = "t";
  options.model = "m";
  options.replica = "r";
  options.open_timeout_ms = 300;
  // Every public value type is reachable from tensorhub/ alone.
  options.retention.keep_latest = 1;
  th::WaitPredicate predicate{th::WaitPredicate::Kind::kRoleHolds, 1, 1, "rollout"};
  th::ListSnapshot snapshot;
  snapshot.latest = predicate.version;
  std::cout << "consumer: " << th::dtype_name(th::DType::kBFloat16) << ", "
            << th::update_status_name(th::UpdateStatus::kNotYet) << ", latest " << *snapshot.latest << "\n";
  auto handle = th::Handle::open(options);
  if (handle.ok()) return 1;
  std::cout << "consumer: open failed as expected: " << th::errc_name(handle.error().code) << "\n";
  return handle.error().code == th::Errc::kUnavailable ? 0 : 1;
}
