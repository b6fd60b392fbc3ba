"""Pulling versions into an engine through its ``load_weights``: what the vLLM and SGLang adapters
share, and what any framework whose model loads ``(name, tensor)`` pairs can use itself.

A :class:`Puller` keeps one buffer per tensor of the model, of the tensor's whole shape, on the
engine's device, registered once with its :class:`tensorhub.Handle` as the whole of the model's
tensor (so that a trainer of any layout that publishes pieces serves it, and engines read from one
another). ``pull(version, manifest, load_weights)`` brings the version into them from any peer and
calls ``load_weights([(name, tensor)])`` for each tensor as soon as its bytes are verified, while
the rest are still on the wire::

    hub = tensorhub.Handle(servers=..., token=..., model="llama", replica="rollout-7")
    puller = Puller(hub, device="cuda:0")
    puller.pull(version, manifest, model.load_weights)   # manifest: [(name, dtype name, shape)]

The manifest is what the trainer published (:func:`manifest_of` computes it from its tensors);
it must be the same every time: the buffers are the model's size, made once.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import tensorhub
from tensorhub import layouts

Manifest = List[Tuple[str, str, Tuple[int, ...]]]  # (Hugging Face name, torch dtype name, whole shape)


def manifest_of(tensors: Iterable[Tuple[str, Any]],
                placements: Optional[Mapping[str, layouts.Placement]] = None) -> Manifest:
    """The manifest of a trainer's tensors: each tensor's whole shape (its placement's, if the
    tensor is a piece) and dtype."""
    placements = placements or {}
    manifest = []
    for name, tensor in tensors:
        shape = placements[name].global_shape if name in placements else tuple(tensor.shape)
        manifest.append((name, str(tensor.dtype).replace("torch.", ""), tuple(int(size) for size in shape)))
    return manifest


def check_manifest(manifest: Sequence[Tuple[str, str, Sequence[int]]]) -> Manifest:
    """The manifest as tuples, or ValueError naming what is wrong (a name twice, a bad entry)."""
    checked: Manifest = []
    seen = set()
    for entry in manifest:
        if len(entry) != 3:
            raise ValueError(f"a manifest entry is (name, dtype name, shape), not {entry!r}")
        name, dtype_name, shape = entry
        if not isinstance(name, str) or not name or name in seen:
            raise ValueError(f"manifest: tensor names must be unique, non-empty strings ({name!r})")
        seen.add(name)
        checked.append((name, str(dtype_name), tuple(int(size) for size in shape)))
    return checked


class Puller:
    """Versions into an engine's model, through its ``load_weights`` (see the module's docstring).
    ``timeout_s`` bounds one pull: a version that does not arrive raises TimeoutError."""

    def __init__(self, hub: tensorhub.Handle, device: Any = "cpu", timeout_s: float = 600.0) -> None:
        self.hub = hub
        self.device = device
        self.timeout_s = timeout_s
        self._manifest: Optional[Manifest] = None
        self._staging: Dict[str, Any] = {}

    def pull(self, version: int, manifest: Sequence[Tuple[str, str, Sequence[int]]],
             load_weights: Callable[[List[Tuple[str, Any]]], Any]) -> tensorhub.UpdateInfo:
        """Brings ``version`` in and loads every tensor of it once; returns what update() said."""
        checked = check_manifest(manifest)
        self._stage(checked)
        loaded = set()

        def land(name: str, tensor: Any) -> None:
            load_weights([(name, tensor)])
            loaded.add(name)

        # "not yet": smart skipping (the version still crosses datacenters to a peer here; a
        # rollout would go on with its weights meanwhile). A pull must end with the version: ask
        # again, backing off.
        deadline = time.monotonic() + self.timeout_s
        pause_s = 0.01
        while True:
            info = self.hub.update(int(version), on_tensor=land)
            if info.status != "not-yet":
                break
            if time.monotonic() + pause_s > deadline:
                raise TimeoutError(f"tensorhub: version {version} did not reach this engine's datacenter "
                                   f"within {self.timeout_s} s")
            time.sleep(pause_s)
            pause_s = min(2 * pause_s, 0.5)
        if info.version != version:
            raise RuntimeError(f"tensorhub: asked for version {version}, holding {info.version} ({info.status})")
        if not info.updated:
            # Held already (the same version pulled again): the buffers have it; load them again.
            for name, _, _ in checked:
                land(name, self._staging[name])
        missing = [name for name, _, _ in checked if name not in loaded]
        if missing:
            raise RuntimeError(f"tensorhub: version {version} arrived without {len(missing)} tensor(s), "
                               f"first '{missing[0]}'")
        return info

    def _stage(self, manifest: Manifest) -> None:
        """The buffers, made and registered at the first pull; later pulls must name the same
        tensors (a trainer's model keeps its tensors' shapes)."""
        if self._manifest is not None:
            if manifest != self._manifest:
                changed = next((a for a, b in zip(manifest, self._manifest) if a != b), None)
                raise ValueError("tensorhub: the version's tensors differ from the first pull's "
                                 f"({changed or 'another number of tensors'}); make a new Puller for another model")
            return
        import torch
        staging = {}
        for name, dtype_name, shape in manifest:
            dtype = getattr(torch, dtype_name, None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"tensorhub: tensor '{name}' has dtype '{dtype_name}', which torch does not know")
            staging[name] = torch.empty(shape, dtype=dtype, device=self.device)
        # Each the whole of the model's tensor: a piece, so that a trainer of any layout (TP, FSDP)
        # that publishes pieces serves it (README "Layouts"), and engines read one another.
        self.hub.register_state_dict(staging, placements={name: layouts.whole(shape) for name, _, shape in manifest})
        self._staging = staging
        self._manifest = manifest
