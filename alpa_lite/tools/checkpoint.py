"""Checkpoints of the whole training state, written and read with orbax-checkpoint.

    al.checkpoint.save(directory, (params, opt_state), step_number=100, step=train_step)
    params, opt_state = al.checkpoint.restore(directory, (params, opt_state),
                                              step=train_step, batch=batch)

`save` writes every array from the devices that hold it (each process writes its own
shards) and, when `step` has gradient compression, the compressor's per-worker state
(residuals, warm starts, delayed queues), its step count (which picks the warm-up phase),
its PRNG key and, under delayed averaging, the workers' own copies of the parameters and
optimizer state. It returns once the checkpoint is complete and renamed into place.

`restore` reads each array straight into the sharding the target plan wants for that
argument (`ParallelizedStep.input_shardings`), so the plan may differ from the one that
saved (another method, mesh or pipeline split) and nothing is gathered on one device.
Before any array is read it checks the saved tree (paths, shapes, dtypes) against `like`
and the saved compressor against the step's. Onto the same plan, the next step is
bit-identical to the uninterrupted run's. The plans that saved are recorded for
information only: a different plan is the point of resharding, never a reason to refuse.

On-disk layout: an orbax `CheckpointManager` directory, one subdirectory per step number.

    directory/
      <step_number>/     written as <step_number>.orbax-checkpoint-tmp-<n> and renamed when
                         complete: a crash mid-save leaves the older steps intact and no
                         half-written <step_number> (orbax skips tmp dirs when listing)
        metadata/        JSON: FORMAT, the state's leaves (path, shape, dtype), the plans
                         the step ran, the compressor's method, worker layout and counters
        arrays/          orbax PyTree: {"leaf_<i>": the i-th leaf of the state}
        compressor/      only with compressor state: {"state_<k>": k-th state leaf stacked
                         over workers, "replica_<i>": the workers' copies of state leaf i}
        _CHECKPOINT_METADATA

Leaves are stored under their index, not their path: paths hold brackets and quotes that
make poor storage keys, and keeping the tree in our own JSON lets `restore` check it, with
messages in the model's terms, before reading any array.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.sharding import Sharding

from alpa_lite.api import ParallelizedStep
from alpa_lite.errors import CheckpointMismatchError
from alpa_lite.plan.methods import describe
from alpa_lite.runtime.compressed import CompressedExecutable

FORMAT = "alpa_lite.tools.checkpoint/1"
"""The format tag in every checkpoint's metadata; bumped when the layout changes."""

_SHOWN = 5      # mismatching leaves listed in an error
_RESET_HINT = ("pass compression_state='reset' to restore the parameters and optimizer "
               "state and start the compressor fresh (zero residuals and queues, step count "
               "0, so warm-ups run again)")


def save(directory, state, *, step_number: int,
         step: ParallelizedStep | None = None) -> epath.Path:
    """Saves `state` (e.g. `(params, opt_state)`) as checkpoint `step_number`.

    Every process must call it (under `jax.distributed`): each writes the shards it holds.
    It returns once the checkpoint is complete.

    Args:
      directory: the checkpoint directory (created if missing); one subdirectory per step.
      state: a pytree of arrays (`jax.Array`, sharded or not, or numpy arrays).
      step_number: the training step this is, an int >= 0; it names the subdirectory.
      step: the `al.parallelize`d step that trained `state`. With compression, its
        compressor state is saved too (that of its last call); its plans are recorded.

    Returns:
      The path of the new checkpoint.

    Raises:
      ValueError: `step_number` is taken or invalid.
      TypeError: a leaf of `state` is not an array.
    """
    if not isinstance(step_number, (int, np.integer)) or isinstance(step_number, bool) \
            or step_number < 0:
        raise ValueError(f"step_number must be an int >= 0, got {step_number!r}")
    if step is not None and not isinstance(step, ParallelizedStep):
        raise TypeError(f"step must be the al.parallelize'd step, got {type(step).__name__}")
    step_number = int(step_number)
    paths, leaves, _ = _flatten(state, "state", abstract_ok=False)
    meta = {"format": FORMAT, "step_number": step_number, "leaves": _describe(paths, leaves),
            "plans": _plans(step), "compressor": None}
    items = {"arrays": ocp.args.StandardSave({_leaf(i): x for i, x in enumerate(leaves)})}
    if step is not None:
        meta["compressor"], arrays = _compressor_to_save(step, leaves)
        if arrays:
            items["compressor"] = ocp.args.StandardSave(arrays)
    items["metadata"] = ocp.args.JsonSave(meta)
    with _manager(directory, read_only=False) as manager:
        try:
            # force: save this step whatever the manager's interval policy says.
            manager.save(step_number, args=ocp.args.Composite(**items), force=True)
        except ocp.checkpoint_manager.StepAlreadyExistsError:
            raise ValueError(f"{directory} already holds a checkpoint for step {step_number}; "
                             "save under another step_number, or delete that one first") \
                from None
        manager.wait_until_finished()
    return epath.Path(directory) / str(step_number)


