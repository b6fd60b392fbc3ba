"""What the Python tests share: a th-server per test, and a handle on it."""

from __future__ import annotations

import pytest

import tensorhub


@pytest.fixture()
def server():
    with tensorhub.Server() as running:
        yield running


def open_handle(server, replica, **options):
    options.setdefault("model", "m")
    return tensorhub.Handle(servers=server.address, token=server.token, replica=replica, **options)
