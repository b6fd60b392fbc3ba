#!/usr/bin/env python3
"""vLLM pulls its weights from TensorHub: the ``tensorhub`` weight-transfer backend, run against a
stand-in of vLLM (vLLM cannot be installed where this was written; see the README, "Using
TensorHub from vLLM / SGLang / your framework").

A trainer of a Llama-like model (Hugging Face names) publishes each step's weights from its own
tensors; a vLLM engine of two tensor-parallel workers pulls each version, every worker loading it
through the model's ``load_weights`` (which fuses q/k/v and gate/up and keeps its rank's slice,
as vLLM's model classes do); the phases go as vLLM drives them (init once; start, update, finish
each step). Every worker's parameters are compared bit for bit with the same slices computed from
the trainer's full weights; prints "vllm_backend: ok" only then.

    python3 examples/vllm_backend.py [--steps 3] [--tp 2]

The stand-ins (StandInModel, StandInWorker, StandInLLM, StandInModelRunner for SGLang) follow
vLLM's and SGLang's published interfaces: vllm/distributed/weight_transfer/, the worker's round
state machine in vllm/v1/worker/gpu_worker.py, SGLang's ModelRunner.update_weights_from_tensor.
tests/python/test_integrations.py uses them too.

Needs th-server (started here: on PATH, in $TH_SERVER_BINARY, or in the build tree) and the
tensorhub package (installed, or PYTHONPATH=build/python).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib
import sys
import types
from typing import Dict, Iterable, List, Tuple

import torch

import tensorhub
from tensorhub.integrations import vllm as backend

HIDDEN, INTERMEDIATE, VOCAB, LAYERS = 8, 16, 32, 2


def hf_state_dict(seed: int) -> Dict[str, torch.Tensor]:
    """A Llama-like model's weights under Hugging Face names, full (as a checkpoint has them)."""
    generator = torch.Generator().manual_seed(seed)
    weights = {"model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=generator),
               "model.norm.weight": torch.randn(HIDDEN, generator=generator),
               "lm_head.weight": torch.randn(VOCAB, HIDDEN, generator=generator)}
    for layer in range(LAYERS):
        prefix = f"model.layers.{layer}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            weights[prefix + f"self_attn.{name}.weight"] = torch.randn(HIDDEN, HIDDEN, generator=generator)
        for name in ("gate_proj", "up_proj"):
            weights[prefix + f"mlp.{name}.weight"] = torch.randn(INTERMEDIATE, HIDDEN, generator=generator)
        weights[prefix + "mlp.down_proj.weight"] = torch.randn(HIDDEN, INTERMEDIATE, generator=generator)
        for name in ("input_layernorm", "post_attention_layernorm"):
            weights[prefix + f"{name}.weight"] = torch.randn(HIDDEN, generator=generator)
    return {name: tensor.to(torch.bfloat16) for name, tensor in weights.items()}