def restore(directory, like, *, step: ParallelizedStep | None = None, batch=None,
            step_number: int | None = None, compression_state: str = "restore"):
    """Restores a checkpoint `save` wrote, shaped like `like` and placed for `step`'s plan.

    Args:
      directory: the checkpoint directory.
      like: the state's structure: the same pytree `save` got, of arrays or
        `jax.ShapeDtypeStruct`s (only shapes and dtypes are used when `step` is given).
      step: the `al.parallelize`d step to continue with. Its plan for
        `step(*like, batch)` places every leaf, which may differ from the saving plan's;
        with compression its compressor state is restored too. Without `step`, each leaf
        goes where its `like` leaf's `.sharding` says and no compressor state is restored.
      batch: an example batch (arrays or ShapeDtypeStructs), needed with `step`: the step
        is planned for `(*like, batch)`, so `like` is the tuple of its leading arguments.
      step_number: the checkpoint to read; default the latest.
      compression_state: "restore" (default) puts back the saved compressor state and
        refuses when the step's compressor or worker layout differs from the saved one;
        "reset" starts the step's compressor fresh instead (or ignores saved compressor
        state when there is no compressed step).

    Returns:
      The state, a pytree like `like` of `jax.Array`s with the target shardings. Under
      delayed averaging, pass these very arrays to the next call: the workers go on from
      their restored copies only when the step gets back what it (here: restore) returned.

    Raises:
      CheckpointMismatchError: the checkpoint holds another model's state, or compressor
        state this step cannot take; nothing was read beyond the metadata.
      FileNotFoundError: there is no checkpoint (for `step_number`) in `directory`.
    """
    if compression_state not in ("restore", "reset"):
        raise ValueError(f"compression_state must be 'restore' or 'reset', got "
                         f"{compression_state!r}")
    paths, like_leaves, treedef = _flatten(like, "like", abstract_ok=True)
    with _manager(directory, read_only=True) as manager:
        n = _pick_step(manager, directory, step_number)
        where = f"{directory}/{n}"
        meta = _read_metadata(manager, n, where)
        # The model check comes first: it needs nothing of the plan.
        _check_leaves(meta["leaves"], _describe(paths, like_leaves), where)
        stored = manager.item_metadata(n)
        _check_stored(stored.get("arrays"), {_leaf(i): d for i, d in enumerate(meta["leaves"])},
                      where, "arrays")
        shardings, exe = _targets(like, paths, like_leaves, step, batch)
        action = _compressor_action(meta["compressor"], exe, step, compression_state, where)
        index = {d["path"]: i for i, d in enumerate(meta["leaves"])}
        abstract = {_leaf(index[p]): jax.ShapeDtypeStruct(tuple(x.shape), x.dtype,
                                                           sharding=_readable(s))
                    for p, x, s in zip(paths, like_leaves, shardings)}
        items = {"arrays": ocp.args.StandardRestore(abstract)}
        if action == "state":
            saved_c = meta["compressor"]
            _check_stored(stored.get("compressor"), _compressor_arrays(saved_c, meta["leaves"]),
                          where, "compressor")
            state_abstract, state_tree = _compressor_abstract(exe, like_leaves, saved_c,
                                                              (*like, batch))
            items["compressor"] = ocp.args.StandardRestore(state_abstract)
        out = manager.restore(n, args=ocp.args.Composite(**items))
    restored = jax.tree_util.tree_unflatten(
        treedef, [_placed(out["arrays"][_leaf(index[p])], s)
                  for p, s in zip(paths, shardings)])
    if action == "reset":
        step.reset_compression_state()
    elif action == "initial":
        # Saved before the compressor's first call: its state then is the fresh one.
        step.reset_compression_state(seed=meta["compressor"]["seed"])
    elif action == "state":
        _restore_compressor(step, exe, meta["compressor"], out["compressor"], state_tree,
                            (*restored, batch))
    return restored


