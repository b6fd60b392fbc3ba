"""TensorHub for Python: weight transfer for LLM reinforcement learning, over libthclient.

One :class:`Handle` is one shard of one replica (a trainer rank, or a rollout worker's shard). A
trainer publishes the weights in its tensors; rollouts pull them straight into theirs::

    import tensorhub
    with tensorhub.Handle(servers=["10.0.0.1:7400"], token=token, model="llama", replica="rollout-3",
                          role="rollout") as hub:
        hub.register_module(model)           # the model's own parameters, written in place
        hub.replicate("latest")              # blocks until the newest version is in them
        ...
        info = hub.update("latest")          # later: a newer version, if there is one
        if info.updated: ...

Blocking calls release the GIL and honour Ctrl-C within a tenth of a second (the handle is then
done: open another). Failures raise the exception class of their code (:mod:`tensorhub.errors`).
Tensors: torch tensors (CPU or CUDA), numpy arrays and any writable C-contiguous buffer, or objects
with ``__dlpack__``; each may say where it sits in the model's tensor (:mod:`tensorhub.layouts`). A registered object is kept alive
until it is unregistered or the handle is closed.
"""

from __future__ import annotations

import dataclasses
import operator
import os
import secrets
import shutil
import subprocess
import tempfile
import weakref
from typing import Any, Callable, Dict, Iterable, Mapping, Optional, Sequence, Union

from . import errors
from ._core import Handle as _CoreHandle
from ._core import metrics_address
from ._core import set_error_factory as _set_error_factory
from .errors import *  # noqa: F401,F403  (the exception classes, as tensorhub.VersionUnavailable etc.)
from .errors import InvalidArgument, TensorHubError
from .layouts import Placement

_set_error_factory(errors.error_of)

__all__ = ["Handle", "Receive", "Server", "ReplicateInfo", "UpdateInfo", "TensorHubError", "metrics_address",
           "Placement"] + [
    name for name in dir(errors) if isinstance(getattr(errors, name), type)
    and issubclass(getattr(errors, name), TensorHubError) and name != "TensorHubError"]


@dataclasses.dataclass(frozen=True)
class ReplicateInfo:
    """What replicate() brought: the version, and the replica the bytes came from."""
    version: int
    source: str

    @property
    def source_replica(self) -> str:
        """The same as ``source`` (libthclient's C++ name)."""
        return self.source


@dataclasses.dataclass(frozen=True)
class UpdateInfo:
    """What update() did: ``status`` is "updated", "no-newer-version" or "not-yet" (nothing
    published yet, or smart skipping: the version still crosses datacenters to a peer in this
    one, and a rollout goes on with what it holds; ask again later); ``version`` is what the
    shard holds now (None: nothing)."""
    status: str
    version: Optional[int]
    source: str

    @property
    def updated(self) -> bool:
        return self.status == "updated"

    @property
    def source_replica(self) -> str:
        """The same as ``source`` (libthclient's C++ name)."""
        return self.source


# A version is a number in 0..2^63-1 (the hub takes none above).
_VERSION_MAX = 2**63 - 1


def _version(value: Any, what: str = "version") -> int:
    # Any integer type (a numpy or torch integer scalar too), but not a bool or a float.
    try:
        number = operator.index(value) if not isinstance(value, bool) else None
    except TypeError:
        number = None
    if number is None:
        raise InvalidArgument(f"{what} must be an int in 0..2^63-1, not {type(value).__name__} {value!r}")
    value = number
    if not 0 <= value <= _VERSION_MAX:
        raise InvalidArgument(f"{what} {value} is not in 0..2^63-1")
    return value


def _selector(value: Union[str, int]) -> str:
    # "latest", "latest-k" or a version number; the server parses the text and names what is wrong.
    return str(value) if isinstance(value, str) else str(_version(value))


# ---- Tensors -------------------------------------------------------------------------------------

