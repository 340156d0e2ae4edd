"""What the CLI plans: a built-in model by name, or a user's `file.py:function`.

    load_target("gpt-2.6b", batch_size=8, cluster=al.Cluster.preset("8xV100"))
    load_target("my_model.py:make_step")

Built-in names are `<model>-<size>` for the models of `alpa_lite.tools.models` (`gpt`,
`moe`, `wide_resnet`, `mlp`; the repository's examples train the same ones) and every size
in their `CONFIGS`, lower case: `gpt-2.6b`, `moe-380m`, `wide_resnet-250m`, `mlp-tiny`
(`builtin_names()`). Their step is the model's optax AdamW train step, their arguments
`jax.ShapeDtypeStruct`s (nothing is allocated), and real arrays for measuring come from the
model's `init_params` / `make_batch` (`models.common.init_args`).

A user's file defines a function (default `make_step`) taking no arguments and returning
`(step_fn, example_args)`: the train step (plain, or already wrapped by `al.parallelize`)
and its positional arguments as a tuple, arrays or `jax.ShapeDtypeStruct`s; the batch is
the last argument unless the step was wrapped with `batch_argnums`.

Every mistake (unknown name, missing file, no such function, a wrong return value) raises
`TargetError` with one line saying what was expected.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import pathlib
import sys
from types import ModuleType
from typing import Any, Callable

import jax
import numpy as np

from alpa_lite.cost_models.cluster import Cluster

FAMILIES = ("gpt", "moe", "wide_resnet", "mlp")
MODELS_PACKAGE = "alpa_lite.tools.models"
# Global batch for built-in models when none is given: the inter-op benchmark's
# (bench/pipeline_search.py). The models' own Config.batch_size (Alpa's 1024 / 1536) is
# kept where it is smaller (the tiny sizes).
DEFAULT_BATCH = 64


class TargetError(ValueError):
    """The model named on the command line cannot be loaded (what and why, in one line)."""


@dataclasses.dataclass(frozen=True, eq=False)
class Target:
    """A train step to plan, with its example arguments.

    Attributes:
      name: as given, e.g. "gpt-2.6b" or "my_model.py:make_step".
      step_fn: the plain train step.
      args: positional arguments: arrays or `jax.ShapeDtypeStruct`s.
      batch_argnums: the batch arguments (None: the last one).
      source: how to build it again ((key, value) strings: `Explanation.source`).
      make_real_args: returns real arrays for the arguments (for measuring), or None.
      no_real_args: why there are no real arrays, where `make_real_args` is None.
    """
    name: str
    step_fn: Callable
    args: tuple
    batch_argnums: tuple[int, ...] | None
    source: tuple[tuple[str, str], ...]
    make_real_args: Callable[[], tuple] | None = None
    no_real_args: str = ""

    @property
    def batch_size(self) -> int:
        """Examples per step: the leading dimension of the first batch leaf."""
        nums = self.batch_argnums if self.batch_argnums is not None else (len(self.args) - 1,)
        for i in nums:
            for leaf in jax.tree_util.tree_leaves(self.args[i]):
                shape = getattr(leaf, "shape", ())
                if shape:
                    return int(shape[0])
        raise TargetError(f"{self.name}: the batch argument has no leaf with a leading "
                          "batch dimension")


def model_module(family: str) -> ModuleType:
    """`alpa_lite.tools.models.<family>`; a missing third-party dependency of the models
    (optax) is a TargetError saying what to install."""
    try:
        return importlib.import_module(f"{MODELS_PACKAGE}.{family}")
    except ImportError as e:
        if (e.name or "").startswith("alpa_lite"):
            raise       # the package itself is broken: not something to install
        raise TargetError(f"the built-in {family} models need {e.name or e}: pip install "
                          "'alpa_lite[examples]'") from None


def builtin_names() -> tuple[str, ...]:
    """Every built-in model name, e.g. ("gpt-tiny", "gpt-125m", ...)."""
    return tuple(f"{family}-{size.lower()}" for family in FAMILIES
                 for size in model_module(family).CONFIGS)


def builtin_sizes() -> dict[str, dict[str, Any]]:
    """name -> the model's Config (for `alpa-lite plan --list`)."""
    out = {}
    for family in FAMILIES:
        for size, cfg in model_module(family).CONFIGS.items():
            out[f"{family}-{size.lower()}"] = cfg
    return out


def is_file_spec(spec: str) -> bool:
    """A user's file ("x.py", "x.py:fn", "dir/x.py") rather than a built-in name."""
    return ".py" in spec or os.sep in spec or ":" in spec


def _builtin_dtype(cfg_dtype: str, dtype: str | None, cluster: Cluster | None) -> str:
    """The dtype to plan in: as asked; else bfloat16 models run in float16 on devices
    without bfloat16 tensor cores (V100: Alpa's V100 runs used float16)."""
    if dtype not in (None, "auto"):
        return dtype
    if cluster is not None and cfg_dtype == "bfloat16":
        dev = cluster.device
        if dev.peak_flops("bfloat16") < dev.peak_flops("float16"):
            return "float16"
    return cfg_dtype


