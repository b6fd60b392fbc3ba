"""Tensors that know their place (README "Layouts"): shapes compared between replicas, pieces of
the model's tensors placed with tensorhub.layouts and checked by the server (ctest -L python)."""

from __future__ import annotations

import threading

import pytest
import torch

import tensorhub
from tensorhub import layouts


from conftest import open_handle as handle  # noqa: E402  (the fixture `server` is conftest's too)


def on_every_shard(work, shards):
    """Runs work(shard) for each shard at once (a replica's shards call together); returns each
    one's result or the exception it raised."""
    results = [None] * shards

    def run(shard):
        try:
            results[shard] = work(shard)
        except Exception as error:  # noqa: BLE001 (handed back to the test to judge)
            results[shard] = error

    threads = [threading.Thread(target=run, args=(shard,)) for shard in range(shards)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
        assert not thread.is_alive(), "a shard's call did not return"
    return results


def test_a_transposed_tensor_is_refused_naming_it_and_both_shapes(server):
    # Same byte count, other shape: before, the reader took the bytes and reported success.
    with handle(server, "trainer") as trainer, handle(server, "rollout") as rollout:
        trainer.register("w", torch.randn(32, 64))
        rollout.register("w", torch.zeros(64, 32))
        trainer.publish(1)
        with pytest.raises(tensorhub.LayoutMismatch) as refused:
            rollout.replicate("latest", timeout=10)
        assert "tensor 'w': shape [32, 64] in the model, [64, 32] here" in str(refused.value)
        trainer.unpublish()


def test_a_missing_tensor_is_named(server):
    with handle(server, "trainer") as trainer, handle(server, "rollout") as rollout:
        trainer.register("a", torch.zeros(4))
        trainer.register("b", torch.zeros(4))
        rollout.register("a", torch.zeros(4))
        trainer.publish(1)
        with pytest.raises(tensorhub.LayoutMismatch) as refused:
            rollout.replicate("latest", timeout=10)
        assert "tensor 'b' is missing here" in str(refused.value)
        trainer.unpublish()


def test_placements_of_the_common_layouts():
    assert layouts.column_parallel((96, 64), 1, 2) == layouts.Placement((96, 64), (48, 0), (48, 64))
    assert layouts.row_parallel((64, 96), 2, 3) == layouts.Placement((64, 96), (0, 64), (64, 32))
    assert layouts.replicated((64,)) == layouts.Placement((64,), (0,), (64,))
    # FSDP2 Shard(0) cuts as torch.chunk does: 10 rows over 4 ranks are 3, 3, 3, 1.
    rows = [layouts.dim0_shard((10, 8), rank, 4) for rank in range(4)]
    assert [p.extent[0] for p in rows] == [len(c) for c in torch.arange(10).chunk(4)]
    assert layouts.dim0_shard((2, 8), 3, 4) is None  # torch.chunk gives this rank nothing
    full = torch.arange(96 * 64).reshape(96, 64)
    assert torch.equal(layouts.column_parallel(full.shape, 1, 2).slice_of(full), full[48:])
    with pytest.raises(ValueError, match="does not split into 5 equal pieces"):
        layouts.split((64, 64), 0, 0, 5)
    with pytest.raises(ValueError, match="does not lie within"):
        layouts.Placement((4,), (2,), (4,))


def test_a_placement_must_fit_the_tensor(server):
    with handle(server, "trainer") as trainer:
        with pytest.raises(tensorhub.InvalidArgument, match=r"tensor 'w' has shape \[48, 64\], its placement a piece of \[32, 64\]"):
            trainer.register("w", torch.zeros(48, 64), layouts.column_parallel((64, 64), 0, 2))
        with pytest.raises(tensorhub.InvalidArgument, match="lies outside its shape"):
            trainer.register("w", torch.zeros(48, 64), global_shape=(64, 64), offset=(32, 0))
        with pytest.raises(tensorhub.InvalidArgument, match="'nope', which the state dict does not have"):
            trainer.register_state_dict({"w": torch.zeros(4)}, placements={"nope": layouts.whole((4,))})


def tensor_parallel_state(rank, size, full):
    """Megatron-style pieces of a small layer: q/k/v rows split, output columns split, norm whole."""
    return {
        "qkv.weight": (layouts.column_parallel(full["qkv.weight"].shape, rank, size)),
        "o.weight": (layouts.row_parallel(full["o.weight"].shape, rank, size)),
        "norm.weight": layouts.replicated(full["norm.weight"].shape),
    }


def test_a_tensor_parallel_replica_publishes_pieces_and_a_like_replica_reads_them(server):
    torch.manual_seed(7)
    full = {"qkv.weight": torch.randn(96, 64), "o.weight": torch.randn(64, 64), "norm.weight": torch.randn(64)}
    received = [{}, {}]

    def shard(rank):
        placements = tensor_parallel_state(rank, 2, full)
        pieces = {name: placements[name].slice_of(full[name]).clone() for name in full}
        empty = {name: torch.zeros_like(piece) for name, piece in pieces.items()}
        with handle(server, "trainer", num_shards=2, shard=rank) as trainer, \
                handle(server, "rollout", num_shards=2, shard=rank) as rollout:
            trainer.register_state_dict(pieces, placements=placements)
            rollout.register_state_dict(empty, placements=placements)
            trainer.publish(1)
            rollout.replicate("latest", timeout=30)
            received[rank] = empty
            trainer.unpublish()
            rollout.close()
        return pieces

    results = on_every_shard(shard, 2)
    for rank, pieces in enumerate(results):
        assert not isinstance(pieces, Exception), pieces
        for name in full:
            assert torch.equal(received[rank][name], pieces[name]), name


def test_pieces_that_overlap_are_refused_at_publish_on_every_shard(server):
    full = torch.randn(64, 64)
    boxes = [layouts.Placement((64, 64), (0, 0), (40, 64)), layouts.Placement((64, 64), (32, 0), (32, 64))]

    def shard(rank):
        with handle(server, "trainer", num_shards=2, shard=rank) as trainer:
            trainer.register("w", boxes[rank].slice_of(full).clone(), boxes[rank])
            trainer.publish(1)

    results = on_every_shard(shard, 2)
    for result in results:
        assert isinstance(result, tensorhub.LayoutMismatch), result
        assert "tensor 'w'" in str(result) and "overlap in [32:40, 0:64]" in str(result)


def test_dimensions_are_whole_numbers():
    import numpy as np
    assert layouts.Placement((np.int64(8),), (0,), (torch.tensor(8).item(),)).global_shape == (8,)
    with pytest.raises(ValueError, match="whole numbers"):
        layouts.Placement((8.5,), (0,), (4,))
    with pytest.raises(ValueError, match="whole numbers"):
        layouts.whole((True, 4))


def test_a_placement_that_does_not_fit_64_bits_is_refused_clearly(server):
    with handle(server, "trainer") as trainer:
        with pytest.raises(tensorhub.InvalidArgument, match="whole numbers from 0 to 2"):
            trainer.register("w", torch.zeros(4), global_shape=(-4,))
        with pytest.raises(tensorhub.InvalidArgument, match="is not its shape's size"):
            trainer._core.register_raw("w", torch.zeros(2).data_ptr(), 8, "float32", False, shape=[1 << 20])


def test_the_example_reshard_megatron_and_fsdp_into_vllm_layouts():
    # Issue 31's example: TP=2 and FSDP trainers into fused, renamed vLLM-style rollouts at TP=1
    # (float32) and TP=4, every tensor bit-exact against the same tensor computed from the full weights.
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    result = subprocess.run([sys.executable, os.path.join(root, "examples", "reshard.py")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "reshard: ok" in result.stdout
    assert "vllm-tp4-bf16 updated to version 2 from fsdp" in result.stdout, result.stdout
    assert result.stdout.count("bit-exact") == 4, result.stdout


def test_a_reader_of_another_layout_asking_for_a_tensor_nobody_holds_is_told_which(server):
    with handle(server, "trainer", num_shards=2, shard=0) as t0, handle(server, "trainer", num_shards=2, shard=1) as t1, \
            handle(server, "rollout") as rollout:
        full = torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8)
        for rank, hub in enumerate((t0, t1)):
            placement = layouts.column_parallel((64, 8), rank, 2)
            hub.register("w", placement.slice_of(full).clone(), placement)
        on_every_shard(lambda r: (t0, t1)[r].publish(1), 2)
        rollout.register("w", torch.zeros(64, 8), layouts.whole((64, 8)))
        rollout.register("lm_head", torch.zeros(4, 8), layouts.whole((4, 8)))
        with pytest.raises(tensorhub.LayoutMismatch) as refused:
            rollout.replicate("latest", timeout=10)
        assert "tensor 'lm_head': no shard of the layout of 2 shards" in str(refused.value)
        rollout.unregister("lm_head")
        rollout.replicate("latest", timeout=10)  # what it can read, it reads
        assert torch.equal(rollout.tensors["w"], full)
        on_every_shard(lambda r: (t0, t1)[r].unpublish(), 2)


def test_a_hook_gets_each_tensor_of_a_read_across_layouts_once_assembled(server):
    torch.manual_seed(11)
    full = {"qkv.weight": torch.randn(96, 64), "o.weight": torch.randn(64, 64), "norm.weight": torch.randn(64)}
    trainers = [handle(server, "trainer", num_shards=2, shard=rank) for rank in range(2)]
    with trainers[0] as t0, trainers[1] as t1, handle(server, "rollout") as rollout:
        for rank, hub in enumerate((t0, t1)):
            placements = tensor_parallel_state(rank, 2, full)
            hub.register_state_dict({name: placements[name].slice_of(full[name]).clone() for name in full},
                                    placements=placements)
        on_every_shard(lambda r: (t0, t1)[r].publish(1), 2)
        # The TP=1 rollout keeps its weights in bfloat16: each lands converted, whole, then is hooked.
        target = {name: torch.zeros(tuple(t.shape), dtype=torch.bfloat16) for name, t in full.items()}
        rollout.register_state_dict(target, placements={name: layouts.whole(tuple(t.shape)) for name, t in full.items()})
        hooked = []

        def on_tensor(name, tensor):
            assert tensor is target[name]
            assert torch.equal(tensor, full[name].to(torch.bfloat16)), name
            hooked.append(name)

        assert rollout.replicate("latest", timeout=30, on_tensor=on_tensor).version == 1
        assert sorted(hooked) == sorted(full)
        on_every_shard(lambda r: (t0, t1)[r].unpublish(), 2)
