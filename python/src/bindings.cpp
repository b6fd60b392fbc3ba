// tensorhub._core: libthclient for Python (pybind11). The pure-Python package around it
// (python/tensorhub/) turns torch tensors and numpy arrays into registrations, codes into typed
// exceptions, and results into small classes; this file is the thin, careful part:
//   - every call that can block runs on a thread of its own while the calling thread waits without
//     the GIL, waking every 100 ms to let Python handle signals: Ctrl-C raises KeyboardInterrupt
//     within ~0.1 s, and the handle then interrupts the call (Handle::interrupt) and is done;
//   - errors come back as (code name, detail): tensorhub raises the exception class of that code.
#include <cctype>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>
#include <variant>

#include "tensorhub/client.h"

namespace py = pybind11;

namespace {

// What Python sees of an error: the code's name ("version-unavailable") and the detail.
struct CallError {
  std::string code;
  std::string detail;
};

[[noreturn]] void raise(const th::Error& error) { throw CallError{std::string(th::errc_name(error.code)), error.detail}; }

template <typename T>
T value_or_raise(th::Result<T> result) {
  if (!result.ok()) raise(result.error());
  return std::move(result).value();
}

void ok_or_raise(const th::Status& status) {
  if (!status.ok()) raise(status.error());
}

constexpr auto kSignalCheck = std::chrono::milliseconds(100);
// The thread that imported the module (Python's main thread, which also finalizes).
std::thread::id main_thread;

// Releases the GIL for its scope, and never takes it back while Python finalizes (a daemon
// thread blocked in a call at exit: taking the GIL then ends the thread by unwinding through
// here, which would abort the process); such a thread is parked instead.
class Unlocked {
 public:
  Unlocked() : state_(PyEval_SaveThread()) {}
  ~Unlocked() {
    // (The main thread finalizes, and may drop handles then: it goes on.)
    while (_Py_IsFinalizing() && std::this_thread::get_id() != main_thread) {
      std::this_thread::sleep_for(std::chrono::hours(1));
    }
    PyEval_RestoreThread(state_);
  }
  Unlocked(const Unlocked&) = delete;
  Unlocked& operator=(const Unlocked&) = delete;

 private:
  PyThreadState* state_;
};

py::tuple update_info_tuple(const th::UpdateInfo& info) {
  return py::make_tuple(std::string(th::update_status_name(info.status)), info.version, info.source_replica);
}

// A replicate or update in flight (th::Receive). Waits without the GIL, looking at Python's signals
// every 100 ms: Ctrl-C cancels the call (the handle stays usable) and raises KeyboardInterrupt.
// Safe after its handle is gone: every method then answers "unavailable".
class PyReceive {
 public:
  explicit PyReceive(std::unique_ptr<th::Receive> receive) : receive_(std::move(receive)) {}

  // (name, version) of the next tensor complete and verified, or None once all were handed out.
  std::optional<py::tuple> next() {
    for (;;) {
      th::Result<std::optional<th::ReceivedTensor>> got = [&] {
        Unlocked unlocked;
        return receive_->next(kSignalCheck.count());
      }();
      if (got.ok()) {
        if (!got.value()) return std::nullopt;
        return py::make_tuple(got.value()->name, got.value()->version);
      }
      // Our own poll's timeout, while the call goes on (not the call's kTimeout, which is its answer).
      if (got.error().code != th::Errc::kTimeout || receive_->progress().done) raise(got.error());
      check_signals();
    }
  }
  // The call's answer as update's tuple (status, version, source), waiting up to timeout_ms
  // (0: no limit); None if it did not come in time.
  std::optional<py::tuple> result(th::TimeMs timeout_ms) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    for (;;) {
      bool done = false;
      {
        Unlocked unlocked;
        done = receive_->wait_for(kSignalCheck.count());
      }
      if (done) break;
      if (timeout_ms > 0 && std::chrono::steady_clock::now() >= deadline) return std::nullopt;
      check_signals();
    }
    return update_info_tuple(value_or_raise(receive_->wait()));
  }
  bool done() const { return receive_->progress().done; }
  void cancel() { receive_->cancel(); }
  py::dict progress() const {
    const th::ReceiveProgress p = receive_->progress();
    py::dict out;
    out["version"] = p.version;
    out["bytes_ready"] = p.bytes_ready;
    out["bytes_total"] = p.bytes_total;
    out["tensors_handed_out"] = p.tensors_handed_out;
    out["tensors_total"] = p.tensors_total;
    out["done"] = p.done;
    return out;
  }

