"""Multi-host runs on the engine JAX ships: `jax.distributed` (multi-controller).

Every process runs the same Python program. Each one sees all devices of the job in
`jax.devices()` and holds only its own (`jax.local_devices()`). A plan whose meshes span
processes then runs unchanged:

- an SPMD stage is one `jax.jit` program over a mesh of devices from several processes;
  XLA's collectives cross processes (NCCL on GPUs, gloo on CPUs);
- pipeline stages on different processes exchange activations by `jax.device_put` between
  their meshes, which JAX carries over its cross-host transfer sockets
  (`jax_cross_host_transfer_socket_address`, one per process). An SPMD pipeline over a
  stage axis with `lax.ppermute` would need identical layers on every stage; the MPMD
  transfer works for any stage split, so it is the one used.

`initialize` is `jax.distributed.initialize` plus what a run needs and the defaults lack:

- a heartbeat timeout of 10 s instead of JAX's 100 s, so that when a process dies the
  others stop within seconds (JAX's coordination service aborts them, naming the task
  that "stopped sending heartbeats") rather than minutes later; likewise a 60 s limit
  (not 300 s) on waiting at exit for a process that failed alone, and on one transfer;
- on CPU, gloo collectives and the number of virtual devices per process;
- a cross-host transfer address for each process, so that pipelined plans can move
  activations between processes.

The planner runs once, on process 0; the others receive its plan through the coordination
service's key-value store (`share_from_first`), so every process executes the same plan even
when a solver time limit would make independent runs differ.

The runtimes move data with the helpers here, each written so that every process takes the
same branches and runs the same collectives in the same order (a process that runs one the
others do not waits forever):

- `place`: arguments onto the plan's shardings, each process cutting its own shards from a
  value all processes hold, without `jax.device_put`'s equality check (a collective that
  can interleave with a step another process has already dispatched);
- `process_rows`: the rows of a batch this process loads itself;
- `on_every_process`: a result living on some processes (a pipeline's loss) copied to all;
- `fetch`: any result as numpy on every process.

Arguments left unset come from the variables the local launcher (`alpa_lite.tools.launch`) sets,
then from JAX's own cluster detection (SLURM, Open MPI, Kubernetes, ...).
"""

from __future__ import annotations

import functools
import itertools
import os
import socket
from typing import Any, Callable

import jax
import numpy as np

__all__ = ["initialize", "is_multiprocess", "place", "process_rows", "fetch",
           "on_every_process", "share_from_first"]

# Set by `alpa_lite.tools.launch` for every process it starts.
ENV_COORDINATOR = "ALPA_LITE_COORDINATOR"
ENV_NUM_PROCESSES = "ALPA_LITE_NUM_PROCESSES"
ENV_PROCESS_ID = "ALPA_LITE_PROCESS_ID"
ENV_CPU_DEVICES = "ALPA_LITE_CPU_DEVICES"
ENV_TRANSFER_HOST = "ALPA_LITE_TRANSFER_HOST"

DEFAULT_HEARTBEAT_TIMEOUT_S = 10
"""Seconds without a heartbeat after which the coordination service declares a process dead
and stops the others. JAX's default (100 s) leaves survivors waiting for minutes; a live
process sends heartbeats from a background thread, so a long step does not trip this."""

DEFAULT_INITIALIZATION_TIMEOUT_S = 120
"""Seconds every process waits for all the others to join (JAX's default: 300)."""

DEFAULT_SHUTDOWN_TIMEOUT_S = 60
"""Seconds a process that has finished (or failed) waits at exit for the others (JAX's
default: 300). A process that fails alone leaves the others blocked in a collective with
it; they are stopped when this runs out."""

SHARE_TIMEOUT_S = 3600
"""Seconds a process waits for process 0's plan (planning a 175B model takes minutes)."""

