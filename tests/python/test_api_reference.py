"""The Python API's documentation agrees with the package (issue 33: docs that drift from the code).

python/API.md is what tools/python-api-reference generates from the package's own names,
signatures and docstrings; tensorhub/_core.pyi (the extension's type stubs) names exactly what the
extension defines.
"""

from __future__ import annotations

import ast
import inspect
import os
import subprocess
import sys

import tensorhub
import tensorhub._core

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_api_reference_is_what_the_package_says():
    result = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "python-api-reference"), "--check"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr


def stub_names():
    """What _core.pyi declares: module functions, and each class's public members."""
    stub = os.path.join(os.path.dirname(tensorhub.__file__), "_core.pyi")
    tree = ast.parse(open(stub, encoding="utf-8").read())
    functions = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    classes = {node.name: {member.name for member in node.body
                           if isinstance(member, ast.FunctionDef) and not member.name.startswith("_")}
               for node in tree.body if isinstance(node, ast.ClassDef)}
    return functions, classes


def test_the_extension_stubs_name_what_the_extension_defines():
    functions, classes = stub_names()
    real_functions = {name for name, value in vars(tensorhub._core).items()
                      if not name.startswith("_") and callable(value) and not inspect.isclass(value)}
    real_classes = {name: {member for member in vars(value) if not member.startswith("_")}
                    for name, value in vars(tensorhub._core).items() if inspect.isclass(value)}
    assert functions == real_functions
    assert set(classes) == set(real_classes)
    for name, members in classes.items():
        assert members == real_classes[name], name
