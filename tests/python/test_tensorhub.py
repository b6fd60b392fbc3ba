"""The tensorhub Python package against a real th-server (ctest -L python).

Every call and its typed exceptions; state dicts of mixed dtypes, bit for bit; a torch module's
own parameters written in place; a 2-shard replica from two processes; a rollout process killed
mid-read; the GIL released while a call blocks; Ctrl-C during a blocking call; the example.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch

import tensorhub

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SPAWN = mp.get_context("spawn")


from conftest import open_handle as handle  # noqa: E402  (the fixture `server` is conftest's too)


def mixed_state_dict(seed: int):
    generator = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(300, 64, generator=generator),                       # float32, 75 KB
        "layer.weight": torch.randn(1024, 1024, generator=generator).to(torch.bfloat16),  # 2 MB: not packed
        "layer.bias": torch.randn(1024, generator=generator).to(torch.bfloat16),
        "steps": torch.randint(0, 1 << 40, (7,), generator=generator, dtype=torch.int64),
        "mask": torch.rand(33, generator=generator) > 0.5,                              # bool
        "table": np.arange(1000, dtype=np.int32) * seed,                                 # numpy
    }


def zeros_like(state):
    return {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else np.zeros_like(v)) for k, v in state.items()}


def equal(a, b):
    return all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else np.array_equal(a[k], b[k]) for k in a)


def test_a_mixed_state_dict_arrives_bit_exact(server):
    source = mixed_state_dict(3)
    target = zeros_like(source)
    with handle(server, "trainer", role="trainer") as trainer, handle(server, "rollout", role="rollout") as rollout:
        trainer.register_state_dict(source)
        rollout.register_state_dict(target)
        assert trainer.publish(1) == 1
        info = rollout.replicate("latest", timeout=30)
        assert info == tensorhub.ReplicateInfo(1, "trainer") and info.source_replica == "trainer"
        assert equal(source, target)
        assert rollout.stats()["checksum_failures"] == 0
        assert rollout.stats()["bytes_received"] > 2 << 20
        trainer.unpublish()
        rollout.close()


def test_a_trainer_that_writes_through_the_handle_sends_rollouts_patches(server):
    # Delta versions: float32 master weights written into the bf16 published tensor through
    # Handle.write; a rollout that holds the version before pulls a patch and ends bit-exact.
    generator = torch.Generator().manual_seed(5)
    master = torch.randn(512, 1024, generator=generator) * 0.02
    published = {"layer.weight": torch.zeros(512, 1024, dtype=torch.bfloat16)}
    engine = {"layer.weight": torch.zeros(512, 1024, dtype=torch.bfloat16)}
    with handle(server, "trainer", role="trainer") as trainer, handle(server, "rollout", role="rollout") as rollout:
        trainer.register_state_dict(published)
        rollout.register_state_dict(engine)
        trainer.write("layer.weight", master)
        trainer.publish(1)
        rollout.update()
        assert torch.equal(engine["layer.weight"], published["layer.weight"])
        for version in (2, 3):
            trainer.unpublish()
            changed = torch.rand(master.shape, generator=generator) < 0.02
            master[changed] *= 1.01
            trainer.write("layer.weight", master)
            trainer.publish(version)
            before = rollout.stats()["bytes_received"]
            rollout.update()
            assert torch.equal(engine["layer.weight"], published["layer.weight"])
            assert torch.equal(engine["layer.weight"], master.to(torch.bfloat16))
            assert rollout.stats()["patch_reads"] == version - 1
            assert rollout.stats()["bytes_received"] - before < (1 << 20) // 8
        assert trainer.stats()["patches_published"] == 2
        trainer.unpublish()
        frozen = master.numpy().copy()
        frozen.setflags(write=False)  # a read-only source is only read
        trainer.write("layer.weight", frozen)
        trainer.publish(4)
        with pytest.raises(tensorhub.InvalidArgument, match="elements"):
            trainer.unpublish()
            trainer.write("layer.weight", master[:10])
        with pytest.raises(tensorhub.InvalidArgument, match="no tensor 'nope'"):
            trainer.write("nope", master)


def test_a_modules_own_parameters_are_written_in_place(server):
    torch.manual_seed(1)
    trained = torch.nn.Linear(64, 32)
    fresh = torch.nn.Linear(64, 32)
    weight_storage = fresh.weight.data_ptr()
    with handle(server, "trainer") as trainer, handle(server, "rollout") as rollout:
        trainer.register_module(trained)
        rollout.register_module(fresh)
        trainer.publish(5)
        rollout.replicate(5, timeout=30)
        assert fresh.weight.data_ptr() == weight_storage
        assert torch.equal(fresh.weight, trained.weight) and torch.equal(fresh.bias, trained.bias)
        trainer.unpublish()
        rollout.close()


def test_calls_and_their_typed_exceptions(server):
    with handle(server, "trainer", role="trainer") as trainer, handle(server, "rollout", role="rollout") as rollout:
        weights = torch.arange(4096, dtype=torch.float32)
        trainer.register("w", weights)
        rollout.register("w", torch.zeros(100))  # not the trainer's layout
        assert rollout.update().status in ("not-yet", "no-newer-version")
        with pytest.raises(tensorhub.Timeout):
            rollout.wait(version=1, timeout=0.3)
        with pytest.raises(tensorhub.BadSelector):
            rollout.replicate("latest-x", timeout=1)
        with pytest.raises(tensorhub.NotPublished):
            trainer.unpublish()
        trainer.publish(1)
        with pytest.raises(tensorhub.AlreadyHolding):
            trainer.publish(2)
        with pytest.raises(tensorhub.AlreadyHolding):
            trainer.register("late", torch.zeros(3))
        with pytest.raises(tensorhub.LayoutMismatch):
            rollout.replicate("latest", timeout=10)
        rollout.unregister("w")
        mine = torch.zeros(4096)
        rollout.register("w", mine)
        rollout.wait(version=1, timeout=5)
        assert rollout.replicate("latest", timeout=10).version == 1
        assert torch.equal(mine, weights)
        rollout.wait(replicas=2, version=1, timeout=5)
        rollout.wait(role="rollout", version=1, timeout=5)
        listing = rollout.list()
        assert listing["latest"] == 1 and {r["name"] for r in listing["replicas"]} == {"trainer", "rollout"}
        trainer.unpublish()
        weights += 1
        trainer.publish(2)
        info = rollout.update("latest")
        assert info.updated and info.version == 2 and info.source == "trainer" == info.source_replica
        assert torch.equal(mine, weights)
        assert rollout.update().status == "no-newer-version"
        with pytest.raises(tensorhub.AlreadyHolding):
            rollout.replicate(2, timeout=1)
        with handle(server, "late") as late:
            late.register("w", torch.zeros(4096))
            with pytest.raises(tensorhub.VersionUnavailable):
                late.replicate(1, timeout=5)  # nobody holds version 1 any more
            with pytest.raises(tensorhub.Timeout):
                late.replicate(99, timeout=0.5)  # not published (yet)
        stats = rollout.stats()
        assert stats["transport"] in ("tcp", "rdma") and stats["reads_failed"] == 0
        assert rollout.data_endpoint and rollout.client_id > 0
        trainer.unpublish()
        rollout.close()
    with pytest.raises(tensorhub.Unavailable):
        rollout.stats()


def test_what_cannot_be_registered_is_refused_clearly(server):
    with handle(server, "r") as hub:
        with pytest.raises(tensorhub.InvalidArgument, match="not contiguous"):
            hub.register("t", torch.zeros(8, 8).t())
        with pytest.raises(tensorhub.InvalidArgument, match="dtype"):
            hub.register("c", torch.zeros(4, dtype=torch.complex64))
        frozen = np.zeros(4)
        frozen.flags.writeable = False
        with pytest.raises(tensorhub.InvalidArgument, match="read-only"):
            hub.register("f", frozen)
        with pytest.raises(tensorhub.InvalidArgument, match="not a torch tensor"):
            hub.register("s", "weights")
        hub.register("ok", bytearray(16))  # any writable buffer
        with pytest.raises(tensorhub.InvalidArgument):
            hub.register("ok", bytearray(16))  # a name twice
        kept = torch.zeros(5)
        with pytest.raises(tensorhub.InvalidArgument):
            hub.register_state_dict({"fine": kept, "ok": torch.zeros(5)})  # "ok" is taken
        assert hub.tensors["fine"] is kept and "ok" in hub.tensors, "what was registered stays registered, alive"
        with pytest.raises(TypeError, match="unexpected keyword"):
            handle(server, "x", replcia="typo")
        with pytest.raises(ValueError, match="log_level must be one of"):
            handle(server, "x", log_level="loud")
    with handle(server, "quiet", log_level="error") as quiet:  # accepted
        assert quiet.data_endpoint.startswith("127.0.0.1:"), "advertised: the interface that reaches the server"
    with pytest.raises(tensorhub.PermissionDenied):
        tensorhub.Handle(servers=server.address, token="wrong", model="m", replica="x", open_timeout_ms=5000)


def _shard(address, token, replica, role, shard, state, queue):
    with tensorhub.Handle(servers=address, token=token, model="m", replica=replica, role=role, shard=shard,
                          num_shards=2) as hub:
        tensors = {k: torch.full((1000 + shard,), float(v)) for k, v in state.items()}
        if role == "rollout":
            tensors = {k: torch.zeros_like(t) for k, t in tensors.items()}
        hub.register_state_dict(tensors)
        if role == "trainer":
            hub.publish(1)
            hub.wait(role="rollout", version=1, timeout=60)
            hub.unpublish()
            queue.put((shard, "published"))
        else:
            info = hub.replicate("latest", timeout=60)
            queue.put((shard, info.version, {k: float(t[0]) for k, t in tensors.items()}, tensors["a"].numel()))


def test_a_two_shard_replica_from_two_processes(server):
    queue = SPAWN.Queue()
    state = {"a": 1.5, "b": -2.0}
    processes = [SPAWN.Process(target=_shard, args=(server.address, server.token, "trainer", "trainer", s, state, queue))
                 for s in (0, 1)]
    processes += [SPAWN.Process(target=_shard, args=(server.address, server.token, "rollout", "rollout", s, state, queue))
                  for s in (0, 1)]
    for process in processes:
        process.start()
    results = [queue.get(timeout=90) for _ in processes]
    for process in processes:
        process.join(60)
        assert process.exitcode == 0
    rollouts = sorted(r for r in results if r[1] != "published")
    assert [r[0] for r in rollouts] == [0, 1]
    for shard, version, values, count in rollouts:
        assert version == 1 and values == state and count == 1000 + shard


def _slow_rollout(address, token):
    with tensorhub.Handle(servers=address, token=token, model="m", replica="slow", role="rollout",
                          read_rate_bytes_per_s=2_000_000, chunk_bytes=256 << 10) as hub:
        hub.register("w", torch.zeros(4_000_000, dtype=torch.uint8))
        hub.replicate("latest", timeout=60)


def test_a_rollout_killed_mid_read_disturbs_nobody(server):
    weights = torch.randint(0, 255, (4_000_000,), dtype=torch.uint8)
    with handle(server, "trainer", role="trainer") as trainer:
        trainer.register("w", weights)
        trainer.publish(1)
        slow = SPAWN.Process(target=_slow_rollout, args=(server.address, server.token))
        slow.start()
        deadline = time.monotonic() + 60
        while trainer.stats()["bytes_served"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)  # until the slow rollout reads (256 KiB at a time, 2 MB/s: ~2 s in all)
        served = trainer.stats()["bytes_served"]
        assert 0 < served < weights.numel(), "killed mid-read"
        os.kill(slow.pid, signal.SIGKILL)
        slow.join()
        with handle(server, "other", role="rollout") as other:
            mine = torch.zeros_like(weights)
            other.register("w", mine)
            assert other.replicate("latest", timeout=30).version == 1
            assert torch.equal(mine, weights)
            started = time.monotonic()
            trainer.unpublish()  # the dead reader does not hold it up for long
            assert time.monotonic() - started < 30
            other.close()


def test_the_gil_is_released_while_a_call_blocks(server):
    with handle(server, "trainer") as trainer, handle(server, "rollout") as rollout:
        trainer.register("w", torch.ones(1000))
        rollout.register("w", torch.zeros(1000))
        ticks = []
        stop = threading.Event()

        def python_work():
            while not stop.is_set():
                ticks.append(time.monotonic())  # runs only while this thread holds the GIL
                time.sleep(0.001)

        worker = threading.Thread(target=python_work)
        worker.start()
        publisher = threading.Timer(1.0, lambda: trainer.publish(1))
        publisher.start()
        began = time.monotonic()
        rollout.replicate("latest", timeout=30)  # blocks about a second
        ended = time.monotonic()
        stop.set()
        worker.join()
        publisher.join()
        during = [t for t in ticks if began < t < ended]
        assert ended - began > 0.5
        assert len(during) > 100, "another Python thread made progress while replicate() blocked"
        trainer.unpublish()
        rollout.close()


CTRL_C_SCRIPT = textwrap.dedent("""
    import sys, time, tensorhub, torch
    hub = tensorhub.Handle(servers=sys.argv[1], token=sys.argv[2], model="m", replica="waiter")
    hub.register("w", torch.zeros(10))
    print("blocking", flush=True)
    try:
        hub.replicate("latest")  # nothing is published: blocks for ever
    except KeyboardInterrupt:
        print("interrupted after %.3f s" % (time.monotonic() - float(sys.stdin.readline())), flush=True)
    try:
        hub.stats()
    except tensorhub.Unavailable as error:
        print("then:", error.code, flush=True)