 private:
  void check_signals() {
    if (PyErr_CheckSignals() != 0) {
      receive_->cancel();
      throw py::error_already_set();
    }
  }

  std::unique_ptr<th::Receive> receive_;
};

// One shard's handle. Owns the C++ handle and the thread of the call in progress (at most one: a
// handle's calls come from one thread at a time).
class PyHandle {
 public:
  explicit PyHandle(th::ClientOptions options) {
    auto opened = run([&] { return th::Handle::open(options); }, /*interruptible=*/false);
    handle_ = value_or_raise(std::move(opened));
  }
  ~PyHandle() { drop(); }
  PyHandle(const PyHandle&) = delete;
  PyHandle& operator=(const PyHandle&) = delete;

  // What Python says of a tensor: its bytes, and where it knows them its shape (a shard's own
  // tensor) or its global shape and offset (a piece of the model's tensor, of extent `shape`).
  using Dims = std::optional<std::vector<std::uint64_t>>;
  void register_tensor(const std::string& name, std::uintptr_t data, std::uint64_t bytes, const std::string& dtype,
                       bool cuda, const Dims& shape, const Dims& global_shape, const Dims& offset) {
    const std::optional<th::DType> parsed = th::parse_dtype(dtype);
    if (!parsed) throw CallError{"invalid-argument", "unknown dtype '" + dtype + "'"};
    void* const memory = reinterpret_cast<void*>(data);
    const th::MemoryKind kind = cuda ? th::MemoryKind::kCuda : th::MemoryKind::kCpu;
    if (!shape) {
      if (global_shape || offset) throw CallError{"invalid-argument", "tensor '" + name + "': a piece needs its shape"};
      ok_or_raise(live().register_tensor(name, memory, bytes, *parsed, kind));
      return;
    }
    // The buffer's size must be its shape's (the shape says how much the data plane may write).
    std::uint64_t elements = 1;
    std::uint64_t shape_bytes = 0;
    bool overflow = false;
    for (const std::uint64_t length : *shape) overflow = overflow || __builtin_mul_overflow(elements, length, &elements);
    overflow = overflow || __builtin_mul_overflow(elements, th::dtype_bytes(*parsed), &shape_bytes);
    if (overflow || shape_bytes != bytes) {
      throw CallError{"invalid-argument", "tensor '" + name + "': its buffer has " + std::to_string(bytes) +
                                              " bytes, which is not its shape's size"};
    }
    if (!global_shape) {
      if (offset) throw CallError{"invalid-argument", "tensor '" + name + "': an offset needs a global shape"};
      ok_or_raise(live().register_tensor(name, memory, *parsed, *shape, kind));
      return;
    }
    th::Box box{offset ? *offset : std::vector<std::uint64_t>(global_shape->size(), 0), *shape};
    ok_or_raise(live().register_piece(name, memory, *parsed, *global_shape, std::move(box), kind));
  }
  // register_tensor for each (name, data, bytes, dtype, cuda, shape, global shape, offset) in
  // order, one call from Python for a whole state dict. Stops at the first failure: (how many were
  // registered, its code, its detail); the code is empty when all were.
  py::tuple register_many(
      const std::vector<std::tuple<std::string, std::uintptr_t, std::uint64_t, std::string, bool, Dims, Dims, Dims>>&
          tensors) {
    std::size_t done = 0;
    try {
      for (const auto& [name, data, bytes, dtype, cuda, shape, global_shape, offset] : tensors) {
        register_tensor(name, data, bytes, dtype, cuda, shape, global_shape, offset);
        ++done;
      }
    } catch (const CallError& error) {
      return py::make_tuple(done, error.code, error.detail);
    }
    return py::make_tuple(done, std::string(), std::string());
  }
  void unregister_tensor(const std::string& name) { ok_or_raise(live().unregister_tensor(name)); }
  // cuda_stream: a cudaStream_t as an integer (0: wait for all work on the GPU tensors' device).
  th::Version publish(th::Version version, std::uintptr_t cuda_stream) {
    return value_or_raise(run([&] { return live().publish(version, reinterpret_cast<void*>(cuda_stream)); }));
  }
  void unpublish() { ok_or_raise(run([&] { return live().unpublish(); })); }
  // Handle::write_tensor: the caller (tensorhub.Handle.write) checked that `data` holds the
  // registered tensor's element count of `dtype`, in host memory.
  void write_tensor(const std::string& name, std::uintptr_t data, const std::string& dtype) {
    const std::optional<th::DType> parsed = th::parse_dtype(dtype);
    if (!parsed) throw CallError{"invalid-argument", "unknown dtype '" + dtype + "'"};
    ok_or_raise(run([&] { return live().write_tensor(name, reinterpret_cast<const void*>(data), *parsed); }));
  }
  py::tuple replicate(const std::string& selector, th::TimeMs timeout_ms) {
    const th::ReplicateInfo info = value_or_raise(run([&] { return live().replicate(selector, timeout_ms); }));
    return py::make_tuple(info.version, info.source_replica);
  }
  py::tuple update(const std::string& selector) {
    return update_info_tuple(value_or_raise(run([&] { return live().update(selector); })));
  }
  // replicate_async ("replicate") or update_async ("update"): returns at once with the call in flight.
  std::unique_ptr<PyReceive> receive(const std::string& kind, const std::string& selector, th::TimeMs timeout_ms) {
    if (kind != "replicate" && kind != "update") throw CallError{"invalid-argument", "unknown receive kind '" + kind + "'"};
    auto launched = run([&] {
      return kind == "update" ? live().update_async(selector) : live().replicate_async(selector, timeout_ms);
    });
    return std::make_unique<PyReceive>(value_or_raise(std::move(launched)));
  }
  void wait(const std::string& kind, th::Version version, std::uint32_t replicas_min, const std::string& role,
            th::TimeMs timeout_ms) {
    th::WaitPredicate predicate;
    if (kind == "version-at-least") {
      predicate.kind = th::WaitPredicate::Kind::kVersionAtLeast;
    } else if (kind == "replicas-hold") {
      predicate.kind = th::WaitPredicate::Kind::kReplicasHold;
    } else if (kind == "role-holds") {
      predicate.kind = th::WaitPredicate::Kind::kRoleHolds;
    } else {
      throw CallError{"invalid-argument", "unknown wait kind '" + kind + "'"};
    }
    predicate.version = version;
    predicate.replicas_min = replicas_min;
    predicate.role = role;
    ok_or_raise(run([&] { return live().wait(predicate, timeout_ms); }));
  }
  py::dict list() {
    const th::ListSnapshot snapshot = value_or_raise(run([&] { return live().list(); }));
    py::dict out;
    out["model"] = snapshot.model;
    out["latest"] = snapshot.latest;
    py::list versions;
    for (const auto& v : snapshot.versions) {
      py::dict entry;
      entry["version"] = v.version;
      entry["complete"] = v.complete;
      entry["partial"] = v.partial;
      entry["retained"] = v.retained;
      entry["offloaded"] = v.offloaded;
      versions.append(entry);
    }
    out["versions"] = versions;
    py::list replicas;
    for (const auto& r : snapshot.replicas) {
      py::dict entry;
      entry["name"] = r.name;
      entry["incarnation"] = r.incarnation;
      entry["datacenter"] = r.datacenter;
      entry["spot"] = r.spot;
      entry["role"] = r.role;
      entry["num_shards"] = r.num_shards;
      entry["state"] = r.state;
      entry["version"] = r.version;
      entry["serving"] = r.serving;
      entry["offloads"] = r.offloads;
      replicas.append(entry);
    }
    out["replicas"] = replicas;
    return out;
  }
  void close() {
    if (handle_ == nullptr) return;
    ok_or_raise(run([&] { return live().close(); }));
  }
  py::dict stats() const {
    const th::HandleStats s = live().stats();
    py::dict out;
    out["bytes_received"] = s.bytes_received;
    out["bytes_served"] = s.bytes_served;
    out["reads_failed"] = s.reads_failed;
    out["checksum_failures"] = s.checksum_failures;
    out["copies_found_corrupt"] = s.copies_found_corrupt;
    out["last_read_seconds"] = s.last_read_seconds;
    out["last_pull_seconds"] = s.last_pull_seconds;
    out["last_read_bytes"] = s.last_read_bytes;
    out["reading_from"] = s.reading_from;
    out["transport"] = s.transport;
    out["pulls_rdma"] = s.pulls_rdma;
    out["pulls_tcp"] = s.pulls_tcp;
    out["pulls_fell_back"] = s.pulls_fell_back;
    out["memory_registrations"] = s.memory_registrations;
    out["servers_lost"] = s.servers_lost;
    out["pulls_ipc"] = s.pulls_ipc;
    out["reads_resumed"] = s.reads_resumed;
    out["bytes_resumed"] = s.bytes_resumed;
    out["patch_reads"] = s.patch_reads;
    out["patch_bytes_received"] = s.patch_bytes_received;
    out["patch_reads_failed"] = s.patch_reads_failed;
    out["patches_published"] = s.patches_published;
    out["patch_bytes_published"] = s.patch_bytes_published;
    out["gpu_registration"] = s.gpu_registration;
    return out;
  }
  std::string data_endpoint() const { return live().data_endpoint(); }
  std::uint64_t client_id() const { return live().client_id(); }
  std::uint64_t incarnation() const { return live().incarnation(); }
  // Leaves without a word (after an interrupted call, or when Python drops the handle).
  void drop() {
    {
      Unlocked unlocked;  // (declared first: the lock is let go before the GIL is taken back)
      std::unique_lock lock(mutex_);
      // The call in progress (another thread's) returns at once now; wait for it.
      if (busy_ && handle_ != nullptr) handle_->interrupt("the Python handle is dropped");
      idle_.wait(lock, [&] { return !busy_; });
    }
    std::unique_ptr<th::Handle> dropped = std::move(handle_);
    {
      Unlocked unlocked;  // the destructor closes (bounded: 5 s) and joins the handle's threads
      dropped.reset();
    }
    keepalive_ = py::dict();  // under the GIL again: only now may the tensors go
  }
  // Keeps `object` alive as long as the C++ handle can touch its memory (the Python Handle's own
  // references go first when it is collected).
  void keep(const std::string& name, py::object object) { keepalive_[py::str(name)] = std::move(object); }
  void forget(const std::string& name) {
    if (keepalive_.contains(name)) PyDict_DelItemString(keepalive_.ptr(), name.c_str());
  }

