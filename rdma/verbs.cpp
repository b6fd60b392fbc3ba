#include "rdma/verbs.h"

#include <poll.h>
#include <sched.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>

#include "core/assert.h"
#include "rdma/verbs_loader.h"

namespace th::rdma {
namespace {

// The one checking helper: a failed verbs call names itself and its errno.
[[noreturn]] void fail(const char* call, int error) {
  throw VerbsError(std::string(call) + " failed: " + std::strerror(error) + " (errno " + std::to_string(error) + ")");
}
void check(const char* call, int result) {
  // Verbs calls return 0 or an errno value (some return -1 and set errno).
  if (result != 0) fail(call, result > 0 ? result : errno);
}
template <typename T>
T* check_pointer(const char* call, T* result) {
  if (result == nullptr) fail(call, errno != 0 ? errno : EINVAL);
  return result;
}

struct DeviceList {
  int count = 0;
  ibv_device** devices = ibv_get_device_list(&count);
  ~DeviceList() {
    if (devices != nullptr) ibv_free_device_list(devices);
  }
};

bool is_ipv4_mapped(const Gid& gid) {
  for (int i = 0; i < 10; ++i) {
    if (gid[i] != 0) return false;
  }
  return gid[10] == 0xff && gid[11] == 0xff;
}

bool port_active(ibv_context* context) {
  ibv_port_attr attr{};
  return ibv_query_port(context, 1, &attr) == 0 && attr.state == IBV_PORT_ACTIVE;
}

}  // namespace

std::vector<std::string> device_names() {
  DeviceList list;
  std::vector<std::string> names;
  for (int i = 0; list.devices != nullptr && i < list.count; ++i) names.emplace_back(ibv_get_device_name(list.devices[i]));
  return names;
}

std::vector<DeviceInfo> list_devices() {
  DeviceList list;
  std::vector<DeviceInfo> devices;
  for (int i = 0; list.devices != nullptr && i < list.count; ++i) {
    DeviceInfo info;
    info.name = ibv_get_device_name(list.devices[i]);
    std::ifstream numa("/sys/class/infiniband/" + info.name + "/device/numa_node");
    if (!(numa >> info.numa_node)) info.numa_node = -1;
    if (ibv_context* context = ibv_open_device(list.devices[i])) {
      info.active = port_active(context);
      ibv_close_device(context);
    }
    devices.push_back(std::move(info));
  }
  return devices;
}

std::vector<std::string> choose_devices(std::vector<DeviceInfo> devices, int node) {
  std::sort(devices.begin(), devices.end(), [](const DeviceInfo& a, const DeviceInfo& b) { return a.name < b.name; });
  std::vector<std::string> near;
  std::vector<std::string> active;
  for (const DeviceInfo& device : devices) {
    if (!device.active) continue;
    active.push_back(device.name);
    if (node >= 0 && device.numa_node == node) near.push_back(device.name);
  }
  return near.empty() ? active : near;
}

int current_numa_node() {
  unsigned cpu = 0;
  unsigned node = 0;
  if (::getcpu(&cpu, &node) != 0) return -1;
  return static_cast<int>(node);
}

Device::Device(const std::string& name, int gid_index) {
  DeviceList list;
  if (std::optional<std::string> missing = verbs_unavailable()) throw VerbsError("no RDMA: " + *missing);
  if (list.devices == nullptr || list.count == 0) throw VerbsError("no RDMA device (ibv_get_device_list found none)");
  for (int i = 0; i < list.count && context_ == nullptr; ++i) {
    const std::string candidate = ibv_get_device_name(list.devices[i]);
    if (!name.empty() && candidate != name) continue;
    ibv_context* context = ibv_open_device(list.devices[i]);
    if (context == nullptr) {
      if (!name.empty()) fail(("ibv_open_device(" + name + ")").c_str(), errno);
      continue;
    }
    if (name.empty() && !port_active(context)) {
      ibv_close_device(context);
      continue;
    }
    context_ = context;
    name_ = candidate;
  }
  if (context_ == nullptr) {
    throw VerbsError(name.empty() ? "no RDMA device has an active port" : "no RDMA device named " + name);
  }
  try {
    ibv_device_attr device{};
    check("ibv_query_device", ibv_query_device(context_, &device));
    memory_windows_ = (device.device_cap_flags & (IBV_DEVICE_MEM_WINDOW_TYPE_2A | IBV_DEVICE_MEM_WINDOW_TYPE_2B)) != 0;
    max_read_atoms_ = static_cast<std::uint32_t>(std::max(1, std::min(device.max_qp_rd_atom, device.max_qp_init_rd_atom)));
    ibv_port_attr port_attr{};
    check("ibv_query_port", ibv_query_port(context_, port(), &port_attr));
    if (port_attr.state != IBV_PORT_ACTIVE) throw VerbsError(name_ + " port 1 is not active");
    lid_ = port_attr.lid;
    mtu_ = port_attr.active_mtu;
    gid_index_ = gid_index;
    if (gid_index_ < 0) {
      // RoCE v2 over IPv4 routes across subnets and is what a deployment sets up; fall back to 0.
      gid_index_ = 0;
      for (int index = 0; index < port_attr.gid_tbl_len; ++index) {
        ibv_gid_entry entry{};
        if (ibv_query_gid_ex(context_, port(), static_cast<std::uint32_t>(index), &entry, 0) != 0) continue;
        Gid raw;
        std::memcpy(raw.data(), entry.gid.raw, raw.size());
        if (entry.gid_type == IBV_GID_TYPE_ROCE_V2 && is_ipv4_mapped(raw)) {
          gid_index_ = index;
          break;
        }
      }
    }
    ibv_gid gid{};
    check("ibv_query_gid", ibv_query_gid(context_, port(), gid_index_, &gid));
    std::memcpy(gid_.data(), gid.raw, gid_.size());
    pd_ = check_pointer("ibv_alloc_pd", ibv_alloc_pd(context_));
  } catch (...) {
    ibv_close_device(context_);
    throw;
  }
}

Device::~Device() {
  if (pd_ != nullptr) ibv_dealloc_pd(pd_);
  ibv_close_device(context_);
}

MemoryRegion::MemoryRegion(const Device& device, void* base, std::uint64_t bytes, int access) {
  TH_REQUIRE(bytes > 0, "a registered region has bytes");
  mr_ = check_pointer("ibv_reg_mr", ibv_reg_mr(device.protection_domain(), base, bytes, access));
  begin_ = reinterpret_cast<std::uintptr_t>(base);
  bytes_ = bytes;
}

MemoryRegion::MemoryRegion(const Device& device, DmaBuf source, std::uintptr_t iova, std::uint64_t bytes, int access) {
  TH_REQUIRE(bytes > 0, "a registered region has bytes");
  TH_REQUIRE(source.fd >= 0, "a dma-buf registration needs the dma-buf");
  mr_ = check_pointer("ibv_reg_dmabuf_mr", ibv_reg_dmabuf_mr(device.protection_domain(), source.offset, bytes, iova,
                                                             source.fd, access));
  begin_ = iova;
  bytes_ = bytes;
}

MemoryRegion::~MemoryRegion() {
  // A failure here means a window is still bound to it (owners deallocate windows first): the
  // pages stay pinned, which is a leak, not a hazard. A destructor cannot throw; say it instead.
  const int result = ibv_dereg_mr(mr_);
  if (result != 0) {
    std::fprintf(stderr, "th rdma: ibv_dereg_mr failed: %s (a leaked registration)\n",
                 std::strerror(result > 0 ? result : errno));
  }
}

CompletionQueue::CompletionQueue(const Device& device, int entries) {
  channel_ = check_pointer("ibv_create_comp_channel", ibv_create_comp_channel(device.context()));
  cq_ = ibv_create_cq(device.context(), entries, nullptr, channel_, 0);
  if (cq_ == nullptr) {
    const int error = errno;
    ibv_destroy_comp_channel(channel_);
    fail("ibv_create_cq", error);
  }
}

CompletionQueue::~CompletionQueue() {
  ibv_destroy_cq(cq_);
  ibv_destroy_comp_channel(channel_);
}

int CompletionQueue::poll(ibv_wc* out, int count) {
  const int got = ibv_poll_cq(cq_, count, out);
  if (got < 0) fail("ibv_poll_cq", EIO);
  return got;
}

CompletionQueue::Woken CompletionQueue::wait(int timeout_ms, int watch) {
  if (!armed_) {
    check("ibv_req_notify_cq", ibv_req_notify_cq(cq_, 0));
    armed_ = true;
    // A completion that landed before the queue was armed raises no event: the caller polls first
    // and again after every wait, so it is not lost; report "maybe" at once.
    return {true, false};
  }
  pollfd entries[2] = {{channel_->fd, POLLIN, 0}, {watch, POLLIN, 0}};
  const int ready = ::poll(entries, watch >= 0 ? 2 : 1, timeout_ms);
  if (ready < 0 && errno != EINTR) fail("poll(completion channel)", errno);
  Woken woken;
  if (ready <= 0) return woken;
  woken.watched = watch >= 0 && entries[1].revents != 0;
  if (entries[0].revents != 0) {
    ibv_cq* cq = nullptr;
    void* context = nullptr;
    check("ibv_get_cq_event", ibv_get_cq_event(channel_, &cq, &context));
    ibv_ack_cq_events(cq, 1);
    armed_ = false;
    woken.completion = true;
  }
  return woken;
}

QueuePair::QueuePair(const Device& device, CompletionQueue& cq, std::uint32_t send_entries, std::uint32_t read_atoms)
    : device_(device), read_atoms_(std::clamp<std::uint32_t>(read_atoms, 1, 255)) {
  ibv_qp_init_attr init{};
  init.send_cq = cq.get();
  init.recv_cq = cq.get();
  init.qp_type = IBV_QPT_RC;
  init.sq_sig_all = 0;
  init.cap.max_send_wr = send_entries;
  init.cap.max_recv_wr = 1;
  init.cap.max_send_sge = 1;
  init.cap.max_recv_sge = 1;
  qp_ = check_pointer("ibv_create_qp", ibv_create_qp(device.protection_domain(), &init));
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_INIT;
  attr.pkey_index = 0;
  attr.port_num = device.port();
  attr.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ;
  const int result = ibv_modify_qp(qp_, &attr, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
  if (result != 0) {
    ibv_destroy_qp(qp_);
    rdma::fail("ibv_modify_qp(INIT)", result);
  }
}

QueuePair::~QueuePair() { ibv_destroy_qp(qp_); }

QueuePairAddress QueuePair::local_address(std::uint32_t packet_sequence) const {
  QueuePairAddress address;
  address.qp_number = qp_->qp_num;
  address.packet_sequence = packet_sequence & 0xffffff;
  address.lid = device_.lid();
  address.mtu = static_cast<std::uint8_t>(device_.active_mtu());
  address.gid = device_.gid();
  address.read_atoms = static_cast<std::uint8_t>(read_atoms_);
  return address;
}

void QueuePair::connect(const QueuePairAddress& local, const QueuePairAddress& remote, std::uint8_t timeout_exponent,
                        std::uint8_t retry_count) {
  TH_REQUIRE(remote.mtu >= IBV_MTU_256 && remote.mtu <= IBV_MTU_4096, "peer's MTU", remote.mtu);
  TH_REQUIRE(remote.read_atoms >= 1, "the peer takes READs");
  const auto atoms = static_cast<std::uint8_t>(std::min<std::uint32_t>(read_atoms_, remote.read_atoms));
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_RTR;
  attr.path_mtu = static_cast<ibv_mtu>(std::min(local.mtu, remote.mtu));
  attr.dest_qp_num = remote.qp_number;
  attr.rq_psn = remote.packet_sequence;
  attr.max_dest_rd_atomic = atoms;
  attr.min_rnr_timer = 12;
  attr.ah_attr.is_global = 1;
  std::memcpy(attr.ah_attr.grh.dgid.raw, remote.gid.data(), remote.gid.size());
  attr.ah_attr.grh.sgid_index = static_cast<std::uint8_t>(device_.gid_index());
  attr.ah_attr.grh.hop_limit = 64;
  attr.ah_attr.dlid = remote.lid;
  attr.ah_attr.port_num = device_.port();
  check("ibv_modify_qp(RTR)",
        ibv_modify_qp(qp_, &attr,
                      IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                          IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER));
  attr = ibv_qp_attr{};
  attr.qp_state = IBV_QPS_RTS;
  attr.timeout = timeout_exponent;
  attr.retry_cnt = retry_count;
  attr.rnr_retry = retry_count;
  attr.sq_psn = local.packet_sequence;
  attr.max_rd_atomic = atoms;
  check("ibv_modify_qp(RTS)", ibv_modify_qp(qp_, &attr,
                                            IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                                                IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC));
}

void QueuePair::fail() {
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_ERR;
  check("ibv_modify_qp(ERR)", ibv_modify_qp(qp_, &attr, IBV_QP_STATE));
}

MemoryWindow::MemoryWindow(const Device& device) {
  mw_ = check_pointer("ibv_alloc_mw", ibv_alloc_mw(device.protection_domain(), IBV_MW_TYPE_2));
}

MemoryWindow::~MemoryWindow() { ibv_dealloc_mw(mw_); }

}  // namespace th::rdma
