"""Shared pytest fixtures. Processes started here are stopped by finalizers."""
from __future__ import annotations

import pytest

from launch.process import free_port


@pytest.fixture
def port() -> int:
    return free_port()