 private:
  th::Handle& live() const {
    if (interrupted_) {
      throw CallError{"unavailable", "an earlier call was interrupted (Ctrl-C): this handle is done; open another"};
    }
    if (handle_ == nullptr) throw CallError{"unavailable", "the handle is closed"};
    return *handle_;
  }

  // Runs `call` on a thread of its own and waits for it without the GIL, looking at Python's
  // signals every 100 ms. An exception from a signal handler (KeyboardInterrupt) interrupts the
  // call, which returns at once; the handle is then let go (it stops serving and reading: nothing
  // changes the registered tensors behind the application's back) and the exception goes on.
  // One call at a time: another thread's call meanwhile is refused, as libthclient would.
  template <typename Call>
  auto run(Call call, bool interruptible = true) -> decltype(call()) {
    using R = decltype(call());
    {
      std::lock_guard lock(mutex_);
      if (busy_) {
        throw CallError{"invalid-argument",
                        "another call is in progress on this handle: calls of one handle come from one thread at a time"};
      }
      busy_ = true;
    }
    std::optional<R> result;
    std::exception_ptr failure;
    bool finished = false;
    std::thread worker;
    try {
      worker = std::thread([&] {
        std::optional<R> value;
        std::exception_ptr error;
        try {
          value.emplace(call());
        } catch (...) {
          error = std::current_exception();
        }
        std::lock_guard lock(mutex_);
        result = std::move(value);
        failure = error;
        finished = true;
        done_.notify_all();
      });
    } catch (const std::system_error& error) {
      std::lock_guard lock(mutex_);
      busy_ = false;
      idle_.notify_all();
      throw CallError{"unavailable", std::string("no thread for the call: ") + error.what()};
    }
    auto let_go = [&] {  // the worker has returned (or returns at once): join it, and say so
      {
        Unlocked unlocked;
        worker.join();
      }
      std::lock_guard lock(mutex_);
      busy_ = false;
      idle_.notify_all();
    };
    for (;;) {
      {
        Unlocked unlocked;
        std::unique_lock lock(mutex_);
        if (done_.wait_for(lock, kSignalCheck, [&] { return finished; })) break;
      }
      if (PyErr_CheckSignals() != 0) {
        interrupted_ = true;
        if (interruptible && handle_ != nullptr) handle_->interrupt("Ctrl-C");
        let_go();
        if (interruptible && handle_ != nullptr) {
          std::unique_ptr<th::Handle> dropped = std::move(handle_);
          Unlocked unlocked;
          dropped.reset();
        }
        throw py::error_already_set();
      }
    }
    let_go();
    if (failure) std::rethrow_exception(failure);
    return std::move(*result);
  }

