"""Helpers the benchmarks share: the machine record, the JSON result file, the table printer.

Importing this module does not import jax: a benchmark that must set `XLA_FLAGS` first
(exec_overhead.py) can import it before jax. `machine()` imports jax when it is called.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Sequence

from rich.console import Console
from rich.table import Table

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO_ROOT = Path(__file__).resolve().parent.parent
EXAMPLES_DIR = REPO_ROOT / "examples"
TABLE_WIDTH = 240  # characters; wide enough that no column of either table wraps
# 1/5/15-minute load averages when the benchmark started: other work on the machine is noise
LOAD_AVERAGE_AT_START = os.getloadavg()


def use_examples() -> None:
    """Makes `import gpt, moe, wide_resnet` work from any working directory."""
    if str(EXAMPLES_DIR) not in sys.path:
        sys.path.insert(0, str(EXAMPLES_DIR))


def package_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def command_line() -> str:
    """The exact command that ran this process, shell-quoted."""
    return " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv])


def machine() -> dict[str, Any]:
    """What ran the benchmark: OS, CPU count, Python/jax versions and the devices JAX sees."""
    import jax

    devices = jax.devices()
    return {
        "platform": platform.platform(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": package_version("jaxlib"),
        "optax": package_version("optax"),
        "jax_backend": jax.default_backend(),
        "jax_device_count": len(devices),
        "jax_devices": [str(d) for d in devices],
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "load_average_at_start": [round(x, 2) for x in LOAD_AVERAGE_AT_START],
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
    }


def code_version() -> dict[str, Any]:
    """The git commit the benchmark ran on, and whether the code it imports had local edits."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                                  check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return "unknown"

    dirty = git("status", "--porcelain", "--", "alpa_lite", "examples")
    return {"git_commit": git("rev-parse", "HEAD"),
            "uncommitted_changes": dirty.splitlines() if dirty != "unknown" else "unknown"}


# Taken when the benchmark starts, i.e. when it imports the code it measures.
CODE_AT_START = code_version()


def now_utc() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def write_result(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")


def print_table(title: str, columns: Sequence[tuple[str, str]], rows: Sequence[Sequence[str]],
                caption: str | None = None) -> None:
    """A rich table; `columns` are (header, justify) with justify 'left' or 'right'."""
    table = Table(title=title, caption=caption, caption_justify="left")
    for header, justify in columns:
        table.add_column(header, justify=justify, no_wrap=True)
    for row in rows:
        table.add_row(*row)
    Console(width=TABLE_WIDTH).print(table)
