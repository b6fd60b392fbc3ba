"""vLLM's pluggable weight transfer, with TensorHub underneath: a backend named ``"tensorhub"``.

vLLM (0.25 and later) makes one weight-transfer engine in every worker process (every tensor- and
pipeline-parallel rank of every data-parallel engine) and drives it in this order::

    init_transfer_engine(init_info)            once
    start_weight_update()                      each round
    update_weights(update_info)                once or more (parses the dict, calls receive_weights)
    finish_weight_update()
    shutdown()

:class:`TensorHubWeightTransferEngine` is such an engine. Each worker is a TensorHub replica of one
shard that holds the model's tensors whole, as the trainer names them (Hugging Face names); a round
pulls version ``update_info["version"]`` from any peer that holds it (the trainer, or another worker
already holding or still receiving it: pipeline replication, so the trainer sends the bytes about
once however many workers read them) and hands each tensor, as soon as its bytes are verified, to
the model's own ``load_weights([(name, tensor)])``, which fuses ``q/k/v`` and ``gate/up`` and keeps
this rank's slice, as for a checkpoint. The tensors land in staging buffers of the full shapes on
the worker's device, kept from one round to the next (the model's size, once per worker).

The trainer's side is :class:`TensorHubSender`: it publishes each version from the trainer's own
tensors (no copy), drives the engines' phases through a client with vLLM's four methods
(``LLM``/``AsyncLLM`` or an HTTP client of vLLM's dev endpoints), and unpublishes once every engine
has the version, so that the trainer may change its tensors again.

Registering the backend: every worker process must know it before the engine is made, which a
``vllm.general_plugins`` entry point does (``tensorhub = "tensorhub.integrations.vllm:register"``;
the wheel declares it). Then ``--weight-transfer-config '{"backend": "tensorhub"}'`` (or
``WeightTransferConfig(backend="tensorhub")``) selects it.

What was run: the phases in vLLM's order against a stand-in engine with vLLM's worker state
machine and a Llama-style ``load_weights`` that fuses and slices for tensor parallelism
(tests/python/test_vllm_backend.py, examples/vllm_backend.py). Not run against vLLM itself, which
cannot be installed where this was written; the interface follows vLLM's
``vllm/distributed/weight_transfer/base.py`` and ``factory.py`` as published.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

try:  # vLLM 0.25 and later
    from vllm.distributed.weight_transfer.base import WeightTransferEngine as _EngineBase
    from vllm.distributed.weight_transfer.base import WeightTransferInitInfo as _InitInfoBase
    from vllm.distributed.weight_transfer.base import WeightTransferUpdateInfo as _UpdateInfoBase
    VLLM_AVAILABLE = True
except ImportError:  # without vLLM: the same contract, for stand-ins and tests
    VLLM_AVAILABLE = False

    class _InitInfoBase:  # type: ignore[no-redef]
        """vLLM's WeightTransferInitInfo: what both sides agree on at init."""

    class _UpdateInfoBase:  # type: ignore[no-redef]
        """vLLM's WeightTransferUpdateInfo: what one round carries."""

    class _EngineBase:  # type: ignore[no-redef]
        """What vLLM's WeightTransferEngine gives a backend: the engine's context, the parsing of
        the dicts the API layer passes, and update_weights() over receive_weights()."""

        init_info_cls: Any = None
        update_info_cls: Any = None

        def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
            self.config = config
            self.vllm_config = vllm_config
            self.parallel_config = getattr(vllm_config, "parallel_config", None)
            self.model_config = getattr(vllm_config, "model_config", None)
            self.device = device
            self.model = model

        def parse_init_info(self, init_info: Mapping[str, Any]) -> Any:
            try:
                return self.init_info_cls(**init_info)
            except TypeError as error:
                raise ValueError(f"invalid init_info for {type(self).__name__}: {error}") from error

        def parse_update_info(self, update_info: Mapping[str, Any]) -> Any:
            try:
                return self.update_info_cls(**update_info)
            except TypeError as error:
                raise ValueError(f"invalid update_info for {type(self).__name__}: {error}") from error

        def update_weights(self, update_info: Mapping[str, Any]) -> None:
            self.receive_weights(self.parse_update_info(update_info))

import tensorhub
from tensorhub import layouts
from tensorhub.integrations.puller import Puller, manifest_of

BACKEND = "tensorhub"

__all__ = ["BACKEND", "TensorHubInitInfo", "TensorHubUpdateInfo", "TensorHubWeightTransferEngine",
           "TensorHubSender", "register", "VLLM_AVAILABLE"]


