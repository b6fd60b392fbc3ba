"""The engine adapters (tensorhub.integrations: vLLM's weight-transfer backend, SGLang's custom
loader) against stand-ins of the engines.

vLLM cannot be installed here. The stand-in keeps what the backend relies on, as vLLM's sources
describe it (vllm/distributed/weight_transfer/, vllm/v1/worker/gpu_worker.py): a factory of engines
by backend name; one engine per worker; the worker's round state machine (start twice, update or
finish outside a round: errors; a failed update ends the round); the API layer's fan-out of each
phase to every worker; and a Llama-style model whose load_weights takes full Hugging Face tensors,
fuses q/k/v and gate/up and keeps its tensor-parallel rank's slice, as vLLM's loaders do. For
SGLang: ModelRunner.update_weights_from_tensor, which calls a custom loader by its import path.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import types
from typing import List

import pytest
import torch

import tensorhub
from tensorhub import layouts
from tensorhub.integrations import sglang as hub_sglang
from tensorhub.integrations.puller import Puller
from tensorhub.integrations import vllm as backend

HIDDEN_FEATURES = 16
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
# The stand-ins of the engines are the example's (examples/vllm_backend.py), so the example runs too.
sys.path.insert(0, os.path.join(ROOT, "examples"))
from vllm_backend import (StandInLLM, StandInModel, StandInModelRunner, StandInWorker,  # noqa: E402
                          check_workers, hf_state_dict)


def init_info(server, model="llama") -> dict:
    return {"servers": [server.address], "token": server.token, "model": model, "timeout_s": 60.0}


def test_two_rounds_reach_every_tensor_parallel_rank_through_load_weights(server):
    workers = [StandInWorker(rank, 2) for rank in range(2)]
    llm = StandInLLM(workers)
    weights = hf_state_dict(1)
    trainer_tensors = {name: tensor.clone() for name, tensor in weights.items()}
    with backend.TensorHubSender(servers=[server.address], token=server.token, model="llama",
                                 init_info=init_info(server), client=llm) as sender:
        sender.send_weights(trainer_tensors.items(), version=1)
        check_workers(workers, weights)
        # Every tensor reached load_weights under its Hugging Face name, full, once per round.
        for worker in workers:
            assert sorted(worker.model.loaded) == sorted(weights)
        # The trainer steps in place (its tensors are no longer published), then sends again.
        weights2 = hf_state_dict(2)
        for name, tensor in trainer_tensors.items():
            tensor.copy_(weights2[name])
        sender.send_weights(trainer_tensors.items(), version=2)
        check_workers(workers, weights2)
    assert llm.calls == ["init_weight_transfer_engine"] + ["start_weight_update", "update_weights",
                                                          "finish_weight_update"] * 2
    llm.shutdown()


def test_workers_in_another_datacenter_than_the_trainer_get_every_round(server):
    # One worker seeds the version across datacenters; smart skipping answers the others "not
    # yet" (a rollout would go on with its weights), but a round must end with the version.
    workers = [StandInWorker(rank, 2) for rank in range(2)]
    llm = StandInLLM(workers)
    weights = hf_state_dict(4)
    remote = dict(init_info(server), datacenter="far")
    with backend.TensorHubSender(servers=[server.address], token=server.token, model="llama", init_info=remote,
                                 client=llm, datacenter="near") as sender:
        trainer_tensors = {name: tensor.clone() for name, tensor in weights.items()}
        for version in (1, 2):
            sender.send_weights(trainer_tensors.items(), version=version)
            check_workers(workers, weights)
        # Other tensors than the ones registered would not be what is published: refused.
        with pytest.raises(ValueError, match="same tensors every time"):
            sender.send_weights({name: tensor.clone() for name, tensor in weights.items()}.items(), version=3)
    llm.shutdown()


def test_a_trainer_of_two_ranks_publishes_its_own_pieces_and_gathers_nothing(server):
    workers = [StandInWorker(0, 1)]
    llm = StandInLLM(workers)
    weights = hf_state_dict(3)
    barrier = threading.Barrier(2)
    errors: List[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            # Megatron TP=2: column-parallel layers split by rows, row-parallel ones by columns.
            pieces, placements = {}, {}
            for name, full in weights.items():
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    placement = layouts.row_parallel(full.shape, rank, 2)
                elif full.dim() == 2:
                    placement = layouts.column_parallel(full.shape, rank, 2)
                else:
                    placement = layouts.whole(full.shape)
                pieces[name] = placement.slice_of(full).clone()
                placements[name] = placement
            with backend.TensorHubSender(servers=[server.address], token=server.token, model="llama2",
                                         init_info=init_info(server, "llama2"), client=llm if rank == 0 else None,
                                         rank=rank, world_size=2, placements=placements,
                                         barrier=barrier.wait) as sender:
                sender.send_weights(pieces.items(), version=1)
        except BaseException as error:  # reported below
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    check_workers(workers, weights)
    llm.shutdown()


def test_the_engine_refuses_what_vllm_would_refuse(server):
    worker = StandInWorker(0, 1)
    with pytest.raises(RuntimeError, match="without start_weight_update"):
        worker.update_weights({"version": 1, "names": [], "dtype_names": [], "shapes": []})
    with pytest.raises(RuntimeError, match="before init_transfer_engine"):
        worker.start_weight_update()
    with pytest.raises(ValueError, match="invalid init_info"):
        worker.init_weight_transfer_engine({"servers": [server.address], "model": "m", "nonsense": 1})
    with pytest.raises(ValueError, match="one of token and token_file"):
        worker.init_weight_transfer_engine({"servers": [server.address], "model": "m"})
    worker.init_weight_transfer_engine(init_info(server, "nothing-published"))
    worker.start_weight_update()
    with pytest.raises(ValueError, match="one length"):
        worker.update_weights({"version": 1, "names": ["a"], "dtype_names": [], "shapes": [[1]]})
    assert not worker.active  # a failed update ends the round, as vLLM's worker does
    with pytest.raises(RuntimeError, match="without a matching start"):
        worker.finish_weight_update()
    worker.shutdown()
    if not backend.VLLM_AVAILABLE:
        with pytest.raises(RuntimeError, match="vLLM is not installed"):
            backend.register()


def test_a_sender_of_several_ranks_needs_placements_and_a_barrier(server):
    with pytest.raises(ValueError, match="placements"):
        backend.TensorHubSender(servers=[server.address], token=server.token, model="m", init_info={},
                                client=object(), world_size=2)
    with pytest.raises(ValueError, match="barrier"):
        backend.TensorHubSender(servers=[server.address], token=server.token, model="m", init_info={},
                                client=object(), world_size=2, placements={})


def test_sglang_loads_each_version_through_its_custom_loader(server):
    runner = StandInModelRunner(StandInModel(0, 1), [hub_sglang.LOADER])
    hub_sglang.configure(servers=[server.address], token=server.token, model="sg", device="cpu")
    weights = hf_state_dict(5)
    trainer_tensors = {name: tensor.clone() for name, tensor in weights.items()}
    try:
        with tensorhub.Handle(servers=server.address, token=server.token, model="sg", replica="trainer",
                              role="trainer") as trainer:
            trainer.register_state_dict(trainer_tensors,
                                        placements={n: layouts.whole(t.shape) for n, t in trainer_tensors.items()})
            manifest = hub_sglang.manifest_of(trainer_tensors.items())
            for version, seed in ((1, 5), (2, 6)):
                for name, tensor in trainer_tensors.items():
                    tensor.copy_(hf_state_dict(seed)[name])
                trainer.publish(version)
                assert runner.update_weights_from_tensor(hub_sglang.request_tensors(version, manifest),
                                                         load_format=hub_sglang.LOADER)[0]
                trainer.unpublish()
                check_workers([types.SimpleNamespace(model=runner.model)], hf_state_dict(seed))
        # Weights sent as tensors are not a request: refused, naming what it takes.
        with pytest.raises(ValueError, match="request_tensors"):
            hub_sglang.load_from_hub(runner.model, list(weights.items())[:1])
    finally:
        hub_sglang.disconnect()


def test_the_example_vllm_backend():
    result = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "vllm_backend.py"), "--steps", "2"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "vllm_backend: ok" in result.stdout


def test_a_trainer_sends_its_modules_parameters_as_they_are(server):
    # named_parameters(): tensors that require grad, changed in place by the optimizer.
    module = torch.nn.Linear(HIDDEN_FEATURES, HIDDEN_FEATURES, bias=True)
    worker_model = types.SimpleNamespace(params={}, loaded=[])

    def load_weights(weights):
        for name, tensor in weights:
            worker_model.params[name] = tensor.clone()

    worker_model.load_weights = load_weights
    hub = tensorhub.Handle(servers=server.address, token=server.token, model="linear", replica="engine")
    puller = Puller(hub)

    class Client:  # the four methods, as LLM has them; the one engine pulls in update_weights
        def init_weight_transfer_engine(self, init_info): pass
        def start_weight_update(self): pass
        def update_weights(self, info):
            puller.pull(info["version"], list(zip(info["names"], info["dtype_names"], info["shapes"])), load_weights)
        def finish_weight_update(self, weight_version=None): pass

    with backend.TensorHubSender(servers=[server.address], token=server.token, model="linear", init_info={},
                                 client=Client()) as sender:
        for version in (1, 2):
            with torch.no_grad():
                module.weight.add_(1.0)  # the optimizer's step, in place
            sender.send_weights(module.named_parameters(), version=version)
            assert torch.equal(worker_model.params["weight"], module.weight.detach())
            assert torch.equal(worker_model.params["bias"], module.bias.detach())
    hub.close()
