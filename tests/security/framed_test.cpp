// The security suite's attacks on framed connections (net/frames.h), libthclient's control path
// since issue 14: the limits that bound a Cap'n Proto RPC peer must bound a framed one too. The
// peer here is written against the wire format (plain sockets, Cap'n Proto's stream framing), not
// with net::FrameStream, so that it can send what FrameStream never would.
#include <capnp/message.h>
#include <capnp/serialize.h>
#include <sys/socket.h>

#include <chrono>
#include <memory>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "security_fixture.h"
#include "net/frames.h"
#include "net/socket.h"
#include "net/tensorhub.capnp.h"
#include "net/wire.h"

namespace th::e2e {
namespace {

std::string secret_of(char fill) { return std::string(16, fill); }

class FramedPeer {
 public:
  enum class Read { kFrame, kEnd, kTimeout };

  explicit FramedPeer(const std::string& server, bool magic = true)
      : socket_(net::connect_tcp(net::parse_endpoint(server), kHangGuardMs)) {
    if (magic) send_raw(net::kFramedMagic.data(), net::kFramedMagic.size());
  }

  void send_raw(const void* data, std::size_t bytes) { net::send_all(socket_, data, bytes); }

  void send(capnp::MessageBuilder& message) {
    const auto words = capnp::messageToFlatArray(message);
    send_raw(words.begin(), words.size() * sizeof(capnp::word));
  }

  void hello(const std::string& token, ClientId client, const std::string& secret) {
    capnp::MallocMessageBuilder message;
    auto hello = message.initRoot<wire::ClientFrame>().initHello();
    hello.setToken(token);
    hello.setClientName("framed-test");
    hello.setClient(client);
    hello.setClientSecret(kj::arrayPtr(reinterpret_cast<const kj::byte*>(secret.data()), secret.size()));
    send(message);
  }

  // One frame of `messages`, asking for `ack` (0: none).
  void messages(const std::vector<net::ToHubMessage>& messages, std::uint64_t ack) {
    capnp::MallocMessageBuilder message;
    auto frame = message.initRoot<wire::ClientFrame>();
    auto list = frame.initMessages(static_cast<unsigned>(messages.size()));
    for (unsigned i = 0; i < messages.size(); ++i) net::encode(messages[i], list[i]);
    frame.setAck(ack);
    send(message);
  }

  // The next frame from the server, within `timeout_ms`.
  Read read(int timeout_ms = kHangGuardMs) {
    net::set_io_timeout(socket_, timeout_ms);
    try {
      std::uint32_t head[2];
      if (!net::recv_all_or_eof(socket_, head, sizeof head)) return Read::kEnd;
      const std::size_t segments = head[0] + 1;
      if (segments > 64) throw net::SocketError("the server sent a segment table of " + std::to_string(segments));
      std::vector<std::uint32_t> sizes = {head[1]};
      sizes.resize(segments + (segments % 2 == 0 ? 1 : 0));  // padded to a word
      if (sizes.size() > 1) net::recv_all(socket_, sizes.data() + 1, (sizes.size() - 1) * sizeof(std::uint32_t));
      std::size_t words = 0;
      for (std::size_t i = 0; i < segments; ++i) words += sizes[i];
      const std::size_t table_words = segments / 2 + 1;
      frame_ = kj::heapArray<capnp::word>(table_words + words);
      auto* table = reinterpret_cast<std::uint32_t*>(frame_.begin());
      table[0] = head[0];
      std::memcpy(table + 1, sizes.data(), sizes.size() * sizeof(std::uint32_t));
      net::recv_all(socket_, frame_.begin() + table_words, words * sizeof(capnp::word));
      reader_.emplace(frame_.asPtr());
      return Read::kFrame;
    } catch (const net::SocketTimeout&) {
      return Read::kTimeout;
    } catch (const net::SocketError&) {
      return Read::kEnd;  // reset
    }
  }
  wire::ServerFrame::Reader frame() { return reader_->getRoot<wire::ServerFrame>(); }

  // Reads until a frame that satisfies `wanted`; false at the end of the stream or the guard.
  template <typename Wanted>
  bool read_until(Wanted&& wanted) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(kHangGuardMs);
    while (std::chrono::steady_clock::now() < deadline) {
      if (read(kHangGuardMs) != Read::kFrame) return false;
      if (wanted(frame())) return true;
    }
    return false;
  }

  // Whether the server ends the stream (after any frames) within the guard.
  bool ended() {
    for (;;) {
      switch (read()) {
        case Read::kEnd: return true;
        case Read::kTimeout: return false;
        case Read::kFrame: continue;
      }
    }
  }

  const net::Fd& socket() const { return socket_; }