@dataclasses.dataclass
class TensorHubInitInfo(_InitInfoBase):
    """What every worker needs to reach the hub (JSON-native: it may travel over vLLM's HTTP
    endpoints). Prefer ``token_file`` (a path every worker can read) to ``token``: the init info
    may be logged or sent in the clear."""

    servers: List[str]
    model: str
    token: str = ""
    token_file: str = ""
    replica_prefix: str = "vllm"  # each worker is replica "<prefix>-dp<d>-rank<r>"
    datacenter: str = ""  # "": tensorhub.Handle's default
    timeout_s: float = 600.0  # one round's pull, at most
    options: Dict[str, Any] = dataclasses.field(default_factory=dict)  # more tensorhub.Handle options


@dataclasses.dataclass
class TensorHubUpdateInfo(_UpdateInfoBase):
    """One round: the version to pull and the tensors it has (Hugging Face names, torch dtype
    names such as "bfloat16", full shapes), as the trainer published them."""

    version: int
    names: List[str]
    dtype_names: List[str]
    shapes: List[List[int]]


def _token_of(info: TensorHubInitInfo) -> str:
    if bool(info.token) == bool(info.token_file):
        raise ValueError("tensorhub init_info takes one of token and token_file")
    if info.token:
        return info.token
    with open(info.token_file, encoding="utf-8") as file:
        return file.read().strip()


def _worker_name(prefix: str, parallel_config: Any) -> str:
    """The replica name of this worker: unique across the data-parallel engines and their ranks."""
    data_parallel = getattr(parallel_config, "data_parallel_rank", 0) or 0
    rank = getattr(parallel_config, "rank", None)
    if rank is None:
        import torch.distributed as distributed  # (a worker's process group, if vLLM made one)
        rank = distributed.get_rank() if distributed.is_available() and distributed.is_initialized() else 0
    return f"{prefix}-dp{data_parallel}-rank{rank}"


class TensorHubWeightTransferEngine(_EngineBase):
    """The inference side (see the module's docstring). One per vLLM worker process."""

    init_info_cls = TensorHubInitInfo
    update_info_cls = TensorHubUpdateInfo
    # A draft model's weights would need their own manifest and staging: not offered yet.
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self._puller: Optional[Puller] = None
        self._in_round = False
        self._layerwise = False

    # -- vLLM's phases --

    def init_transfer_engine(self, init_info: TensorHubInitInfo) -> None:
        if self._puller is not None:
            raise RuntimeError("the tensorhub weight-transfer engine is initialized already")
        options = dict(init_info.options)
        options.setdefault("role", "rollout")
        if init_info.datacenter:
            options["datacenter"] = init_info.datacenter
        hub = tensorhub.Handle(servers=list(init_info.servers), token=_token_of(init_info), model=init_info.model,
                               replica=_worker_name(init_info.replica_prefix, self.parallel_config), **options)
        self._puller = Puller(hub, self.device, init_info.timeout_s)

    def start_weight_update(self) -> None:
        if self._puller is None:
            raise RuntimeError("start_weight_update before init_transfer_engine")
        self._in_round = True
        # vLLM's layerwise reload (its default for checkpoint-format updates): the model's layers
        # take raw weights again, and are processed for their kernels at finish.
        self._layerwise = VLLM_AVAILABLE and getattr(self.config, "reload_mode", "layerwise") == "layerwise"
        if self._layerwise:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload
            initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: TensorHubUpdateInfo) -> None:
        if self._puller is None or not self._in_round:
            raise RuntimeError("receive_weights outside a round (start_weight_update first)")
        if not (len(update_info.names) == len(update_info.dtype_names) == len(update_info.shapes)):
            raise ValueError("update_info: names, dtype_names and shapes must be of one length")
        manifest = list(zip(update_info.names, update_info.dtype_names, update_info.shapes))
        self._puller.pull(int(update_info.version), manifest, self.model.load_weights)

    def finish_weight_update(self) -> None:
        if not self._in_round:
            raise RuntimeError("finish_weight_update without a matching start_weight_update")
        self._in_round = False
        if self._layerwise:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
            finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        if self._puller is not None:
            self._puller.hub.close()
            self._puller = None


