"""Multi-layer perceptron regression (Linear - relu - ... - Linear) trained with AdamW.

The model lives in the package, `alpa_lite/tools/models/mlp.py` (sizes, sources), where
`alpa-lite plan mlp-<size>` finds it too; this script parallelizes and trains it
(`_common.run_example`; --help for the flags).

    python examples/mlp.py                                   # tiny, 5 steps on 8 CPU devices
    python examples/mlp.py --size b128_h1024 --method manual --dp 1 --tp 8
"""

from __future__ import annotations

import os

# 8 virtual CPU devices unless the caller chose otherwise. Must happen before jax is imported.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import pathlib
import sys

# The model: Config, CONFIGS, init_params, make_batch, loss_fn, make_train_step, abstract_args...
from alpa_lite.tools.models.mlp import *  # noqa: E402, F401, F403

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # run as a script or imported
import _common  # noqa: E402


def main(argv=None) -> None:
    _common.run_example(sys.modules[__name__], argv)


if __name__ == "__main__":
    main()
