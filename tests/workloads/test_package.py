"""The workloads live outside the core: the engine must load without them, and their data ships."""
from __future__ import annotations

import subprocess
import sys

from flashspec_workloads import dev


def test_engine_does_not_import_the_workloads() -> None:
    code = ("import sys, flashspec_core.engine, flashspec_core.loading, flashspec_core.routing; "
            "print(sorted(m for m in sys.modules if m.startswith('flashspec_workloads')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_data_sits_in_the_package() -> None:
    assert dev.DATA_FILE.parent.parent.name == "flashspec_workloads" and dev.DATA_FILE.is_file()
