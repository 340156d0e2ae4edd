"""Plans and layer solutions kept on disk: planning the same step again is instant, and a
changed cluster re-solves only what the change touches.

Two kinds of entries, each a file under the cache folder named by a sha256 key:

- plans/: a whole `Plan` (its JSON), keyed by the traced step's fingerprint, the argument
  shapes, the cluster's fingerprint, the method, the compression setting and this
  alpa_lite's code. A second `step.plan(...)` of the same step traces it (the fingerprint
  needs the trace) and reads the plan.
- layers/: one intra-op plan of a layer range on a logical mesh (`pipeline.StageCost`),
  keyed by the range's structural hash, the mesh, the pins, the optimizer-state ratio, the
  solver and what of the cluster the mesh's costs read: its device and links and the node
  size, not the number of nodes (`mesh_cluster`). A cluster with more or fewer nodes of
  the same GPUs reuses every layer solution; another GPU or link re-solves.

Every key carries a hash of alpa_lite's own source files, so a code change starts afresh.
An unreadable entry is a miss (and is overwritten); a cache never changes a plan, it only
skips recomputing one. The folder is `$ALPA_LITE_CACHE_DIR`, else `~/.cache/alpa_lite`;
`ALPA_LITE_CACHE=off` turns the cache off.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import pickle
import tempfile
from pathlib import Path
from typing import Any

from alpa_lite.cost_models.cluster import Cluster
from alpa_lite.plan import Plan

CACHE_DIR_ENV = "ALPA_LITE_CACHE_DIR"
CACHE_SWITCH_ENV = "ALPA_LITE_CACHE"
_OFF = ("0", "off", "false", "no")


def cache_dir() -> Path | None:
    """The cache folder, None when the cache is off."""
    if os.environ.get(CACHE_SWITCH_ENV, "").strip().lower() in _OFF:
        return None
    where = os.environ.get(CACHE_DIR_ENV)
    return Path(where) if where else Path.home() / ".cache" / "alpa_lite"


@functools.lru_cache(maxsize=1)
def code_version() -> str:
    """A hash of every alpa_lite source file: entries made by other code never match."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def cache_key(*parts: Any) -> str:
    """A file name for an entry: sha256 of the parts' reprs and the code version."""
    text = repr((code_version(),) + parts)
    return hashlib.sha256(text.encode()).hexdigest()


def mesh_cluster(cluster: Cluster, num_devices: int) -> str:
    """What a logical mesh of `num_devices` placed node-aligned reads of the cluster: the
    same cluster cut to the nodes the mesh covers (device, links, node size), by its
    fingerprint."""
    nodes = max(1, -(-num_devices // cluster.devices_per_node))
    inter = cluster.inter_node if nodes > 1 else None
    return dataclasses.replace(cluster, name="mesh", num_nodes=nodes,
                               inter_node=inter).fingerprint()


def load_plan(key: str) -> Plan | None:
    text = _read("plans", key + ".json")
    if text is None:
        return None
    try:
        return Plan.from_json(text.decode())
    except ValueError:
        return None


def save_plan(key: str, plan: Plan) -> None:
    if cache_dir() is not None:     # (a pipeline of 64 stages takes a second to encode)
        _write("plans", key + ".json", plan.to_json().encode())


def load_object(kind: str, key: str) -> Any | None:
    """A pickled entry of `kind` (a folder name), None when missing or unreadable. The
    entries are this user's own, written by `save_object` with the same code."""
    data = _read(kind, key + ".pkl")
    if data is None:
        return None
    try:
        return pickle.loads(data)
    except Exception:   # a truncated or foreign file is a miss, never an error
        return None


def save_object(kind: str, key: str, obj: Any) -> None:
    _write(kind, key + ".pkl", pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _read(kind: str, name: str) -> bytes | None:
    root = cache_dir()
    if root is None:
        return None
    try:
        return (root / kind / name).read_bytes()
    except OSError:
        return None


def _write(kind: str, name: str, data: bytes) -> None:
    """Writes atomically (a reader sees the old file or the new one); a cache that cannot
    be written is skipped, as if it were off."""
    root = cache_dir()
    if root is None:
        return
    folder = root / kind
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
    except OSError:
        return
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, folder / name)
    except OSError:
        Path(tmp).unlink(missing_ok=True)
