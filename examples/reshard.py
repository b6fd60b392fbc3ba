#!/usr/bin/env python3
"""Any trainer layout to any rollout layout (README "Layouts"), with a Llama-like model in torch.

A trainer at tensor parallelism 2 holds its weights as Megatron does (q/k/v and gate/up split by
rows, o and down by columns, the vocabulary split, norms whole on every rank) and publishes them
as pieces of the model's tensors, under the Hugging Face names. Rollouts hold the vLLM layout:
fused ``qkv_proj`` and ``gate_up_proj`` (one buffer each, q|k|v and gate|up stacked by rows), at
TP=1 in float32 and at TP=4 in bfloat16. Each rollout describes its buffers as views onto pieces
of the same logical tensors (the name map below), and TensorHub's reader plans which bytes of
which trainer shard land where: no gather, no staging copy on either side. An FSDP trainer
(each parameter cut by rows over 4 ranks, as FSDP2's Shard(0) does) then publishes version 2 of
the same model from its own flat parameter shards; the rollouts update to it.

Every rollout tensor is compared bit for bit with the same tensor computed here from the full
weights. Exits 0 and prints "reshard: ok" only then.

    python3 examples/reshard.py [--hidden 64] [--layers 2]

Needs th-server (started here as a child; found on PATH, in $TH_SERVER_BINARY, or in the build
tree) and the tensorhub package (PYTHONPATH=build/python, or installed).
"""

from __future__ import annotations

import argparse
import sys
import threading
from dataclasses import dataclass
from typing import Callable, Dict, List, Tuple

import torch

import tensorhub
from tensorhub import layouts


@dataclass(frozen=True)
class Config:
    vocab: int = 256
    hidden: int = 64
    heads: int = 8
    kv_heads: int = 4
    intermediate: int = 128
    layers: int = 2

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def hf_shapes(cfg: Config) -> Dict[str, Tuple[int, ...]]:
    """The Hugging Face names and shapes of a Llama/Qwen-style model's parameters."""
    shapes: Dict[str, Tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab, cfg.hidden),
                                          "model.norm.weight": (cfg.hidden,),
                                          "lm_head.weight": (cfg.vocab, cfg.hidden)}
    kv = cfg.kv_heads * cfg.head_dim
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        shapes[p + "self_attn.q_proj.weight"] = (cfg.hidden, cfg.hidden)
        shapes[p + "self_attn.k_proj.weight"] = (kv, cfg.hidden)
        shapes[p + "self_attn.v_proj.weight"] = (kv, cfg.hidden)
        shapes[p + "self_attn.o_proj.weight"] = (cfg.hidden, cfg.hidden)
        shapes[p + "mlp.gate_proj.weight"] = (cfg.intermediate, cfg.hidden)
        shapes[p + "mlp.up_proj.weight"] = (cfg.intermediate, cfg.hidden)
        shapes[p + "mlp.down_proj.weight"] = (cfg.hidden, cfg.intermediate)
        shapes[p + "input_layernorm.weight"] = (cfg.hidden,)
        shapes[p + "post_attention_layernorm.weight"] = (cfg.hidden,)
    return shapes


def full_weights(cfg: Config, version: int) -> Dict[str, torch.Tensor]:
    """What the training step produced: every parameter whole, in bfloat16."""
    generator = torch.Generator().manual_seed(1000 + version)
    return {name: torch.randn(shape, generator=generator).to(torch.bfloat16)
            for name, shape in hf_shapes(cfg).items()}


# ---- the trainers' layouts -----------------------------------------------------------------------

def megatron_placement(name: str, shape: Tuple[int, ...], rank: int, size: int) -> layouts.Placement:
    """Megatron tensor parallelism: column-parallel linears split their rows, row-parallel ones
    their columns, the vocabulary is split, norms stay whole on every rank."""
    if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight")):
        return layouts.column_parallel(shape, rank, size)
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return layouts.row_parallel(shape, rank, size)
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return layouts.vocab_parallel(shape, rank, size)
    return layouts.whole(shape)


