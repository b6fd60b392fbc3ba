#!/usr/bin/env bash
# The .deb (tools/deb): built with cpack from the build folder; its files and dependencies; then,
# as root on a machine without tensorhub installed, installed with dpkg, th-server started the way
# its systemd unit starts it (as user tensorhub, with the token the package wrote; systemd itself
# is not running here), answered by th-ctl, stopped with SIGTERM, and the package purged.
# Usage: deb_test.sh BUILD_DIR. Exit 77 (skipped) for the install part when not root or when a
# tensorhub package is already installed.
set -euo pipefail
build_dir=$(cd "$1" && pwd)
scratch=$(mktemp -d)
installed=0
server_pid=""
cleanup() {
  if [ -n "$server_pid" ]; then kill -9 "$server_pid" 2> /dev/null || true; fi
  if [ "$installed" = 1 ]; then dpkg --purge tensorhub > /dev/null 2>&1 || true; fi
  rm -rf "$scratch"
}
trap cleanup EXIT

(cd "$scratch" && cpack -G DEB --config "$build_dir/CPackConfig.cmake" -B "$scratch/out" > "$scratch/cpack.log" 2>&1) ||
  { tail -30 "$scratch/cpack.log"; exit 1; }
deb=$(ls "$scratch"/out/tensorhub_*.deb)
echo "package: $(basename "$deb") ($(stat -c %s "$deb") bytes)"
depends=$(dpkg-deb -f "$deb" Depends)
echo "Depends: $depends"
for needed in libcapnp libxxhash libssl adduser; do
  case "$depends" in *"$needed"*) ;; *) echo "deb_test: Depends lacks $needed" >&2; exit 1 ;; esac
done
case "$depends" in *ibverbs*) echo "deb_test: Depends names libibverbs, which libthclient opens at run time" >&2; exit 1 ;; esac
contents=$(dpkg-deb -c "$deb" | awk '{print $6}')
for file in ./usr/bin/th-server ./usr/bin/th-ctl ./usr/bin/timeline-plot ./usr/lib/systemd/system/th-server.service \
            ./usr/include/tensorhub/client.h ./usr/lib/pkgconfig/tensorhub.pc ./usr/share/doc/tensorhub/README.md; do
  grep -qx "$file" <<< "$contents" || { echo "deb_test: the package has no $file" >&2; exit 1; }
done
grep -q '^./usr/lib/libthclient.so' <<< "$contents" || { echo "deb_test: the package has no libthclient" >&2; exit 1; }
echo "files: th-server, th-ctl, timeline-plot, the systemd unit, libthclient, headers, pkg-config"

if [ "$(id -u)" -ne 0 ]; then echo "deb_test: not root: the package is not installed (skipped)"; exit 77; fi
if dpkg-query -W -f='${Status}' tensorhub 2> /dev/null | grep -q 'install ok installed'; then
  echo "deb_test: a tensorhub package is installed already: not touching it (skipped)"; exit 77
fi
installed=1
dpkg -i "$deb" > "$scratch/dpkg.log" 2>&1 || { cat "$scratch/dpkg.log"; exit 1; }
getent passwd tensorhub > /dev/null || { echo "deb_test: no user tensorhub" >&2; exit 1; }
[ "$(stat -c '%a %U' /etc/tensorhub/token)" = "600 tensorhub" ] ||
  { echo "deb_test: /etc/tensorhub/token is $(stat -c '%a %U' /etc/tensorhub/token)" >&2; exit 1; }
# Enabled at the first install, even with no systemd running (deb-systemd-helper's links).
wants=/etc/systemd/system/multi-user.target.wants/th-server.service
if command -v deb-systemd-helper > /dev/null; then
  [ -L "$wants" ] || { echo "deb_test: th-server.service is not enabled ($wants)" >&2; exit 1; }
fi
# Installed again (an upgrade to the same version): the token stays; an empty one is replaced, and
# one left readable by others is made 0600 again.
token_before=$(cat /etc/tensorhub/token)
chmod 0644 /etc/tensorhub/token
dpkg -i "$deb" > "$scratch/dpkg.log" 2>&1 || { cat "$scratch/dpkg.log"; exit 1; }
[ "$(cat /etc/tensorhub/token)" = "$token_before" ] || { echo "deb_test: a reinstall changed the token" >&2; exit 1; }
[ "$(stat -c '%a' /etc/tensorhub/token)" = 600 ] || { echo "deb_test: a reinstall left the token readable" >&2; exit 1; }
: > /etc/tensorhub/token
dpkg -i "$deb" > "$scratch/dpkg.log" 2>&1 || { cat "$scratch/dpkg.log"; exit 1; }
[ -s /etc/tensorhub/token ] || { echo "deb_test: an empty token was kept" >&2; exit 1; }
echo "reinstalled: the token kept (and made 0600 again); an empty one replaced"
unit=/usr/lib/systemd/system/th-server.service
# Where systemd runs (not in this container), it must accept the unit; elsewhere it cannot judge it.
if [ -d /run/systemd/system ] && command -v systemd-analyze > /dev/null; then
  systemd-analyze verify "$unit" || { echo "deb_test: systemd-analyze rejects $unit" >&2; exit 1; }
  echo "systemd-analyze verify: ok"
else
  echo "systemd-analyze verify: skipped (systemd is not running here)"
fi
# The unit's ExecStart (continuation lines joined), on loopback ports of the kernel's choosing.
exec_start=$(sed -n '/^ExecStart=/,/[^\\]$/p' "$unit" | sed 's/^ExecStart=//; s/\\$//' | tr -s ' \n' ' ')
exec_start=$(sed 's/--listen [^ ]*/--listen 127.0.0.1:0/; s/--metrics-listen [^ ]*/--metrics-listen 127.0.0.1:0/' <<< "$exec_start")
echo "ExecStart: $exec_start"
# shellcheck disable=SC2086  # the unit's words
setpriv --reuid tensorhub --regid tensorhub --init-groups $exec_start > "$scratch/server.out" 2>&1 &
server_pid=$!
for _ in $(seq 100); do grep -q "listening on" "$scratch/server.out" && break; sleep 0.1; done
address=$(sed -n 's/^th-server listening on //p' "$scratch/server.out")
[ -n "$address" ] || { echo "deb_test: th-server did not start:"; cat "$scratch/server.out"; exit 1; }
/usr/bin/th-ctl --server "$address" --token-file /etc/tensorhub/token list
kill -TERM "$server_pid"
wait "$server_pid" || { echo "deb_test: th-server exited $? on SIGTERM" >&2; exit 1; }
server_pid=""
grep -q . /var/log/tensorhub/th-server.log || { echo "deb_test: nothing in /var/log/tensorhub/th-server.log" >&2; exit 1; }
echo "th-server ran as tensorhub from the unit's command line; its log: $(wc -l < /var/log/tensorhub/th-server.log) lines"
dpkg --purge tensorhub > "$scratch/dpkg.log" 2>&1 || { cat "$scratch/dpkg.log"; exit 1; }
installed=0
[ ! -e /usr/bin/th-server ] && [ ! -e /etc/tensorhub ] && [ ! -L "$wants" ] ||
  { echo "deb_test: purge left files behind" >&2; exit 1; }
echo "deb_test: ok"
