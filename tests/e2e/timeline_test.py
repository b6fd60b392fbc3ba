#!/usr/bin/env python3
"""The transfer timeline of a real job, checked against the job's own table.

Runs `th-demo --timeline FILE` (an embedded th-server, a trainer and rollouts as processes), then:
  - the file is valid JSON in Chrome's Trace Event format (traceEvents; X slices with ts/dur;
    process and thread names), and otherData.transfers counts its shard reads;
  - one flow per transfer: every flow id has exactly one start ("s") inside a serving slice of
    the source's process and one end ("f") inside the receiving slice of the reader's, at the
    read's start;
  - it agrees with th-demo's table: for every (version, rollout replica) row, the timeline has one
    done read per shard, from the row's source, whose bytes add up to the row's bytes (at least the
    row's bytes where a read was withdrawn and the next went on from what it verified), and each
    read lies within the update call that waited for it (duration <= the row's stall);
then draws it with tools/timeline-plot and checks that a PNG came out.

Usage: timeline_test.py --th-demo PATH --plot PATH [--keep DIR]
Exit 0: pass; 1: fail (with what differed).
"""
import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

STEPS, ROLLOUTS, SHARDS, SHARD_MB = 4, 4, 2, 4
SLACK_US = 1000  # the table's stall is printed with 0.1 ms; the timeline has microseconds


class Failure(Exception):
    pass


def check(condition, message):
    if not condition:
        raise Failure(message)


def parse_table(output):
    rows = {}
    for match in re.finditer(r"^(\d+)\s+(rollout-\d+)\s+(\S+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+(\S+)",
                             output, re.MULTILINE):
        version, replica, source, size, _, stall_ms, checksum = match.groups()
        rows[(int(version), replica)] = {"source": source, "bytes": int(size), "stall_us": float(stall_ms) * 1000,
                                         "ok": checksum == "ok"}
    return rows


def check_trace(trace):
    check(isinstance(trace.get("traceEvents"), list), "no traceEvents list")
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    slices = [e for e in events if e.get("ph") == "X"]
    for event in slices:
        check(isinstance(event["ts"], int) and event["ts"] >= 0 and isinstance(event["dur"], int) and event["dur"] >= 1,
              f"a slice without a valid time: {event}")
        check(event["pid"] in names and (event["pid"], event["tid"]) in lanes, f"a slice on an unnamed lane: {event}")
    receives = [e for e in slices if e["cat"] == "receive"]
    serves = [e for e in slices if e["cat"] == "serve"]
    check(len(receives) == len(serves) == trace["otherData"]["transfers"],
          f"{len(receives)} receive and {len(serves)} serve slices for {trace['otherData']['transfers']} transfers")
    for event in receives:
        check(names[event["pid"]] == event["args"]["reader"], f"a read on another replica's lane: {event}")
        check(lanes[(event["pid"], event["tid"])] == f"shard {event['args']['shard']} receive",
              f"a read on the wrong lane: {event}")
    for event in serves:
        check(names[event["pid"]] == event["args"]["source"], f"a serve on another replica's lane: {event}")

    flows = collections.defaultdict(dict)
    for event in events:
        if event.get("ph") in ("s", "f"):
            check(event["ph"] not in flows[event["id"]], f"flow {event['id']} has two '{event['ph']}' events")
            flows[event["id"]][event["ph"]] = event
    check(len(flows) == len(receives), f"{len(flows)} flows for {len(receives)} transfers: one flow per transfer")

    def enclosing(point, category):
        return [e for e in slices if e["cat"] == category and e["pid"] == point["pid"] and e["tid"] == point["tid"]
                and e["ts"] <= point["ts"] <= e["ts"] + e["dur"]]
    for flow_id, ends in flows.items():
        check(set(ends) == {"s", "f"}, f"flow {flow_id} lacks an end: {ends}")
        check(ends["f"].get("bp") == "e", f"flow {flow_id}'s end does not bind to its enclosing slice")
        start_in, end_in = enclosing(ends["s"], "serve"), enclosing(ends["f"], "receive")
        check(start_in and end_in, f"flow {flow_id} does not start in a serve slice and end in a receive slice")
        check(any(s["args"]["transfer"] == r["args"]["transfer"] and s["args"]["shard"] == r["args"]["shard"]
                  for s in start_in for r in end_in), f"flow {flow_id} joins slices of different reads")
    return receives


