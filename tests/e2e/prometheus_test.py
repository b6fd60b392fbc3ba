#!/usr/bin/env python3
"""End to end with a real Prometheus: th-server and th-demo's workers, scraped, must add up.

Starts th-server (with --metrics-listen), a Prometheus server of its own (Debian's 2.42, as
tools/install-deps --test unpacks it into /opt/tensorhub-test/prometheus, or one on PATH; run in a
temporary directory, on a free loopback port, never as a system service)
that scrapes th-server statically and th-demo's workers through the file_sd file th-demo writes,
runs a small th-demo job against th-server, then asks Prometheus' HTTP API for the figures and
checks them against what the job did:

  model size = one replica's bytes in th-demo's table (every row the same), readers = rollouts,
  versions = steps; bytes moved = versions x model size x readers, on the server and as the
  rollouts counted them; operations, transfers and shard reads by count; no checksum failure;
  stall histograms for every reader shard; every worker scraped.

Usage: prometheus_test.py --th-server PATH --th-demo PATH [--keep DIR] [--prometheus PATH]

Exit status: 0 passed, 1 failed (with what was expected and what Prometheus returned),
77 skipped (no prometheus binary: tools/install-deps --test).
Python standard library only. Every process it starts is stopped (SIGTERM to its process group,
then SIGKILL after a bound), also on failure; the whole run is bounded by GLOBAL_TIMEOUT_S.
"""

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request

EXIT_PASS, EXIT_FAIL, EXIT_SKIP = 0, 1, 77
GLOBAL_TIMEOUT_S = 120
SERVER_START_S = 15  # th-server's two lines
PROMETHEUS_READY_S = 30  # /-/ready
DEMO_TIMEOUT_S = 60  # the th-demo job, linger included
QUERY_DEADLINE_S = 30  # figures must match within this after th-demo exits
STOP_GRACE_S = 5  # SIGTERM, then SIGKILL

# The job (small; the figures below follow from it).
STEPS, ROLLOUTS, SHARDS, SHARD_MB = 3, 2, 2, 4
# Prometheus (2.42, Debian 12) hands service-discovery changes to its scrapers only on a 5 s tick
# (the discovery manager's fixed update interval; no flag changes it): a file_sd target is first
# scraped 0.5 to ~5.2 s after th-demo writes the file. th-demo's workers must outlive that by a
# scrape after the job's last figures, whatever the job's own length: 7 s, not 4.
LINGER_MS = 7000
SCRAPED_S = 15  # th-server's static target scraped (the same 5 s tick, from Prometheus' start)
MIB = 1024 * 1024
SCRAPE_INTERVAL, SCRAPE_TIMEOUT = "250ms", "200ms"

START = time.monotonic()


class Failure(Exception):
    """The test failed; the message says why."""


class GlobalTimeout(BaseException):
    """SIGALRM: the whole test ran past GLOBAL_TIMEOUT_S."""


class Stopped(BaseException):
    """SIGTERM or SIGINT to the test itself."""