_share_counter = itertools.count()


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, cpu_devices: int | None = None,
               transfer_host: str | None = None,
               heartbeat_timeout_s: int = DEFAULT_HEARTBEAT_TIMEOUT_S,
               initialization_timeout_s: int = DEFAULT_INITIALIZATION_TIMEOUT_S,
               shutdown_timeout_s: int = DEFAULT_SHUTDOWN_TIMEOUT_S,
               **jax_kwargs: Any) -> None:
    """Joins this process to a multi-process JAX job (call before any JAX computation).

    Args:
      coordinator_address: "host:port" of process 0's coordination service; with
        `num_processes` and `process_id` as `jax.distributed.initialize` documents. Unset:
        from the launcher's environment, else JAX's cluster auto-detection.
      num_processes: processes in the job.
      process_id: this process's index, 0 .. num_processes-1.
      cpu_devices: on CPU, virtual devices for this process (`jax_num_cpu_devices`).
      transfer_host: the address other processes reach this one at for pipeline
        activations (`jax_cross_host_transfer_socket_address`, on a free port). Unset: the
        launcher's, else this host's name as resolved by DNS; on hosts whose name
        resolves to a loopback address (127.0.1.1 on some Linux distributions), pass the
        address of the network the other hosts reach.
      heartbeat_timeout_s: see `DEFAULT_HEARTBEAT_TIMEOUT_S`.
      initialization_timeout_s: see `DEFAULT_INITIALIZATION_TIMEOUT_S`.
      shutdown_timeout_s: see `DEFAULT_SHUTDOWN_TIMEOUT_S`.
      **jax_kwargs: passed to `jax.distributed.initialize` (e.g. `local_device_ids`).

    Raises:
      ValueError: for a non-positive timeout or device count, or a malformed environment
        variable set for the launcher.
      RuntimeError: when JAX has already started its backends (JAX's own message).
    """
    for name, v in (("heartbeat_timeout_s", heartbeat_timeout_s),
                    ("initialization_timeout_s", initialization_timeout_s),
                    ("shutdown_timeout_s", shutdown_timeout_s)):
        check_positive_int(name, v, "a whole number of seconds")
    env = os.environ
    coordinator_address = coordinator_address or env.get(ENV_COORDINATOR)
    if num_processes is None and ENV_NUM_PROCESSES in env:
        num_processes = _env_int(ENV_NUM_PROCESSES, 1)
    if process_id is None and ENV_PROCESS_ID in env:
        process_id = _env_int(ENV_PROCESS_ID, 0)
    if cpu_devices is None and ENV_CPU_DEVICES in env:
        cpu_devices = _env_int(ENV_CPU_DEVICES, 1)
    if cpu_devices is not None:
        check_positive_int("cpu_devices", cpu_devices)
        jax.config.update("jax_num_cpu_devices", cpu_devices)
    # gloo is the CPU backend's cross-process collective library; GPUs use NCCL regardless.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    host = transfer_host or env.get(ENV_TRANSFER_HOST) or _this_host()
    jax.config.update("jax_cross_host_transfer_socket_address", f"{host}:{free_port(host)}")
    # A transfer whose peer has failed must not wait longer than the exit does.
    jax.config.update("jax_cross_host_transfer_timeout_seconds", shutdown_timeout_s)
    jax.distributed.initialize(
        coordinator_address=coordinator_address, num_processes=num_processes,
        process_id=process_id, heartbeat_timeout_seconds=heartbeat_timeout_s,
        initialization_timeout=initialization_timeout_s,
        shutdown_timeout_seconds=shutdown_timeout_s, **jax_kwargs)


def is_multiprocess() -> bool:
    """True when this program is one of several JAX processes."""
    return jax.process_count() > 1


def place(values: Any, shardings: Any) -> Any:
    """`jax.device_put(values, shardings)`, also for shardings that span processes.

    With one process this is `jax.device_put`. With several, a value the program itself
    placed (a committed `jax.Array`, e.g. the previous step's parameters) is resharded by
    JAX, which every process joins; anything else (numpy arrays, Python scalars, arrays
    JAX put on a process's default device) must hold the same value on every process, as
    in any multi-controller program, and each process cuts its own shards from it locally:
    no collective, unlike `device_put`'s equality check, whose collectives can interleave
    with a step another process has already dispatched.
    """
    if jax.process_count() == 1:
        return jax.device_put(values, shardings)
    return jax.tree.map(_place_leaf, values, shardings)


def _place_leaf(x: Any, sharding: Any) -> Any:
    # `committed` is a property of the value in the program, the same on every process,
    # so every process takes the same branch.
    if isinstance(x, jax.Array) and x.committed:
        return x if x.sharding == sharding else _moved(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index],
                                        dtype=host.dtype)