def _readable(sharding: Sharding) -> Sharding:
    """Where this process reads a leaf: its target sharding, or, when this process holds
    none of the target's devices (a pipeline stage on other processes), one of its own
    devices. orbax cannot build an array of which a process holds no shard; the copy read
    here is dropped by `_placed`."""
    if sharding.addressable_devices:
        return sharding
    return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])


def _placed(x: jax.Array, sharding: Sharding) -> jax.Array:
    """The restored leaf on its target sharding (see `_readable`)."""
    if sharding.addressable_devices:
        return x
    return jax.make_array_from_single_device_arrays(x.shape, sharding, [], dtype=x.dtype)


def read_metadata(directory, step_number: int | None = None) -> dict:
    """The JSON metadata of checkpoint `step_number` (default the latest): its leaves,
    the plans that saved it and its compressor record. Reads no array."""
    with _manager(directory, read_only=True) as manager:
        n = _pick_step(manager, directory, step_number)
        return _read_metadata(manager, n, f"{directory}/{n}")


# ---- orbax -----------------------------------------------------------------------------

def _manager(directory, *, read_only: bool) -> ocp.CheckpointManager:
    # Readers only list and read: nothing is created (orbax's `read_only` would do the
    # same but logs two warnings per restore).
    if not read_only:
        # Every process may create it (exist_ok); orbax's own `create` refuses to run
        # with `active_processes` set.
        epath.Path(directory).mkdir(parents=True, exist_ok=True)
    options = ocp.CheckpointManagerOptions(
        create=False, max_to_keep=None,
        # Synchronous: `save` returns only once the step directory is renamed into place.
        enable_async_checkpointing=False,
        # Naming every process makes orbax wait at the coordination service's barriers.
        # Its default barrier is a JAX computation over all devices, which can interleave
        # with a training step another process has already dispatched and deadlock.
        multiprocessing_options=ocp.options.MultiprocessingOptions(
            active_processes=set(range(jax.process_count()))))
    handlers = {"metadata": ocp.JsonCheckpointHandler(),
                "arrays": ocp.StandardCheckpointHandler(),
                "compressor": ocp.StandardCheckpointHandler()}
    return ocp.CheckpointManager(epath.Path(directory), options=options,
                                 item_handlers=handlers)


def _pick_step(manager, directory, step_number) -> int:
    steps = manager.all_steps()
    if not steps:
        raise FileNotFoundError(f"no checkpoint in {directory} (it holds no completed "
                                "step directory); check the path")
    if step_number is None:
        return manager.latest_step()
    if step_number not in steps:
        raise FileNotFoundError(f"{directory} holds no checkpoint for step {step_number}; "
                                f"it holds steps {sorted(steps)}")
    return int(step_number)


def _read_metadata(manager, n: int, where: str) -> dict:
    try:
        meta = manager.restore(n, args=ocp.args.Composite(
            metadata=ocp.args.JsonRestore()))["metadata"]
    except KeyError:
        raise CheckpointMismatchError(f"{where} has no alpa_lite metadata item: it was not "
                                      "written by alpa_lite.tools.checkpoint.save") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise CheckpointMismatchError(f"{where} has format {got!r}, this alpa_lite reads "
                                      f"{FORMAT!r}; restore it with the alpa_lite that wrote it")
    return meta


