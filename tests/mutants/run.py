#!/usr/bin/env python3
"""Mutation testing of core/: runs the property test, then the th-sim CI block, against every
mutant of catalogue.txt and reports how many each kills (ctest -L mutants).

A mutant is killed by the property test if the test binary fails (or hangs past its timeout) with
TH_MUTANT=N; the th-sim block (and, with --regression-seeds, the named seeds of
tests/sim/regression-seeds.txt) runs only for the mutants the property test left alive, and kills
one with a violation (or a hang). The targets: the property test alone kills at least 90%, property
test and simulator together kill all. The property test runs with a fixed RapidCheck seed, so the
score is the same on every machine; TH_MUTANT_SEED changes it (a look at other cases).

    run.py --list mutants.tsv --property BIN --sim BIN [--unit BIN] [--regression-seeds FILE]
           [--report FILE] [--jobs N]
           [--cases N] [--only NAME,...] [--property-target 0.9] [--combined-target 1.0]

With --unit, the hub's unit tests (core_hub_test built against the mutants) also run against the
survivors of both: a third figure, for information; the targets are the two above.
"""
import argparse
import concurrent.futures
import datetime
import os
import subprocess
import sys
import time

# The th-sim CI block (tests/sim/CMakeLists.txt): every workload with drawn faults, then every
# workload under each harsh profile. A mutant is killed at its first violation.
WORKLOADS = ["colocated", "standalone", "elastic", "cross-dc", "off-by-k", "multi-model", "mixed"]
SIM_BLOCK = [["--seeds", "1..2000"]] + [
    ["--seeds", "3001..3500", "--workload", workload, "--profile", profile]
    for profile in ("harsh-net", "harsh-crash") for workload in WORKLOADS] + [
    ["--seeds", "5001..5500", "--workload", workload, "--profile", "harsh-crash", "--faults", "rack=1"]
    for workload in ("cross-dc", "mixed")]


def regression_seeds(path):
    """The named seeds of tests/sim/regression-seeds.txt, as th-sim argument lists."""
    blocks = []
    with open(path, encoding="utf-8") as listing:
        for line in listing:
            words = line.split("#", 1)[0].split()
            if words:
                blocks.append(["--seed"] + words)
    return blocks
PROPERTY_TIMEOUT_S = 300
SIM_TIMEOUT_S = 300


def run(command, env_extra, timeout_s):
    """Returns (status, seconds, last lines): status 'pass', 'fail' or 'hang'."""
    env = dict(os.environ)
    env.update(env_extra)
    started = time.monotonic()
    try:
        done = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              timeout=timeout_s, check=False)
        status = "pass" if done.returncode == 0 else "fail"
        output = done.stdout.decode("utf-8", "replace")
    except subprocess.TimeoutExpired as expired:
        status = "hang"
        output = (expired.stdout or b"").decode("utf-8", "replace")
    return status, time.monotonic() - started, output


def first_failure(output):
    for marker in ("Exception thrown with message:", "violation at"):
        index = output.find(marker)
        if index >= 0:
            line = output[index:].split("\n")[1 if marker.startswith("Exception") else 0]
            return line.strip()[:160]
    return ""


def property_command(args):
    return [args.property]


def property_env(args, mutant):
    return {"TH_MUTANT": str(mutant),
            "RC_PARAMS": f"max_success={args.cases} max_size=200 seed={args.seed}"}