  // Declared first: destroyed after the handle, so the tensors outlive every use of their memory.
  py::dict keepalive_;
  std::unique_ptr<th::Handle> handle_;
  std::mutex mutex_;
  std::condition_variable done_;  // the call's thread finished
  std::condition_variable idle_;  // no call in progress
  bool busy_ = false;             // guarded by mutex_
  std::atomic<bool> interrupted_{false};
};

// libthclient's lines below this level are dropped; the rest go to stderr (ClientOptions::log_level).
// Any case; "warn" as th-server's --log-level spells it.
th::LogLevel log_level_from(const std::string& given) {
  std::string name;
  for (char c : given) name += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (name == "warn") return th::LogLevel::kWarning;
  for (th::LogLevel level : {th::LogLevel::kDebug, th::LogLevel::kInfo, th::LogLevel::kWarning, th::LogLevel::kError}) {
    if (th::log_level_name(level) == name) return level;
  }
  throw py::value_error("Handle(): log_level must be one of 'debug', 'info', 'warning' ('warn'), 'error', not '" + given + "'");
}

th::ClientOptions options_from(const py::kwargs& kwargs) {
  th::ClientOptions options;
  for (const auto& [key_object, value] : kwargs) {
    const std::string key = py::cast<std::string>(key_object);
    try {
    if (key == "servers") options.servers = py::cast<std::vector<std::string>>(value);
    else if (key == "token") options.token = py::cast<std::string>(value);
    else if (key == "model") options.model = py::cast<std::string>(value);
    else if (key == "replica") options.replica = py::cast<std::string>(value);
    else if (key == "incarnation") options.incarnation = py::cast<std::uint64_t>(value);
    else if (key == "shard") options.shard = py::cast<std::uint32_t>(value);
    else if (key == "num_shards") options.num_shards = py::cast<std::uint32_t>(value);
    else if (key == "datacenter") options.datacenter = py::cast<std::string>(value);
    else if (key == "spot") options.spot = py::cast<bool>(value);
    else if (key == "role") options.role = py::cast<std::string>(value);
    else if (key == "keep_latest") options.retention.keep_latest = py::cast<std::optional<std::uint64_t>>(value);
    else if (key == "pinned") options.retention.pinned = py::cast<std::vector<th::Version>>(value);
    else if (key == "data_listen") options.data_listen = py::cast<std::string>(value);
    else if (key == "data_advertise") options.data_advertise = py::cast<std::string>(value);
    else if (key == "transport") options.transport = py::cast<std::string>(value);
    else if (key == "rdma_device") options.rdma_device = py::cast<std::string>(value);
    else if (key == "rdma_gid_index") options.rdma_gid_index = py::cast<int>(value);
    else if (key == "heartbeat_interval_ms") options.heartbeat_interval_ms = py::cast<th::TimeMs>(value);
    else if (key == "open_timeout_ms") options.open_timeout_ms = py::cast<th::TimeMs>(value);
    else if (key == "chunk_bytes") options.chunk_bytes = py::cast<std::uint64_t>(value);
    else if (key == "read_rate_bytes_per_s") options.read_rate_bytes_per_s = py::cast<std::uint64_t>(value);
    else if (key == "data_streams") options.data_streams = py::cast<std::uint32_t>(value);
    else if (key == "data_timeout_ms") options.data_timeout_ms = py::cast<th::TimeMs>(value);
    else if (key == "server_timeout_ms") options.server_timeout_ms = py::cast<th::TimeMs>(value);
    else if (key == "tls_ca_file") options.tls_ca_file = py::cast<std::string>(value);
    else if (key == "tls_server_name") options.tls_server_name = py::cast<std::string>(value);
    else if (key == "metrics_listen") options.metrics_listen = py::cast<std::string>(value);
    else if (key == "log_level") options.log_level = log_level_from(py::cast<std::string>(value));
    else if (key == "cuda_ipc") options.cuda_ipc = py::cast<bool>(value);
    else throw py::type_error("Handle() got an unexpected keyword argument '" + key + "'");
    } catch (const py::cast_error&) {
      throw py::type_error("Handle(): " + key + "=" + py::cast<std::string>(py::repr(value)) +
                           " has the wrong type (see help(tensorhub.Handle))");
    }
  }
  return options;
}

}  // namespace

