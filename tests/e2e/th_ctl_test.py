#!/usr/bin/env python3
"""th-ctl for scripts: --json output (validated with `python3 -m json.tool` and read back), exit
codes, and wait-version as a job script's barrier, against a real th-server and a th-demo job.

Usage: th_ctl_test.py --th-server PATH --th-ctl PATH --th-demo PATH
Exit 0: pass; 1: fail.
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

STEPS, ROLLOUTS = 3, 2


class Failure(Exception):
    pass


def check(condition, message):
    if not condition:
        raise Failure(message)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--th-server", required=True)
    parser.add_argument("--th-ctl", required=True)
    parser.add_argument("--th-demo", required=True)
    args = parser.parse_args()
    workdir = tempfile.mkdtemp(prefix="th-ctl-test-")
    token = os.path.join(workdir, "token")
    with open(token, "w") as file:
        file.write("th-ctl-test-token-0123456789\n")
    os.chmod(token, 0o600)
    children = []
    try:
        server = subprocess.Popen([args.th_server, "--listen", "127.0.0.1:0", "--token-file", token,
                                   "--metrics-listen", "127.0.0.1:0"],
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        children.append(server)
        line = server.stdout.readline()
        check(line.startswith("th-server listening on "), f"th-server said {line!r}")
        address = line.split()[-1]
        line = server.stdout.readline()
        check(line.startswith("th-server metrics on "), f"th-server said {line!r}")
        metrics_address = line.split()[-1]

        def ctl(*command, timeout=60):
            return subprocess.run([args.th_ctl, "--server", address, "--token-file", token, *command],
                                  capture_output=True, text=True, timeout=timeout)

        demo = subprocess.Popen([args.th_demo, "--server", address, "--token-file", token, "--steps", str(STEPS),
                                 "--rollouts", str(ROLLOUTS), "--shard-mb", "2", "--linger-ms", "3000"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        children.append(demo)

        # The barrier a job script blocks on: every rollout holds the last version.
        waited = ctl("wait-version", "--model", "demo", "--version", str(STEPS), "--role", "rollout",
                     "--replicas", str(ROLLOUTS), "--timeout-ms", "60000", "--json")
        check(waited.returncode == 0, f"wait-version exited {waited.returncode}: {waited.stderr}")
        met = json.loads(waited.stdout)
        check(met["met"] is True and sorted(met["replicas"]) == [f"rollout-{i}" for i in range(ROLLOUTS)],
              f"wait-version said {met}")

        # --json list, through python3 -m json.tool as a script would, then read back.
        listed = ctl("--json", "list")
        check(listed.returncode == 0, f"th-ctl --json list exited {listed.returncode}: {listed.stderr}")
        tool = subprocess.run([sys.executable, "-m", "json.tool"], input=listed.stdout, capture_output=True, text=True)
        check(tool.returncode == 0, f"python3 -m json.tool refused th-ctl's output: {tool.stderr}\n{listed.stdout}")
        listing = json.loads(listed.stdout)
        check(set(listing) == {"server", "stats", "models"}, f"top-level keys {sorted(listing)}")
        check(listing["stats"]["transfers_completed"] >= STEPS * ROLLOUTS, f"stats {listing['stats']}")
        (model,) = listing["models"]
        check(model["model"] == "demo" and model["latest"] == STEPS, f"model {model['model']} latest {model['latest']}")
        replicas = {r["name"]: r for r in model["replicas"]}
        check(set(replicas) == {"trainer"} | {f"rollout-{i}" for i in range(ROLLOUTS)}, f"replicas {sorted(replicas)}")
        for name, replica in replicas.items():
            check(replica["role"] == ("trainer" if name == "trainer" else "rollout"), f"{name}: role {replica['role']}")
            check(isinstance(replica["incarnation"], int) and replica["shards"] == 2, f"{name}: {replica}")
        for i in range(ROLLOUTS):
            check(replicas[f"rollout-{i}"]["version"] == STEPS, f"rollout-{i}: {replicas[f'rollout-{i}']}")
        check(all(set(v) == {"version", "complete", "partial", "retained", "offloaded"} for v in model["versions"]),
              f"versions {model['versions']}")

        # Exit codes: 4 no such model (still valid JSON), 3 timeout, 1 unreachable, 2 bad arguments.
        missing = ctl("--json", "list", "--model", "nope")
        check(missing.returncode == 4 and json.loads(missing.stdout)["models"] == [],
              f"list --model nope: exit {missing.returncode}, {missing.stdout!r}")
        late = ctl("wait-version", "--model", "demo", "--version", "999", "--timeout-ms", "300", "--json")
        check(late.returncode == 3 and json.loads(late.stdout)["met"] is False,
              f"wait-version of a version that never comes: exit {late.returncode}, {late.stdout!r}")
        unreachable = subprocess.run([args.th_ctl, "--server", "127.0.0.1:1", "--token-file", token, "list"],
                                     capture_output=True, text=True, timeout=60)
        check(unreachable.returncode == 1, f"an unreachable server: exit {unreachable.returncode}")
        # The metrics port by mistake: th-ctl says it speaks HTTP, rather than "Peer disconnected.".
        http = subprocess.run([args.th_ctl, "--server", metrics_address, "--token-file", token, "list"],
                              capture_output=True, text=True, timeout=60)
        check(http.returncode == 1 and "answers HTTP" in http.stderr and "--metrics-listen" in http.stderr,
              f"th-ctl on the metrics port: exit {http.returncode}, {http.stderr!r}")
        wrong = subprocess.run([args.th_ctl, "--server", address, "--token-file", token, "wait-version"],
                               capture_output=True, text=True, timeout=60)
        check(wrong.returncode == 2, f"wait-version without --model: exit {wrong.returncode}")
        trace = ctl("timeline")
        check(trace.returncode == 0 and json.loads(trace.stdout)["otherData"]["transfers"] >= STEPS * ROLLOUTS * 2,
              f"th-ctl timeline: exit {trace.returncode}")
        # One model's transfers: the demo's all, another name's none.
        mine = ctl("--model", "demo", "timeline")
        check(mine.returncode == 0 and json.loads(mine.stdout)["otherData"]["transfers"] >=
              json.loads(trace.stdout)["otherData"]["transfers"], f"th-ctl --model demo timeline: {mine.stdout[:300]!r}")
        other = ctl("timeline", "--model", "another")
        check(other.returncode == 0 and json.loads(other.stdout)["otherData"]["transfers"] == 0,
              f"th-ctl timeline --model another: {other.stdout[:300]!r}")

        out, err = demo.communicate(timeout=120)
        check(demo.returncode == 0 and "th-demo: ok" in out, f"th-demo failed: {out[-1500:]}{err[-1500:]}")
        server.send_signal(signal.SIGTERM)
        check(server.wait(timeout=30) == 0, f"th-server exited {server.returncode} on SIGTERM")
        print(f"th_ctl_test: ok (wait-version met after {met['waited_ms']} ms; --json list valid; exit codes 4, 3, 1, 2)")
        return 0
    except (Failure, json.JSONDecodeError, subprocess.TimeoutExpired, ValueError, KeyError) as error:
        print(f"th_ctl_test: FAILED: {error}", file=sys.stderr)
        return 1
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()


if __name__ == "__main__":
    sys.exit(main())
