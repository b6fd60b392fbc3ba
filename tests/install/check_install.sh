#!/usr/bin/env bash
# cmake --install into a scratch prefix, then build and run a consumer with find_package(TensorHub).
set -euo pipefail
build_dir=$1
source_dir=$(cd "$(dirname "$0")" && pwd)
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
cmake --install "$build_dir" --prefix "$scratch/prefix" > /dev/null
cmake -S "$source_dir/consumer" -B "$scratch/build" -G Ninja -DCMAKE_PREFIX_PATH="$scratch/prefix" > /dev/null
cmake --build "$scratch/build" > /dev/null
LD_LIBRARY_PATH="$scratch/prefix/lib" "$scratch/build/consumer"