 private:
  net::Fd socket_;
  kj::Array<capnp::word> frame_;
  std::optional<capnp::FlatArrayMessageReader> reader_;
};

bool welcomed(FramedPeer& peer) {
  return peer.read() == FramedPeer::Read::kFrame && peer.frame().isWelcome();
}

// A wrong token is answered with a refusal and the server closes its side; nothing else is taken
// on that connection.
TEST_F(Security, FramedAWrongTokenIsRefusedAndTheConnectionEnds) {
  const std::string server = start_server({"--log-level", "info"});
  FramedPeer guesser(server);
  guesser.hello("guess", 7, secret_of('g'));
  guesser.messages({net::ToHubMessage{Report{7, Heartbeat{}, 0}}}, 1);
  ASSERT_EQ(guesser.read(), FramedPeer::Read::kFrame);
  ASSERT_TRUE(guesser.frame().isRefused());
  EXPECT_NE(std::string(guesser.frame().getRefused().cStr()).find("wrong cluster token"), std::string::npos);
  EXPECT_TRUE(guesser.ended()) << "after refusing the token the server kept its side open";
  FramedPeer polite(server);
  polite.hello(kToken, 8, secret_of('p'));
  EXPECT_TRUE(welcomed(polite));
  EXPECT_TRUE(server_log_says(*servers_[0], "wrong cluster token", kHangGuardMs)) << server_log(*servers_[0]);
}

// Before the hello is accepted, a frame is bounded in size and messages are refused: a peer cannot
// make the server buffer a large frame or feed the hub without the token.
TEST_F(Security, FramedPeersCannotSendLargeFramesOrMessagesBeforeTheirHello) {
  const std::string server = start_server({"--log-level", "info"});
  {
    // A segment table declaring 64 MiB: refused from the table, before the bytes come.
    FramedPeer large(server);
    const std::uint32_t table[2] = {0, 8u << 20};
    large.send_raw(table, sizeof table);
    EXPECT_TRUE(large.ended());
  }
  {
    FramedPeer eager(server);
    eager.messages({net::ToHubMessage{Report{9, Heartbeat{}, 0}}}, 1);
    EXPECT_TRUE(eager.ended());
  }
  {
    FramedPeer garbage(server);
    const std::uint32_t table[4] = {0, 1, 0xffffffffu, 0xffffffffu};  // a pointer out of bounds
    garbage.send_raw(table, sizeof table);
    EXPECT_TRUE(garbage.ended());
  }
  {
    FramedPeer twice(server);
    twice.hello(kToken, 10, secret_of('t'));
    twice.hello(kToken, 10, secret_of('t'));
    EXPECT_TRUE(twice.ended());
  }
  FramedPeer polite(server);
  polite.hello(kToken, 11, secret_of('p'));
  EXPECT_TRUE(welcomed(polite));
  EXPECT_TRUE(running(*servers_[0]));
}

// As for RPC connections: a client id belongs to the connection that claimed it; another's
// messages naming it are refused (with a notice) and never reach the hub.
TEST_F(Security, FramedAClientIdBelongsToTheConnectionThatClaimedIt) {
  const std::string server = start_server({"--log-level", "info"});
  constexpr ClientId kVictim = 0x4321;
  FramedPeer victim(server);
  victim.hello(kToken, kVictim, secret_of('v'));
  ASSERT_TRUE(welcomed(victim));

  FramedPeer thief(server);
  thief.hello(kToken, kVictim, secret_of('t'));
  ASSERT_EQ(thief.read(), FramedPeer::Read::kFrame);
  ASSERT_TRUE(thief.frame().isRefused());
  EXPECT_NE(std::string(thief.frame().getRefused().cStr()).find("permission denied"), std::string::npos);

  FramedPeer impostor(server);
  impostor.hello(kToken, 0x9999, secret_of('i'));
  ASSERT_TRUE(welcomed(impostor));
  impostor.messages({net::ToHubMessage{Report{kVictim, Heartbeat{}, 0}}}, 5);
  bool noticed = false;
  bool acked = false;
  ASSERT_TRUE(impostor.read_until([&](wire::ServerFrame::Reader frame) {
    noticed = noticed || (frame.isNotice() && std::string(frame.getNotice().cStr()).find("names client") != std::string::npos);
    acked = acked || frame.getAck() == 5;
    return noticed && acked;
  })) << "noticed " << noticed << ", acked " << acked;

  // The victim's own probe is still answered on its connection.
  victim.messages({}, 77);
  EXPECT_TRUE(victim.read_until([](wire::ServerFrame::Reader frame) { return frame.getAck() == 77; }));
}

// A framed peer that reads nothing: the server writes until the socket is full, then keeps at most
// --effects-backlog-max effects for it and disconnects it, serving everyone else on.
TEST_F(Security, FramedAPeerThatReadsNothingIsClosedWhenItFallsTooFarBehind) {
  constexpr int kBacklogMax = 100;
  const std::string server = start_server({"--effects-backlog-max", std::to_string(kBacklogMax)});
  FramedPeer stuck(server);
  net::set_buffer_bytes(stuck.socket(), 4096);
  stuck.hello(kToken, 93, secret_of('s'));
  // A client that never opened: every report is answered "unknown client, re-open" (an effect).
  const std::vector<net::ToHubMessage> reports(4096, net::ToHubMessage{Report{93, Heartbeat{}, 0}});
  bool refused = false;
  for (int frames = 0; frames < 400 && !refused; ++frames) {
    try {
      stuck.messages(reports, 0);
    } catch (const net::SocketError&) {
      refused = true;  // the server closed the connection
    }
    refused = refused || server_log(*servers_[0]).find("effects behind: disconnecting it") != std::string::npos;
  }
  EXPECT_TRUE(refused) << "1.6 M effects for a peer that reads nothing were all kept";
  ASSERT_TRUE(running(*servers_[0]));
  Process& trainer = worker({server}, "trainer", {}, {"publish:1"});
  expect(trainer, "publish ok 1");
}

// Attack review finds (issue 14): after the hello, a table declaring a 64 MiB frame made the server
// reserve and zero it at once (16 bytes for 64 MiB, per connection), and one declaring millions of
// segments cost a pass over the table per read. Now the buffer grows with the bytes that come, and
// more than 512 segments close the connection.
TEST_F(Security, FramedDeclaredSizesDoNotMakeTheServerReserveMemory) {
  constexpr int kPeers = 40;
  const std::string server = start_server();
  const long rss_before_kb = status_field(servers_[0]->pid(), "VmRSS");
  std::vector<std::unique_ptr<FramedPeer>> peers;
  for (int i = 0; i < kPeers; ++i) {
    peers.push_back(std::make_unique<FramedPeer>(server));
    peers.back()->hello(kToken, 500 + static_cast<ClientId>(i), secret_of('m'));
    ASSERT_TRUE(welcomed(*peers.back()));
    const std::uint32_t table[4] = {0, (8u << 20) - 8, 0, 0};  // one segment of ~64 MiB, then one word of it
    peers.back()->send_raw(table, sizeof table);
  }
  FramedPeer segments(server);
  segments.hello(kToken, 600, secret_of('n'));
  ASSERT_TRUE(welcomed(segments));
  const std::uint32_t many[2] = {(8u << 20) - 1, 1};  // 8 M segments
  segments.send_raw(many, sizeof many);
  EXPECT_TRUE(segments.ended()) << "a table of 8 M segments was taken";
  ctl(server);  // every peer's bytes have been read by the time it answers another connection
  const long rss_after_kb = status_field(servers_[0]->pid(), "VmRSS");
  EXPECT_LT(rss_after_kb - rss_before_kb, 200 * 1024) << kPeers << " declared 64 MiB frames grew the server by "
                                                      << (rss_after_kb - rss_before_kb) / 1024 << " MiB";
}

// A refused claim (the right token, another's client id) closes soon even if the peer keeps sending
// (its frames are not read, so they must not keep it alive); a client that half-closes after its
// frames still gets their answers.
TEST_F(Security, FramedARefusedPeerIsClosedAndAHalfClosingOneIsAnswered) {
  const std::string server = start_server();
  FramedPeer holder(server);
  holder.hello(kToken, 700, secret_of('h'));
  ASSERT_TRUE(welcomed(holder));
  FramedPeer thief(server);
  thief.hello(kToken, 700, secret_of('t'));
  for (int i = 0; i < 30; ++i) {
    try {
      thief.messages({}, 1);
    } catch (const net::SocketError&) {
      break;  // closed
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_TRUE(thief.ended()) << "a refused peer that keeps sending was kept open";

  FramedPeer brief(server);
  brief.hello(kToken, 701, secret_of('b'));
  brief.messages({}, 9);
  ASSERT_EQ(::shutdown(brief.socket().get(), SHUT_WR), 0);
  bool welcome = false;
  bool acked = false;
  while (brief.read() == FramedPeer::Read::kFrame) {
    welcome = welcome || brief.frame().isWelcome();
    acked = acked || brief.frame().getAck() == 9;
  }
  EXPECT_TRUE(welcome && acked) << "welcome " << welcome << ", ack " << acked;
}

// A framed peer's probe (an empty frame asking for an ack) is answered, and a Cap'n Proto RPC peer
// (th-ctl) is served on the same port: the server tells them apart by the first 8 bytes.
TEST_F(Security, FramedAndRpcPeersShareThePort) {
  const std::string server = start_server();
  FramedPeer framed(server);
  framed.hello(kToken, 31, secret_of('f'));
  ASSERT_TRUE(welcomed(framed));
  framed.messages({}, 3);
  EXPECT_TRUE(framed.read_until([](wire::ServerFrame::Reader frame) { return frame.getAck() == 3; }));
  EXPECT_NE(ctl(server).find("th-server "), std::string::npos);
  // Fewer than 8 bytes and silence: neither protocol; closed at the auth deadline, not taken.
  FramedPeer quiet(server, /*magic=*/false);
  quiet.send_raw("TH", 2);
  EXPECT_EQ(quiet.read(300), FramedPeer::Read::kTimeout);
}

}  // namespace
}  // namespace th::e2e
