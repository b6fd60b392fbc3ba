"""The console scripts of the wheel: th-server, th-ctl and timeline-plot, as bundled with it.

pip puts these on PATH; each runs the program that came in the wheel (tensorhub/_bin), whose
libraries are the wheel's own (tensorhub/_libs).
"""

from __future__ import annotations

import os
import sys

_BIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bin")


def _exec(name: str) -> None:
    program = os.path.join(_BIN, name)
    if not os.access(program, os.X_OK):
        sys.exit(f"{name}: not in this installation of tensorhub ({program}); it comes with the wheel "
                 f"(pip install tensorhub-*.whl) or with the CMake build (build/tools/{name})")
    os.execv(program, [name, *sys.argv[1:]])


def th_server() -> None:
    _exec("th-server")


def th_ctl() -> None:
    _exec("th-ctl")


def timeline_plot() -> None:
    from . import _timeline_plot  # the wheel's copy of tools/timeline-plot
    sys.exit(_timeline_plot.main())
