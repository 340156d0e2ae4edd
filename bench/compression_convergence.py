"""Convergence under gradient compression: test accuracy on scikit-learn's digits, 8 workers.

Every method of `alpa_lite.compression` trains the same two small models with
`al.parallelize(train_step, method=al.DataParallel(), compression=...)` on the 8 virtual CPU
devices (8 data-parallel workers, each computing its gradient on 1/8 of the batch), and the
final test accuracy is compared with the uncompressed all-reduce (`Dense()`) under the same
optimizer: dense SGD with the same momentum.

Data: `sklearn.datasets.load_digits` (1797 8x8 images, shipped with the package), pixels
scaled from 0..16 to [0, 1], split once by a fixed permutation (seed 0) into 1438 training
and 359 test images. Batches of 128 (16 per worker) are drawn from a stream of per-epoch
permutations of the training set, so every image is seen equally often.

Models, in plain jax.numpy: an MLP 64-128-10 (ReLU), and a CNN: 3x3 conv 1->16, 3x3 conv
16->32 with stride 2 (NHWC / HWIO, `jax.lax.conv_general_dilated`), then dense 512->10.
Loss: mean softmax cross-entropy over the batch.

Schedule, shared by every method and tuned once for the uncompressed MLP: `--steps` steps
(default 500, ~45 epochs), SGD with momentum 0.9 and a cosine learning rate from 0.1 to 0
(optax). DGC carries the momentum itself (momentum correction), so its optimizer is plain SGD
with the same learning rate, and its baseline is dense SGD with DGC's momentum (the
"uncompressed" row when that is 0.9; a "dense SGD m=..." row is added otherwise). DGC's
sparsity warm-up takes the paper's four epochs (45 steps of 128 images): 75%, 93.75%,
98.4375%, 99.6%, then the target.

Layouts (`--layouts`): how the 8 devices are used. "dp": pure data parallelism
(`al.DataParallel()`, every device a worker). Rows record their layout, and each row is
compared with the baseline of its own layout.

Seeds: a seed sets the parameter initialisation and the batch order. One parallelized step
is built per (model, method) and reused across seeds (it compiles once per argument
signature, and once per DGC warm-up phase); between seeds `step.reset_compression_state(seed=...)`
zeroes residuals and queues and restarts the step count. The runtime's own random keys
(random-k positions, stochastic rounding, DGC's threshold sample, PowerSGD's first Q) come
from a fixed key folded with the step number, so they repeat from seed to seed.

Reported per (model, layout, method):
- test accuracy (%) after the last step: mean, std (population), min, max over seeds, and
  the difference of the means to the baseline's (dense SGD with the same momentum, same
  learning rate schedule, same layout and harness), in points (359 test images: one image
  is 0.28 points);
- payload ratio: dense gradient bytes of all leaves (numel x 4) / the bytes ONE worker
  contributes per step, as the compressor encodes it (see `payload_bytes`): k x (4 + 4) for
  top-k / DGC (float32 value + int32 index, k at the final sparsity; DGC sends vectors and
  matrices under 2 / (1 - sparsity) entries whole, 4 bytes per entry), k x 4 for random-k
  (positions come from the shared key), 2 bytes per entry for bf16, (rows + cols) x r x 4
  for PowerSGD's factors (leaves it does not compress: dense), packed sign bits plus two
  float32 per column for 1-bit SGD, packed sign bits plus one float32 for signSGD, one int8
  per entry plus one float32 for TernGrad, one int8 per entry plus a float32 norm per bucket
  for QSGD. For methods that send some leaves whole (DGC, PowerSGD), "compr." is the same
  ratio over the leaves they compress. Bytes on the wire also depend on the collective (an
  all-gather grows with n), hence the last ratio:
- wire ratio: plan.compression.dense_wire_bytes / plan.compression.wire_bytes, the bytes one
  worker sends per step for a ring all-reduce of the dense gradient over those the method
  sends (the cost model's count);
- replicas equal: for synchronous methods, whether every parameter leaf's 8 device copies
  are bitwise equal after the last step (`leaf.addressable_shards`). Delayed averaging keeps
  per-worker parameters by design (n/a).

Targets (stated, not tuned for): DGC 99.9% and 99% within 0.5 points of dense momentum SGD,
at 99.9% with the leaves it compresses >= 250x smaller (the whole model is not: its biases
and small layers go whole, as in the paper, and on these 10k-parameter models they are most
of the bytes); PowerSGD rank 2 within 0.5 points; the negative controls (top-k 0.1% and
random-k 1% without error feedback, random-k 1% with it) visibly worse, taken as >= 1 point
below uncompressed.

`--harness shard_map` runs the compressors without alpa_lite's runtime: a bench-local
`jax.shard_map` over a 1-D mesh ("dp",) of the 8 devices in which each worker takes
`jax.value_and_grad` of the loss on its shard, exchanges the gradients with
`alpa_lite.compression.reduce_tree` and applies the same optax update (not for delayed
averaging, which is a runtime feature). It separates the compressors' convergence from the
runtime's; `--harness parallelize shard_map` runs both.

Run (times on 2 shared CPU cores):
    python bench/compression_convergence.py --quick     # MLP, 1 seed, 150 steps (~1 min)
    python bench/compression_convergence.py             # MLP + CNN, 3 seeds, 500 steps (~4 min)
    python bench/compression_convergence.py --methods "DGC 99.9%" "DGC 99%" --seeds 5 \
        --out /tmp/dgc.json                  # DGC and its dense momentum-SGD baseline (~2 min)
    python bench/compression_convergence.py --steps 1000 --methods "DGC 99.9%" "DGC 99%" \
        "top-k 1% EF" --out bench/results/compression_convergence_1000steps.json   # ~2 min
    python bench/compression_convergence.py --harness parallelize shard_map --seeds 5
Writes bench/results/compression_convergence.json (--quick: compression_convergence_quick.json;
``--out`` to change).
"""