def _check_stored(tree_metadata, expected: dict[str, dict], where: str, item: str) -> None:
    """Checks orbax's own record of `item` holds every array the JSON metadata promises
    ({storage name: path, shape, dtype}), as promised: orbax would pad or cut an array
    read into another shape."""
    if tree_metadata is None:
        raise CheckpointMismatchError(f"{where} has no {item!r} item: the checkpoint is "
                                      "incomplete or was not written by alpa_lite")
    tree = getattr(tree_metadata, "tree", tree_metadata)
    missing = [k for k in expected if k not in tree]
    if missing:
        raise CheckpointMismatchError(
            f"{where}: the {item!r} item lacks {len(missing)} of the {len(expected)} arrays "
            f"its metadata lists ({', '.join(missing[:_SHOWN])}"
            f"{' and more' if len(missing) > _SHOWN else ''}); the checkpoint is damaged: "
            "restore an earlier step")
    for name, d in expected.items():
        m = tree[name]
        if tuple(m.shape) != tuple(d["shape"]) or str(np.dtype(m.dtype)) != d["dtype"]:
            raise CheckpointMismatchError(
                f"{where}: array {name} ({d['path']}) is stored as "
                f"{_fmt_shape(str(np.dtype(m.dtype)), m.shape)} but its metadata says "
                f"{_fmt(d)}; the checkpoint is damaged: restore an earlier step")


# ---- the state's leaves ----------------------------------------------------------------

def _leaf(i: int) -> str:
    return f"leaf_{i}"


def _state_name(k: int) -> str:
    return f"state_{k}"


def _replica_name(i: int) -> str:
    return f"replica_{i}"


def _flatten(tree, what: str, *, abstract_ok: bool):
    """(paths, leaves, treedef), each leaf checked to be an array (or, if `abstract_ok`,
    a ShapeDtypeStruct)."""
    pairs, treedef = jax.tree_util.tree_flatten_with_path(tree)
    kinds = (jax.Array, np.ndarray, np.generic) + ((jax.ShapeDtypeStruct,) if abstract_ok
                                                   else ())
    paths = []
    for path, x in pairs:
        p = jax.tree_util.keystr(path)
        if not isinstance(x, kinds):
            raise TypeError(f"{what} leaf {p or '(root)'} is a {type(x).__name__}; a "
                            "checkpoint holds arrays only" +
                            ("" if abstract_ok else ": make it one (jnp.asarray) or keep it "
                             "out of the saved state"))
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            raise TypeError(f"{what} leaf {p} is a typed PRNG key; save "
                            "jax.random.key_data(key) instead and rebuild the key with "
                            "jax.random.wrap_key_data after restoring")
        paths.append(p)
    return paths, [x for _, x in pairs], treedef


def _describe(paths: Sequence[str], leaves: Sequence[Any]) -> list[dict]:
    return [{"path": p, "shape": [int(d) for d in np.shape(x)], "dtype": str(np.dtype(x.dtype))}
            for p, x in zip(paths, leaves)]


def _fmt_shape(dtype: str, shape) -> str:
    return f"{dtype}[{','.join(str(int(d)) for d in shape)}]"


def _fmt(d: dict) -> str:
    return _fmt_shape(d["dtype"], d["shape"])


def _check_leaves(saved: list[dict], expected: list[dict], where: str) -> None:
    """Raises CheckpointMismatchError listing the first leaves that differ."""
    s = {d["path"]: d for d in saved}
    e = {d["path"]: d for d in expected}
    lines = []
    for d in expected:
        got = s.get(d["path"])
        if got is None:
            lines.append(f"{d['path']}: missing from the checkpoint (expected {_fmt(d)})")
        elif (got["shape"], got["dtype"]) != (d["shape"], d["dtype"]):
            lines.append(f"{d['path']}: saved {_fmt(got)}, expected {_fmt(d)}")
    lines += [f"{d['path']}: saved {_fmt(d)}, not in the state to restore"
              for d in saved if d["path"] not in e]
    if lines:
        more = f" (first {_SHOWN} shown)" if len(lines) > _SHOWN else ""
        raise CheckpointMismatchError(
            f"the checkpoint at {where} holds another model's state: {len(lines)} leaf "
            f"difference(s){more} between its {len(saved)} saved leaves and the "
            f"{len(expected)} of `like` (saved vs expected):\n  " +
            "\n  ".join(lines[:_SHOWN]) +
            "\nBuild `like` from the model and optimizer that saved it "
            "(alpa_lite.tools.checkpoint.read_metadata lists its leaves).")


