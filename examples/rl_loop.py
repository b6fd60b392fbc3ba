#!/usr/bin/env python3
"""A small asynchronous RL-style loop over TensorHub, with a real torch model.

One trainer process runs optimizer steps on a torch.nn policy and publishes every version; four
rollout processes each run batches with their own copy of the policy and, between batches, move to
the newest version with update() (the weights land in the module's own parameters, in place).
After every update a rollout checks its weights against the trainer's bit for bit (a SHA-256 of
the state dict that the trainer records with each version), and the table shows how far behind the
trainer each batch ran: asynchronous RL's off-by-one (or more).

    python3 examples/rl_loop.py [--steps 8] [--rollouts 4]

Needs th-server (started here as a child; found on PATH, in $TH_SERVER_BINARY, or in the build
tree) and the tensorhub package (PYTHONPATH=build/python, or installed).
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import sys
import time

import torch

import tensorhub


def make_policy() -> torch.nn.Module:
    torch.manual_seed(0)  # every process starts from the same (untrained) weights
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                               torch.nn.ReLU(), torch.nn.Linear(256, 8))


def digest(module: torch.nn.Module) -> str:
    sha = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        sha.update(name.encode())
        sha.update(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()


def trainer(address: str, token: str, steps: int, digests, done) -> None:
    policy = make_policy()
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.05)
    with tensorhub.Handle(servers=address, token=token, model="policy", replica="trainer", role="trainer",
                          keep_latest=0) as hub:
        hub.register_module(policy)
        for step in range(1, steps + 1):
            batch = torch.randn(128, 64)
            loss = policy(batch).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()                       # the weights change in place
            digests[step] = digest(policy)
            hub.publish(step)                      # rollouts may read them now
            if step == steps:
                break
            time.sleep(0.3)                        # the next batch of experience comes in
            hub.unpublish()                        # (blocks while a reader still reads them)
        hub.wait(role="rollout", version=steps, timeout=60)  # every rollout has the last version
        hub.unpublish()
    # Closed: its retention rule (keep the latest) goes with it, so the rollouts may close now (a
    # rollout holding the last copy of a version the trainer's rule keeps could not).
    done.set()


def rollout(index: int, address: str, token: str, steps: int, digests, rows, done) -> None:
    policy = make_policy()
    with tensorhub.Handle(servers=address, token=token, model="policy", replica=f"rollout-{index}",
                          role="rollout") as hub:
        hub.register_module(policy)
        hub.wait(version=1, timeout=60)
        held = hub.replicate("latest", timeout=60).version
        batches = 0
        while True:
            with torch.no_grad():
                policy(torch.randn(64, 64))      # a batch of rollouts with the weights held
            batches += 1
            trainer_at = max(digests.keys())
            exact = digest(policy) == digests[held]
            rows.append((index, batches, held, trainer_at, exact))
            if held == steps:
                break
            time.sleep(0.1 + 0.05 * index)          # rollouts run at their own pace
            info = hub.update("latest")
            if info.updated:
                held = info.version
        done.wait(60)  # stay open until the trainer saw every rollout hold the last version, and left


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rollouts", type=int, default=4)
    args = parser.parse_args()
    context = mp.get_context("spawn")
    started = time.monotonic()
    with tensorhub.Server() as server, context.Manager() as manager:
        digests = manager.dict()
        rows = manager.list()
        done = context.Event()
        processes = [context.Process(target=trainer, args=(server.address, server.token, args.steps, digests, done))]
        processes += [context.Process(target=rollout,
                                      args=(i, server.address, server.token, args.steps, digests, rows, done))
                      for i in range(args.rollouts)]
        for process in processes:
            process.start()
        for process in processes:
            process.join(120)
        failed = [p.name for p in processes if p.exitcode != 0]
        table = sorted(rows)
    print(f"{'rollout':>7} {'batch':>5} {'version':>7} {'trainer at':>10} {'behind':>6}  weights")
    for index, batch, held, trainer_at, exact in table:
        print(f"{index:>7} {batch:>5} {held:>7} {trainer_at:>10} {trainer_at - held:>6}  "
              f"{'bit-exact' if exact else 'DIFFERENT'}")
    behind = [trainer_at - held for _, _, held, trainer_at, _ in table]
    print(f"{len(table)} batches; behind the trainer by 0: {behind.count(0)}, by 1: {behind.count(1)}, "
          f"by more: {sum(1 for b in behind if b > 1)}; {time.monotonic() - started:.1f} s")
    ok = not failed and table and all(row[4] for row in table) and {row[0] for row in table} == set(range(args.rollouts))
    if failed:
        print("processes that failed:", ", ".join(failed))
    print("rl_loop: ok" if ok else "rl_loop: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
