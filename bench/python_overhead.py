#!/usr/bin/env python3
"""The Python package's overhead (bench/run-python-overhead runs this beside th-bench's C++).

    python_overhead.py register [TENSORS] [BYTES] [ROUNDS]   # register_state_dict of small tensors
    python_overhead.py pair [GIB] [TENSOR_MB] [ROUNDS]         # publish -> replicate/update -> unpublish

Prints a RESULT line like th-bench's.
"""

import mmap
import statistics
import sys
import time

import torch

import tensorhub


def register(tensors: int, nbytes: int, rounds: int) -> None:
    with tensorhub.Server() as server:
        times = []
        for round_ in range(rounds):
            state = {f"layers.{i}.weight": torch.zeros(nbytes // 4) for i in range(tensors)}
            with tensorhub.Handle(servers=server.address, token=server.token, model="bench-register",
                                  replica=f"r{round_}") as hub:
                started = time.perf_counter()
                hub.register_state_dict(state)
                times.append(time.perf_counter() - started)
    ms = statistics.median(times) * 1e3
    print(f"python register: {tensors} tensors of {nbytes} bytes, median of {rounds}: {ms:.3f} ms")
    print(f"RESULT register_tensors={tensors} register_ms={ms:.6f}")


def pair(gib: float, tensor_mb: int, rounds: int) -> None:
    tensor_bytes = tensor_mb * 1_000_000
    tensors = max(1, -(-int(gib * (1 << 30)) // tensor_bytes))
    total = tensors * tensor_bytes
    # The memory th-bench pair uses (tools/big_buffer.h): anonymous, in 2 MiB pages where the kernel
    # allows, touched before the first round; each tensor a view of it.
    def big(fill):
        region = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE)  # (shared anonymous memory gets no huge pages)
        region.madvise(mmap.MADV_HUGEPAGE)
        whole = torch.frombuffer(region, dtype=torch.uint8)
        whole.copy_(fill(total)) if fill else whole.zero_()
        return region, {f"tensor.{i:05d}": whole[i * tensor_bytes:(i + 1) * tensor_bytes] for i in range(tensors)}
    source_memory, source = big(lambda n: torch.randint(0, 255, (n,), dtype=torch.uint8))
    target_memory, target = big(None)
    with tensorhub.Server() as server:
        common = dict(servers=server.address, token=server.token, model="bench-pair")
        with tensorhub.Handle(replica="source", role="trainer", **common) as trainer, \
                tensorhub.Handle(replica="reader", role="rollout", **common) as reader:
            trainer.register_state_dict(source)
            reader.register_state_dict(target)
            rates = []
            for version in range(1, rounds + 1):
                for t in source.values():
                    t[:8] = torch.tensor(list(version.to_bytes(8, "little")), dtype=torch.uint8)
                trainer.publish(version)
                started = time.perf_counter()
                if version == 1:
                    reader.replicate("latest")
                else:
                    assert reader.update("latest").version == version
                seconds = time.perf_counter() - started
                assert all(torch.equal(source[n], target[n]) for n in source)
                rates.append(total / seconds / 1e9)
                print(f"round {version}: {total} bytes in {seconds:.3f} s ({rates[-1]:.3f} GB/s), bit-exact")
                trainer.unpublish()
            reader.close()
    print(f"RESULT pair_bytes={total} pair_call_gbps={statistics.median(rates):.4f}")


if __name__ == "__main__":
    if sys.argv[1] == "register":
        register(*(int(a) for a in sys.argv[2:5]))
    else:
        pair(float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