_TORCH_DTYPES: Dict[str, str] = {
    "torch.float32": "float32", "torch.float16": "float16", "torch.bfloat16": "bfloat16",
    "torch.float64": "float64", "torch.int8": "int8", "torch.uint8": "uint8", "torch.int16": "int16",
    "torch.int32": "int32", "torch.int64": "int64", "torch.bool": "bool",
    "torch.float8_e4m3fn": "float8_e4m3", "torch.float8_e5m2": "float8_e5m2",
}
# struct-module formats of the buffer protocol (numpy arrays, array.array, bytearray, mmap, ...).
_BUFFER_DTYPES: Dict[str, str] = {
    "f": "float32", "e": "float16", "d": "float64", "b": "int8", "B": "uint8", "c": "uint8", "h": "int16",
    "i": "int32", "l": "int64", "q": "int64", "?": "bool",
}


try:  # torch is optional: numpy arrays and buffers work without it
    import torch as _torch
    _TORCH_DTYPE_OF = {getattr(_torch, key.split(".")[1]): value for key, value in _TORCH_DTYPES.items()
                       if hasattr(_torch, key.split(".")[1])}
except ImportError:
    _torch = None
    _TORCH_DTYPE_OF = {}


# Bytes per element of each dtype name libthclient knows (core/include/tensorhub/types.h).
_DTYPE_BYTES: Dict[str, int] = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3": 1, "float8_e5m2": 1, "float64": 8,
    "int8": 1, "uint8": 1, "int16": 2, "int32": 4, "int64": 8, "bool": 1,
}


def _describe(name: str, tensor: Any, writable: bool = True):
    """(address, bytes, dtype name, is_cuda, what to keep alive, shape) of a tensor-like object,
    or InvalidArgument. ``writable``: libthclient writes it (a registered tensor), so a read-only
    buffer is refused."""
    if _torch is not None and isinstance(tensor, _torch.Tensor):
        if tensor.layout != _torch.strided:
            raise InvalidArgument(f"tensor '{name}' is {tensor.layout}: only dense (strided) tensors")
        dtype = _TORCH_DTYPE_OF.get(tensor.dtype)
        if dtype is None:
            raise InvalidArgument(f"tensor '{name}' has dtype {tensor.dtype}, which TensorHub does not move")
        if not tensor.is_contiguous():
            raise InvalidArgument(f"tensor '{name}' is not contiguous (call .contiguous() on a copy you keep)")
        cuda = tensor.is_cuda
        if not cuda and tensor.device.type != "cpu":
            raise InvalidArgument(f"tensor '{name}' is on {tensor.device}: only CPU and CUDA memory")
        return tensor.data_ptr(), tensor.numel() * tensor.element_size(), dtype, cuda, tensor, list(tensor.shape)
    if hasattr(tensor, "__dlpack__") and not hasattr(tensor, "__array_interface__"):
        # Through torch (writable, and the result owns the capsule: it is what is kept alive).
        if _torch is None:
            raise InvalidArgument(f"tensor '{name}': a __dlpack__ object needs torch to be registered")
        try:
            return _describe(name, _torch.utils.dlpack.from_dlpack(tensor), writable)
        except (RuntimeError, TypeError, BufferError) as error:
            raise InvalidArgument(f"tensor '{name}': cannot take its __dlpack__: {error}") from None
    try:
        view = memoryview(tensor)
    except (TypeError, ValueError):
        raise InvalidArgument(f"'{name}' is a {type(tensor).__name__}: not a torch tensor, an array or a buffer") from None
    # The view is kept (unreleased) while registered: a bytearray cannot be resized, nor an mmap
    # closed, under libthclient meanwhile.
    if not view.c_contiguous:
        raise InvalidArgument(f"tensor '{name}' is not C-contiguous")
    if view.readonly and writable:
        raise InvalidArgument(f"tensor '{name}' is read-only: replicate() writes into registered tensors")
    dtype = _BUFFER_DTYPES.get(view.format.lstrip("@=<"))
    if dtype is None or (dtype == "int64" and view.itemsize != 8):
        raise InvalidArgument(f"tensor '{name}' has element format '{view.format}', which TensorHub does not move")
    shape = list(view.shape) if view.shape is not None else None
    if view.nbytes == 0:
        return 0, 0, dtype, False, view, shape
    import ctypes
    if view.readonly:  # (a source write() only reads)
        try:
            import numpy
        except ImportError:
            raise InvalidArgument(f"'{name}': a read-only source is taken through numpy, which is not installed") from None
        array = numpy.frombuffer(view, dtype=numpy.uint8)
        return array.ctypes.data, view.nbytes, dtype, False, (view, array), shape
    address = ctypes.addressof(ctypes.c_char.from_buffer(view))
    return address, view.nbytes, dtype, False, view, shape


