"""The command line every example shares: build a model, parallelize its train step, run it.

Each example module (mlp, gpt, moe, wide_resnet, flax_mlp) exposes a model and its plain
JAX + optax train step (the built-in ones from `alpa_lite.tools.models`, flax_mlp its own);
its `main` hands the module to `run_example`, which does the rest:

    python examples/gpt.py                               # tiny GPT, auto plan, 5 steps on CPU
    python examples/gpt.py --method manual --dp 4 --tp 2
    python examples/gpt.py --method manual --dp 2 --tp 2 --pp 2 --micro-batches 4
    python examples/gpt.py --micro-batches 4             # auto, pipelined with 4 micro-batches
    python examples/gpt.py --size 2.6B --plan-only --cluster 8xA100 --batch-size 32
                                                       # plan only, nothing allocated

Without --plan-only the steps run on the devices JAX sees: by default 8 virtual CPU devices
(XLA_FLAGS below), so the multi-device plans can be tried on a laptop. With --distributed the
example joins a multi-process job first, e.g. two processes of 4 CPU devices each:

    alpa-lite launch -n 2 --cpu-devices 4 examples/gpt.py --distributed --method manual --dp 2 --tp 4
"""

from __future__ import annotations

import os

# 8 virtual CPU devices unless the caller chose otherwise. Must happen before jax is imported.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import builtins
import pathlib
import time
from types import ModuleType
from typing import Any, Sequence

import jax
import optax

import alpa_lite as al
from alpa_lite.tools.models.common import count_params, init_args

# -----------------------------------------------------------------------------
# knobs (each one can be overridden on the command line)
DEFAULT_SIZE = "tiny"       # a key of the module's CONFIGS
DEFAULT_STEPS = 5           # train steps to run (ignored with --plan-only)
DEFAULT_METHOD = "auto"     # auto: planner searches; dp: data parallel; manual: --dp x --tp
DEFAULT_OPTIMIZER = "adamw"
DEFAULT_LR = 1e-3           # adamw's default in optax; sgd may want a larger one
DEFAULT_SEED = 0
# -----------------------------------------------------------------------------


def example_name(module: ModuleType) -> str:
    """'gpt' for examples/gpt.py, also when it runs as __main__."""
    return pathlib.Path(module.__file__).stem


def format_count(n: int) -> str:
    """12_345_678 -> '12.35M'."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def make_optimizer(name: str, learning_rate: float) -> optax.GradientTransformation:
    """The optax optimizer a user would pick: AdamW (the default) or plain SGD."""
    if name == "adamw":
        return optax.adamw(learning_rate)
    if name == "sgd":
        return optax.sgd(learning_rate)
    raise ValueError(f"unknown optimizer {name!r}; expected 'adamw' or 'sgd'")


def build_parser(module: ModuleType) -> argparse.ArgumentParser:
    """Arguments shared by every example; `module.CONFIGS` supplies the --size choices."""
    doc = (module.__doc__ or "").strip()
    parser = argparse.ArgumentParser(prog=f"examples/{example_name(module)}.py",
                                     description=doc.splitlines()[0] if doc else None)
    parser.add_argument("--size", default=DEFAULT_SIZE, choices=list(module.CONFIGS),
                        help="named model size (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                        help="train steps to run (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="global batch size (default: the size's Config.batch_size)")
    parser.add_argument("--method", default=DEFAULT_METHOD, choices=("auto", "dp", "manual"),
                        help="auto: search the plan; dp: data parallel; manual: --dp x --tp "
                             "(default: %(default)s)")
    parser.add_argument("--dp", type=int, default=None,
                        help="data-parallel degree for --method manual "
                             "(default: number of devices, or of --cluster's devices, // --tp)")
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor (operator) parallel degree for --method manual "
                             "(default: %(default)s)")
    parser.add_argument("--pp", type=int, default=1,
                        help="pipeline stages for --method manual (default: %(default)s)")
    parser.add_argument("--micro-batches", type=int, default=None,
                        help="micro-batches per step: pipelines the step (manual: default 1; "
                             "auto: exactly this many; default: the planner chooses)")
    parser.add_argument("--schedule", default=None, choices=("1f1b", "gpipe"),
                        help="pipeline schedule (default: auto chooses, manual uses 1f1b)")
    parser.add_argument("--remat", action="store_true",
                        help="recompute activations in the backward (--method manual)")
    parser.add_argument("--distributed", action="store_true",
                        help="join a multi-process job first (alpa_lite.runtime.distributed."
                             "initialize), e.g. under `alpa-lite launch -n 2`; only "
                             "process 0 prints")
    parser.add_argument("--plan-only", action="store_true",
                        help="plan with abstract arguments (jax.ShapeDtypeStruct); "
                             "allocate nothing and run nothing")
    parser.add_argument("--cluster", default=None, metavar="NAME", choices=al.Cluster.presets(),
                        help="cluster preset to plan for (with --plan-only): "
                             f"{', '.join(al.Cluster.presets())}; default: the devices JAX sees")
    parser.add_argument("--optimizer", default=DEFAULT_OPTIMIZER, choices=("adamw", "sgd"),
                        help="optax optimizer (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=DEFAULT_LR,
                        help="learning rate (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED,
                        help="PRNG seed for parameters and the synthetic batch")
    return parser


def parse_args(module: ModuleType, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parses and cross-checks the command line (errors exit with a usage message)."""
    parser = build_parser(module)
    args = parser.parse_args(argv)
    if args.cluster is not None and not args.plan_only:
        parser.error("--cluster names a cluster to plan for; it needs --plan-only "
                     "(a run uses the devices JAX sees)")
    if args.method != "manual" and (args.dp is not None or args.tp != 1 or args.pp != 1
                                    or args.remat):
        parser.error(f"--dp/--tp/--pp/--remat set the layout of --method manual, not "
                     f"--method {args.method}")
    if args.method == "dp" and args.micro_batches is not None:
        parser.error("--micro-batches needs --method auto or manual")
    if args.tp < 1 or (args.dp is not None and args.dp < 1):
        parser.error(f"--dp and --tp must be >= 1, got --dp {args.dp} --tp {args.tp}")
    if args.steps < 0:
        parser.error(f"--steps must be >= 0, got {args.steps}")
    return args