class TensorHubSender:
    """The trainer's side: publishes a version from the trainer's own tensors and has every vLLM
    engine pull it.

    Tensors: ``send_weights`` takes full tensors under Hugging Face names from a trainer of one
    shard (``world_size`` 1); a trainer of several ranks passes each rank's own pieces with
    ``placements`` (:mod:`tensorhub.layouts`: Megatron, FSDP), and no rank gathers anything.

    ``client`` has vLLM's four methods (``init_weight_transfer_engine(dict)``,
    ``start_weight_update()``, ``update_weights(dict)``, ``finish_weight_update(...)``), reaches
    every engine and blocks until all are done: ``LLM``/``AsyncLLM``'s, or an HTTP client of
    vLLM's endpoints. Only the sender (rank 0) talks to it; every trainer rank publishes its shard,
    and with several ranks ``barrier`` (``torch.distributed.barrier``) holds their unpublish until
    the engines are done.

    The mutability contract: between send_weights() and the next one the trainer must not change
    its tensors only while they are published, and send_weights() unpublishes before it returns,
    so the trainer's optimizer may step right after it.
    """

    def __init__(self, *, servers: Sequence[str], token: str, model: str, init_info: Mapping[str, Any],
                 client: Any = None, replica: str = "trainer", rank: int = 0, world_size: int = 1,
                 placements: Optional[Mapping[str, layouts.Placement]] = None,
                 barrier: Optional[Callable[[], Any]] = None, **options: Any) -> None:
        if rank == 0 and client is None:
            raise ValueError("the sender (rank 0) needs a client of the engines")
        if world_size > 1 and placements is None:
            raise ValueError("a trainer of several ranks says where each rank's tensors sit (placements)")
        if world_size > 1 and barrier is None:
            raise ValueError("a trainer of several ranks needs a barrier (torch.distributed.barrier): its ranks "
                             "unpublish only once the engines have the version")
        self._placements = placements
        self._barrier = barrier
        options.setdefault("role", "trainer")
        self._hub = tensorhub.Handle(servers=list(servers), token=token, model=model, replica=replica, shard=rank,
                                     num_shards=world_size, **options)
        self._client = client if rank == 0 else None
        self._registered: Optional[List[str]] = None
        self._addresses: List[int] = []
        self._manifest: Optional[Dict[str, List[Any]]] = None
        if self._client is not None:
            self._client.init_weight_transfer_engine(dict(init_info))

    def send_weights(self, named_tensors: Iterable[Tuple[str, Any]], version: int) -> None:
        """Publishes ``version`` from ``named_tensors`` (full tensors under Hugging Face names,
        the same ones every time: registered in place on the first call), has every engine pull
        and load it, then unpublishes."""
        # (Parameters as they are: detached views of the same memory, as registering wants.)
        tensors = [(name, tensor.detach() if hasattr(tensor, "detach") else tensor) for name, tensor in named_tensors]
        names = [name for name, _ in tensors]
        if self._registered is None:
            placements = self._placements or {name: layouts.whole(tuple(tensor.shape)) for name, tensor in tensors}
            missing = [name for name in names if name not in placements]
            if missing:
                raise ValueError(f"send_weights: no placement for tensor '{missing[0]}'")
            self._hub.register_state_dict(dict(tensors), placements=placements)
            self._registered = names
            self._addresses = [tensor.data_ptr() for _, tensor in tensors]
            # What the engines stage: the model's whole tensors.
            manifest = manifest_of(tensors, placements)
            self._manifest = {"names": [name for name, _, _ in manifest],
                              "dtype_names": [dtype for _, dtype, _ in manifest],
                              "shapes": [list(shape) for _, _, shape in manifest]}
        elif names != self._registered:
            raise ValueError("send_weights: the tensors differ from the first call's (names, order)")
        elif [tensor.data_ptr() for _, tensor in tensors] != self._addresses:
            # Registered in place: another tensor object would not be what is published.
            raise ValueError("send_weights: pass the same tensors every time (the trainer's own, changed in place); "
                             "these are other memory than the first call's")
        self._hub.publish(version)  # (returns once every rank published)
        try:
            if self._client is not None:
                assert self._manifest is not None
                self._client.start_weight_update()
                self._client.update_weights({"version": version, **self._manifest})
                self._client.finish_weight_update()
        finally:
            # Every rank waits for the engines (the sender's calls above), then unpublishes, which
            # returns once no engine reads the trainer's tensors any more.
            if self._barrier is not None:
                self._barrier()
            self._hub.unpublish()

    def close(self) -> None:
        self._hub.close()

    def __enter__(self) -> "TensorHubSender":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def register() -> None:
    """Registers the backend by name with vLLM's factory (a ``vllm.general_plugins`` entry point
    calls this in every vLLM process; calling it again is harmless)."""
    if not VLLM_AVAILABLE:
        raise RuntimeError("vLLM is not installed: there is no weight-transfer factory to register with")
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    try:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "TensorHubWeightTransferEngine")
    except ValueError:
        pass  # registered already in this process