from __future__ import annotations

import os
import re

# 8 virtual CPU devices = 8 workers; set before jax is imported (replacing any other count).
WORKERS = 8
os.environ["XLA_FLAGS"] = (re.sub(r"--xla_force_host_platform_device_count=\S*", "",
                                  os.environ.get("XLA_FLAGS", "")).strip()
                           + f" --xla_force_host_platform_device_count={WORKERS}").strip()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P
from sklearn.datasets import load_digits  # noqa: E402

import alpa_lite as al  # noqa: E402
from alpa_lite import compression as C  # noqa: E402
from alpa_lite.compression.base import count_of  # noqa: E402
from alpa_lite.compression.collectives import ColumnChunks  # noqa: E402
from alpa_lite.compression.powersgd import matrix_shape  # noqa: E402

TRAIN_SIZE = 1438            # of 1797; the other 359 are the test set
DATA_SEED = 0                # the fixed train/test permutation
BATCH = 128                  # global; 16 per worker
STEPS = 500
QUICK_STEPS = 150
PEAK_LR = 0.1                # cosine decay to 0 over the run
MOMENTUM = 0.9
DGC_WARMUP_EPOCHS = 4        # Lin et al. 2018: sparsity warm-up over the first four epochs
DGC_WARMUP_STEPS = round(DGC_WARMUP_EPOCHS * TRAIN_SIZE / BATCH)    # 45
SEEDS = 3
TARGET_WITHIN_PTS = 0.5      # DGC and PowerSGD: |mean - baseline mean| within this
TARGET_DGC_PAYLOAD = 250.0   # DGC 99.9%: payload ratio over the leaves it compresses
LAYOUTS = {"dp": al.DataParallel}   # layout -> the al.parallelize method (pure data parallel)
CONTROL_WORSE_PTS = 1.0      # a negative control is "visibly worse" this far below