def check_against_table(receives, rows):
    check(len(rows) == STEPS * ROLLOUTS, f"th-demo's table has {len(rows)} rows, not {STEPS * ROLLOUTS}")
    by_row = collections.defaultdict(list)
    for event in receives:
        by_row[(event["args"]["version"], event["args"]["reader"])].append(event)
    check(set(by_row) == set(rows), f"the timeline's (version, reader) pairs {sorted(by_row)} differ from the "
                                    f"table's {sorted(rows)}")
    for key, row in rows.items():
        # A read the server moved to another source ends 'withdrawn' (rate-aware source selection
        # puts a faster reader ahead of a slower one early in its read): the reads that completed
        # are one per shard, from the source the table names.
        reads = [e for e in by_row[key] if e["args"]["outcome"] != "withdrawn"]
        check(row["ok"], f"th-demo's row {key} failed its checksum")
        check(sorted(e["args"]["shard"] for e in reads) == list(range(SHARDS)),
              f"{key}: reads of shards {[e['args']['shard'] for e in reads]}, not one per shard")
        for event in by_row[key]:
            check(event["dur"] <= row["stall_us"] + SLACK_US,
                  f"{key}: a read of {event['dur']} us inside an update call of {row['stall_us']:.0f} us")
        for event in reads:
            check(event["args"]["outcome"] == "done", f"{key}: a read ended '{event['args']['outcome']}'")
            check(event["args"]["source"] == row["source"],
                  f"{key}: the timeline's source {event['args']['source']}, the table's {row['source']}")
        # The timeline gives each read its shard's bytes (the server's view); the table counts the
        # bytes pulled. A read that follows a withdrawn one goes on from the tensors that one
        # verified (resume, also at a source still receiving), and pulls less.
        total = sum(e["args"]["bytes"] for e in reads)
        if len(reads) == len(by_row[key]):
            check(total == row["bytes"], f"{key}: the timeline's reads add up to {total} bytes, the table says {row['bytes']}")
        else:
            check(row["bytes"] <= total, f"{key}: the table says {row['bytes']} bytes pulled, more than the timeline's "
                                         f"reads add up to ({total}) after a withdrawn read")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--th-demo", required=True)
    parser.add_argument("--plot", required=True, help="tools/timeline-plot")
    parser.add_argument("--keep", help="write the files here instead of a temporary directory")
    args = parser.parse_args()
    workdir = args.keep or tempfile.mkdtemp(prefix="th-timeline-")
    os.makedirs(workdir, exist_ok=True)
    trace_path, png_path = os.path.join(workdir, "t.json"), os.path.join(workdir, "t.png")
    try:
        demo = subprocess.run([args.th_demo, "--steps", str(STEPS), "--rollouts", str(ROLLOUTS), "--shards",
                               str(SHARDS), "--shard-mb", str(SHARD_MB), "--timeline", trace_path],
                              capture_output=True, text=True, timeout=120)
        print(demo.stdout, end="")
        check(demo.returncode == 0 and "th-demo: ok" in demo.stdout, f"th-demo failed:\n{demo.stderr[-2000:]}")
        with open(trace_path) as file:
            trace = json.load(file)  # raises on invalid JSON
        receives = check_trace(trace)
        check_against_table(receives, parse_table(demo.stdout))
        plot = subprocess.run([args.plot, trace_path, "-o", png_path], capture_output=True, text=True, timeout=120)
        print(plot.stdout, end="")
        check(plot.returncode == 0, f"timeline-plot failed ({plot.returncode}):\n{plot.stderr[-2000:]}")
        with open(png_path, "rb") as file:
            check(file.read(8) == b"\x89PNG\r\n\x1a\n", "timeline-plot wrote no PNG")
        print(f"timeline_test: ok ({len(receives)} reads, one flow each, consistent with th-demo's table; {png_path})")
        return 0
    except (Failure, json.JSONDecodeError, subprocess.TimeoutExpired, OSError, KeyError) as error:
        print(f"timeline_test: FAILED: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