def load_builtin(name: str, batch_size: int | None = None, dtype: str | None = None,
                 cluster: Cluster | None = None) -> Target:
    """A built-in model's step and abstract arguments (module docstring)."""
    family, _, size = name.partition("-")
    if family not in FAMILIES or not size:
        raise TargetError(f"unknown model {name!r}: built-in models are <model>-<size> "
                          f"with model one of {list(FAMILIES)} (see alpa-lite plan --list), "
                          "or give your own file.py:make_step")
    module = model_module(family)
    sizes = {k.lower(): k for k in module.CONFIGS}
    if size.lower() not in sizes:
        raise TargetError(f"unknown model {name!r}: {family} sizes are "
                          f"{[s.lower() for s in module.CONFIGS]} (see alpa-lite plan --list)")
    # The models need optax; imported here (model_module said what to install if it is
    # missing) so that `alpa_lite` itself does not.
    import optax

    from alpa_lite.tools.models.common import init_args

    cfg = module.CONFIGS[sizes[size.lower()]]
    chosen = _builtin_dtype(cfg.dtype, dtype, cluster)
    try:
        np.dtype(chosen)
    except TypeError:
        raise TargetError(f"--dtype {chosen!r} is not a dtype; use float32, bfloat16 or "
                          "float16") from None
    cfg = dataclasses.replace(cfg, dtype=chosen)
    batch = batch_size if batch_size is not None else min(cfg.batch_size, DEFAULT_BATCH)
    if batch < 1:
        raise TargetError(f"--batch-size must be at least 1, got {batch}")
    tx = optax.adamw(1e-4)
    step_fn = module.make_train_step(cfg, tx)
    args = tuple(module.abstract_args(cfg, batch, tx))

    def real_args():
        return init_args(module.init_params, module.make_batch, cfg, batch, tx)

    source = (("target", f"{family}-{size.lower()}"), ("batch_size", str(batch)),
              ("dtype", chosen))
    return Target(name=f"{family}-{size.lower()}", step_fn=step_fn, args=args,
                  batch_argnums=None, source=source, make_real_args=real_args)


def load_file(spec: str) -> Target:
    """A user's `path.py[:function]` (module docstring)."""
    path_text, _, func = spec.partition(":")
    func = func or "make_step"
    path = pathlib.Path(path_text).expanduser()
    if not path.is_file():
        raise TargetError(f"no such file: {path_text} (give a Python file defining "
                          f"{func}() -> (step_fn, example_args), or a built-in model name)")
    module_name = f"_alpa_lite_user_{abs(hash(str(path.resolve())))}"
    loader_spec = importlib.util.spec_from_file_location(module_name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise TargetError(f"{path_text} is not a Python file")
    module = importlib.util.module_from_spec(loader_spec)
    folder = str(path.resolve().parent)
    sys.path.insert(0, folder)      # so the file can import its neighbours
    try:
        loader_spec.loader.exec_module(module)
    except Exception as e:   # noqa: BLE001 -- any error in the user's file is reported in one line
        raise TargetError(f"importing {path_text} failed: {type(e).__name__}: {e}") from None
    finally:
        sys.path.remove(folder)
    make = getattr(module, func, None)
    if not callable(make):
        raise TargetError(f"{path_text} has no function {func}(); define {func}() returning "
                          "(step_fn, example_args)")
    try:
        result = make()
    except Exception as e:   # noqa: BLE001 -- as above
        raise TargetError(f"{path_text}:{func}() failed: {type(e).__name__}: {e}") from None
    if not (isinstance(result, tuple) and len(result) == 2 and callable(result[0])
            and isinstance(result[1], (tuple, list)) and len(result[1]) > 0):
        raise TargetError(f"{path_text}:{func}() must return (step_fn, example_args) with "
                          "example_args a non-empty tuple of positional arguments, got "
                          f"{type(result).__name__}")
    step_fn, args = result
    batch_argnums = None
    from alpa_lite.api import ParallelizedStep  # a step the user already wrapped
    if isinstance(step_fn, ParallelizedStep):
        step_fn, batch_argnums = step_fn.fn, step_fn.batch_argnums
    args = tuple(args)
    leaves = jax.tree_util.tree_leaves(args)
    real = all(isinstance(x, (jax.Array, np.ndarray)) for x in leaves)
    resolved = str(path.resolve())
    return Target(
        name=spec, step_fn=step_fn, args=args, batch_argnums=batch_argnums,
        source=(("target", f"{resolved}:{func}"),),
        make_real_args=(lambda: args) if real else None,
        no_real_args="" if real else
        f"{spec} returned example arguments that are not all arrays (e.g. "
        "jax.ShapeDtypeStruct); return real arrays from it to measure")


def load_target(spec: str, batch_size: int | None = None, dtype: str | None = None,
                cluster: Cluster | None = None) -> Target:
    """A built-in model or a user's file, by what the command line says."""
    if is_file_spec(spec):
        if batch_size is not None or dtype not in (None, "auto"):
            raise TargetError("--batch-size and --dtype apply to built-in models; a file's "
                              f"{spec.partition(':')[2] or 'make_step'}() sets its own arguments")
        return load_file(spec)
    return load_builtin(spec, batch_size, dtype, cluster)


def target_from_source(source: tuple[tuple[str, str], ...],
                       cluster: Cluster | None = None) -> Target:
    """Builds the target a plan's `Explanation.source` records."""
    d = dict(source)
    if "target" not in d:
        raise TargetError("the plan does not record which step it was made for; name it "
                          "with --target (a built-in model or file.py:make_step)")
    spec = d["target"]
    if is_file_spec(spec):
        return load_file(spec)
    return load_builtin(spec, int(d["batch_size"]), d.get("dtype"), cluster)