def _targets(like, paths, like_leaves, step, batch):
    """(one sharding per leaf of `like`, the step's compressed executable or None)."""
    if step is None:
        out = []
        for p, x in zip(paths, like_leaves):
            s = getattr(x, "sharding", None)
            if not isinstance(s, Sharding):
                raise ValueError(f"like leaf {p} has no sharding to restore onto; pass step= "
                                 "and batch= to place it as a step's plan wants, or give "
                                 "`like` jax.Arrays or ShapeDtypeStructs with sharding=")
            out.append(s)
        return out, None
    if not isinstance(step, ParallelizedStep):
        raise TypeError(f"step must be the al.parallelize'd step, got {type(step).__name__}")
    if not isinstance(like, (tuple, list)):
        raise TypeError("with step=, `like` is the tuple of the step's leading arguments, "
                        f"e.g. (params, opt_state), got a {type(like).__name__}; the step "
                        "is planned for step(*like, batch)")
    if batch is None:
        raise TypeError("restore(step=...) needs batch=: an example batch (arrays or "
                        "ShapeDtypeStructs) to plan the step for step(*like, batch)")
    # Planned for shapes only: the values of `like` (e.g. fresh initial parameters) matter not.
    abstract = _abstract((*like, batch))
    exe = step.compile(*abstract)
    flat = jax.tree.leaves(exe.input_shardings(*abstract)[:len(like)])
    return flat, (exe if isinstance(exe, CompressedExecutable) else None)


def _plans(step: ParallelizedStep | None) -> list[dict]:
    """The plans `step` has run, for information (a restore may use another)."""
    if step is None:
        return []
    out = []
    for plan in step.built_plans:
        text = plan.to_json()
        out.append({"method": describe(plan.method), "cluster": plan.cluster_name,
                    "fingerprint": hashlib.sha256(text.encode()).hexdigest()[:16],
                    "plan": json.loads(text)})
    return out


# ---- the compressor --------------------------------------------------------------------

def _compressor_to_save(step: ParallelizedStep, leaves) -> tuple[dict | None, dict]:
    """(the compressor's JSON record, its arrays by storage name) for `step`."""
    exe = step.active_compressed
    if exe is None or exe.state() is None:
        if step.compression is None:
            return None, {}
        # No compressed call yet: the state is the fresh one of this seed, whatever the
        # method and worker layout turn out to be.
        return {"kind": "initial", "seed": step.compression_seed}, {}
    state_pairs = jax.tree_util.tree_flatten_with_path(exe.state())[0]
    replicas = exe.replicas_of(leaves)
    key = exe.base_key
    record = {
        "kind": "state",
        "method": exe.spec.exchange,
        "description": exe.spec.description,
        "num_nodes": exe.num_nodes,
        "workers_per_node": exe.local,
        "step": exe.step,
        "key": {"impl": str(jax.random.key_impl(key)),
                "data": np.asarray(jax.random.key_data(key)).tolist()},
        "state_leaves": _describe([jax.tree_util.keystr(p) for p, _ in state_pairs],
                                  [x for _, x in state_pairs]),
        "replicas": sorted(replicas),
    }
    arrays = {_state_name(k): x for k, (_, x) in enumerate(state_pairs)}
    arrays.update({_replica_name(i): r for i, r in replicas.items()})
    return record, arrays


def _compressor_arrays(saved: dict, leaves: list[dict]) -> dict[str, dict]:
    """{storage name: path, shape, dtype} of the compressor item's arrays."""
    n = saved["num_nodes"] * saved["workers_per_node"]
    out = {_state_name(k): d for k, d in enumerate(saved["state_leaves"])}
    for i in saved["replicas"]:
        out[_replica_name(i)] = dict(leaves[i], path=f"per-worker copies of {leaves[i]['path']}",
                                     shape=[n] + leaves[i]["shape"])
    return out


def _describe_layout(num_nodes: int, local: int) -> str:
    return f"{num_nodes * local} workers ({num_nodes} node(s) x {local})"