# ---- data and models ----------------------------------------------------------------------

def load_data() -> dict[str, np.ndarray]:
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)         # pixel values 0..16 -> [0, 1]
    y = digits.target.astype(np.int32)
    perm = np.random.default_rng(DATA_SEED).permutation(len(x))
    train, test = perm[:TRAIN_SIZE], perm[TRAIN_SIZE:]
    return {"x_train": x[train], "y_train": y[train], "x_test": x[test], "y_test": y[test]}


def init_mlp(key):
    k1, k2 = jax.random.split(key)
    return {"w1": jax.random.normal(k1, (64, 128)) * math.sqrt(2 / 64), "b1": jnp.zeros(128),
            "w2": jax.random.normal(k2, (128, 10)) * math.sqrt(1 / 128), "b2": jnp.zeros(10)}


def apply_mlp(p, x):
    return jax.nn.relu(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def _conv(x, w, stride):
    return jax.lax.conv_general_dilated(x, w, (stride, stride), "SAME",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))


def init_cnn(key):
    k1, k2, k3 = jax.random.split(key, 3)
    return {"c1": jax.random.normal(k1, (3, 3, 1, 16)) * math.sqrt(2 / 9), "b1": jnp.zeros(16),
            "c2": jax.random.normal(k2, (3, 3, 16, 32)) * math.sqrt(2 / 144),
            "b2": jnp.zeros(32),
            "w": jax.random.normal(k3, (512, 10)) * math.sqrt(1 / 512), "b": jnp.zeros(10)}


def apply_cnn(p, x):
    h = x.reshape(-1, 8, 8, 1)
    h = jax.nn.relu(_conv(h, p["c1"], 1) + p["b1"])           # 8x8x16
    h = jax.nn.relu(_conv(h, p["c2"], 2) + p["b2"])           # 4x4x32
    return h.reshape(h.shape[0], -1) @ p["w"] + p["b"]


MODELS: dict[str, tuple[Callable, Callable]] = {"mlp": (init_mlp, apply_mlp),
                                                "cnn": (init_cnn, apply_cnn)}


def make_loss(apply):
    def loss_fn(params, batch):
        x, y = batch
        logp = jax.nn.log_softmax(apply(params, x))
        return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))
    return loss_fn


# ---- methods ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Method:
    label: str
    compression: Any             # a compressor or DelayedAveraging
    optimizer_momentum: float | None = MOMENTUM   # None for DGC: the momentum is its own
    target: str = ""             # "within" (DGC, PowerSGD), "control", or ""
    min_payload_compressed: float | None = None   # target: "compr." payload ratio at least

    @property
    def momentum(self) -> float:
        """The momentum the run trains with, in the optimizer or in the compressor (DGC)."""
        if self.optimizer_momentum is not None:
            return self.optimizer_momentum
        return getattr(self.compression, "momentum", 0.0)

    @property
    def is_baseline(self) -> bool:
        """Dense SGD: the reference for the runs with its momentum."""
        return self.compression == C.Dense() and self.optimizer_momentum is not None


def methods() -> list[Method]:
    dgc = functools.partial(C.DGC, warmup_steps=DGC_WARMUP_STEPS, momentum=MOMENTUM)
    return [
        Method("uncompressed", C.Dense()),
        Method("bf16 cast", C.Cast("bf16")),
        Method("top-k 1% EF", C.TopK(0.01)),
        Method("DGC 99.9%", dgc(sparsity=0.999), None, "within", TARGET_DGC_PAYLOAD),
        Method("DGC 99%", dgc(sparsity=0.99), None, "within"),
        Method("PowerSGD r2", C.PowerSGD(rank=2), target="within"),
        Method("1-bit SGD EF", C.OneBit()),
        Method("signSGD vote", C.SignSGD()),
        Method("TernGrad", C.TernGrad()),
        Method("QSGD 8 lv", C.QSGD(levels=8)),
        Method("delayed D=4", C.DelayedAveraging(4)),
        Method("ctl top-k 0.1% noEF", C.TopK(0.001, error_feedback=False), target="control"),
        Method("ctl random-k 1% EF", C.RandomK(0.01), target="control"),
        Method("ctl random-k 1% noEF", C.RandomK(0.01, error_feedback=False), target="control"),
    ]