def trainer_tp(cfg: Config, weights: Dict[str, torch.Tensor], rank: int, size: int):
    """Rank `rank`'s parameters (its own tensors, as the trainer holds them) and their places."""
    held = {}
    for name, full in weights.items():
        placement = megatron_placement(name, tuple(full.shape), rank, size)
        held[name] = (placement.slice_of(full).clone(), placement)
    return held


def trainer_fsdp(cfg: Config, weights: Dict[str, torch.Tensor], rank: int, size: int):
    """FSDP2 Shard(0): each parameter's rows cut as torch.chunk cuts them (a rank may hold none)."""
    held = {}
    for name, full in weights.items():
        placement = layouts.dim0_shard(tuple(full.shape), rank, size)
        if placement is not None:
            held[name] = (placement.slice_of(full).clone(), placement)
    return held


# ---- the rollouts' layout: vLLM's fused, renamed tensors ---------------------------------------------

# vLLM name -> the Hugging Face tensors it stacks by rows, in order. Written from the public
# descriptions of vLLM's Llama (QKVParallelLinear, MergedColumnParallelLinear); every other name
# is the Hugging Face one.
FUSED = {
    "self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}


def vllm_tensors(cfg: Config, rank: int, size: int) -> List[Tuple[str, List[Tuple[str, layouts.Placement]]]]:
    """The rollout's tensors at TP `size`, rank `rank`: (vLLM name, [(HF name, placement), ...]),
    the parts stacked by rows in one buffer."""
    shapes = hf_shapes(cfg)
    out = []
    for name, shape in shapes.items():
        layer, _, rest = name.rpartition("layers.")
        prefix = ""
        if layer:
            index, _, rest = rest.partition(".")
            prefix = layer + "layers." + index + "."
        fused = next((vllm for vllm, parts in FUSED.items() if rest == parts[0]), None)
        if fused is not None:
            parts = [prefix + part for part in FUSED[fused]]
            out.append((prefix + fused, [(p, megatron_placement(p, shapes[p], rank, size)) for p in parts]))
        elif any(rest in parts[1:] for parts in FUSED.values()):
            continue  # stacked into a fused tensor above
        else:
            out.append((name, [(name, megatron_placement(name, shape, rank, size))]))
    return out


def rollout_buffers(cfg: Config, rank: int, size: int, dtype: torch.dtype):
    """The engine's buffers (as vLLM allocates them) and the views of them that TensorHub fills."""
    buffers: Dict[str, torch.Tensor] = {}
    views = []
    for vllm_name, parts in vllm_tensors(cfg, rank, size):
        rows = sum(placement.extent[0] for _, placement in parts)
        inner = tuple(parts[0][1].extent[1:])
        buffer = torch.zeros((rows, *inner), dtype=dtype)
        buffers[vllm_name] = buffer
        at = 0
        for hf_name, placement in parts:
            views.append((hf_name, buffer[at:at + placement.extent[0]], placement))
            at += placement.extent[0]
    return buffers, views


def expected_rollout(cfg: Config, weights, rank: int, size: int, dtype: torch.dtype) -> Dict[str, torch.Tensor]:
    """The rollout's tensors computed here from the full weights: what vLLM's loader would make."""
    return {vllm_name: torch.cat([placement.slice_of(weights[hf]) for hf, placement in parts]).to(dtype)
            for vllm_name, parts in vllm_tensors(cfg, rank, size)}


# ---- running it --------------------------------------------------------------------------------------

def on_every_shard(work: Callable[[int], object], shards: int) -> list:
    """A replica's shards call together (each in a process of its own in a real deployment)."""
    results: list = [None] * shards

    def run(shard: int) -> None:
        try:
            results[shard] = work(shard)
        except Exception as error:  # noqa: BLE001 (raised below, in the caller's thread)
            results[shard] = error

    threads = [threading.Thread(target=run, args=(s,)) for s in range(shards)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
        if thread.is_alive():
            raise RuntimeError("a shard's call did not return in 120 s")
    for result in results:
        if isinstance(result, Exception):
            raise result
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    cfg = Config(hidden=args.hidden, layers=args.layers)
    v1, v2 = full_weights(cfg, 1), full_weights(cfg, 2)

    with tensorhub.Server() as server:
        def handle(replica: str, shard: int, shards: int, role: str = "rollout") -> tensorhub.Handle:
            return tensorhub.Handle(servers=server.address, token=server.token, model="llama", replica=replica,
                                    shard=shard, num_shards=shards, role=role, keep_latest=0)

        # The Megatron trainer, TP=2: publishes version 1 from its own slices.
        trainer = [handle("megatron", r, 2, "trainer") for r in range(2)]
        for rank, hub in enumerate(trainer):
            for name, (tensor, placement) in trainer_tp(cfg, v1, rank, 2).items():
                hub.register(name, tensor, placement)
        on_every_shard(lambda r: trainer[r].publish(1), 2)
        print("reshard: megatron TP=2 published version 1")

        rollouts = {"vllm-tp1-fp32": (1, torch.float32), "vllm-tp4-bf16": (4, torch.bfloat16)}
        opened = {}
        for replica, (size, dtype) in rollouts.items():
            hubs = [handle(replica, r, size) for r in range(size)]
            buffers = []
            for rank, hub in enumerate(hubs):
                engine, views = rollout_buffers(cfg, rank, size, dtype)
                for hf_name, view, placement in views:
                    hub.register(hf_name, view, placement)
                buffers.append(engine)
            opened[replica] = (hubs, buffers, size, dtype)

        def check(version: int, weights) -> None:
            for replica, (hubs, buffers, size, dtype) in opened.items():
                for rank in range(size):
                    expected = expected_rollout(cfg, weights, rank, size, dtype)
                    for vllm_name, want in expected.items():
                        got = buffers[rank][vllm_name]
                        if not torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8)):
                            raise SystemExit(f"reshard: {replica} rank {rank} '{vllm_name}' differs at version {version}")
                print(f"reshard: {replica} (TP={size}, {str(dtype).removeprefix('torch.')}) holds version {version}: "
                      f"{len(expected)} tensors per rank bit-exact, qkv_proj and gate_up_proj fused")

        for replica, (hubs, _, size, _) in opened.items():
            results = on_every_shard(lambda r, hubs=hubs: hubs[r].replicate("latest", timeout=60), size)
            print(f"reshard: {replica} read version {results[0].version} from {results[0].source}")
        check(1, v1)

        # The FSDP trainer: each rank publishes its own rows of every parameter, in place (the
        # tensors registered are its parameters: nothing is allocated to publish them).
        for hub in trainer:
            hub.unpublish()
            hub.close()
        fsdp_params = [trainer_fsdp(cfg, v2, r, 4) for r in range(4)]
        fsdp = [handle("fsdp", r, 4, "trainer") for r in range(4)]
        for rank, hub in enumerate(fsdp):
            for name, (tensor, placement) in fsdp_params[rank].items():
                hub.register(name, tensor, placement)
                if hub.tensors[name].data_ptr() != tensor.data_ptr():
                    raise SystemExit("reshard: a registered FSDP parameter is not the parameter itself")
        on_every_shard(lambda r: fsdp[r].publish(2), 4)
        print("reshard: FSDP x4 published version 2 from its own parameter shards")
        for replica, (hubs, _, size, _) in opened.items():
            results = on_every_shard(lambda r, hubs=hubs: hubs[r].update("latest"), size)
            print(f"reshard: {replica} updated to version {results[0].version} from {results[0].source}")
        check(2, v2)
        for hubs, *_ in opened.values():
            for hub in hubs:
                hub.close()
        for hub in fsdp:
            hub.unpublish()
            hub.close()
    print("reshard: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