def _registration(name: str, tensor: Any, placement: Optional["Placement"],
                  global_shape: Optional[Sequence[int]], offset: Optional[Sequence[int]]):
    """(name, address, bytes, dtype, is_cuda, keep, shape, global shape, offset) for register_raw."""
    address, nbytes, dtype, cuda, keep, shape = _describe(name, tensor)
    if placement is not None:
        if global_shape is not None or offset is not None:
            raise InvalidArgument(f"tensor '{name}': a placement or global_shape/offset, not both")
        if shape is not None and tuple(shape) != tuple(placement.extent):
            raise InvalidArgument(f"tensor '{name}' has shape {list(shape)}, its placement a piece of "
                                  f"{list(placement.extent)}")
        global_shape, offset = placement.global_shape, placement.offset
    elif offset is not None and global_shape is None:
        raise InvalidArgument(f"tensor '{name}': an offset needs a global_shape")
    if global_shape is not None and shape is None:
        raise InvalidArgument(f"tensor '{name}': a piece needs a shape (a torch tensor or an array)")
    def as_list(dims):
        if dims is None:
            return None
        listed = list(dims)
        if not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < (1 << 64) for d in listed):
            raise InvalidArgument(f"tensor '{name}': dimensions are whole numbers from 0 to 2^64 - 1, not {listed}")
        return listed
    return (name, address, nbytes, dtype, cuda, keep, shape, as_list(global_shape), as_list(offset))


# ---- The handle ----------------------------------------------------------------------------------

class Receive:
    """A replicate or update in flight (:meth:`Handle.replicate_stream`, :meth:`Handle.update_stream`).

    Iterate over it for ``(name, tensor)`` pairs: each tensor is the registered object, handed out
    as soon as all its bytes arrived and matched the publisher's checksum (the small tensors first,
    then the others in name order), so that an engine loads one tensor while the next is still on
    the wire. The iteration ends once every tensor was handed out (or at once, for an update with
    nothing newer); if the call fails first, it raises the call's exception. Then :meth:`result`
    gives the answer. Until the call has its answer the handle takes no other call.

    As a context manager, leaving the block early cancels the call and waits for its answer, so
    the handle is usable again after it. Ctrl-C while it waits cancels the call too.
    """

    def __init__(self, core: Any, tensors: Mapping[str, Any], replicate: bool):
        self._core = core
        self._tensors = tensors
        self._replicate = replicate
        self.version: Optional[int] = None  # of the tensors handed out so far

    def __iter__(self) -> "Receive":
        return self

    def __next__(self):
        got = self._core.next()
        if got is None:
            raise StopIteration
        name, self.version = got
        return name, self._tensors[name]

    def result(self, timeout: Optional[float] = None) -> Union[ReplicateInfo, UpdateInfo]:
        """The call's answer (ReplicateInfo for replicate_stream, UpdateInfo for update_stream),
        waiting for it at most ``timeout`` seconds (None: no limit); TimeoutError if it did not
        come, the call going on. Raises the call's exception if it failed (tensorhub.Cancelled
        after cancel())."""
        answer = self._core.result(_ms(timeout))
        if answer is None:
            raise TimeoutError(f"the call had no answer within {timeout} s (it goes on)")
        status, version, source = answer
        return ReplicateInfo(version, source) if self._replicate else UpdateInfo(status, version, source)

    def done(self) -> bool:
        """Whether the call has its answer."""
        return self._core.done()

    def cancel(self) -> None:
        """Asks the server to end the call for the whole replica (every shard's call then raises
        tensorhub.Cancelled, unless it completed first). Returns at once: result() waits."""
        self._core.cancel()

    def progress(self) -> Dict[str, Any]:
        """version, bytes_ready, bytes_total, tensors_handed_out, tensors_total, done."""
        return self._core.progress()

    def __enter__(self) -> "Receive":
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if self._core.done():
            return
        self._core.cancel()
        try:
            self._core.result(0)
        except TensorHubError:
            pass  # cancelled (or failed meanwhile): the handle takes calls again either way