def log(message):
    print(f"[{time.monotonic() - START:6.2f}s] {message}", flush=True)


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Process:
    """A child in a process group of its own, stdout and stderr in files under the work dir."""

    def __init__(self, name, argv, workdir):
        self.name = name
        self.argv = argv
        self.stdout_path = os.path.join(workdir, f"{name}.stdout")
        self.stderr_path = os.path.join(workdir, f"{name}.stderr")
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            try:
                self.popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                              cwd=workdir, start_new_session=True)
            except OSError as error:
                raise Failure(f"cannot start {name} ({argv[0]}): {error}")
        self.pgid = self.popen.pid  # start_new_session: the child leads a new session and group
        log(f"started {name} (pid {self.popen.pid}): {' '.join(argv)}")

    def stdout(self):
        with open(self.stdout_path, "r", errors="replace") as f:
            return f.read()

    def output_tail(self, lines=25):
        parts = []
        for label, path in (("stdout", self.stdout_path), ("stderr", self.stderr_path)):
            with open(path, "r", errors="replace") as f:
                text = f.read().splitlines()
            if text:
                shown = min(lines, len(text))
                parts.append(f"--- {self.name} {label} (last {shown} of {len(text)} lines) ---")
                parts.extend(text[-lines:])
        return "\n".join(parts) if parts else f"--- {self.name}: no output ---"

    def exited(self):
        return self.popen.poll() is not None

    def _group_alive(self):
        try:
            os.killpg(self.pgid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def stop(self):
        """SIGTERM to the process group (th-demo's workers too), SIGKILL after STOP_GRACE_S."""
        if self.popen.poll() is None or self._group_alive():
            try:
                os.killpg(self.pgid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            bound = time.monotonic() + STOP_GRACE_S
            while time.monotonic() < bound and (self.popen.poll() is None or self._group_alive()):
                time.sleep(0.05)
            if self.popen.poll() is None or self._group_alive():
                log(f"{self.name} still running {STOP_GRACE_S}s after SIGTERM: SIGKILL")
                try:
                    os.killpg(self.pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        try:
            self.popen.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            log(f"{self.name} (pid {self.popen.pid}) did not die after SIGKILL")


def wait_for_lines(process, patterns, deadline):
    """The first match of each regex in process' stdout, waiting until deadline."""
    found = {}
    while True:
        text = process.stdout()
        for key, pattern in patterns.items():
            if key not in found:
                match = re.search(pattern, text, re.MULTILINE)
                if match:
                    found[key] = match
        if len(found) == len(patterns):
            return found
        missing = " and ".join(repr(key) for key in patterns if key not in found)
        if process.exited():  # the caller prints its output
            raise Failure(f"{process.name} exited with status {process.popen.returncode} "
                          f"before printing {missing}")
        if time.monotonic() >= deadline:
            raise Failure(f"{process.name} did not print {missing} within {SERVER_START_S}s")
        time.sleep(0.05)


def http_get(url, timeout=5.0):
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.status, response.read()


class Prometheus:
    def __init__(self, binary, workdir, config_path, deadline, processes):
        """Each process it starts goes into processes at once, for the caller to stop."""
        self.binary = binary
        self.processes = processes
        self.workdir = workdir
        self.config_path = config_path
        self.process = None
        self.base = None
        self._start(deadline)

    def _start(self, deadline):
        # The free port can be taken between probing and binding: try a few.
        last_error = None
        for attempt in range(3):
            port = free_port()
            name = "prometheus" if attempt == 0 else f"prometheus-{attempt}"
            self.process = Process(name, [
                self.binary,
                f"--config.file={self.config_path}",
                f"--storage.tsdb.path={os.path.join(self.workdir, f'{name}-data')}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--storage.tsdb.retention.time=1h",
                "--log.level=info",
            ], self.workdir)
            self.processes.append(self.process)
            self.base = f"http://127.0.0.1:{port}"
            ready_by = min(deadline, time.monotonic() + PROMETHEUS_READY_S)
            while time.monotonic() < ready_by and not self.process.exited():
                try:
                    status, _ = http_get(self.base + "/-/ready", timeout=1.0)
                    if status == 200:
                        log(f"prometheus ready at {self.base}")
                        return
                except (urllib.error.URLError, OSError):
                    pass
                time.sleep(0.1)
            last_error = self.process.output_tail(40)
            if not self.process.exited():
                self.process.stop()
                raise Failure(f"prometheus not ready within {PROMETHEUS_READY_S}s\n{last_error}")
            if "address already in use" not in last_error:
                break
            log(f"prometheus port {port} was taken; trying another")
        raise Failure(f"prometheus exited with status {self.process.popen.returncode}\n{last_error}")

    def api(self, path, params=None):
        url = self.base + path + ("?" + urllib.parse.urlencode(params) if params else "")
        try:
            _, body = http_get(url)
        except urllib.error.HTTPError as error:
            body = error.read()
        except (urllib.error.URLError, OSError) as error:
            raise Failure(f"prometheus API {path} unreachable: {error}")
        try:
            answer = json.loads(body)
        except ValueError:
            raise Failure(f"prometheus API {path}: not JSON: {body[:300]!r}")
        if answer.get("status") != "success":
            raise Failure(f"prometheus API {url}: {answer.get('errorType')}: {answer.get('error')}")
        return answer["data"]

    def query(self, expression):
        """The value of a one-sample instant query; None for no data; a string for anything else."""
        data = self.api("/api/v1/query", {"query": expression})
        if data["resultType"] == "scalar":
            return float(data["result"][1])
        if data["resultType"] != "vector":
            return f"unexpected {data['resultType']}"
        if not data["result"]:
            return None
        if len(data["result"]) > 1:
            return "several: " + ", ".join(f"{r['metric']}={r['value'][1]}" for r in data["result"])
        return float(data["result"][0]["value"][1])

    def wait_scraped(self, pool, count, deadline):
        """Waits until count targets of pool are up: /-/ready comes ~5 s before the first scrape."""
        started = time.monotonic()
        targets = []
        while time.monotonic() < deadline:
            targets = self.targets(pool)
            if sum(1 for t in targets if t.get("health") == "up") >= count:
                log(f"prometheus scraping {pool} ({time.monotonic() - started:.2f}s after asking)")
                return
            if self.process.exited():
                raise Failure(f"prometheus exited with status {self.process.popen.returncode}\n"
                              f"{self.process.output_tail(40)}")
            time.sleep(0.1)
        raise Failure(f"prometheus did not scrape {pool} within {SCRAPED_S}s: " + (
            "; ".join(f"{t['scrapeUrl']} health={t['health']} lastError={t.get('lastError')!r}"
                      for t in targets) or "no such target"))

    def targets(self, pool):
        data = self.api("/api/v1/targets", {"state": "active"})
        return [t for t in data.get("activeTargets", []) if t.get("scrapePool") == pool]


def write_prometheus_config(path, metrics_port, targets_file):
    # JSON strings are valid YAML double-quoted scalars.
    with open(path, "w") as f:
        f.write(f"""# Written by tests/e2e/prometheus_test.py
global:
  scrape_interval: {SCRAPE_INTERVAL}
  scrape_timeout: {SCRAPE_TIMEOUT}
  evaluation_interval: 1s
scrape_configs:
  - job_name: th-server
    static_configs:
      - targets: [{json.dumps(f"127.0.0.1:{metrics_port}")}]
  - job_name: th-client
    file_sd_configs:
      - files: [{json.dumps(targets_file)}]
        refresh_interval: 1s
""")


def table_bytes(demo_output):
    """The bytes column of th-demo's table (one row per version and rollout replica): what each
    rollout received, by th-demo's own count. Returns the list of values."""
    rows = re.findall(r"^\d+\s+rollout-\d+\s+\S+\s+(\d+)\s", demo_output, re.MULTILINE)
    return [int(value) for value in rows]


def checks(model_bytes, pulled_bytes):
    """(expression, comparison, expected, what it stands for). Client metrics go through
    max_over_time: th-demo's workers are gone (their series stale) by the time we ask.
    model_bytes: one replica's bytes (all shards), as th-demo's table shows them; pulled_bytes:
    the table's bytes column summed (a resumed read pulls less than the model)."""
    moved = STEPS * model_bytes * ROLLOUTS  # versions x model size x readers
    workers = (ROLLOUTS + 1) * SHARDS  # the trainer's shards and each rollout's
    reads = STEPS * ROLLOUTS * SHARDS  # shard reads: versions x readers x shards
    return [
        ("sum(th_server_transfer_bytes_total)", "==", moved,
         "bytes moved = versions x model size x readers"),
        ("sum(max_over_time(th_client_received_bytes_total[5m]))", "==", pulled_bytes,
         "bytes the rollouts received = the table's bytes column, summed"),
        ('sum(th_server_operations_total{op="publish",result="ok"})', "==", STEPS * SHARDS,
         "publishes = versions x shards"),
        ('sum(th_server_operations_total{op="replicate",result="ok"})', "==", ROLLOUTS * SHARDS,
         "replicates = readers x shards (each rollout's first version)"),
        ('sum(th_server_operations_total{op="update",result="ok"})', ">=", (STEPS - 1) * ROLLOUTS * SHARDS,
         "ok updates >= later versions x readers x shards"),
        ("sum(th_server_transfers_completed_total)", "==", STEPS * ROLLOUTS,
         "replica transfers = versions x readers"),
        ('sum(th_server_shard_reads_total{outcome="done"})', "==", reads,
         "shard reads = versions x readers x shards"),
        ("sum(max_over_time(th_client_checksum_failures_total[5m]))", "==", 0,
         "no checksum failure (the counter exported, at 0)"),
        ("count(max_over_time(th_client_stall_seconds_count[5m]))", ">=", ROLLOUTS * SHARDS,
         "stall histograms >= readers x shards"),
        ("sum(max_over_time(th_client_stall_seconds_count[5m]))", ">=", reads,
         "replicate/update stalls >= versions x readers x shards"),
        ("max(max_over_time(th_server_clients[5m]))", ">=", workers,
         "clients at the peak >= (rollouts+1) x shards"),
        ('up{job="th-server"}', "==", 1, "th-server scraped"),
        ('max_over_time(count(up{job="th-client"} == 1)[5m:250ms])', "==", workers,
         "every worker scraped up at once"),
    ]


def compare(value, op, expected):
    if not isinstance(value, float):
        return False
    return value == expected if op == "==" else value >= expected


def show(value):
    if value is None:
        return "(no data)"
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    return value


def run_checks(prometheus, deadline, model_bytes, pulled_bytes):
    """Query every check until all hold or deadline; returns (all ok, rows)."""
    rows = []
    while True:
        rows = []
        for expression, op, expected, meaning in checks(model_bytes, pulled_bytes):
            value = prometheus.query(expression)
            rows.append((expression, op, expected, value, compare(value, op, expected), meaning))
        if all(row[4] for row in rows) or time.monotonic() >= deadline:
            return all(row[4] for row in rows), rows
        time.sleep(0.5)


def print_table(rows):
    width = max(len(row[0]) for row in rows)
    print(f"{'expression':<{width}}  {'expected':>14}  {'prometheus':>12}  ok", flush=True)
    for expression, op, expected, value, ok, _ in rows:
        print(f"{expression:<{width}}  {op + ' ' + str(expected):>14}  {show(value):>12}  "
              f"{'ok' if ok else 'FAIL'}", flush=True)


def describe_client_targets(prometheus):
    try:
        targets = prometheus.targets("th-client")
    except Failure as error:
        return f"(targets API: {error})"
    if not targets:
        return "Prometheus has no th-client target (file_sd never yielded any)."
    return "th-client targets now:\n" + "\n".join(
        f"  {t['scrapeUrl']} health={t['health']} lastScrape={t.get('lastScrape')} "
        f"lastError={t.get('lastError')!r}" for t in targets)


def run_demo(args, prometheus, port, token_path, targets_path, deadline, processes):
    """Runs th-demo; meanwhile watches when Prometheus discovers and scrapes its workers."""
    workers = (ROLLOUTS + 1) * SHARDS
    demo = Process("th-demo", [
        args.th_demo, "--server", f"127.0.0.1:{port}", "--token-file", token_path,
        "--steps", str(STEPS), "--rollouts", str(ROLLOUTS), "--shards", str(SHARDS),
        "--shard-mb", str(SHARD_MB), "--client-metrics-targets", targets_path,
        "--linger-ms", str(LINGER_MS),
    ], prometheus.workdir)
    processes.append(demo)
    started = time.monotonic()
    file_at = discovered_at = all_up_at = None
    demo_deadline = min(deadline, started + DEMO_TIMEOUT_S)
    while demo.popen.poll() is None:
        if time.monotonic() >= demo_deadline:
            raise Failure(f"th-demo still running after {DEMO_TIMEOUT_S}s\n{demo.output_tail()}")
        now = time.monotonic()
        if file_at is None and os.path.exists(targets_path):
            file_at = now
        if file_at is not None and all_up_at is None:
            try:
                targets = prometheus.targets("th-client")
            except Failure:
                targets = []
            if targets and discovered_at is None:
                discovered_at = now
            if sum(1 for t in targets if t.get("health") == "up") >= workers:
                all_up_at = now
        time.sleep(0.1)
    ended = time.monotonic()
    demo.stop()  # its workers, should any outlive it

    def since(t, origin):
        return "never" if t is None else f"{t - origin:.2f}s"
    log(f"th-demo exited with status {demo.popen.returncode} after {ended - started:.2f}s; "
        f"targets file after {since(file_at, started)}; Prometheus discovered its targets "
        f"{since(discovered_at, file_at or started)} later, had all {workers} up "
        f"{since(all_up_at, file_at or started)} after the file appeared")
    print(demo.output_tail(40), flush=True)
    timing = {"file": file_at, "discovered": discovered_at, "all_up": all_up_at, "ended": ended}
    if demo.popen.returncode != 0 or not re.search(r"^th-demo: ok\s*$", demo.stdout(), re.MULTILINE):
        raise Failure(f"th-demo exited with status {demo.popen.returncode}"
                      f"{'' if 'th-demo: ok' in demo.stdout() else ' without printing th-demo: ok'}")
    if file_at is None and not os.path.exists(targets_path):
        raise Failure(f"th-demo wrote no {targets_path} (--client-metrics-targets)")
    sizes = table_bytes(demo.stdout())
    if len(sizes) != STEPS * ROLLOUTS:
        raise Failure(f"th-demo's table should have {STEPS * ROLLOUTS} rows; bytes column: {sizes}")
    # A row counts the bytes its rollout pulled: the model's, unless a read the server moved to
    # another source went on there from the tensors it had verified (resume), pulling fewer.
    return timing, max(sizes), sum(sizes)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--th-server", required=True, help="the th-server binary")
    parser.add_argument("--th-demo", required=True, help="the th-demo binary")
    parser.add_argument("--keep", metavar="DIR",
                        help="work in DIR (created; must be empty) and keep it: logs, configs, TSDB")
    parser.add_argument("--prometheus", default=os.environ.get("PROMETHEUS"),
                        help="the prometheus binary (default: $PROMETHEUS, then prometheus on PATH, "
                             "then /usr/bin/prometheus)")
    args = parser.parse_args()
    # The children run in the work dir: relative paths are taken from here.
    args.th_server, args.th_demo = os.path.abspath(args.th_server), os.path.abspath(args.th_demo)

    # tools/install-deps --test unpacks Debian's package there (no system service).
    unpacked = "/opt/tensorhub-test/prometheus/usr/bin/prometheus"
    binary = os.path.abspath(args.prometheus or shutil.which("prometheus") or
                             (unpacked if os.path.exists(unpacked) else "/usr/bin/prometheus"))
    if not (os.path.isfile(binary) and os.access(binary, os.X_OK)):
        print(f"SKIP: no prometheus binary ({binary}); "
              "tools/install-deps --test unpacks Debian's", flush=True)
        return EXIT_SKIP
    for flag, path in (("--th-server", args.th_server), ("--th-demo", args.th_demo)):
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            print(f"FAIL: {flag} {path}: not an executable file", flush=True)
            return EXIT_FAIL

    if args.keep:
        workdir = os.path.abspath(args.keep)
        os.makedirs(workdir, exist_ok=True)
        if os.listdir(workdir):
            print(f"FAIL: --keep {workdir}: not empty", flush=True)
            return EXIT_FAIL
    else:
        workdir = tempfile.mkdtemp(prefix="th-prometheus-test.")

    def on_alarm(signum, frame):
        raise GlobalTimeout()

    def on_stop(signum, frame):
        raise Stopped(signal.Signals(signum).name)

    signal.signal(signal.SIGALRM, on_alarm)
    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)
    signal.alarm(GLOBAL_TIMEOUT_S)
    deadline = START + GLOBAL_TIMEOUT_S - 5  # leaves time to stop everything

    processes = []
    status = EXIT_FAIL
    try:
        version = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10)
        log(f"{binary}: {((version.stdout or version.stderr).strip() or '?').splitlines()[0]}")
        log(f"work dir {workdir}")

        token_path = os.path.join(workdir, "token")
        fd = os.open(token_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")

        server = Process("th-server", [
            args.th_server, "--listen", "127.0.0.1:0", "--token-file", token_path,
            "--metrics-listen", "127.0.0.1:0",
        ], workdir)
        processes.append(server)
        listen_line = "th-server listening on 127.0.0.1:PORT"
        metrics_line = "th-server metrics on 127.0.0.1:PORT"
        lines = wait_for_lines(server, {
            listen_line: r"^th-server listening on 127\.0\.0\.1:(\d+)\s*$",
            metrics_line: r"^th-server metrics on 127\.0\.0\.1:(\d+)\s*$",
        }, min(deadline, time.monotonic() + SERVER_START_S))
        port, metrics_port = int(lines[listen_line].group(1)), int(lines[metrics_line].group(1))
        log(f"th-server on 127.0.0.1:{port}, metrics on 127.0.0.1:{metrics_port}")

        targets_path = os.path.join(workdir, "targets.json")
        config_path = os.path.join(workdir, "prometheus.yml")
        write_prometheus_config(config_path, metrics_port, targets_path)
        prometheus = Prometheus(binary, workdir, config_path, deadline, processes)
        # Otherwise th-server's figures during the job (th_server_clients' peak) could go unseen.
        prometheus.wait_scraped("th-server", 1, min(deadline, time.monotonic() + SCRAPED_S))

        timing, model_bytes, pulled_bytes = run_demo(args, prometheus, port, token_path, targets_path, deadline,
                                                     processes)

        ok, rows = run_checks(prometheus, min(deadline, time.monotonic() + QUERY_DEADLINE_S), model_bytes,
                              pulled_bytes)
        print_table(rows)
        failed = [row for row in rows if not row[4]]
        print(f"checks: {len(rows) - len(failed)} passed, {len(failed)} failed", flush=True)
        if failed:
            why = "\n".join(f"  {e}: expected {op} {x} ({m}), Prometheus returned {show(v)}"
                            for e, op, x, v, _, m in failed)
            hint = ""
            if any("th_client" in row[0] or "th-client" in row[0] for row in failed):
                hint = "\n" + describe_client_targets(prometheus)
                if timing["all_up"] is None:
                    hint += (f"\nPrometheus never had every th-demo worker up while th-demo ran: "
                             f"file_sd changes reach the scrapers only every ~5s; is --linger-ms "
                             f"{LINGER_MS} long enough?")
            raise Failure(f"{len(failed)} of {len(rows)} figures did not match within "
                          f"{QUERY_DEADLINE_S}s:\n{why}{hint}")
        status = EXIT_PASS
    except Failure as failure:
        print(f"FAIL: {failure}", flush=True)
        for process in processes:
            if process.name.startswith("th-server"):
                print(process.output_tail(), flush=True)
        if not args.keep:
            print("(--keep DIR keeps every process' output, prometheus.yml and Prometheus' data)", flush=True)
    except GlobalTimeout:
        print(f"FAIL: the test ran past its global timeout of {GLOBAL_TIMEOUT_S}s", flush=True)
    except Stopped as stop:
        print(f"FAIL: stopped by {stop}", flush=True)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        for process in reversed(processes):
            process.stop()
        if args.keep:
            log(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    log("prometheus_test: " + ("ok" if status == EXIT_PASS else "FAILED"))
    return status


if __name__ == "__main__":
    sys.exit(main())
