#!/usr/bin/env python3
"""Mutation testing of core/: runs the property test, then the th-sim CI block, against every
mutant of catalogue.txt and reports how many each kills (ctest -L mutants).

A mutant is killed by the property test if the test binary fails with TH_MUTANT=N, or if one of
the counterexamples of tests/core/property-regressions.txt fails against it (--regressions). The
property test runs once per RapidCheck seed (--seeds, three by default): its score is reported per
seed, and the targets must hold for every seed, so that a score is not the luck of one seed. It
runs without shrinking: a kill needs a failing case, not its smallest form (shrinking a mutant's
failure can outlast any timeout).

The th-sim block (and, with --regression-seeds, the named seeds of tests/sim/regression-seeds.txt)
runs for the mutants the property test left alive on some seed, and kills one with a violation.
The targets: the property test alone kills at least 90%, property test and simulator together
kill all, on every seed. A kill that is only a timeout (the binary hung) is not a kill: the run
fails and names the mutant (a hang is a bug of the tests or of the mutant's catalogue entry).

    run.py --list mutants.tsv --property BIN --sim BIN [--regressions BIN] [--unit BIN]
           [--regression-seeds FILE] [--report FILE] [--jobs N] [--cases N] [--seeds A,B,C]
           [--only NAME,...] [--property-target 0.9] [--combined-target 1.0]

With --unit, the core's unit tests (the hub's, the layouts' and the agent's, built against the
mutants) also run against the survivors of both: a third figure, for information; the targets
are the two above.
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
    for profile in ("harsh-net", "harsh-crash", "harsh-bytes") for workload in WORKLOADS] + [
    ["--seeds", "5001..5500", "--workload", workload, "--profile", "harsh-crash", "--faults", "rack=1"]
    for workload in ("cross-dc", "mixed")] + [
    ["--seeds", "6001..6300", "--workload", workload, "--faults", "throttle=0.3,drain-grace=2000"]
    for workload in ("colocated", "standalone", "mixed")] + [
    ["--seeds", "7001..7300", "--workload", workload, "--faults", "run-restart=1,model-grace=2000"]
    for workload in ("colocated", "multi-model", "layouts")] + [
    ["--seeds", "7001..7300", "--workload", "mixed", "--profile", "harsh-crash",
     "--faults", "run-restart=1,model-grace=2000"]]

# The fixed seed of CI's property test, and two others.
DEFAULT_SEEDS = "20261130,2,3"


def regression_seeds(path):
    """The named seeds of tests/sim/regression-seeds.txt, as th-sim argument lists."""
    blocks = []
    with open(path, encoding="utf-8") as listing:
        for line in listing:
            words = line.split("#", 1)[0].split()
            if words:
                blocks.append(["--seed"] + words)
    return blocks


PROPERTY_TIMEOUT_S = 600
SIM_TIMEOUT_S = 300


def run(command, env_extra, timeout_s):
    """Returns (status, seconds, output): status 'pass', 'fail' or 'hang'."""
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
    for marker in ("Exception thrown with message:", "violation at", "throws th::AssertionFailure"):
        index = output.find(marker)
        if index >= 0:
            if marker.startswith("Exception"):
                line = output[index:].split("\n")[1]
            else:
                line = output[index:].split("\n")[0]
            return line.strip()[:160]
    # No checker's message: a gtest failure, or a crash (a mutant that corrupts memory aborts the
    # binary): quote the first failure line, else the last line it wrote, rather than nothing
    # (an empty reason was reported as "SURVIVED").
    lines = [line.strip() for line in output.split("\n") if line.strip()]
    for line in lines:
        if "Failure" in line or line.startswith("[  FAILED  ]"):
            return line[:160]
    return ("crashed or failed without a message; its last words: " + lines[-1][:120]) if lines else "failed, no output"


def property_env(args, mutant, seed):
    return {"TH_MUTANT": str(mutant),
            "RC_PARAMS": f"max_success={args.cases} max_size=200 seed={seed} noshrink=1"}


def judge_property(args, number, seed):
    """The property test (and the counterexamples) against mutant `number` on one seed."""
    status, seconds, output = run([args.property], property_env(args, number, seed), PROPERTY_TIMEOUT_S)
    why = first_failure(output) if status == "fail" else ""
    if status == "pass" and args.regressions:
        status, more, output = run([args.regressions], {"TH_MUTANT": str(number)}, PROPERTY_TIMEOUT_S)
        seconds += more
        why = "counterexample: " + first_failure(output) if status == "fail" else ""
    return status, seconds, why


def judge(args, number, name):
    result = {"id": number, "name": name, "property": {}, "property_why": "",
              "sim": "-", "sim_s": 0.0, "sim_why": "", "unit": "-"}
    for seed in args.seeds:
        status, seconds, why = judge_property(args, number, seed)
        result["property"][seed] = (status, seconds)
        if why and not result["property_why"]:
            result["property_why"] = why
    if all(status == "fail" for status, _ in result["property"].values()):
        return result
    sim_seconds = 0.0
    for block in SIM_BLOCK + args.regression_blocks:
        status, seconds, output = run([args.sim] + block, {"TH_MUTANT": str(number)}, SIM_TIMEOUT_S)
        sim_seconds += seconds
        if status != "pass":
            result["sim"] = status
            result["sim_why"] = " ".join(block) + ": " + (first_failure(output) or status)
            break
    else:
        result["sim"] = "pass"
    result["sim_s"] = sim_seconds
    if result["sim"] != "fail" and args.unit:
        status, _, output = run([args.unit], {"TH_MUTANT": str(number)}, PROPERTY_TIMEOUT_S)
        result["unit"] = status
        if status != "pass":
            failed = [line.split("]", 1)[1].strip() for line in output.splitlines()
                      if line.startswith("[  FAILED  ]") and "listed below" not in line]
            result["unit_why"] = "unit test " + (failed[0].split(" ")[0] if failed else status)
    return result


def killed_by_property(result, seed):
    return result["property"][seed][0] == "fail"


def killed(result, seed):
    return killed_by_property(result, seed) or result["sim"] == "fail"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--list", required=True)
    parser.add_argument("--property", required=True)
    parser.add_argument("--regressions", default="",
                        help="the property counterexamples' replay, built against the mutants")
    parser.add_argument("--sim", required=True)
    parser.add_argument("--unit", default="")
    parser.add_argument("--regression-seeds", default="",
                        help="tests/sim/regression-seeds.txt: the named seeds run after the block")
    parser.add_argument("--report")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--cases", type=int, default=2000)
    parser.add_argument("--seeds", default=os.environ.get("TH_MUTANT_SEEDS", DEFAULT_SEEDS),
                        help="RapidCheck seeds of the property test, comma-separated (three by default)")
    parser.add_argument("--only", default="")
    parser.add_argument("--property-target", type=float, default=0.9)
    parser.add_argument("--combined-target", type=float, default=1.0)
    args = parser.parse_args()
    args.seeds = [int(seed) for seed in args.seeds.split(",") if seed.strip()]
    if not args.seeds:
        print("run.py: no seeds", file=sys.stderr)
        return 2
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
    for seed in args.seeds:
        status, _, why = judge_property(args, 0, seed)
        if status != "pass":
            print(why)
            print(f"run.py: the property test fails without any mutant (seed {seed})")
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
    seed_columns = " | ".join(f"property test, seed {seed}" for seed in args.seeds)
    rows = [f"| # | mutant | file | {seed_columns} | th-sim block | what caught it |",
            "|---|---|---|" + "---|" * len(args.seeds) + "---|---|"]
    files = {number: path for number, _, path, _ in mutants}
    for result in results:
        caught = (result["property_why"] or result["sim_why"] or
                  (f"SURVIVED (killed by {result['unit_why']})" if result.get("unit_why") else "SURVIVED"))
        sim = result["sim"] if result["sim"] == "-" else f"{result['sim']} ({result['sim_s']:.0f} s)"
        cells = " | ".join(f"{status} ({seconds:.1f} s)" for status, seconds in result["property"].values())
        rows.append(f"| {result['id']} | {result['name']} | {files[result['id']]} | {cells} | {sim} | {caught} |")

    ok = True
    lines = [f"mutants: {total}; {args.cases} cases per property, no shrinking; {elapsed:.0f} s"]
    for seed in args.seeds:
        by_property = sum(1 for result in results if killed_by_property(result, seed))
        by_either = sum(1 for result in results if killed(result, seed))
        property_score = by_property / total
        combined_score = by_either / total
        ok = ok and property_score >= args.property_target and combined_score >= args.combined_target
        lines.append(f"RapidCheck seed {seed}: the property test alone kills {by_property} "
                     f"({100 * property_score:.0f}%, target {100 * args.property_target:.0f}%); property "
                     f"test + th-sim CI block kill {by_either} ({100 * combined_score:.0f}%, target "
                     f"{100 * args.combined_target:.0f}%)")
    survivors = sorted({result["name"] for result in results for seed in args.seeds
                        if not killed(result, seed)})
    hangs = [result["name"] for result in results
             if any(status == "hang" for status, _ in result["property"].values()) or result["sim"] == "hang"]
    if survivors:
        lines.append("survivors (on some seed): " + ", ".join(survivors))
        by_unit = [result["name"] for result in results
                   if result["name"] in survivors and result.get("unit") not in ("-", "pass")]
        if args.unit:
            lines.append(f"the core's unit tests kill {len(by_unit)} of them" +
                         (f" ({', '.join(by_unit)})" if by_unit else ""))
    if hangs:
        ok = False
        lines.append("hung (a timeout is not a kill; fix the test or the mutant): " + ", ".join(hangs))
    summary = "\n".join(lines)
    print("\n".join(rows))
    print(summary)
    if args.report:
        with open(args.report, "w", encoding="utf-8") as report:
            report.write(f"# Mutation testing, {datetime.date.today()}\n\n{summary}\n\n")
            report.write("\n".join(rows) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