def with_baselines(chosen: list[Method]) -> list[Method]:
    """`chosen` with a dense-SGD baseline first for every momentum a run trains with
    ("uncompressed" for MOMENTUM; "dense SGD m=..." for another DGC momentum)."""
    baselines = {m.momentum: m for m in chosen if m.is_baseline}
    for m in chosen:
        if m.momentum not in baselines:
            label = "uncompressed" if m.momentum == MOMENTUM else f"dense SGD m={m.momentum:g}"
            baselines[m.momentum] = Method(label, C.Dense(), m.momentum)
    return list(baselines.values()) + [m for m in chosen if not m.is_baseline]


def optimizer(method: Method, steps: int) -> optax.GradientTransformation:
    """SGD on the cosine schedule, with momentum where the method leaves it to the
    optimizer (not DGC: its momentum correction is the momentum)."""
    schedule = optax.cosine_decay_schedule(PEAK_LR, steps)
    return optax.sgd(schedule, momentum=method.optimizer_momentum or None)


def payload_bytes(method, shape: tuple[int, ...], itemsize: int = 4) -> float:
    """Bytes ONE worker contributes for a gradient leaf, as the compressor encodes it (the
    module docstring); the collective that moves it is not counted."""
    numel = math.prod(shape)
    if isinstance(method, C.DelayedAveraging):
        return payload_bytes(method.compressor, shape, itemsize)
    if isinstance(method, C.Dense):
        return numel * itemsize
    if isinstance(method, C.Cast):
        return numel * 2
    if isinstance(method, C.TopK):
        return count_of(numel, method.ratio) * (itemsize + 4)
    if isinstance(method, C.DGC):
        if not method.compresses(shape):
            return numel * itemsize                # sent whole (a psum of the velocity)
        return count_of(numel, 1 - method.sparsity) * (itemsize + 4)
    if isinstance(method, C.RandomK):
        return count_of(numel, method.ratio) * itemsize
    if isinstance(method, C.PowerSGD):
        if not method.compresses(shape):
            return numel * itemsize
        rows, cols = matrix_shape(shape)
        return (rows + cols) * method.rank * 4
    if isinstance(method, C.OneBit):
        layout = ColumnChunks(shape, WORKERS)
        return layout.cols * (math.ceil(layout.rows / 8) + 2 * 4)
    if isinstance(method, C.SignSGD):
        return math.ceil(numel / 8) + 4
    if isinstance(method, C.TernGrad):
        return numel + 4
    if isinstance(method, C.QSGD):
        buckets = math.ceil(numel / min(method.bucket_size or numel, numel))
        return buckets * min(method.bucket_size or numel, numel) + 4 * buckets
    raise TypeError(f"no payload formula for {method!r}")


# ---- the two harnesses --------------------------------------------------------------------

def parallelize_step(method: Method, loss_fn, tx, layout: str):
    def train_step(params, opt_state, batch):
        loss, grads = al.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    return al.parallelize(train_step, method=LAYOUTS[layout](), compression=method.compression)