""")


def test_ctrl_c_interrupts_a_blocking_call_within_a_second(server):
    child = subprocess.Popen([sys.executable, "-c", CTRL_C_SCRIPT, server.address, server.token],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    assert child.stdout.readline().strip() == "blocking"
    time.sleep(0.5)
    child.stdin.write(f"{time.monotonic()}\n")
    child.stdin.flush()
    child.send_signal(signal.SIGINT)
    out, _ = child.communicate(timeout=30)
    lines = out.strip().splitlines()
    assert lines[0].startswith("interrupted after "), out
    assert float(lines[0].split()[2]) < 1.0
    assert lines[1] == "then: unavailable"
    assert child.returncode == 0


def test_the_example_rl_loop(tmp_path):
    result = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "rl_loop.py"), "--steps", "4",
                             "--rollouts", "2"], capture_output=True, text=True, timeout=170)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rl_loop: ok" in result.stdout
    assert "bit-exact" in result.stdout and "DIFFERENT" not in result.stdout


def test_two_threads_on_one_handle_get_a_clear_refusal_not_a_hang(server):
    with handle(server, "r") as hub:
        hub.register("w", torch.zeros(10))
        waiting = threading.Thread(target=lambda: pytest.raises(tensorhub.Timeout, hub.wait, version=1, timeout=2))
        waiting.start()
        time.sleep(0.3)
        with pytest.raises(tensorhub.InvalidArgument, match="another call is in progress"):
            hub.wait(version=1, timeout=1)
        waiting.join()
        hub.list()  # and the handle goes on


def test_a_tensor_whose_storage_was_replaced_is_refused(server):
    with handle(server, "trainer") as trainer:
        weights = torch.nn.Parameter(torch.zeros(1000))
        trainer.register("w", weights)
        weights.data = torch.ones(1000)  # the registered memory is not the tensor's any more
        with pytest.raises(tensorhub.InvalidArgument, match="moved to other memory"):
            trainer.publish(1)


def test_wrong_option_types_and_timeouts_are_clear(server):
    with pytest.raises(TypeError, match="shard"):
        handle(server, "x", shard="0")
    with handle(server, "r") as hub:
        hub.register("w", torch.zeros(10))
        for bad in (float("inf"), float("nan"), -1, 0):
            with pytest.raises(tensorhub.InvalidArgument, match="timeout"):
                hub.replicate("latest", timeout=bad)
        # A version out of range is named as such, not a binding's TypeError (issue 33).
        for bad, words in ((-1, "-1 is not in 0..2"), (2**63, "is not in 0..2"), (1.5, "must be an int"),
                           (True, "must be an int")):
            with pytest.raises(tensorhub.InvalidArgument, match=words):
                hub.publish(bad)
            with pytest.raises(tensorhub.InvalidArgument, match="version"):
                hub.wait(version=bad, timeout=0.1)
        with pytest.raises(tensorhub.InvalidArgument, match="-1 is not in"):
            hub.replicate(-1, timeout=1)
        with pytest.raises(tensorhub.InvalidArgument, match="-1 is not in"):
            hub.update(-1)
    # Any integer type names a version (a step counter kept in numpy or torch).
    assert tensorhub._version(np.int64(7)) == 7 and tensorhub._version(torch.tensor(7)) == 7


class DlpackOnly:
    """An object that speaks only DLPack (as a JAX or CuPy array would)."""

    def __init__(self, tensor):
        self._tensor = tensor

    def __dlpack__(self, stream=None):
        return self._tensor.__dlpack__()

    def __dlpack_device__(self):
        return self._tensor.__dlpack_device__()


def test_a_dlpack_object_is_written_in_place(server):
    source = torch.arange(100, dtype=torch.float32)
    target = torch.zeros(100)
    with handle(server, "trainer") as trainer, handle(server, "rollout") as rollout:
        trainer.register("w", source)
        rollout.register("w", DlpackOnly(target))
        trainer.publish(1)
        rollout.replicate("latest", timeout=30)
        assert torch.equal(target, source)
        trainer.unpublish()
        rollout.close()


def test_a_process_serves_prometheus_metrics_of_its_handles(server):
    import urllib.request
    state = mixed_state_dict(3)
    with handle(server, "trainer", role="trainer", metrics_listen="127.0.0.1:0") as trainer:
        trainer.register_state_dict(state)
        trainer.publish(1)
        with handle(server, "rollout") as rollout:  # shown on the same endpoint (one per process)
            received = zeros_like(state)
            rollout.register_state_dict(received)
            rollout.replicate("latest")
            address = tensorhub.metrics_address()
            assert address.startswith("127.0.0.1:") and not address.endswith(":0")
            text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    assert 'th_client_operations_total{model="m",replica="trainer",shard="0",op="publish",result="ok"} 1' in text
    assert 'th_client_stall_seconds_count{model="m",replica="rollout",shard="0",op="replicate"} 1' in text
    received_bytes = [line for line in text.splitlines()
                      if line.startswith('th_client_received_bytes_total{model="m",replica="rollout"')]
    assert len(received_bytes) == 1 and int(received_bytes[0].split()[-1]) > 0


def test_a_metrics_port_given_as_the_server_is_named_so(server):
    # Issue 33, friction 3: a metrics endpoint (HTTP) waits 5 s for a request line, then hangs up
    # on the hello; open() retried it until its deadline and said "no server answered". A server
    # quiet for a second is asked in HTTP: with that one server only, open() fails naming it, well
    # within a deadline shorter than those 5 s.
    with handle(server, "trainer", role="trainer", metrics_listen="127.0.0.1:0"):
        address = tensorhub.metrics_address()
        with pytest.raises(tensorhub.InvalidArgument, match="answers HTTP.*--metrics-listen"):
            tensorhub.Handle(servers=address, token=server.token, model="m", replica="lost", open_timeout_ms=4_000)
        # Listed before a real server (a mistyped primary, a working backup): the handle opens on
        # the backup and stays usable; the HTTP server costs nothing but a log line.
        for attempt in range(3):
            with tensorhub.Handle(servers=[address, server.address], token=server.token, model="m",
                                  replica=f"backed-up-{attempt}", open_timeout_ms=30_000) as backed_up:
                assert backed_up.list()["replicas"]



def big_state_dict(seed: int):
    generator = torch.Generator().manual_seed(seed)
    state = {f"layer{i}.weight": torch.randn(1024, 1024, generator=generator) for i in range(4)}  # 4 MB each
    state["norm.scale"] = torch.randn(512, generator=generator)  # packed
    return state


@contextlib.contextmanager
def published_and_slow_reader(server, seed):
    """A trainer that published version 1 of big_state_dict(seed), and a rollout (8 MB/s) with
    zeroed tensors of the same layout: (source, target, trainer, rollout)."""
    source = big_state_dict(seed)
    target = zeros_like(source)
    with handle(server, "trainer", role="trainer") as trainer, \
            handle(server, "rollout", role="rollout", read_rate_bytes_per_s=8_000_000) as rollout:
        trainer.register_state_dict(source)
        rollout.register_state_dict(target)
        trainer.publish(1)
        yield source, target, trainer, rollout


def test_a_stream_yields_each_tensor_verified_before_the_last_byte_arrives(server):
    with published_and_slow_reader(server, 5) as (source, target, trainer, rollout):
        seen = []
        with rollout.replicate_stream("latest", timeout=60) as stream:
            for name, tensor in stream:
                assert tensor is target[name]                  # the registered object, written in place
                assert torch.equal(tensor, source[name])       # complete and verified when handed out
                if not seen:
                    first = stream.progress()
                seen.append(name)
            info = stream.result()
        assert info == tensorhub.ReplicateInfo(1, "trainer")
        assert stream.version == 1
        assert seen == ["norm.scale", "layer0.weight", "layer1.weight", "layer2.weight", "layer3.weight"]
        assert not first["done"] and first["bytes_ready"] < first["bytes_total"] // 2
        assert equal(source, target)
        # Nothing newer: the update's stream is empty.
        with rollout.update_stream() as stream:
            assert list(stream) == []
            assert stream.result().status == "no-newer-version"
        trainer.unpublish()


def test_a_stream_cancelled_midway_leaves_the_handle_usable(server):
    with published_and_slow_reader(server, 6) as (source, target, trainer, rollout):
        stream = rollout.replicate_stream("latest")
        next(stream)
        with pytest.raises(tensorhub.InvalidArgument):
            rollout.list()  # the handle takes no other call while one is in flight
        stream.cancel()
        with pytest.raises(tensorhub.Cancelled):
            stream.result(timeout=30)
        with pytest.raises(tensorhub.Cancelled):
            next(stream)
        assert stream.done()
        # Leaving a with-block early cancels too, and waits, so that the next call runs.
        with rollout.replicate_stream("latest") as early:
            next(early)
        assert early.done()
        assert rollout.replicate("latest", timeout=60).version == 1
        assert equal(source, target)
        trainer.unpublish()
    # A version nobody published yet: result(timeout) gives up, the call going on; the block's end
    # cancels it.
    with handle(server, "late", role="rollout") as late:
        late.register_state_dict(zeros_like(source))
        with pytest.raises(TimeoutError):
            with late.replicate_stream("2") as waiting:
                waiting.result(timeout=0.3)
        assert waiting.done()
        with pytest.raises(tensorhub.Cancelled):
            waiting.result()


def test_a_hook_gets_each_tensor_verified_and_one_that_raises_cancels_the_call(server):
    with published_and_slow_reader(server, 7) as (source, target, trainer, rollout):
        scales = {}

        def quantize(name, tensor):  # what an engine does on landing: fp8 scales per tensor
            assert tensor is target[name] and torch.equal(tensor, source[name])
            scales[name] = tensor.float().abs().max().item() / 448.0

        info = rollout.replicate("latest", timeout=60, on_tensor=quantize)
        assert info == tensorhub.ReplicateInfo(1, "trainer")
        assert sorted(scales) == sorted(source)
        assert scales["layer0.weight"] == source["layer0.weight"].float().abs().max().item() / 448.0

        trainer.unpublish()
        for tensor in source.values():
            tensor.add_(1)
        trainer.publish(2)

        class EngineFull(Exception):
            pass

        def give_up(name, tensor):
            raise EngineFull(name)

        with pytest.raises(EngineFull):
            rollout.update(on_tensor=give_up)
        with pytest.raises(tensorhub.InvalidArgument, match="on_tensor must be callable"):
            rollout.update(on_tensor="not a function")
        # The handle takes calls again; the update brings version 2 whole.
        assert rollout.update(on_tensor=lambda name, tensor: None).version == 2
        assert equal(source, target)
        trainer.unpublish()


def test_close_cancels_a_stream_still_running(server):
    with handle(server, "closer", role="rollout") as closer:
        closer.register("w", torch.zeros(4096))
        stream = closer.replicate_stream("3")  # never published: it waits
        closer.close()                         # not refused as "in flight": the stream ends first
        assert stream.done()
        with pytest.raises(tensorhub.Cancelled):
            stream.result()


def test_publish_takes_a_cuda_stream_or_none_and_refuses_anything_else(server):
    with handle(server, "trainer") as hub:
        hub.register("w", torch.arange(64, dtype=torch.float32))
        with pytest.raises(tensorhub.InvalidArgument, match="stream must be a torch.cuda.Stream or an int"):
            hub.publish(1, stream="default")
        assert hub.publish(1, stream=0) == 1  # CPU tensors only: there is nothing to wait for
        hub.unpublish()
        assert hub.publish(2) == 2


def test_a_trainer_that_writes_while_published_is_told_and_readers_name_it(server, capfd):
    # Issue 33, friction 1: the tensor changes under its checksum; the first reader's two failed
    # checksums condemn the copy, the reader's error names it, and the trainer hears of it.
    weights = {"w": torch.zeros(2 << 20)}  # 8 MiB: read from the buffer itself, not a packed copy
    target = {"w": torch.empty(2 << 20)}
    with handle(server, "trainer", model="written", role="trainer") as trainer, \
            handle(server, "rollout", model="written", role="rollout") as rollout:
        trainer.register_state_dict(weights)
        rollout.register_state_dict(target)
        trainer.publish(1)
        weights["w"] += 1  # the misuse: written while published
        with pytest.raises(tensorhub.VersionUnavailable, match="replica 'trainer'.*failed readers' checksums"):
            rollout.replicate("latest", timeout=30)
        deadline = time.monotonic() + 10
        while trainer.stats()["copies_found_corrupt"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert trainer.stats()["copies_found_corrupt"] == 1
        assert rollout.stats()["copies_found_corrupt"] == 0
        assert rollout.stats()["checksum_failures"] == 2
        trainer.unpublish()
    assert "readers found the registered tensors of version 1 of this shard failing" in capfd.readouterr().err


def test_a_rollout_closes_under_keep_latest_0_and_the_version_it_took_is_named(server):
    # Issue 33, friction 2: the trainer's rule keeps the newest version; it unpublished it to write
    # the next while the rollout held the only copy. The rollout's close is not refused.
    weights = {"w": torch.arange(1 << 16, dtype=torch.float32)}
    with handle(server, "trainer", model="kept", role="trainer", keep_latest=0) as trainer:
        trainer.register_state_dict(weights)
        trainer.publish(1)
        rollout = handle(server, "rollout", model="kept", role="rollout")
        rollout.register_state_dict({"w": torch.empty(1 << 16)})
        rollout.replicate("latest", timeout=30)
        trainer.unpublish()          # rollout holds a safe copy: nothing offloads
        rollout.close()              # was: LastRetainedCopy
        with handle(server, "late", model="kept", role="rollout") as late:
            late.register_state_dict({"w": torch.empty(1 << 16)})
            with pytest.raises(tensorhub.VersionUnavailable, match="left with replica 'rollout'"):
                late.replicate("latest", timeout=30)
        trainer.publish(2)           # the next version serves as usual
    assert "closing replica took the last copy of 1 version(s)" in server.log()


def test_close_while_another_thread_calls_is_refused_and_the_handle_goes_on(server):
    with handle(server, "r", model="busy") as hub:
        hub.register("w", torch.zeros(10))
        waiting = threading.Thread(target=lambda: pytest.raises(tensorhub.Timeout, hub.wait, version=1, timeout=2))
        waiting.start()
        time.sleep(0.3)
        with pytest.raises(tensorhub.InvalidArgument, match="another call is in progress"):
            hub.close()
        waiting.join()
        hub.list()  # still open: the refused close let go of nothing
