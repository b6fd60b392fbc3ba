#!/usr/bin/env python3
"""check_trace.py TH_SIM DIR: runs th-sim with --trace and checks that the file is Chrome Trace Event
JSON as Perfetto and chrome://tracing load it (the JSON Object Format: {"traceEvents": [...]})."""
import json
import os
import subprocess
import sys

PHASES = {"X", "B", "E", "i", "I", "M", "s", "t", "f", "C"}


def fail(message):
    print("check_trace: " + message)
    sys.exit(1)


def main():
    sim, directory = sys.argv[1], sys.argv[2]
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "trace.json")
    if os.path.exists(path):
        os.remove(path)
    # Seed 9 has a crash and a server failover, so that failures are in the trace with transfers.
    run = subprocess.run([sim, "--seed", "9", "--trace", path], capture_output=True, text=True)
    if run.returncode != 0:
        fail("th-sim failed:\n" + run.stdout + run.stderr)
    with open(path, encoding="utf-8") as f:
        trace = json.load(f)  # raises on anything that is not JSON
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        fail("the top level must be an object with a traceEvents array")
    events = trace["traceEvents"]
    if not events:
        fail("no events")
    lanes = set()
    named_lanes = set()
    kinds = {}
    for index, event in enumerate(events):
        where = "event %d %r" % (index, event)
        for key in ("ph", "pid", "tid", "name"):
            if key not in event:
                fail(where + ": no " + key)
        phase = event["ph"]
        if phase not in PHASES:
            fail(where + ": unknown phase " + phase)
        if not isinstance(event["pid"], int) or not isinstance(event["tid"], int):
            fail(where + ": pid and tid must be integers")
        if phase == "M":
            if event["name"] == "thread_name":
                named_lanes.add((event["pid"], event["tid"]))
            continue
        if not isinstance(event.get("ts"), (int, float)) or event["ts"] < 0:
            fail(where + ": ts must be a number >= 0")
        if phase == "X" and (not isinstance(event.get("dur"), (int, float)) or event["dur"] < 0):
            fail(where + ": a complete event needs dur >= 0")
        if "args" in event and not isinstance(event["args"], dict):
            fail(where + ": args must be an object")
        lanes.add((event["pid"], event["tid"]))
        kinds[event.get("cat", "")] = kinds.get(event.get("cat", ""), 0) + 1
    unnamed = lanes - named_lanes
    if unnamed:
        fail("lanes without a thread_name: %r" % sorted(unnamed))
    for category in ("call", "transfer", "failure"):
        if category not in kinds:
            fail("no %s events (categories: %r)" % (category, kinds))
    if len(lanes) < 3:
        fail("expected a lane per worker, got %d lanes" % len(lanes))
    print("check_trace: %d events in %d lanes; categories %r" % (len(events), len(lanes), kinds))


if __name__ == "__main__":
    main()
