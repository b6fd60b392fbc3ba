"""SGLang pulls its weights from TensorHub: a custom weight loader.

SGLang lets a server name functions that load weights (``--custom-weight-loader``); a call of
``update_weights_from_tensor(named_tensors, load_format=<that function's path>)`` then runs
``function(model, named_tensors)`` on every tensor-parallel rank. Here the tensors sent carry no
weights, only the request (the version, and the tensors it has); each rank pulls the version from
any peer that holds it and loads it through the model's ``load_weights``, as a checkpoint would be.

Serving side (every SGLang process)::

    export TH_SERVERS=10.0.0.1:7400 TH_TOKEN_FILE=/etc/tensorhub/token TH_MODEL=llama
    python -m sglang.launch_server ... \\
        --custom-weight-loader tensorhub.integrations.sglang.load_from_hub

Trainer side (after publishing ``version`` with :class:`tensorhub.Handle`)::

    from tensorhub.integrations import sglang as hub_sglang
    engine.update_weights_from_tensor(
        named_tensors=hub_sglang.request_tensors(version, hub_sglang.manifest_of(trainer_tensors)),
        load_format=hub_sglang.LOADER)

Optional: ``TH_REPLICA_PREFIX`` (each rank is replica "<prefix>-rank<r>", default "sglang"),
``TH_DATACENTER``, ``TH_TIMEOUT_S`` (one pull, default 600), or :func:`configure` in-process.

What was run: a stand-in of SGLang's ModelRunner (the custom loader called by its import path,
on the model) in tests/python/test_vllm_backend.py. Not run against SGLang itself.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import tensorhub
from tensorhub.integrations.puller import Manifest, Puller, check_manifest, manifest_of

LOADER = "tensorhub.integrations.sglang.load_from_hub"
REQUEST = "tensorhub.request"  # the name of the one tensor a request sends

__all__ = ["LOADER", "load_from_hub", "request_tensors", "configure", "disconnect", "manifest_of"]

_settings: Dict[str, Any] = {}
_puller: Optional[Puller] = None


def configure(*, servers: Sequence[str], model: str, token: str = "", token_file: str = "",
              replica_prefix: str = "sglang", datacenter: str = "", timeout_s: float = 600.0,
              device: Any = None, **options: Any) -> None:
    """Sets what load_from_hub() connects with, instead of the TH_* environment (before its first call)."""
    if _puller is not None:
        raise RuntimeError("tensorhub: the SGLang loader is connected already")
    _settings.clear()
    _settings.update(servers=list(servers), model=model, token=token, token_file=token_file,
                     replica_prefix=replica_prefix, datacenter=datacenter, timeout_s=timeout_s, device=device,
                     options=options)


def disconnect() -> None:
    """Closes the loader's handle (a later load_from_hub() connects again)."""
    global _puller
    if _puller is not None:
        _puller.hub.close()
        _puller = None
    _settings.clear()


def request_tensors(version: int, manifest: Manifest) -> List[Tuple[str, Any]]:
    """What the trainer passes as ``named_tensors``: the request, as one tensor of bytes (SGLang
    carries tensors to every rank, and nothing else)."""
    import torch
    payload = json.dumps({"version": int(version), "manifest": [list(entry) for entry in check_manifest(manifest)]})
    return [(REQUEST, torch.frombuffer(bytearray(payload.encode("utf-8")), dtype=torch.uint8))]


def load_from_hub(model: Any, named_tensors: Sequence[Tuple[str, Any]]) -> None:
    """SGLang's custom loader: pulls the version the request names into ``model``."""
    requests = [tensor for name, tensor in named_tensors if name == REQUEST]
    if len(requests) != 1 or len(named_tensors) != 1:
        raise ValueError(f"tensorhub: load_from_hub takes one tensor named '{REQUEST}' "
                         "(request_tensors()), not weights")
    request = json.loads(bytes(requests[0].cpu().numpy().tobytes()).decode("utf-8"))
    _connected(model).pull(request["version"], request["manifest"], model.load_weights)


def _connected(model: Any) -> Puller:
    global _puller
    if _puller is None:
        settings = dict(_settings) or _from_environment()
        token = settings["token"]
        if bool(token) == bool(settings["token_file"]):
            raise ValueError("tensorhub: give one of TH_TOKEN and TH_TOKEN_FILE (or configure(token=...))")
        if settings["token_file"]:
            with open(settings["token_file"], encoding="utf-8") as file:
                token = file.read().strip()
        options = dict(settings.get("options") or {})
        options.setdefault("role", "rollout")
        if settings["datacenter"]:
            options["datacenter"] = settings["datacenter"]
        hub = tensorhub.Handle(servers=settings["servers"], token=token, model=settings["model"],
                               replica=f"{settings['replica_prefix']}-rank{_rank()}", **options)
        device = settings.get("device") or _device_of(model)
        _puller = Puller(hub, device, float(settings["timeout_s"]))
    return _puller


def _from_environment() -> Dict[str, Any]:
    missing = [name for name in ("TH_SERVERS", "TH_MODEL") if not os.environ.get(name)]
    if missing:
        raise ValueError(f"tensorhub: the SGLang loader needs {' and '.join(missing)} in its environment "
                         "(or configure())")
    return {"servers": os.environ["TH_SERVERS"].split(","), "model": os.environ["TH_MODEL"],
            "token": os.environ.get("TH_TOKEN", ""), "token_file": os.environ.get("TH_TOKEN_FILE", ""),
            "replica_prefix": os.environ.get("TH_REPLICA_PREFIX", "sglang"),
            "datacenter": os.environ.get("TH_DATACENTER", ""), "timeout_s": os.environ.get("TH_TIMEOUT_S", "600")}


def _rank() -> int:
    import torch.distributed as distributed
    return distributed.get_rank() if distributed.is_available() and distributed.is_initialized() else 0


def _device_of(model: Any) -> Any:
    parameters = getattr(model, "parameters", None)
    if callable(parameters):
        for parameter in parameters():
            return parameter.device
    return "cpu"