def _moved(x: jax.Array, sharding: Any) -> jax.Array:
    """`x` (committed, laid out differently) laid out as `sharding`, also where some of
    the devices involved belong to other processes.

    JAX's `device_put` reshards only values this process holds whole, and copies between
    processes only between layouts that match shard for shard. So a change of layout on
    the same devices is a jitted identity (which the processes not holding the devices
    join in name), and a move to other devices with another layout is first a copy in the
    source's layout onto the target's mesh (when the meshes have the same shape), then
    that change of layout there."""
    if jax.process_count() == 1:
        return jax.device_put(x, sharding)
    if x.sharding.device_set == sharding.device_set:
        return _relaid(x, sharding)
    src = x.sharding
    if (isinstance(src, jax.sharding.NamedSharding)
            and isinstance(sharding, jax.sharding.NamedSharding)
            and src.mesh.shape_tuple == sharding.mesh.shape_tuple):
        copied = jax.device_put(x, jax.sharding.NamedSharding(sharding.mesh, src.spec))
        return copied if copied.sharding == sharding else _relaid(copied, sharding)
    return jax.device_put(x, sharding)


def process_rows(sharding: Any, shape: tuple[int, ...]) -> slice:
    """The rows (first-dimension range) of a global array of `shape` that this process's
    devices hold under `sharding`: the part of a batch this process has to load.

    With the plan's batch sharding (`ParallelizedStep.input_shardings`), each process loads
    only its rows and JAX assembles the global batch without moving data:

        shardings = train_step.input_shardings(params, opt_state, abstract_batch)[-1]
        batch = jax.tree.map(lambda s, x: jax.make_array_from_process_local_data(
            s, load(x, process_rows(s, x.shape)), x.shape), shardings, abstract_batch)

    An empty slice means this process holds none of the array (e.g. a pipeline stage on
    other processes reads the batch).

    Raises:
      ValueError: when this process's rows are not one contiguous range (a layout that
        interleaves processes along the first dimension).
    """
    shape = tuple(shape)
    if not shape:
        raise ValueError("process_rows needs an array with a first dimension, got shape ()")
    spans = sorted({(idx[0].start or 0, shape[0] if idx[0].stop is None else idx[0].stop)
                    for idx in sharding.addressable_devices_indices_map(shape).values()})
    if not spans:
        return slice(0, 0)
    lo, hi = spans[0]
    for a, b in spans[1:]:
        if a > hi:
            raise ValueError(f"this process holds rows {spans} of an array of shape {shape}: "
                             "not one contiguous range; load the whole array on every "
                             "process instead")
        hi = max(hi, b)
    return slice(lo, hi)


def fetch(tree: Any) -> Any:
    """Every array of `tree` as a numpy array on every process (for logging, evaluation and
    tests). An array whose shards live on other processes (a pipeline stage's parameters)
    is gathered on its own devices and sent to the processes lacking it through the
    coordination service, so this moves data: use it for small values, or rarely."""
    return jax.tree.map(_fetch_leaf, tree)


def _fetch_leaf(x: Any) -> Any:
    if not isinstance(x, jax.Array) or jax.process_count() == 1:
        return np.asarray(x)
    # Every decision below depends on where `x` lives, never on what this process holds,
    # so all processes take the same branch and run the same collectives in order.
    holders = sorted({d.process_index for d in x.sharding.device_set})
    if not x.is_fully_replicated:
        x = _replicated_on_own_devices(x)
    value = np.asarray(x.addressable_data(0)) if jax.process_index() in holders else None
    if len(holders) == jax.process_count():
        return value
    client = _client()
    key = f"alpa_lite/fetch/{next(_share_counter)}"
    if jax.process_index() == holders[0]:
        client.key_value_set_bytes(key, value.tobytes())
    if value is not None:
        return value
    data = client.blocking_key_value_get_bytes(key, SHARE_TIMEOUT_S * 1000)
    _done_reading(client, key, jax.process_count() - len(holders))
    return np.frombuffer(data, dtype=x.dtype).reshape(x.shape).copy()


def on_every_process(v: Any) -> Any:
    """`v`, replicated, with a copy on every process, when some process holds none of it.

    JAX copies between processes only between device lists of equal size and equal layout,
    so `v` is first replicated over its own k devices, then copied to k devices of each
    process lacking it, and the copies are joined into one replicated array. A process with
    fewer than k devices (a value spanning several processes of a job with more) gets no
    copy: it reads the value with `fetch`."""
    if not isinstance(v, jax.Array):
        return v
    layout = _copy_layout(frozenset(v.sharding.device_set))
    if layout is None:
        return v
    own, targets, joined = layout
    v = _relaid(v, own)
    pieces = [v] + [jax.device_put(v, t) for t in targets]
    mine = [shard.data for piece in pieces for shard in piece.addressable_shards]
    return jax.make_array_from_single_device_arrays(v.shape, joined, mine)


