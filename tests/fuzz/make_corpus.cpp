// Writes the fuzzers' seed corpora (tests/fuzz/corpus/<target>/): well-formed inputs of every kind,
// from which libFuzzer mutates. Run once when the formats change:  make_corpus tests/fuzz/corpus
#include <capnp/message.h>
#include <capnp/serialize.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>

#include "core/patch.h"
#include "net/heartbeat.h"
#include "net/wire.h"

namespace {

namespace fs = std::filesystem;

void write(const fs::path& path, const void* data, std::size_t size) {
  std::ofstream(path, std::ios::binary).write(static_cast<const char*>(data), static_cast<std::streamsize>(size));
}

template <typename Wire, typename Value>
void write_message(const fs::path& path, const Value& value) {
  capnp::MallocMessageBuilder builder;
  th::net::encode(value, builder.initRoot<Wire>());
  const auto words = capnp::messageToFlatArray(builder);
  write(path, words.begin(), words.size() * sizeof(capnp::word));
}

th::LayoutRef layout() {
  return th::ShardLayout::make({th::TensorSpec{"w", th::DType::kBFloat16, 4096}, th::TensorSpec{"b", th::DType::kFloat32, 64}})
      .value();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: make_corpus DIR\n";
    return 2;
  }
  const fs::path root = argv[1];
  for (const char* target : {"fuzz_wire", "fuzz_heartbeat", "fuzz_data_request", "fuzz_frames", "fuzz_patch"}) {
    fs::create_directories(root / target);
  }
  using th::net::ToHubMessage;
  const fs::path wire = root / "fuzz_wire";
  th::OpenRequest open;
  open.model = "m";
  open.replica = "r";
  open.incarnation = 1;
  open.num_shards = 2;
  open.datacenter = "dc0";
  open.role = "rollout";
  open.data_endpoint = "10.0.0.1:7000";
  write_message<th::wire::ToHub>(wire / "open", ToHubMessage{th::Request{7, 0, open}});
  auto checksums = std::make_shared<th::Checksums>(th::Checksums{1, 2});
  write_message<th::wire::ToHub>(wire / "publish", ToHubMessage{th::Request{7, 1, th::PublishRequest{3, layout(), checksums}}});
  write_message<th::wire::ToHub>(wire / "update", ToHubMessage{th::Request{7, 2, th::UpdateRequest{th::Selector::latest(), layout()}}});
  write_message<th::wire::ToHub>(wire / "heartbeat", ToHubMessage{th::Report{7, th::Heartbeat{}, 1}});
  write_message<th::wire::ToHub>(wire / "done", ToHubMessage{th::Report{7, th::TransferDone{9, 1}, 1}});
  th::StartRead read{9, 1, 2, 3, 0, th::SourceRef{"t", 1, "dc0", "10.0.0.2:7000", th::CopyKind::kPrimary, true},
                     checksums, 0, nullptr, th::GrantSecret{1, 2}};
  write_message<th::wire::Effect>(wire / "start-read", th::Effect{7, read, 1});
  write_message<th::wire::Effect>(wire / "serve-read",
                                  th::Effect{7, th::ServeRead{9, 1, 3, th::CopyKind::kOffload, 0, "r", {3, 4}}, 1});
  write_message<th::wire::Effect>(wire / "reply", th::Effect{7, th::Reply{2, th::UpdateOk{th::UpdateStatus::kUpdated, 3, "t"}}, 1});

  const auto beat = th::net::encode(th::net::seal(7, 1, 1, th::net::HeartbeatKey{1, 2}));  // fuzz_heartbeat's key
  write(root / "fuzz_heartbeat" / "beat", beat.data(), beat.size());