class ShardMapStep:
    """The compressor without alpa_lite's runtime (module docstring): same call signature
    as a parallelized step, (params, opt_state, batch) -> (params, opt_state, loss)."""

    def __init__(self, method: Method, loss_fn, tx):
        if isinstance(method.compression, C.DelayedAveraging):
            raise NotImplementedError("delayed averaging is a runtime feature: not in the "
                                      "shard_map harness")
        self.comp = method.compression
        self.loss_fn, self.tx = loss_fn, tx
        self.mesh = jax.make_mesh((WORKERS,), ("dp",))
        self.key = jax.random.key(0)
        self.state = None
        self.step = 0
        self.compiled: dict[Any, Callable] = {}

    def reset_compression_state(self, seed: int = 0):
        self.state = None
        self.step = 0
        self.key = jax.random.key(seed)

    def _program(self, phase):
        comp, tx, loss_fn, n = self.comp, self.tx, self.loss_fn, WORKERS

        def worker(state, key, params, opt_state, batch):
            state = jax.tree.map(lambda a: a[0], state)
            local = jax.tree.map(lambda p: jax.lax.pcast(p, ("dp",), to="varying"), params)
            loss, grads = jax.value_and_grad(loss_fn)(local, batch)
            worker_key = jax.random.fold_in(key, n + jax.lax.axis_index("dp"))
            summed, state = C.reduce_tree(comp, grads, state, axis_name="dp", num_workers=n,
                                          phase=phase, shared_key=key, worker_key=worker_key)
            grads = jax.tree.map(lambda s: s / n, summed)
            updates, opt_state = tx.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state,
                    jax.lax.psum(loss, "dp") / n, jax.tree.map(lambda a: a[None], state))

        return jax.jit(jax.shard_map(worker, mesh=self.mesh,
                                     in_specs=(P("dp"), P(), P(), P(), P("dp")),
                                     out_specs=(P(), P(), P(), P("dp"))))

    def __call__(self, params, opt_state, batch):
        if self.state is None:
            sharded = NamedSharding(self.mesh, P("dp"))
            self.state = jax.tree.map(
                lambda a: jax.device_put(jnp.zeros((WORKERS, *a.shape), a.dtype), sharded),
                C.init_tree(self.comp, params))
        phase = self.comp.phase(self.step)
        if phase not in self.compiled:
            self.compiled[phase] = self._program(phase)
        replicated = NamedSharding(self.mesh, P())
        params, opt_state = jax.device_put((params, opt_state), replicated)
        batch = jax.device_put(batch, NamedSharding(self.mesh, P("dp")))
        key = jax.random.fold_in(self.key, self.step)
        params, opt_state, loss, self.state = self.compiled[phase](self.state, key, params,
                                                                   opt_state, batch)
        self.step += 1
        return params, opt_state, loss


# ---- one (model, method, harness) ---------------------------------------------------------

def batches(seed: int, n: int, steps: int):
    """`steps` index arrays of BATCH, from consecutive permutations of range(n)."""
    rng = np.random.default_rng(seed)
    stream = np.empty(0, np.int64)
    for _ in range(steps):
        if len(stream) < BATCH:
            stream = np.concatenate([stream, rng.permutation(n)])
        yield stream[:BATCH]
        stream = stream[BATCH:]


def replicas_equal(params) -> tuple[bool, int]:
    """(every leaf's device copies bitwise equal, fewest copies of a leaf)."""
    equal, copies = True, WORKERS
    for leaf in jax.tree.leaves(params):
        shards = [np.asarray(s.data).tobytes() for s in leaf.addressable_shards]
        copies = min(copies, len(shards))
        equal &= all(s == shards[0] for s in shards[1:])
    return equal, copies