class StandInModel:
    """One tensor-parallel rank of a vLLM-style Llama: fused qkv_proj and gate_up_proj, column-
    parallel layers split by rows, row-parallel ones by columns, the vocabulary split, norms whole."""

    STACKED = [(".qkv_proj", ".q_proj", 0), (".qkv_proj", ".k_proj", 1), (".qkv_proj", ".v_proj", 2),
               (".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1)]

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size
        self.params: Dict[str, torch.Tensor] = {
            "model.embed_tokens.weight": torch.zeros(VOCAB // size, HIDDEN, dtype=torch.bfloat16),
            "model.norm.weight": torch.zeros(HIDDEN, dtype=torch.bfloat16),
            "lm_head.weight": torch.zeros(VOCAB // size, HIDDEN, dtype=torch.bfloat16)}
        for layer in range(LAYERS):
            prefix = f"model.layers.{layer}."
            self.params[prefix + "self_attn.qkv_proj.weight"] = torch.zeros(3 * HIDDEN // size, HIDDEN, dtype=torch.bfloat16)
            self.params[prefix + "self_attn.o_proj.weight"] = torch.zeros(HIDDEN, HIDDEN // size, dtype=torch.bfloat16)
            self.params[prefix + "mlp.gate_up_proj.weight"] = torch.zeros(2 * INTERMEDIATE // size, HIDDEN, dtype=torch.bfloat16)
            self.params[prefix + "mlp.down_proj.weight"] = torch.zeros(HIDDEN, INTERMEDIATE // size, dtype=torch.bfloat16)
            for name in ("input_layernorm", "post_attention_layernorm"):
                self.params[prefix + f"{name}.weight"] = torch.zeros(HIDDEN, dtype=torch.bfloat16)
        self.loaded: List[str] = []

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> set:
        done = set()
        for name, full in weights:
            self.loaded.append(name)
            for fused, part, index in self.STACKED:
                if part in name:
                    target = self.params[name.replace(part, fused)]
                    rows = full.shape[0] // self.size  # this rank's rows of the part
                    target[index * rows:(index + 1) * rows].copy_(full.narrow(0, self.rank * rows, rows))
                    done.add(name.replace(part, fused))
                    break
            else:
                target = self.params[name]
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    piece = full.narrow(1, self.rank * target.shape[1], target.shape[1])
                elif target.shape != full.shape:  # the vocabulary
                    piece = full.narrow(0, self.rank * target.shape[0], target.shape[0])
                else:
                    piece = full
                target.copy_(piece)
                done.add(name)
        return done


def expected_params(weights: Dict[str, torch.Tensor], rank: int, size: int) -> Dict[str, torch.Tensor]:
    """What rank `rank` of `size` must hold, from the full weights (written apart from the loader)."""
    def rows(tensor):
        return tensor.chunk(size, 0)[rank]
    out = {"model.embed_tokens.weight": rows(weights["model.embed_tokens.weight"]),
           "model.norm.weight": weights["model.norm.weight"], "lm_head.weight": rows(weights["lm_head.weight"])}
    for layer in range(LAYERS):
        p = f"model.layers.{layer}."
        out[p + "self_attn.qkv_proj.weight"] = torch.cat([rows(weights[p + f"self_attn.{n}_proj.weight"]) for n in "qkv"])
        out[p + "self_attn.o_proj.weight"] = weights[p + "self_attn.o_proj.weight"].chunk(size, 1)[rank]
        out[p + "mlp.gate_up_proj.weight"] = torch.cat([rows(weights[p + f"mlp.{n}_proj.weight"]) for n in ("gate", "up")])
        out[p + "mlp.down_proj.weight"] = weights[p + "mlp.down_proj.weight"].chunk(size, 1)[rank]
        for name in ("input_layernorm", "post_attention_layernorm"):
            out[p + f"{name}.weight"] = weights[p + f"{name}.weight"]
    return out


# The stand-in of vLLM: a factory of engines by name, workers, and the API layer.
ENGINES = {backend.BACKEND: backend.TensorHubWeightTransferEngine}


class StandInWorker:
    """vLLM's worker (gpu_worker.py): makes its engine after loading the model, guards the rounds."""

    def __init__(self, rank: int, size: int, data_parallel_rank: int = 0):
        self.model = StandInModel(rank, size)
        vllm_config = types.SimpleNamespace(
            parallel_config=types.SimpleNamespace(rank=rank, tensor_parallel_size=size, data_parallel_rank=data_parallel_rank),
            model_config=None)
        config = types.SimpleNamespace(backend=backend.BACKEND)
        self.engine = ENGINES[config.backend](config, vllm_config, torch.device("cpu"), self.model)
        self.active = False

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.engine.init_transfer_engine(self.engine.parse_init_info(init_info))

    def start_weight_update(self) -> None:
        if self.active:
            raise RuntimeError("a weight update is already active")
        self.engine.start_weight_update()
        self.active = True

    def update_weights(self, update_info: dict) -> None:
        if not self.active:
            raise RuntimeError("update_weights without start_weight_update")
        try:
            self.engine.update_weights(update_info)
        except BaseException:
            self.active = False
            raise

    def finish_weight_update(self, weight_version=None) -> None:
        if not self.active:
            raise RuntimeError("finish_weight_update called without a matching start_weight_update")
        self.engine.finish_weight_update()
        self.active = False

    def shutdown(self) -> None:
        self.engine.shutdown()


class StandInLLM:
    """vLLM's LLM/AsyncLLM: each phase goes to every worker at once (collective_rpc) and returns
    when all are done; it records the order, to check the sender drives them as vLLM expects."""

    def __init__(self, workers: List[StandInWorker]):
        self.workers = workers
        self.calls: List[str] = []
        self._pool = concurrent.futures.ThreadPoolExecutor(len(workers))

    def _all(self, method: str, *args) -> None:
        self.calls.append(method)
        for future in [self._pool.submit(getattr(worker, method), *args) for worker in self.workers]:
            future.result()

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._all("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self._all("start_weight_update")

    def update_weights(self, update_info: dict) -> None:
        self._all("update_weights", update_info)

    def finish_weight_update(self, weight_version=None) -> None:
        self._all("finish_weight_update")

    def shutdown(self) -> None:
        self._all("shutdown")
        self._pool.shutdown()


class StandInModelRunner:
    """SGLang's ModelRunner.update_weights_from_tensor (one tensor-parallel rank): a load_format
    among the server's --custom-weight-loader paths is imported and called on the model."""

    def __init__(self, model: StandInModel, custom_weight_loader: List[str]):
        self.model = model
        self.custom_weight_loader = custom_weight_loader

    def update_weights_from_tensor(self, named_tensors, load_format=None):
        if load_format in self.custom_weight_loader:
            module, function = load_format.rsplit(".", 1)
            getattr(importlib.import_module(module), function)(self.model, named_tensors)
        elif load_format is None:
            self.model.load_weights(named_tensors)
        else:
            raise NotImplementedError(load_format)
        return True, "Succeeded to update model weights."



def check_workers(workers: List["StandInWorker"], weights: Dict[str, torch.Tensor]) -> None:
    """Every worker's parameters are its slices of `weights`, bit for bit."""
    for worker in workers:
        want = expected_params(weights, worker.model.rank, worker.model.size)
        for name, tensor in worker.model.params.items():
            if not torch.equal(tensor, want[name]):
                raise AssertionError(f"rank {worker.model.rank}: {name} differs from the trainer's")


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tp", type=int, default=2, choices=(1, 2, 4))
    args = parser.parse_args(argv)
    with tensorhub.Server() as server:
        workers = [StandInWorker(rank, args.tp) for rank in range(args.tp)]
        llm = StandInLLM(workers)
        trainer = hf_state_dict(0)  # the trainer's own tensors, changed in place each step
        init_info = {"servers": [server.address], "token": server.token, "model": "llama", "timeout_s": 60.0}
        with backend.TensorHubSender(servers=[server.address], token=server.token, model="llama",
                                     init_info=init_info, client=llm) as sender:
            for step in range(1, args.steps + 1):
                for name, tensor in trainer.items():  # "training": the optimizer steps in place
                    tensor.copy_(hf_state_dict(step)[name])
                sender.send_weights(trainer.items(), version=step)
                check_workers(workers, trainer)
                print(f"step {step}: {len(workers)} workers loaded version {step} ({len(trainer)} tensors)")
        llm.shutdown()
    print("vllm_backend: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