  // Data-plane request frames (net/data_frames.h): magic "TDP2", epoch, transfer, region, wait,
  // offset, length, secret (the fuzz target's grant secret for the valid ones).
  struct Frame {
    std::uint32_t magic = 0x32504454;
    std::uint32_t epoch;
    std::uint64_t transfer;
    std::uint32_t region;
    std::uint32_t wait_for_bytes;
    std::uint64_t offset;
    std::uint64_t length;
    std::uint64_t secret[2];
  };
  static_assert(sizeof(Frame) == 56);
  const std::uint64_t secret[2] = {0x243f6a8885a308d3ULL, 0x13198a2e03707344ULL};
  const Frame frames[] = {
      {0x32504454, 1, 7, 0, 0, 0, 4096, {secret[0], secret[1]}},   // a complete copy
      {0x32504454, 1, 8, 1, 1, 0, 4096, {secret[0], secret[1]}},   // a partial one, waiting for bytes
      {0x32504454, 1, 7, 0, 0, 65000, 4096, {secret[0], secret[1]}},  // past the region's end
      {0x32504454, 2, 7, 0, 0, 0, 4096, {secret[0], secret[1]}},   // another epoch
      {0x32504454, 1, 7, 0, 0, 0, 4096, {0, 0}},                   // no secret
      // CUDA IPC handle requests (net/ipc.h, magic "TDI1": first region, region count in the
      // place of region and wait) of the target's GPU grant (9, 1).
      {0x31494454, 1, 9, 0, 2, 0, 0, {secret[0], secret[1]}},      // both regions' handles
      {0x31494454, 1, 9, 0, 2, 0, 0, {0, 0}},                      // no secret
      {0x31494454, 1, 9, 1, 0xffffffffu, 0, 0, {secret[0], secret[1]}},  // a page past the end
  };
  for (std::size_t i = 0; i < std::size(frames); ++i) {
    write(root / "fuzz_data_request" / ("frame-" + std::to_string(i)), &frames[i], sizeof frames[i]);
  }
  write(root / "fuzz_data_request" / "two-frames", frames, 2 * sizeof(Frame));
  // Framed connections (net/frames.h): a piece-size byte, then a client's hello and messages frames
  // back to back, and a server's welcome and effects.
  {
    std::string client(1, '\x07');
    auto append = [](std::string& out, capnp::MessageBuilder& builder) {
      const auto words = capnp::messageToFlatArray(builder);
      out.append(reinterpret_cast<const char*>(words.begin()), words.size() * sizeof(capnp::word));
    };
    capnp::MallocMessageBuilder hello;
    auto fields = hello.initRoot<th::wire::ClientFrame>().initHello();
    fields.setToken("token");
    fields.setClientName("r/0");
    fields.setClient(7);
    const std::string secret(16, 's');
    fields.setClientSecret(kj::arrayPtr(reinterpret_cast<const kj::byte*>(secret.data()), secret.size()));
    append(client, hello);
    capnp::MallocMessageBuilder messages;
    auto frame = messages.initRoot<th::wire::ClientFrame>();
    auto list = frame.initMessages(2);
    th::net::encode(ToHubMessage{th::Request{7, 0, open}}, list[0]);
    th::net::encode(ToHubMessage{th::Report{7, th::Heartbeat{}, 1}}, list[1]);
    frame.setAck(1);
    append(client, messages);
    write(root / "fuzz_frames" / "client", client.data(), client.size());
    std::string server(1, '\x3f');
    capnp::MallocMessageBuilder welcome;
    welcome.initRoot<th::wire::ServerFrame>().initWelcome().setHeartbeatTimeoutMs(10000);
    append(server, welcome);
    capnp::MallocMessageBuilder effects;
    auto answer = effects.initRoot<th::wire::ServerFrame>();
    th::net::encode(th::Effect{7, read, 1}, answer.initEffects(1)[0]);
    answer.setAck(1);
    append(server, effects);
    write(root / "fuzz_frames" / "server", server.data(), server.size());
  }
  {
    // Patches: one sparse over two blocks and a bit of bf16 (positions as gaps), one dense in a
    // small tensor (a bitmap), and the empty tensor's.
    struct Seed {
      const char* name;
      std::uint64_t elements;
      std::uint64_t every;
    };
    for (const Seed& seed : {Seed{"gaps", (1u << 19) + 100, 50000}, Seed{"bitmap", 1000, 3}}) {
      th::PatchBuilder builder(2, seed.elements * 2, 0x5eed, ~std::uint64_t{0});
      const std::byte value[2] = {std::byte{0x3f}, std::byte{0x80}};
      for (std::uint64_t at = 5; at < seed.elements; at += seed.every) builder.changed(at, value);
      const auto patch = builder.finish();
      write(root / "fuzz_patch" / seed.name, patch->data(), patch->size());
    }
    const auto empty = th::PatchBuilder(4, 0, 1, 1000).finish();
    write(root / "fuzz_patch" / "empty", empty->data(), empty->size());
  }
  std::cout << "make_corpus: wrote seeds under " << root << "\n";
  return 0;
}
