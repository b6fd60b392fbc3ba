#include "net/tls.h"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <sstream>
#include <vector>

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

namespace th::net {
namespace {

// A CA file with more certificates than this is not a CA file.
constexpr std::size_t kCaCertificatesMax = 64;
// Certificates and keys are a few KiB; a bigger file is a mistake (or /dev/zero).
constexpr std::streamsize kPemFileBytesMax = 1 << 20;

Result<std::string> read_pem_file(const std::string& path, const std::string& what) {
  std::ifstream file(path, std::ios::binary);
  if (!file) return make_error(Errc::kInvalidArgument, "cannot read the " + what + " file " + path);
  std::string text(static_cast<std::size_t>(kPemFileBytesMax) + 1, '\0');
  file.read(text.data(), kPemFileBytesMax + 1);
  if (file.gcount() > kPemFileBytesMax) {
    return make_error(Errc::kInvalidArgument, "the " + what + " file " + path + " is larger than 1 MiB");
  }
  text.resize(static_cast<std::size_t>(file.gcount()));
  return text;
}

std::string openssl_reason() {
  std::string reason;
  while (const unsigned long code = ERR_get_error()) {
    char line[256];
    ERR_error_string_n(code, line, sizeof line);
    reason += reason.empty() ? line : std::string("; ") + line;
  }
  return reason.empty() ? "no PEM block of that kind" : reason;
}

struct BioFree {
  void operator()(BIO* bio) const { BIO_free(bio); }
};
struct X509Free {
  void operator()(X509* certificate) const { X509_free(certificate); }
};
struct KeyFree {
  void operator()(EVP_PKEY* key) const { EVP_PKEY_free(key); }
};
using BioPtr = std::unique_ptr<BIO, BioFree>;
using X509Ptr = std::unique_ptr<X509, X509Free>;
using KeyPtr = std::unique_ptr<EVP_PKEY, KeyFree>;

BioPtr memory_bio(const std::string& text) {
  BioPtr bio(BIO_new_mem_buf(text.data(), static_cast<int>(text.size())));
  if (bio == nullptr) throw std::bad_alloc();
  return bio;
}

// Every certificate of a PEM text, in order.
std::vector<X509Ptr> parse_certificates(const std::string& text) {
  std::vector<X509Ptr> certificates;
  BioPtr bio = memory_bio(text);
  while (certificates.size() <= kCaCertificatesMax) {
    X509Ptr certificate(PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr));
    if (certificate == nullptr) break;
    certificates.push_back(std::move(certificate));
  }
  ERR_clear_error();  // the read past the last block reports "no start line"
  return certificates;
}

std::vector<kj::byte> to_der(X509* certificate) {
  const int length = i2d_X509(certificate, nullptr);
  TH_ASSERT(length > 0);
  std::vector<kj::byte> der(static_cast<std::size_t>(length));
  kj::byte* out = der.data();
  TH_ASSERT(i2d_X509(certificate, &out) == length);
  return der;
}

Error kj_refusal(const std::string& what, const kj::Exception& exception) {
  return make_error(Errc::kInvalidArgument, what + ": " + exception.getDescription().cStr());
}

// Reads `first` before the inner stream; everything else goes straight to it. (kj owns streams
// through kj::Own, which deletes the most-derived type: the base's non-virtual destructor is fine.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wnon-virtual-dtor"
class FirstBytesStream final : public kj::AsyncIoStream {
 public:
  FirstBytesStream(kj::Array<kj::byte> first, kj::Own<kj::AsyncIoStream> inner)
      : first_(kj::mv(first)), inner_(kj::mv(inner)) {}

  kj::Promise<std::size_t> tryRead(void* buffer, std::size_t min_bytes, std::size_t max_bytes) override {
    const std::size_t left = first_.size() - taken_;
    if (left == 0) return inner_->tryRead(buffer, min_bytes, max_bytes);
    const std::size_t copied = std::min(left, max_bytes);
    std::memcpy(buffer, first_.begin() + taken_, copied);
    taken_ += copied;
    if (copied >= min_bytes) return copied;
    return inner_->tryRead(static_cast<kj::byte*>(buffer) + copied, min_bytes - copied, max_bytes - copied)
        .then([copied](std::size_t more) { return copied + more; });
  }
  kj::Promise<void> write(const void* buffer, std::size_t size) override { return inner_->write(buffer, size); }
  kj::Promise<void> write(kj::ArrayPtr<const kj::ArrayPtr<const kj::byte>> pieces) override {
    return inner_->write(pieces);
  }
  kj::Promise<void> whenWriteDisconnected() override { return inner_->whenWriteDisconnected(); }
  void shutdownWrite() override { inner_->shutdownWrite(); }
  void abortRead() override { inner_->abortRead(); }
  void getsockopt(int level, int option, void* value, kj::uint* length) override {
    inner_->getsockopt(level, option, value, length);
  }
  void setsockopt(int level, int option, const void* value, kj::uint length) override {
    inner_->setsockopt(level, option, value, length);
  }
  void getsockname(struct sockaddr* address, kj::uint* length) override { inner_->getsockname(address, length); }
  void getpeername(struct sockaddr* address, kj::uint* length) override { inner_->getpeername(address, length); }