PYBIND11_MODULE(_core, module) {
  module.doc() = "libthclient for Python; use the tensorhub package, not this module.";
  main_thread = std::this_thread::get_id();
  // CallError -> tensorhub.errors: the package installs the translator's target (set_error_factory).
  // Never destroyed: it would outlive the interpreter at exit.
  static auto* error_factory = new py::object();
  module.def("set_error_factory", [](py::object factory) { *error_factory = std::move(factory); });
  module.def("metrics_address", &th::Handle::metrics_address,
             "Where this process serves Prometheus metrics (a handle's metrics_listen), or \"\"");
  py::register_local_exception_translator([](std::exception_ptr pointer) {
    try {
      if (pointer) std::rethrow_exception(pointer);
    } catch (const CallError& error) {
      if (!*error_factory) {
        PyErr_SetString(PyExc_RuntimeError, (error.code + ": " + error.detail).c_str());
        return;
      }
      py::object exception = (*error_factory)(error.code, error.detail);
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exception.ptr())), exception.ptr());
    }
  });
  py::class_<PyReceive>(module, "Receive")
      .def("next", &PyReceive::next)
      .def("result", &PyReceive::result, py::arg("timeout_ms"))
      .def("done", &PyReceive::done)
      .def("cancel", &PyReceive::cancel)
      .def("progress", &PyReceive::progress);
  py::class_<PyHandle>(module, "Handle")
      .def(py::init([](const py::kwargs& kwargs) { return std::make_unique<PyHandle>(options_from(kwargs)); }))
      .def("register_raw", &PyHandle::register_tensor, py::arg("name"), py::arg("data"), py::arg("bytes"),
           py::arg("dtype"), py::arg("cuda"), py::arg("shape") = py::none(), py::arg("global_shape") = py::none(),
           py::arg("offset") = py::none())
      .def("register_many", &PyHandle::register_many)
      .def("unregister", &PyHandle::unregister_tensor)
      .def("keep", &PyHandle::keep)
      .def("forget", &PyHandle::forget)
      .def("publish", &PyHandle::publish, py::arg("version"), py::arg("cuda_stream") = 0)
      .def("unpublish", &PyHandle::unpublish)
      .def("write_tensor", &PyHandle::write_tensor, py::arg("name"), py::arg("data"), py::arg("dtype"))
      .def("replicate", &PyHandle::replicate, py::arg("selector"), py::arg("timeout_ms"))
      .def("update", &PyHandle::update, py::arg("selector"))
      .def("receive", &PyHandle::receive, py::arg("kind"), py::arg("selector"), py::arg("timeout_ms"))
      .def("wait", &PyHandle::wait, py::arg("kind"), py::arg("version"), py::arg("replicas_min"), py::arg("role"),
           py::arg("timeout_ms"))
      .def("list", &PyHandle::list)
      .def("close", &PyHandle::close)
      .def("drop", &PyHandle::drop)
      .def("stats", &PyHandle::stats)
      .def_property_readonly("data_endpoint", &PyHandle::data_endpoint)
      .def_property_readonly("client_id", &PyHandle::client_id)
      .def_property_readonly("incarnation", &PyHandle::incarnation);
}
