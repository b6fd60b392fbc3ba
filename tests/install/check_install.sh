#!/usr/bin/env bash
# cmake --install into a scratch prefix, then build and run a consumer with find_package(TensorHub);
# and, where the Python package was built, import it from the prefix with Debian's python3.
set -euo pipefail
build_dir=$1
source_dir=$(cd "$(dirname "$0")" && pwd)
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
cmake --install "$build_dir" --prefix "$scratch/prefix" > /dev/null
# The public surface is tensorhub/ alone: no core/ (or any other) headers are installed.
headers=$(cd "$scratch/prefix/include" && find . -type f | sed 's|^\./||' | sort)
echo "installed headers:" $headers
expected="tensorhub/client.h tensorhub/result.h tensorhub/types.h"
if [ "$(echo $headers)" != "$expected" ]; then
  echo "check_install: installed headers are not exactly: $expected" >&2
  exit 1
fi
# A consumer compiled with pkg-config's flags alone (-I<prefix>/include -L<prefix>/lib -lthclient;
# no CMake, no source tree) and an rpath to the library's folder: it runs without LD_LIBRARY_PATH.
export PKG_CONFIG_PATH="$scratch/prefix/lib/pkgconfig"
echo "pkg-config --cflags --libs tensorhub:" $(pkg-config --cflags --libs tensorhub)
libdir=$(pkg-config --variable=libdir tensorhub)
c++ "$source_dir/consumer/consumer.cpp" $(pkg-config --cflags --libs tensorhub) -Wl,-rpath,"$libdir" \
    -o "$scratch/consumer-pkg-config"
env -u LD_LIBRARY_PATH "$scratch/consumer-pkg-config"
# CMake's find_package: the build tree's rpath points at the library; no LD_LIBRARY_PATH either.
cmake -S "$source_dir/consumer" -B "$scratch/build" -G Ninja -DCMAKE_PREFIX_PATH="$scratch/prefix" > /dev/null
cmake --build "$scratch/build" > /dev/null
env -u LD_LIBRARY_PATH "$scratch/build/consumer"
python_dir=$(ls -d "$scratch"/prefix/lib*/python3*/dist-packages 2> /dev/null | head -1)
if [ -n "$python_dir" ]; then
  PYTHONPATH="$python_dir" /usr/bin/python3 -c \
    'import tensorhub, sys; assert tensorhub.__file__.startswith(sys.argv[1]), tensorhub.__file__; print("python: import tensorhub ok from", sys.argv[1])' \
    "$python_dir"
fi
echo "check_install: ok"