 private:
  kj::Array<kj::byte> first_;
  std::size_t taken_ = 0;
  kj::Own<kj::AsyncIoStream> inner_;
};
#pragma GCC diagnostic pop

}  // namespace

kj::Own<kj::AsyncIoStream> with_first_bytes(kj::Array<kj::byte> first, kj::Own<kj::AsyncIoStream> stream) {
  return kj::heap<FirstBytesStream>(kj::mv(first), kj::mv(stream));
}

Result<std::unique_ptr<kj::TlsContext>> make_server_tls(const std::string& certificate_file,
                                                        const std::string& key_file) {
  auto certificate_text = read_pem_file(certificate_file, "certificate");
  if (!certificate_text.ok()) return certificate_text.error();
  auto key_text = read_pem_file(key_file, "key");
  if (!key_text.ok()) return key_text.error();

  ERR_clear_error();
  const auto chain = parse_certificates(certificate_text.value());
  if (chain.empty()) {
    return make_error(Errc::kInvalidArgument, "the certificate file " + certificate_file + " holds no PEM certificate");
  }
  KeyPtr key(PEM_read_bio_PrivateKey(memory_bio(key_text.value()).get(), nullptr, nullptr, nullptr));
  if (key == nullptr) {
    return make_error(Errc::kInvalidArgument,
                      "the key file " + key_file + " holds no unencrypted PEM private key (" + openssl_reason() + ")");
  }
  if (X509_check_private_key(chain.front().get(), key.get()) != 1) {
    ERR_clear_error();
    return make_error(Errc::kInvalidArgument,
                      "the key in " + key_file + " does not belong to the certificate in " + certificate_file);
  }
  try {
    kj::TlsKeypair keypair{kj::TlsPrivateKey(kj::StringPtr(key_text.value().c_str())),
                           kj::TlsCertificate(kj::StringPtr(certificate_text.value().c_str()))};
    kj::TlsContext::Options options;
    options.useSystemTrustStore = false;  // the server trusts nobody: clients prove themselves with the token
    options.defaultKeypair = keypair;     // copied (reference-counted) into the context
    return std::make_unique<kj::TlsContext>(kj::mv(options));
  } catch (const kj::Exception& exception) {
    return kj_refusal("cannot use " + certificate_file + " and " + key_file, exception);
  }
}

Result<std::unique_ptr<kj::TlsContext>> make_client_tls(const std::string& ca_file) {
  auto text = read_pem_file(ca_file, "CA");
  if (!text.ok()) return text.error();
  ERR_clear_error();
  const auto authorities = parse_certificates(text.value());
  if (authorities.empty()) {
    return make_error(Errc::kInvalidArgument, "the CA file " + ca_file + " holds no PEM certificate");
  }
  if (authorities.size() > kCaCertificatesMax) {
    return make_error(Errc::kInvalidArgument, "the CA file " + ca_file + " holds more than " +
                                                  std::to_string(kCaCertificatesMax) + " certificates");
  }
  try {
    // kj adds only the first certificate of each TlsCertificate to the trust store: one per CA.
    std::vector<kj::TlsCertificate> trusted;
    for (const auto& authority : authorities) {
      const auto der = to_der(authority.get());
      trusted.emplace_back(kj::arrayPtr(der.data(), der.size()));
    }
    kj::TlsContext::Options options;
    options.useSystemTrustStore = false;
    options.trustedCertificates = kj::arrayPtr(trusted.data(), trusted.size());  // added to the store at once
    return std::make_unique<kj::TlsContext>(kj::mv(options));
  } catch (const kj::Exception& exception) {
    return kj_refusal("cannot use the CA file " + ca_file, exception);
  }
}

std::string tls_server_name(const std::string& address, const std::string& server_name) {
  if (!server_name.empty()) return server_name;
  std::string host = address.substr(0, address.rfind(':'));
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  return host;
}

bool is_certificate_refusal(const std::string& description) {
  // kj-tls's words when verification fails, and OpenSSL's when the handshake stops at the
  // certificate. (Not kj's "TLS peer provided no certificate": kj 0.9 also says that when the
  // connection merely ended mid-handshake.)
  return description.find("certificate is not trusted") != std::string::npos ||
         description.find("certificate verify failed") != std::string::npos;
}

}  // namespace th::net