def _compressor_action(saved: dict | None, exe: CompressedExecutable | None,
                       step: ParallelizedStep | None, compression_state: str, where: str):
    """What to do with the compressor: None, "reset", "initial" or "state"; raises
    CheckpointMismatchError when the saved state cannot go onto this step."""
    if compression_state == "reset":
        return "reset" if step is not None and step.compression is not None else None
    if saved is None:
        if step is None or step.compression is None:
            return None
        raise CheckpointMismatchError(
            f"the checkpoint at {where} holds no compressor state (it was saved without "
            "step=, or from a step without compression) but this step compresses its "
            f"gradients; {_RESET_HINT}")
    if step is None or step.compression is None:
        what = "no step was given" if step is None else "this step has no compression"
        desc = saved.get("description", "a compressor's initial state")
        raise CheckpointMismatchError(
            f"the checkpoint at {where} holds compressor state ({desc}) but {what}, so it "
            "would be dropped; pass step= a step with that compression to restore it, or "
            "compression_state='reset' to go on without it")
    if saved["kind"] == "initial":
        return "initial"
    if exe is None:
        raise CheckpointMismatchError(
            f"the checkpoint at {where} holds compressor state ({saved['description']}) but "
            "this step's plan for these arguments runs without compression (the planner "
            f"chose an uncompressed plan); {_RESET_HINT}")
    differs = []
    if json.loads(json.dumps(exe.spec.exchange)) != saved["method"]:
        differs.append(f"method: saved {saved['description']!r}, this plan "
                       f"{exe.spec.description!r}")
    if (saved["num_nodes"], saved["workers_per_node"]) != (exe.num_nodes, exe.local):
        saved_layout = _describe_layout(saved["num_nodes"], saved["workers_per_node"])
        differs.append(f"workers: saved {saved_layout}, this plan "
                       f"{_describe_layout(exe.num_nodes, exe.local)}")
    if differs:
        raise CheckpointMismatchError(
            f"the compressor state in {where} cannot go onto this step: its "
            f"{'; its '.join(differs)}. The state (residuals, warm starts, queues) is per "
            f"worker and per method; {_RESET_HINT}")
    return "state"


def _compressor_abstract(exe: CompressedExecutable, like_leaves, saved: dict, args):
    """(what the compressor item restores into, the state's treedef), after checking the
    step's compressor state against the saved record."""
    pairs, treedef = jax.tree_util.tree_flatten_with_path(exe.state_shapes(*_abstract(args)))
    expected = _describe([jax.tree_util.keystr(p) for p, _ in pairs], [x for _, x in pairs])
    if expected != saved["state_leaves"]:
        raise CheckpointMismatchError(
            f"the compressor state's leaves differ from this step's ({len(saved['state_leaves'])}"
            f" saved, {len(expected)} expected; first saved "
            f"{saved['state_leaves'][:1]}, expected {expected[:1]}); {_RESET_HINT}")
    out = {_state_name(k): x for k, (_, x) in enumerate(pairs)}
    for i in saved["replicas"]:
        if i not in exe.per_worker:
            raise CheckpointMismatchError(
                f"the checkpoint holds per-worker copies of state leaf {i}, which this "
                f"step's plan does not keep per worker; {_RESET_HINT}")
        x = like_leaves[i]
        out[_replica_name(i)] = jax.ShapeDtypeStruct((exe.num_workers,) + tuple(np.shape(x)),
                                                     x.dtype, sharding=exe.worker_sharding)
    return out, treedef


def _restore_compressor(step: ParallelizedStep, exe: CompressedExecutable, saved: dict,
                        arrays: dict, treedef, args) -> None:
    state = jax.tree.unflatten(treedef, [arrays[_state_name(k)]
                                         for k in range(len(saved["state_leaves"]))])
    key = jax.random.wrap_key_data(np.asarray(saved["key"]["data"], np.uint32),
                                   impl=saved["key"]["impl"])
    replicas = {i: arrays[_replica_name(i)] for i in saved["replicas"]}
    # The replicas go on only when the next call passes these very arrays (see
    # CompressedExecutable._prepare), so the executable is handed the restored leaves.
    exe.restore_checkpoint(args, state, saved["step"], key, replicas)
    step.active_compressed = exe                # so step.compression_state shows it


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)