@functools.lru_cache(maxsize=None)
def _copy_layout(device_set: frozenset):
    """For a value on `device_set`: None when every process holds some of it, else (its
    own devices replicated, one such sharding per process lacking it with enough devices,
    all of them joined). Fixed by the plan, so worked out once per device set."""
    holders = {d.process_index for d in device_set}
    if holders == set(range(jax.process_count())):
        return None
    own = sorted(device_set, key=lambda d: d.id)
    targets, devices = [], list(own)
    for p in range(jax.process_count()):
        theirs = sorted((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
        if p in holders or len(theirs) < len(own):
            continue
        targets.append(_replicated(theirs[:len(own)]))
        devices += theirs[:len(own)]
    return _replicated(own), tuple(targets), _replicated(devices)


def _device_list(v: jax.Array) -> list:
    return sorted(v.sharding.device_set, key=lambda d: d.id)


def _replicated(devices) -> jax.sharding.NamedSharding:
    mesh = jax.sharding.Mesh(np.array(devices, dtype=object), ("d",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def _identity(x):
    return x


def _replicated_on_own_devices(v: jax.Array) -> jax.Array:
    return _relaid(v, _replicated(_device_list(v)))


def _relaid(v: jax.Array, sharding) -> jax.Array:
    # `v` laid out as `sharding` (on the same devices). Runs on the processes holding `v`
    # only; the others take part in name. One module-level function, so JAX's caches
    # compile each (shape, sharding) once, not once per call.
    return jax.jit(_identity, out_shardings=sharding)(v)


def share_from_first(make: Callable[[], Any], errors: tuple[type[Exception], ...] = (), *,
                     encode: Callable[[Any], str] = str,
                     decode: Callable[[str], Any] = str) -> Any:
    """`make()` run on process 0 only; every process gets its result.

    With one process this is `make()`. With several, process 0's result travels as
    `encode(result)` through the coordination service's key-value store, which waits
    without a collective (the others may wait for minutes of planning), and every process,
    process 0 included, returns `decode` of that text: the same value everywhere. Every
    process must call this the same number of times in the same order (as they run the
    same program). An exception on process 0 is re-raised there; the others raise the same
    type when it is one of `errors` (each taking one message argument), else a
    RuntimeError naming it.
    """
    if not is_multiprocess():
        return make()
    client = _client()
    key = f"alpa_lite/share/{next(_share_counter)}"
    if jax.process_index() == 0:
        try:
            text = encode(make())
        except BaseException as e:
            client.key_value_set(key, f"E{type(e).__name__}\n{e}")
            raise
        client.key_value_set(key, "T" + text)
        return decode(text)
    got = client.blocking_key_value_get(key, SHARE_TIMEOUT_S * 1000)
    _done_reading(client, key, jax.process_count() - 1)
    if got.startswith("E"):
        name, _, message = got[1:].partition("\n")
        for cls in errors:
            if cls.__name__ == name:
                raise cls(f"(on process 0) {message}")
        raise RuntimeError(f"process 0 failed where this process waits for its result: "
                           f"{name}: {message}")
    return decode(got[1:])


def _done_reading(client, key: str, readers: int) -> None:
    # The coordination service keeps every key until the job ends; a long run that fetches
    # each step would grow it without bound. The last of the `readers` to read deletes it.
    if client.key_value_increment(f"{key}/read", 1) == readers:
        client.key_value_delete(key)
        client.key_value_delete(f"{key}/read")


def _client():
    # JAX keeps its coordination client here; there is no public accessor in JAX 0.10.2.
    from jax._src import distributed as jax_distributed
    client = jax_distributed.global_state.client
    if client is None:
        raise RuntimeError("several JAX processes but no jax.distributed client: start the "
                           "job with alpa_lite.runtime.distributed.initialize() or "
                           "jax.distributed.initialize()")
    return client


def _env_int(name: str, minimum: int) -> int:
    text = os.environ[name]
    try:
        v = int(text)
    except ValueError:
        v = minimum - 1
    if v < minimum:
        raise ValueError(f"environment variable {name}={text!r} must be an integer >= "
                         f"{minimum}; it is set by alpa_lite.tools.launch, unset it to let JAX "
                         "detect the cluster")
    return v


def _this_host() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def check_positive_int(name: str, v: Any, what: str = "an integer") -> None:
    """ValueError unless `v` is an int >= 1 (a bool is not)."""
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be {what} >= 1, got {v!r}")


def free_port(host: str) -> int:
    # The port is released before JAX binds it; another program could take it in between,
    # which JAX then reports when the first transfer is set up.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
