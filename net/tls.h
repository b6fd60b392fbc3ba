// TLS for the control connection (kj-tls over OpenSSL).
//
// th-server presents a certificate and its key; libthclient and th-ctl trust the CAs of one PEM file
// (not the system's store: a training cluster's server certificate comes from its own CA) and check
// the certificate's name. The data plane stays clear text for throughput; its grants are capabilities
// whose secrets travel only on the control connection (see the README's trust model).
#pragma once

#include <memory>
#include <string>

#include <kj/compat/tls.h>

#include "core/result.h"

namespace th::net {

// kInvalidArgument naming the file and OpenSSL's reason when a file is unreadable, is not PEM of the
// right kind, or the key does not belong to the certificate (OpenSSL would otherwise drop the key
// silently and fail every handshake later).
Result<std::unique_ptr<kj::TlsContext>> make_server_tls(const std::string& certificate_file,
                                                        const std::string& key_file);
// Trusts every certificate in `ca_file` (one or more PEM blocks) and nothing else.
Result<std::unique_ptr<kj::TlsContext>> make_client_tls(const std::string& ca_file);

// The name a client checks the server's certificate against: `server_name` when given, else the host
// of "host:port" (brackets of an IPv6 literal removed). kj-tls checks it as a DNS name, so a server
// reached by IP address needs the certificate's DNS name given here.
std::string tls_server_name(const std::string& address, const std::string& server_name);

// `stream` with `first` in front of it: th-server reads a connection's first bytes before it gives
// the connection a handshake turn, then hands TLS the stream with those bytes put back.
kj::Own<kj::AsyncIoStream> with_first_bytes(kj::Array<kj::byte> first, kj::Own<kj::AsyncIoStream> stream);

// Whether a failed client handshake was the server's certificate being refused (a configuration
// error or an impostor: retrying cannot help) rather than the network.
bool is_certificate_refusal(const std::string& description);

}  // namespace th::net