class Handle:
    """One shard of one replica. Opening blocks until the server answered.

    Keyword arguments are those of libthclient's ``ClientOptions`` (client/include/tensorhub/client.h):
    ``servers`` (a "host:port" or a list, primary first), ``token``, ``model``, ``replica``,
    ``shard``, ``num_shards``, ``datacenter``, ``spot``, ``role``, ``keep_latest`` and ``pinned``
    (retention), ``incarnation`` (default: the server chooses; see the ``incarnation`` property),
    ``data_listen``, ``data_advertise``, ``transport`` ("auto",
    "rdma", "tcp"), ``rdma_device``, ``rdma_gid_index``, ``heartbeat_interval_ms``,
    ``open_timeout_ms``, ``chunk_bytes``, ``read_rate_bytes_per_s``, ``data_streams``,
    ``data_timeout_ms``, ``server_timeout_ms``, ``tls_ca_file``, ``tls_server_name``,
    ``metrics_listen`` ("host:port": this process serves Prometheus metrics of its handles there),
    ``log_level`` ("debug", "info" (the default), "warning", "error": libthclient's lines below it
    are dropped, the rest go to stderr), ``cuda_ipc`` (default True: CUDA tensors between processes
    of one host are copied device to device; see ClientOptions::cuda_ipc). Without ``data_listen`` the handle listens on every
    interface and advertises the address of the interface that reaches the first server.

    Use it as a context manager: it closes on exit (on an exception, it leaves without waiting).
    """

    def __init__(self, *, servers: Union[str, Sequence[str]], token: str, model: str, replica: str, **options: Any):
        if isinstance(servers, str):
            servers = [servers]
        self._tensors: Dict[str, Any] = {}  # kept alive while registered
        self._stream: Optional["weakref.ReferenceType[Receive]"] = None  # the last stream started
        self._core = _CoreHandle(servers=list(servers), token=token, model=model, replica=replica, **options)

    # -- tensors --

    def register(self, name: str, tensor: Any, placement: Optional["Placement"] = None, *,
                 global_shape: Optional[Sequence[int]] = None, offset: Optional[Sequence[int]] = None) -> None:
        """Registers a tensor (torch, numpy, a writable buffer, or ``__dlpack__``) by unique name.
        Only while the shard holds no version (before the first publish/replicate, or after
        unpublish). Its memory is read and written in place.

        Without a placement the tensor is this shard's own, of its shape: a replica whose shard
        registers another shape under the name is refused (``LayoutMismatch``). With one, it is
        the piece of the model's tensor ``name`` of ``global_shape`` that begins at ``offset``
        (zeros if left out) and has the tensor's shape: see :mod:`tensorhub.layouts` for Megatron,
        FSDP and replicated placements. A replica's pieces of one tensor must tile it."""
        entry = _registration(name, tensor, placement, global_shape, offset)
        self._core.register_raw(*entry[:5], shape=entry[6], global_shape=entry[7], offset=entry[8])
        self._core.keep(name, entry[5])  # alive until the C++ handle is gone, whatever Python drops first
        self._tensors[name] = (tensor, entry[1])

    def register_state_dict(self, state_dict: Mapping[str, Any], prefix: str = "",
                            placements: Optional[Mapping[str, "Placement"]] = None) -> None:
        """Registers every tensor of a state dict under ``prefix + key``, in one call into
        libthclient. For a module's own parameters (written in place), pass ``module.state_dict()``
        or use register_module(). ``placements`` (by key) makes those tensors pieces, as
        register() does. On a refusal, the tensors before it stay registered."""
        placements = placements or {}
        unknown = sorted(set(placements) - set(state_dict))
        if unknown:
            raise InvalidArgument(f"a placement for '{unknown[0]}', which the state dict does not have")
        items = [(prefix + key, tensor, placements.get(key)) for key, tensor in state_dict.items()]
        described = [_registration(name, tensor, placement, None, None) for name, tensor, placement in items]
        done, code, detail = self._core.register_many([entry[:5] + entry[6:] for entry in described])
        for (name, tensor, _), entry in zip(items[:done], described[:done]):
            self._core.keep(name, entry[5])
            self._tensors[name] = (tensor, entry[1])
        if code:
            raise errors.error_of(code, detail)

    def register_module(self, module: Any, prefix: str = "") -> None:
        """Registers a torch module's parameters and buffers in place: replicate() and update()
        write the module's own weights, without a copy."""
        self.register_state_dict(module.state_dict(keep_vars=False), prefix)

    def unregister(self, name: str) -> None:
        self._core.unregister(name)
        self._core.forget(name)
        self._tensors.pop(name, None)

    @property
    def tensors(self) -> Mapping[str, Any]:
        """The registered objects, by name."""
        return {name: entry[0] for name, entry in self._tensors.items()}

    def _check_storage(self) -> None:
        # A torch tensor whose storage was replaced since it was registered (param.data = ...,
        # set_(), resize_()) no longer is the memory libthclient reads and writes: refuse, rather
        # than move bytes the application does not see.
        for name, (tensor, address) in self._tensors.items():
            if _torch is not None and isinstance(tensor, _torch.Tensor) and tensor.data_ptr() != address:
                raise InvalidArgument(f"tensor '{name}' moved to other memory since it was registered "
                                      "(its storage was replaced): unregister and register it again")

    # -- calls --

    def publish(self, version: int, stream: Any = None) -> int:
        """Promises that the registered tensors hold ``version`` and will not change until unpublish().
        CUDA tensors are read once the work queued on ``stream`` is done (a ``torch.cuda.Stream``,
        or a cudaStream_t as an int); None: once all work on their device is."""
        self._check_storage()
        if stream is None:
            handle = 0
        elif isinstance(stream, int):
            handle = stream
        elif isinstance(getattr(stream, "cuda_stream", None), int):
            handle = stream.cuda_stream
        else:
            raise InvalidArgument(f"stream must be a torch.cuda.Stream or an int, not {type(stream).__name__}")
        return self._core.publish(_version(version), handle)

    def unpublish(self) -> None:
        """Withdraws the promise; returns when no reader reads these tensors any more."""
        self._core.unpublish()

    def write(self, name: str, source: Any) -> None:
        """Writes ``source`` (a CPU tensor or array of the registered tensor's element count: of
        its dtype, or float32 into a bfloat16/float16 tensor, rounded to nearest even) into the
        registered tensor ``name`` and records what changed against the version it held: the next
        publish() sends rollouts that hold that version a patch instead of the whole tensor
        (README "Delta versions"). Between unpublish() (or before the first publish) and
        publish(); CPU tensors only for now."""
        registered = self._tensors.get(name)
        if registered is None:
            raise InvalidArgument(f"write: no tensor '{name}' is registered")
        address, size, dtype, cuda, keep, _ = _describe(name, source, writable=False)
        _, reg_size, reg_dtype, reg_cuda, _, _ = _describe(name, registered[0])
        if cuda or reg_cuda:
            raise InvalidArgument(f"write: tensor '{name}': patches of GPU tensors are not built yet "
                                  "(copy into it and publish: it is read whole)")
        if size * _DTYPE_BYTES[reg_dtype] != reg_size * _DTYPE_BYTES[dtype]:
            raise InvalidArgument(f"write: tensor '{name}' holds {reg_size // _DTYPE_BYTES[reg_dtype]} elements, "
                                  f"the source {size // _DTYPE_BYTES[dtype]}")
        self._core.write_tensor(name, address, dtype)
        del keep  # (alive until here: libthclient has read it)

    def replicate(self, selector: Union[str, int] = "latest", timeout: Optional[float] = None,
                  on_tensor: Optional[Callable[[str, Any], None]] = None) -> ReplicateInfo:
        """Brings a version ("latest", "latest-2", or a number) into the registered tensors,
        verified; blocks until it is there (at most ``timeout`` seconds; None: no limit).

        ``on_tensor(name, tensor)``, if given, is called on this thread with each registered tensor
        as soon as its bytes are verified, while the rest are still on the wire: for what the
        engine does itself as weights land (fp8 quantization with scales, post-processing). If it
        raises, the exception propagates after the call is cancelled for every shard (the tensors
        then hold no version) or, if the call had its answer already, after that answer (the
        version stays). (A read from a source of another layout verifies its tensors once all of
        them are assembled: they then come in one burst, after the answer.)"""
        self._check_storage()
        self._check_hook(on_tensor)
        if on_tensor is not None:
            return self._each(self.replicate_stream(selector, timeout), on_tensor)
        version, source = self._core.replicate(_selector(selector), _ms(timeout))
        return ReplicateInfo(version, source)

    def update(self, selector: Union[str, int] = "latest",
               on_tensor: Optional[Callable[[str, Any], None]] = None) -> UpdateInfo:
        """Moves to a newer version if there is one (blocks while it arrives), else returns at once.
        ``on_tensor``: as for replicate()."""
        self._check_storage()
        self._check_hook(on_tensor)
        if on_tensor is not None:
            return self._each(self.update_stream(selector), on_tensor)
        status, version, source = self._core.update(_selector(selector))
        return UpdateInfo(status, version, source)

    @staticmethod
    def _check_hook(on_tensor: Any) -> None:
        if on_tensor is not None and not callable(on_tensor):
            raise InvalidArgument(f"on_tensor must be callable, not {type(on_tensor).__name__}")

    @staticmethod
    def _each(stream: Receive, on_tensor: Callable[[str, Any], None]):
        with stream:  # leaving it early (on_tensor raised) cancels the call and waits for its answer
            for name, tensor in stream:
                on_tensor(name, tensor)
            return stream.result()

    def replicate_stream(self, selector: Union[str, int] = "latest", timeout: Optional[float] = None) -> Receive:
        """replicate() without blocking: iterate over the returned :class:`Receive` for
        ``(name, tensor)`` pairs as they arrive, verified::

            with hub.replicate_stream("latest") as stream:
                for name, tensor in stream:
                    engine.load_weight(name, tensor)
                info = stream.result()
        """
        self._check_storage()
        return self._started(Receive(self._core.receive("replicate", _selector(selector), _ms(timeout)), self.tensors, True))

    def update_stream(self, selector: Union[str, int] = "latest") -> Receive:
        """update() without blocking (see replicate_stream); with nothing newer, the iteration
        is empty and result().updated is False."""
        self._check_storage()
        return self._started(Receive(self._core.receive("update", _selector(selector), 0), self.tensors, False))

    def _started(self, stream: Receive) -> Receive:
        self._stream = weakref.ref(stream)
        return stream

    def _end_stream(self) -> None:
        # A stream still running ends first (cancelled), so that close() is not "in flight".
        stream = self._stream() if self._stream is not None else None
        if stream is not None and not stream.done():
            stream.cancel()
            try:
                stream.result()
            except TensorHubError:
                pass

    def wait(self, *, version: int = 0, replicas: Optional[int] = None, role: Optional[str] = None,
             timeout: Optional[float] = None) -> None:
        """Blocks until: a version >= ``version`` was published (the default); or ``replicas``
        replicas hold ``version``; or every open replica of ``role`` holds a version >= ``version``."""
        if replicas is not None and role is not None:
            raise InvalidArgument("wait for replicas or for a role, not both")
        version = _version(version)
        if role is not None:
            self._core.wait("role-holds", version, 1, role, _ms(timeout))
        elif replicas is not None:
            self._core.wait("replicas-hold", version, replicas, "", _ms(timeout))
        else:
            self._core.wait("version-at-least", version, 1, "", _ms(timeout))

    def list(self) -> Dict[str, Any]:
        """The model's versions and replicas, as the server sees them now."""
        return self._core.list()

    def stats(self) -> Dict[str, Any]:
        """Bytes moved, reads failed, checksum failures, ``copies_found_corrupt`` (times readers
        found this shard's tensors changed under their checksums: written while published?), the
        transport in use, ..."""
        return self._core.stats()

    @property
    def data_endpoint(self) -> str:
        return self._core.data_endpoint

    @property
    def client_id(self) -> int:
        return self._core.client_id

    @property
    def incarnation(self) -> int:
        """The replica's incarnation this shard is part of (the server chooses it unless the
        ``incarnation`` option names one: a restarted process needs no bookkeeping)."""
        return self._core.incarnation

    def close(self) -> None:
        """Leaves: blocks until readers of this replica drained (a stream still running is
        cancelled first). The handle is then done, whatever the server answers: it never refuses a
        close. One that holds the last copy of a version another replica's ``keep_latest`` or
        ``pinned`` keeps takes it along (the server counts and logs it, and its readers get
        VersionUnavailable naming this replica); to hand a version on first, wait until another
        non-spot replica holds it. Only a close made while another thread's call is in progress
        on this handle is refused (InvalidArgument), here, and leaves the handle as it was."""
        try:
            self._end_stream()
            self._core.close()
        except errors.Unavailable:
            pass  # closed or interrupted already: nothing to leave
        except errors.InvalidArgument:
            raise  # refused here, before anything reached the server: the other call goes on
        except BaseException:
            self._drop()  # an error is raised after the handle let go: nothing to close again
            raise
        self._drop()

    def _drop(self) -> None:
        self._core.drop()
        self._tensors.clear()

    def __enter__(self) -> "Handle":
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            self.close()
        else:
            self._core.drop()  # leave without waiting: the server evicts the shard
            self._tensors.clear()