def run_method(model: str, layout: str, method: Method, harness: str, seeds: list[int],
               steps: int, data: dict[str, np.ndarray]) -> dict[str, Any]:
    init, apply = MODELS[model]
    loss_fn = make_loss(apply)
    tx = optimizer(method, steps)
    forward = jax.jit(apply)
    synchronous = not isinstance(method.compression, C.DelayedAveraging)
    row: dict[str, Any] = {"model": model, "layout": layout, "method": method.label,
                           "harness": harness, "config": C.to_config(method.compression),
                           "description": method.compression.describe(),
                           "optimizer": f"sgd cosine {PEAK_LR}->0, momentum "
                                        f"{method.optimizer_momentum or 0:g}",
                           "momentum": method.momentum, "is_baseline": method.is_baseline,
                           "target": method.target,
                           "min_payload_compressed": method.min_payload_compressed,
                           "synchronous": synchronous}
    example = init(jax.random.key(0))
    shapes = [tuple(x.shape) for x in jax.tree.leaves(example)]
    dense = sum(math.prod(s) * 4 for s in shapes)
    payload = sum(payload_bytes(method.compression, s) for s in shapes)
    row.update(dense_gradient_bytes=dense, payload_bytes=payload, payload_ratio=dense / payload)
    compresses = getattr(method.compression, "compresses", None)
    if compresses is not None:          # DGC, PowerSGD: some leaves go whole
        squeezed = [s for s in shapes if compresses(s)]
        row["payload_ratio_compressed"] = (
            sum(math.prod(s) * 4 for s in squeezed)
            / sum(payload_bytes(method.compression, s) for s in squeezed) if squeezed else None)
    t0 = time.perf_counter()
    try:
        planned = parallelize_step(method, loss_fn, tx, layout)   # the step, for that harness
        x0 = (data["x_train"][:BATCH], data["y_train"][:BATCH])
        spec = planned.plan(example, tx.init(example), x0).compression
        row.update(wire_bytes=spec.wire_bytes, dense_wire_bytes=spec.dense_wire_bytes,
                   wire_ratio=spec.dense_wire_bytes / spec.wire_bytes,
                   plan_description=spec.description)
        if harness == "shard_map" and layout != "dp":
            raise NotImplementedError(f"the shard_map harness runs pure data parallelism "
                                      f"only, not layout {layout!r}")
        step = planned if harness == "parallelize" else ShardMapStep(method, loss_fn, tx)
    except Exception as e:  # noqa: BLE001 - recorded and reported, the other methods go on
        row.update(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        return row
    runs = []
    for i, seed in enumerate(seeds):
        step.reset_compression_state(seed=seed)     # the compressors' randomness too
        params = init(jax.random.key(seed))
        opt_state = tx.init(params)
        losses = []
        diverged_at = None
        t_seed = time.perf_counter()
        try:
            for idx in batches(seed, TRAIN_SIZE, steps):
                params, opt_state, loss = step(params, opt_state,
                                               (data["x_train"][idx], data["y_train"][idx]))
                losses.append(float(loss))
        except al.NonFiniteGradientError:
            # Training diverged: the step refused the NaN gradients and changed nothing, so
            # `params` are the last finite ones; they are what this run ends with.
            diverged_at = len(losses)
        except Exception as e:  # noqa: BLE001
            row.update(error=f"seed {seed}, step {len(losses)}: {type(e).__name__}: {e}",
                       traceback=traceback.format_exc())
            break
        host = jax.device_get(params)
        acc = float(np.mean(np.argmax(np.asarray(forward(host, data["x_test"])), -1)
                            == data["y_test"])) * 100
        run = {"seed": seed, "test_accuracy": acc, "final_train_loss": float(np.mean(losses[-10:])),
               "wall_s": time.perf_counter() - t_seed}
        if diverged_at is not None:
            run["diverged_at_step"] = diverged_at
        if synchronous:
            run["replicas_equal"], run["replica_copies"] = replicas_equal(params)
        runs.append(run)
        print(f"  {model} {layout} {method.label} [{harness}] seed {seed}: {acc:.2f}% "
              f"(loss {run['final_train_loss']:.4f}, {run['wall_s']:.1f} s)", flush=True)
    row["runs"] = runs
    row["wall_s"] = time.perf_counter() - t0
    if runs and "error" not in row:
        accs = [r["test_accuracy"] for r in runs]
        row.update(accuracy_mean=statistics.fmean(accs), accuracy_std=statistics.pstdev(accs),
                   accuracy_min=min(accs), accuracy_max=max(accs))
        if synchronous:
            row["replicas_equal"] = all(r["replicas_equal"] for r in runs)
    return row


def judge(rows: list[dict[str, Any]]) -> None:
    """Adds the baseline (dense SGD with the row's momentum, same model, layout and harness),
    delta_pts to it, and target verdicts."""
    def key(r):
        return r["model"], r["layout"], r["harness"], r["momentum"]

    base = {key(r): r for r in rows if r["is_baseline"]}
    for r in rows:
        b = base.get(key(r))
        r["baseline"] = b["method"] if b is not None else None
        ref = b.get("accuracy_mean") if b is not None else None
        r["baseline_accuracy"] = ref
        if ref is None or "accuracy_mean" not in r:
            r["delta_pts"] = None
            if r["target"]:
                r["target_text"], r["target_holds"] = _target_text(r), None
            continue
        d = r["accuracy_mean"] - ref
        r["delta_pts"] = d
        r["target_text"] = _target_text(r)
        if r["target"] == "within":
            holds = abs(d) <= TARGET_WITHIN_PTS
            if r["min_payload_compressed"] is not None:
                holds = holds and r["payload_ratio_compressed"] >= r["min_payload_compressed"]
            r["target_holds"] = holds
        elif r["target"] == "control":
            r["target_holds"] = d <= -CONTROL_WORSE_PTS


def _target_text(r) -> str:
    if r["target"] == "within":
        extra = (f", compr. payload >= {r['min_payload_compressed']:g}x"
                 if r["min_payload_compressed"] is not None else "")
        return f"|delta| <= {TARGET_WITHIN_PTS} pts{extra}"
    if r["target"] == "control":
        return f"delta <= -{CONTROL_WORSE_PTS} pts"
    return ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help=f"MLP only, 1 seed, {QUICK_STEPS} steps")
    ap.add_argument("--steps", type=int, default=None, help=f"default {STEPS}")
    ap.add_argument("--seeds", type=int, default=None, help=f"seeds 0..N-1 (default {SEEDS})")
    ap.add_argument("--models", nargs="*", choices=sorted(MODELS), default=None)
    ap.add_argument("--layouts", nargs="*", choices=sorted(LAYOUTS), default=["dp"],
                    help="how the 8 devices are used (dp: pure data parallelism)")
    ap.add_argument("--methods", nargs="*", default=None,
                    help="labels to run (default: all; the dense baselines are always run)")
    ap.add_argument("--harness", nargs="*", choices=["parallelize", "shard_map"],
                    default=["parallelize"])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    steps = args.steps or (QUICK_STEPS if args.quick else STEPS)
    seeds = list(range(args.seeds or (1 if args.quick else SEEDS)))
    models = args.models or (["mlp"] if args.quick else ["mlp", "cnn"])
    chosen = with_baselines([m for m in methods()
                             if args.methods is None or m.label in args.methods])
    out = args.out or _common.RESULTS_DIR / ("compression_convergence_quick.json" if args.quick
                                             else "compression_convergence.json")
    if jax.device_count() != WORKERS:
        sys.exit(f"needs {WORKERS} devices, JAX sees {jax.device_count()} ({jax.default_backend()}); "
                 "run with JAX_PLATFORMS=cpu to get the virtual CPU devices")
    data = load_data()
    t0 = time.perf_counter()
    rows = []
    for model in models:
        for layout in args.layouts:
            for harness in args.harness:
                for method in chosen:
                    if harness == "shard_map" and isinstance(method.compression,
                                                             C.DelayedAveraging):
                        continue        # a runtime feature: parallelize harness only
                    rows.append(run_method(model, layout, method, harness, seeds, steps, data))
                    if "error" in rows[-1]:
                        print(f"  {model} {layout} {method.label} [{harness}] FAILED: "
                              f"{rows[-1]['error'].splitlines()[0][:300]}", flush=True)
    judge(rows)
    total_s = time.perf_counter() - t0

    def pct(r, key):
        return f"{r[key]:.2f}" if r.get(key) is not None else "-"

    def ratio(r, key):
        return f"{r[key]:.1f}x" if r.get(key) is not None else "-"

    table = []
    for r in rows:
        failed = "error" in r
        holds = r.get("target_holds")
        table.append([
            r["model"], r["layout"], r["method"], r["harness"],
            "FAILED" if failed else pct(r, "accuracy_mean"),
            pct(r, "accuracy_std"),
            f"{r['accuracy_min']:.2f}/{r['accuracy_max']:.2f}" if "accuracy_min" in r else "-",
            "" if r["is_baseline"] else f"{r['baseline'] or '-'} {pct(r, 'baseline_accuracy')}",
            f"{r['delta_pts']:+.2f}" if r.get("delta_pts") is not None else "-",
            ratio(r, "payload_ratio"), ratio(r, "payload_ratio_compressed"),
            ratio(r, "wire_ratio"),
            ("yes" if r["replicas_equal"] else "NO") if "replicas_equal" in r else
            ("n/a" if not r["synchronous"] else "-"),
            r.get("target_text", ""),
            "" if not r["target"] else ("yes" if holds else "NO" if holds is False else "?"),
            f"{r.get('wall_s', 0):.0f}"])
    caption = (f"digits 1438/359, 8 workers x {BATCH // WORKERS} images, {steps} steps, "
               f"seeds {seeds[0]}..{seeds[-1]}, SGD cosine {PEAK_LR}->0, momentum {MOMENTUM} "
               f"(DGC: in the compressor, plain SGD outside), DGC warm-up {DGC_WARMUP_STEPS} "
               f"steps ({DGC_WARMUP_EPOCHS} epochs). Δ: to the baseline, dense SGD with the "
               f"same momentum. payload = dense bytes / one worker's encoded bytes (compr.: "
               f"of the leaves the method compresses); wire = plan's dense / method wire "
               f"bytes. Total {total_s / 60:.1f} min.")
    _common.print_table(
        "Gradient compression: test accuracy (%) on digits",
        [("model", "left"), ("layout", "left"), ("method", "left"), ("harness", "left"),
         ("acc mean", "right"), ("std", "right"), ("min/max", "right"),
         ("baseline", "left"), ("Δ pts", "right"), ("payload", "right"),
         ("compr.", "right"), ("wire", "right"), ("replicas =", "right"),
         ("target", "left"), ("holds", "left"), ("s", "right")], table, caption=caption)
    failures = [r for r in rows if "error" in r]
    for r in failures:
        print(f"\n{r['model']} {r['layout']} {r['method']} [{r['harness']}] failed:\n"
              f"{r['traceback']}")
    _common.write_result(out, {
        "benchmark": "compression_convergence", "command": _common.command_line(),
        "date": _common.now_utc(), "machine": _common.machine(), "code": _common.CODE_AT_START,
        "settings": {"dataset": "sklearn load_digits, pixels / 16", "train": TRAIN_SIZE,
                     "test": len(data["y_test"]), "data_seed": DATA_SEED, "workers": WORKERS,
                     "global_batch": BATCH, "steps": steps, "seeds": seeds,
                     "peak_lr": PEAK_LR, "schedule": "cosine to 0", "momentum": MOMENTUM,
                     "dgc_warmup_steps": DGC_WARMUP_STEPS,
                     "dgc_warmup_epochs": DGC_WARMUP_EPOCHS,
                     "models": models, "layouts": args.layouts, "harness": args.harness,
                     "targets": {"within_pts": TARGET_WITHIN_PTS,
                                 "dgc_payload_ratio_compressed": TARGET_DGC_PAYLOAD,
                                 "control_worse_pts": CONTROL_WORSE_PTS}},
        "total_wall_s": total_s, "rows": rows})
    print(f"wrote {out} ({total_s / 60:.1f} min)")


if __name__ == "__main__":
    main()