def make_method(args: argparse.Namespace, num_devices: int) -> Any:
    """The `alpa_lite` parallelization method the command line asks for."""
    if args.method == "auto":
        return al.Auto(num_micro_batches=args.micro_batches, schedule=args.schedule)
    if args.method == "dp":
        return al.DataParallel()
    dp = args.dp if args.dp is not None else max(1, num_devices // (args.tp * args.pp))
    return al.Manual(dp=dp, tp=args.tp, pp=args.pp, num_micro_batches=args.micro_batches or 1,
                     schedule=args.schedule or "1f1b", remat=args.remat)


def run_example(module: ModuleType, argv: Sequence[str] | None = None) -> None:
    """The `main` of every example: parse flags, parallelize the step, plan, then train.

    Args:
      module: an example module exposing Config/CONFIGS/init_params/abstract_params/
        make_batch/abstract_batch/loss_fn/make_train_step/abstract_args.
      argv: command-line arguments without the program name (None: sys.argv[1:]).
    """
    args = parse_args(module, argv)
    if args.distributed:
        al.distributed.initialize()     # before JAX touches a device
    # Every process runs this same program; one of them speaks.
    print = builtins.print if jax.process_index() == 0 else (lambda *a, **k: None)
    cfg = module.CONFIGS[args.size]
    batch_size = args.batch_size or cfg.batch_size
    tx = make_optimizer(args.optimizer, args.lr)

    cluster = al.Cluster.preset(args.cluster) if args.cluster else None
    num_devices = cluster.num_devices if cluster else jax.device_count()

    # The only alpa_lite call in a training script: wrap the plain train step.
    step = al.parallelize(module.make_train_step(cfg, tx), method=make_method(args, num_devices))

    if args.plan_only:
        params, opt_state, batch = module.abstract_args(cfg, batch_size, tx)
        print(f"{example_name(module)} {args.size}: {format_count(count_params(params))} "
              f"parameters, batch {batch_size}, dtype {cfg.dtype}, planned for "
              f"{cluster.name if cluster else 'the local devices'} (abstract, nothing allocated)")
        plan = step.plan(params, opt_state, batch, cluster=cluster)
        print(plan.summary())
        return

    # One synthetic batch, reused every step: the loss falling shows the step learns.
    params, opt_state, batch = init_args(module.init_params, module.make_batch, cfg, batch_size,
                                         tx, seed=args.seed)
    print(f"{example_name(module)} {args.size}: {format_count(count_params(params))} parameters, "
          f"batch {batch_size}, dtype {cfg.dtype}, {jax.device_count()} devices")
    print(step.plan(params, opt_state, batch).summary())

    for i in range(args.steps):
        t0 = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, batch)
        loss = float(loss)  # blocks until the step is done
        print(f"step {i}  loss {loss:.4f}  ({time.perf_counter() - t0:.2f} s)")