def _ms(timeout: Optional[float]) -> int:
    if timeout is None:
        return 0
    import math
    if not isinstance(timeout, (int, float)) or math.isnan(timeout) or timeout <= 0 or math.isinf(timeout):
        raise InvalidArgument(f"timeout must be a positive number of seconds (None: no limit), not {timeout!r}")
    return max(1, int(timeout * 1000))


# ---- A server for tests and single-node jobs -----------------------------------------------------

def _find_server(binary: Optional[str]) -> str:
    # The wheel's own th-server comes before one on PATH, which may be another version.
    candidates = [binary, os.environ.get("TH_SERVER_BINARY"),
                  os.path.join(os.path.dirname(__file__), "_bin", "th-server"), shutil.which("th-server"),
                  os.path.join(os.path.dirname(__file__), "..", "..", "tools", "th-server")]
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return os.path.abspath(candidate)
    raise FileNotFoundError("th-server not found: pass binary=, set TH_SERVER_BINARY, or put it on PATH")


def _die_with_parent() -> None:
    # In the child, before exec: the server gets SIGTERM when this process dies, however it dies.
    import ctypes
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, 15)


def _stop_server(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class Server:
    """A th-server as a child process (for tests and single-node jobs); stopped on close/exit.

    ``address`` is its "host:port" and ``token`` the cluster token (drawn at random unless given).
    Extra command-line options go in ``args`` (see ``th-server --help``).
    """

    def __init__(self, *, listen: str = "127.0.0.1:0", token: Optional[str] = None, binary: Optional[str] = None,
                 args: Iterable[str] = (), start_timeout: float = 30.0):
        executable = _find_server(binary)  # first: nothing to clean up if it is missing
        self.token = token or secrets.token_hex(16)
        self._dir = tempfile.TemporaryDirectory(prefix="tensorhub-server-")
        token_file = os.path.join(self._dir.name, "token")
        with open(token_file, "w") as out:
            out.write(self.token + "\n")
        os.chmod(token_file, 0o600)
        self._log = open(os.path.join(self._dir.name, "log"), "w")
        self._process = subprocess.Popen(
            [executable, "--listen", listen, "--token-file", token_file, *args],
            stdout=subprocess.PIPE, stderr=self._log, text=True, preexec_fn=_die_with_parent)
        # Stopped when this object goes, or at exit, if nobody closed it.
        self._finalizer = weakref.finalize(self, _stop_server, self._process)
        self.address = self._read_address(start_timeout)

    def _read_address(self, timeout: float) -> str:
        import selectors
        prefix = "th-server listening on "
        with selectors.DefaultSelector() as selector:
            selector.register(self._process.stdout, selectors.EVENT_READ)
            if selector.select(timeout):
                line = self._process.stdout.readline().strip()
                if line.startswith(prefix):
                    return line[len(prefix):]
        self.close()
        raise RuntimeError(f"th-server did not start within {timeout} s: {self.log()}")

    def log(self) -> str:
        """What the server wrote to its log so far."""
        try:
            with open(os.path.join(self._dir.name, "log")) as log:
                return log.read()
        except OSError:
            return ""

    def close(self) -> None:
        self._finalizer.detach()
        _stop_server(self._process)
        if self._process.stdout:
            self._process.stdout.close()
        self._log.close()
        self._dir.cleanup()

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
