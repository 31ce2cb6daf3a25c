"""Shared test helpers: run a launcher the way a user does, from the repository root."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def run_launcher(script: str, *args: str, timeout: float = 300, env: dict | None = None,
                 cwd: Path = REPO) -> subprocess.CompletedProcess:
    """``python launch/<script> args...`` as a subprocess; returns the finished process."""
    return subprocess.run([sys.executable, str(REPO / "launch" / script), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.fixture
def repo() -> Path:
    return REPO