def judge(args, number, name):
    status, seconds, output = run(property_command(args), property_env(args, number),
                                  PROPERTY_TIMEOUT_S)
    result = {"id": number, "name": name, "property": status, "property_s": seconds,
              "property_why": first_failure(output) if status != "pass" else "",
              "sim": "-", "sim_s": 0.0, "sim_why": ""}
    if status != "pass":
        return result
    sim_seconds = 0.0
    for block in SIM_BLOCK + args.regression_blocks:
        status, seconds, output = run([args.sim] + block, {"TH_MUTANT": str(number)}, SIM_TIMEOUT_S)
        sim_seconds += seconds
        if status != "pass":
            result["sim"] = status
            result["sim_why"] = " ".join(block) + ": " + first_failure(output)
            break
    else:
        result["sim"] = "pass"
    result["sim_s"] = sim_seconds
    result["unit"] = "-"
    if result["sim"] == "pass" and args.unit:
        status, _, output = run([args.unit], {"TH_MUTANT": str(number)}, PROPERTY_TIMEOUT_S)
        result["unit"] = status
        if status != "pass":
            failed = [line.split("]", 1)[1].strip() for line in output.splitlines()
                      if line.startswith("[  FAILED  ]") and "listed below" not in line]
            result["unit_why"] = "unit test " + (failed[0].split(" ")[0] if failed else status)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--list", required=True)
    parser.add_argument("--property", required=True)
    parser.add_argument("--sim", required=True)
    parser.add_argument("--unit", default="")
    parser.add_argument("--regression-seeds", default="",
                        help="tests/sim/regression-seeds.txt: the named seeds run after the block")
    parser.add_argument("--report")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--cases", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=int(os.environ.get("TH_MUTANT_SEED", "20261130")))
    parser.add_argument("--only", default="")
    parser.add_argument("--property-target", type=float, default=0.9)
    parser.add_argument("--combined-target", type=float, default=1.0)
    args = parser.parse_args()
    args.regression_blocks = regression_seeds(args.regression_seeds) if args.regression_seeds else []

    mutants = []
    with open(args.list, encoding="utf-8") as listing:
        for line in listing:
            fields = line.rstrip("\n").split("\t")
            if len(fields) >= 5:
                mutants.append((int(fields[0]), fields[1], fields[2], fields[4]))
    if args.only:
        wanted = set(args.only.split(","))
        mutants = [mutant for mutant in mutants if mutant[1] in wanted]
    if not mutants:
        print("run.py: no mutants to run", file=sys.stderr)
        return 2

    # The copy without any mutant must pass, or no kill means anything.
    started = time.monotonic()
    status, _, output = run(property_command(args), property_env(args, 0), PROPERTY_TIMEOUT_S)
    if status != "pass":
        print(output[-3000:])
        print("run.py: the property test fails without any mutant")
        return 1
    status, _, output = run([args.sim, "--seeds", "1..200"], {"TH_MUTANT": "0"}, SIM_TIMEOUT_S)
    if status != "pass":
        print(output[-3000:])
        print("run.py: th-sim fails without any mutant")
        return 1

    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(judge, args, number, name) for number, name, _, _ in mutants]
        results = [future.result() for future in futures]
    elapsed = time.monotonic() - started

    total = len(results)
    by_property = sum(1 for result in results if result["property"] != "pass")
    by_either = sum(1 for result in results if result["property"] != "pass" or result["sim"] != "pass")
    rows = ["| # | mutant | file | property test | th-sim block | what caught it |",
            "|---|---|---|---|---|---|"]
    files = {number: path for number, _, path, _ in mutants}
    for result in results:
        caught = (result["property_why"] or result["sim_why"] or
                  (f"SURVIVED (killed by {result['unit_why']})" if result.get("unit_why") else "SURVIVED"))
        sim = result["sim"] if result["sim"] == "-" else f"{result['sim']} ({result['sim_s']:.0f} s)"
        rows.append(f"| {result['id']} | {result['name']} | {files[result['id']]} | "
                    f"{result['property']} ({result['property_s']:.1f} s) | {sim} | {caught} |")
    property_score = by_property / total
    combined_score = by_either / total
    summary = (f"mutants: {total}; the property test alone kills {by_property} "
               f"({100 * property_score:.0f}%, target {100 * args.property_target:.0f}%); property "
               f"test + th-sim CI block kill {by_either} ({100 * combined_score:.0f}%, target "
               f"{100 * args.combined_target:.0f}%); {elapsed:.0f} s, {args.cases} cases per "
               f"property, RapidCheck seed {args.seed}")
    survivors = [result["name"] for result in results
                 if result["property"] == "pass" and result["sim"] == "pass"]
    if args.unit and survivors:
        by_unit = [result["name"] for result in results
                   if result["name"] in survivors and result.get("unit") not in ("-", "pass")]
        summary += (f"; the hub's unit tests kill {len(by_unit)} of the {len(survivors)} survivors"
                    + (f" ({', '.join(by_unit)})" if by_unit else ""))
    print("\n".join(rows))
    print(summary)
    if survivors:
        print("survivors: " + ", ".join(survivors))
    if args.report:
        with open(args.report, "w", encoding="utf-8") as report:
            report.write(f"# Mutation testing, {datetime.date.today()}\n\n{summary}\n\n")
            report.write("\n".join(rows) + "\n")
    ok = property_score >= args.property_target and combined_score >= args.combined_target
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
