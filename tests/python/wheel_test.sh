#!/usr/bin/env bash
# The wheel as a user installs it: built with Debian's python3-build from a copy of python/ (the
# source tree stays clean), installed with pip into fresh venvs, then
#   1. every native file in it loads only glibc/libstdc++ from the system, the rest from the wheel;
#   2. a venv without system packages (no numpy, no torch): import, th-server/th-ctl on PATH, and a
#      publish and replicate through plain Python buffers;
#   3. a venv that sees Debian's torch/numpy/pytest runs the Python tests (tests/python, the
#      examples rl_loop.py and vllm_backend.py among them) against the installed package;
#   4. pip install ./python (from source, reusing the CMake build) installs the same package.
# Usage: wheel_test.sh BUILD_DIR
set -euo pipefail
build_dir=$(cd "$1" && pwd)
root=$(cd "$(dirname "$0")/../.." && pwd)
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
cp -r "$root/python" "$scratch/python"
rm -rf "$scratch/python/build" "$scratch"/python/*.egg-info
export TH_PROJECT_DIR="$root" TH_BUILD_DIR="$build_dir"
unset PYTHONPATH TH_SERVER_BINARY

echo "== build the wheel (at ${SECONDS} s)"
/usr/bin/python3 -m build --no-isolation --wheel --outdir "$scratch/dist" "$scratch/python" > "$scratch/build.log" 2>&1 ||
  { tail -40 "$scratch/build.log"; exit 1; }
grep "tensorhub setup: bundled" "$scratch/build.log"
wheel=$(ls "$scratch"/dist/tensorhub-*.whl)
echo "wheel: $(basename "$wheel") ($(stat -c %s "$wheel") bytes)"

echo "== 2. a fresh venv, no system packages (at ${SECONDS} s)"
/usr/bin/python3 -m venv "$scratch/bare"
"$scratch/bare/bin/pip" install -q --no-index "$wheel"
package=$("$scratch/bare/bin/python" -c 'import os, tensorhub; print(os.path.dirname(tensorhub.__file__))')
case "$package" in "$scratch/bare/"*) ;; *) echo "tensorhub imported from $package, not the venv" >&2; exit 1 ;; esac

echo "== 1. what the native files load (at ${SECONDS} s)"
"$scratch/bare/bin/python" - "$package" <<'PY'
import glob, os, re, subprocess, sys
package = sys.argv[1]
system = re.compile(r"^(linux-vdso|ld-linux[-\w.]*|libc|libm|libdl|libpthread|librt|libutil|libgcc_s|libstdc\+\+|libresolv)\.so")
elves = glob.glob(os.path.join(package, "_core*.so")) + glob.glob(os.path.join(package, "_libs", "*")) + \
        glob.glob(os.path.join(package, "_bin", "*"))
assert len(elves) > 4, elves
for elf in elves:
    listing = subprocess.run(["ldd", elf], check=True, text=True, stdout=subprocess.PIPE, env={}).stdout
    for line in listing.splitlines():
        parts = line.split()
        if len(parts) < 3 or parts[1] != "=>":
            continue
        soname, path = parts[0], parts[2]
        assert path != "not", f"{elf}: {line.strip()}"
        assert "ibverbs" not in soname and "cuda" not in soname, f"{elf} links {soname}: it must be opened at run time"
        if not system.match(soname):
            assert os.path.realpath(path).startswith(os.path.realpath(package) + os.sep), \
                f"{os.path.basename(elf)} loads {soname} from {path}, not from the wheel"
print(f"{len(elves)} native files: every library besides glibc/libstdc++ comes from the wheel")
PY
for tool in th-server th-ctl; do
  help=$("$scratch/bare/bin/$tool" --help)
  echo "$tool --help: ${help%%$'\n'*}"
done
"$scratch/bare/bin/python" - <<'PY'
import array, tensorhub
with tensorhub.Server() as server:
    weights = array.array("f", [float(i) for i in range(1000)])
    received = array.array("f", bytes(4000))
    with tensorhub.Handle(servers=server.address, token=server.token, model="m", replica="trainer") as trainer, \
         tensorhub.Handle(servers=server.address, token=server.token, model="m", replica="rollout",
                          role="rollout") as rollout:
        trainer.register("w", weights)
        trainer.publish(1)
        rollout.register("w", received)
        info = rollout.replicate("latest")
        assert info.version == 1 and received == weights, (info, received[:4])
# The wheel's copies of shared libraries have names of their own: Python's ssl module, loaded
# after tensorhub, still uses the system's libssl, not the wheel's.
import os, ssl
package = os.path.realpath(os.path.dirname(tensorhub.__file__))
mapped = {line.split()[-1] for line in open("/proc/self/maps") if "/" in line.split()[-1]}
ours = sorted(os.path.basename(path) for path in mapped if path.startswith(package + os.sep))
theirs = sorted(path for path in mapped if os.path.basename(path).startswith("libssl.so"))
assert all("-" in name for name in ours if name.startswith("lib")), ours
assert theirs and not any(path.startswith(package) for path in theirs), theirs
print("bare venv: published and replicated 4000 bytes through array.array; ssl uses", theirs[0],
      "beside the wheel's", [name for name in ours if name.startswith("libssl")])
PY

echo "== 3. the Python tests against the installed wheel (at ${SECONDS} s)"
/usr/bin/python3 -m venv --system-site-packages "$scratch/venv"
"$scratch/venv/bin/pip" install -q --no-index "$wheel"
(cd "$scratch" && "$scratch/venv/bin/python" -m pytest -q -p no:cacheprovider "$root/tests/python" \
   --rootdir "$root/tests/python" -o "python_files=test_*.py")
"$scratch/venv/bin/python" -c 'import tensorhub, sys; assert tensorhub.__file__.startswith(sys.argv[1]), tensorhub.__file__' "$scratch/venv/"
help=$("$scratch/venv/bin/timeline-plot" --help)
echo "timeline-plot --help: ${help%%$'\n'*}"

echo "== 4. pip install ./python (from source, the CMake build reused) (at ${SECONDS} s)"
/usr/bin/python3 -m venv --system-site-packages "$scratch/source"
"$scratch/source/bin/pip" install -q --no-index --no-build-isolation "$scratch/python" > "$scratch/pip.log" 2>&1 ||
  { tail -40 "$scratch/pip.log"; exit 1; }
"$scratch/source/bin/python" -c 'import tensorhub, sys, os; assert tensorhub.__file__.startswith(sys.argv[1]); assert os.access(os.path.join(os.path.dirname(tensorhub.__file__), "_bin", "th-server"), os.X_OK); print("pip install ./python: ok")' "$scratch/source/"
echo "wheel_test: ok (${SECONDS} s)"
