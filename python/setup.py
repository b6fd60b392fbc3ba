"""Builds the tensorhub wheel from the CMake project one folder up.

The extension (tensorhub._core), libthclient and th-server/th-ctl come from a CMake build: the one
TH_BUILD_DIR names (already configured; its targets are brought up to date), or else a build of
its own in <project>/build-wheel (Release, without tests and benchmarks). Every library they load
besides glibc's and libstdc++'s (Cap'n Proto, KJ, xxHash, OpenSSL) is copied into
tensorhub/_libs under a name of its own, with patchelf setting each one's search path to its own
folder, as auditwheel does; libibverbs is not linked (libthclient opens it at run time where
present), nor is CUDA in a build without the toolkit.
Debian's static Cap'n Proto and KJ are built without -fPIC and cannot go into a shared object,
hence copies rather than static links: the effect for the user is the same.

Environment: TH_BUILD_DIR (a CMake build to take the binaries from; relative to the source tree),
TH_PROJECT_DIR (the source tree, if not one folder up), TH_CMAKE_ARGS (extra arguments for the
build of its own), TH_BUILD_JOBS (its parallelism; default 2).
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
import shutil
import subprocess
import sys
import sysconfig

from setuptools import Command, Distribution, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
# TH_PROJECT_DIR: the source tree, when this folder was copied out of it (the wheel's test does).
PROJECT = os.path.abspath(os.environ.get("TH_PROJECT_DIR") or os.path.dirname(HERE))

# Libraries every Linux with a C++ runtime has (the manylinux policy's list, roughly): not bundled.
SYSTEM_LIBRARIES = re.compile(
    r"^(linux-vdso|ld-linux[-\w.]*|libc|libm|libdl|libpthread|librt|libutil|libgcc_s|libstdc\+\+|libresolv)\.so")
BUNDLED = "_libs"
BINARIES = ("th-server", "th-ctl")


def project_version() -> str:
    with open(os.path.join(PROJECT, "CMakeLists.txt"), encoding="utf-8") as cmake_lists:
        found = re.search(r"project\(TensorHub VERSION ([0-9.]+)", cmake_lists.read())
    if not found:
        raise RuntimeError(f"no 'project(TensorHub VERSION x.y.z' in {PROJECT}/CMakeLists.txt")
    return found.group(1)


def run(command: list[str], **kwargs) -> str:
    print("tensorhub setup:", " ".join(command), flush=True)
    return subprocess.run(command, check=True, text=True, stdout=subprocess.PIPE, **kwargs).stdout


def cmake_build() -> str:
    """The CMake build folder with tensorhub_python, th-server and th-ctl up to date."""
    if not os.path.exists(os.path.join(PROJECT, "core")):
        raise RuntimeError(f"setup.py builds from the TensorHub source tree; {PROJECT} is not one "
                           "(pip copied python/ alone? use pip >= 21.3, which builds in place)")
    build_dir = os.environ.get("TH_BUILD_DIR")
    if build_dir:
        # Relative to the source tree (the build backend runs in python/, not where it was called).
        build_dir = os.path.abspath(os.path.join(PROJECT, build_dir))
        if not os.path.exists(os.path.join(build_dir, "CMakeCache.txt")):
            raise RuntimeError(f"TH_BUILD_DIR={build_dir} is not a configured CMake build (no CMakeCache.txt)")
    else:
        build_dir = os.path.join(PROJECT, "build-wheel")
        run(["cmake", "-S", PROJECT, "-B", build_dir, "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
             "-DTH_BUILD_TESTS=OFF", "-DTH_BUILD_BENCH=OFF", f"-DPython_EXECUTABLE={sys.executable}"]
            + os.environ.get("TH_CMAKE_ARGS", "").split())
    run(["cmake", "--build", build_dir, "-j", os.environ.get("TH_BUILD_JOBS", "2"),
         "--target", "tensorhub_python", *BINARIES])
    return build_dir


def dependencies(elf: str) -> dict[str, str]:
    """The shared libraries elf loads (soname -> path), as the dynamic loader resolves them."""
    found = {}
    for line in run(["ldd", elf]).splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[1] == "=>":
            if parts[2] == "not":
                raise RuntimeError(f"{elf} needs {parts[0]}, which is not found: {line.strip()}")
            found[parts[0]] = parts[2]
    return found


def patchelf(elf: str, *arguments: str) -> None:
    if shutil.which("patchelf") is None:
        raise RuntimeError("patchelf is needed to build the wheel (Debian: apt-get install patchelf)")
    run(["patchelf", *arguments, elf])


def set_search_path(elf: str, path: str) -> None:
    patchelf(elf, "--set-rpath", path, "--force-rpath")


def private_name(soname: str, path: str) -> str:
    """libssl.so.3 -> libssl-<8 hex digits of its content>.so.3."""
    with open(path, "rb") as library:
        digest = hashlib.sha256(library.read()).hexdigest()[:8]
    stem, separator, version = soname.partition(".so")
    return f"{stem}-{digest}{separator}{version}"


class BundleNative(Command):
    """Copies the extension, th-server, th-ctl and the libraries they need into the package."""

    description = "bundle the native parts of tensorhub"
    user_options: list = []

    def initialize_options(self) -> None:
        self.build_lib = None

    def finalize_options(self) -> None:
        self.set_undefined_options("build_py", ("build_lib", "build_lib"))

    def run(self) -> None:
        build_dir = cmake_build()
        package = os.path.join(self.build_lib, "tensorhub")
        libs = os.path.join(package, BUNDLED)
        bins = os.path.join(package, "_bin")
        os.makedirs(libs, exist_ok=True)
        os.makedirs(bins, exist_ok=True)
        suffix = sysconfig.get_config_var("EXT_SUFFIX")
        extensions = glob.glob(os.path.join(build_dir, "python", "tensorhub", "_core*.so"))
        if len(extensions) != 1 or not extensions[0].endswith(suffix):
            raise RuntimeError(f"expected one tensorhub/_core{suffix} in {build_dir}/python, found {extensions} "
                               f"(was that build configured for {sys.executable}?)")
        extension = os.path.join(package, os.path.basename(extensions[0]))
        shutil.copy2(extensions[0], extension)
        binaries = []
        for name in BINARIES:
            binaries.append(os.path.join(bins, name))
            shutil.copy2(os.path.join(build_dir, "tools", name), binaries[-1])
        # Every library in the closure (ldd lists it whole) that is not the system's, once.
        bundled = {}
        for elf in [extension, *binaries]:
            for soname, path in dependencies(elf).items():
                if not SYSTEM_LIBRARIES.match(soname):
                    bundled.setdefault(soname, path)
        # Each copy gets a name of its own (libssl.so.3 -> libssl-1a2b3c4d.so.3, as auditwheel
        # does): a process that also loads the system's or conda's libssl.so.3 (Python's ssl
        # module) then gets two libraries side by side, each used by its own, instead of one
        # soname shared by code built against different versions.
        copies = []
        renamed = {}
        for soname, path in sorted(bundled.items()):
            renamed[soname] = private_name(soname, path)
            copies.append(os.path.join(libs, renamed[soname]))
            shutil.copyfile(path, copies[-1])
            os.chmod(copies[-1], 0o755)
        # Debug information stays in the build (a RelWithDebInfo build's binaries are mostly that).
        if shutil.which("strip"):
            run(["strip", "--strip-debug", extension, *binaries, *copies])
        replacements = [argument for old, new in renamed.items() for argument in ("--replace-needed", old, new)]
        for elf in [extension, *binaries, *copies]:
            if replacements:
                patchelf(elf, *replacements)
        for soname, copy in zip(sorted(bundled), copies):
            patchelf(copy, "--set-soname", renamed[soname])
        for copy in copies:
            set_search_path(copy, "$ORIGIN")
        set_search_path(extension, f"$ORIGIN/{BUNDLED}")
        for binary in binaries:
            set_search_path(binary, f"$ORIGIN/../{BUNDLED}")
        # The package's own files are the build's copy of python/tensorhub (build_py copied them
        # already); timeline-plot comes along as a module for its console script.
        shutil.copyfile(os.path.join(PROJECT, "tools", "timeline-plot"), os.path.join(package, "_timeline_plot.py"))
        print(f"tensorhub setup: bundled {', '.join(sorted(bundled)) or 'nothing'}", flush=True)


class BinaryDistribution(Distribution):
    """A wheel for this Python and platform: it carries an extension module."""

    def has_ext_modules(self) -> bool:
        return True


class BuildPy(build_py):
    def run(self) -> None:
        super().run()
        self.run_command("bundle_native")


setup(
    version=project_version(),
    packages=["tensorhub", "tensorhub.integrations"],
    package_data={"tensorhub": ["py.typed", "_core.pyi"]},
    cmdclass={"build_py": BuildPy, "bundle_native": BundleNative},
    distclass=BinaryDistribution,
    zip_safe=False,
)
