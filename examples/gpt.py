"""GPT-2 style decoder trained with AdamW, parallelized by alpa_lite.

The model lives in the package, `alpa_lite/tools/models/gpt.py` (sizes, sources), where
`alpa-lite plan gpt-<size>` finds it too; this script parallelizes and trains it
(`_common.run_example`; --help for the flags).

    python examples/gpt.py                                   # tiny, 5 steps on 8 CPU devices
    python examples/gpt.py --size 2.6B --plan-only --cluster 8xA100 --batch-size 32
"""

from __future__ import annotations

import os

# 8 virtual CPU devices unless the caller chose otherwise. Must happen before jax is imported.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import pathlib
import sys

# The model: Config, CONFIGS, init_params, make_batch, loss_fn, make_train_step, abstract_args...
from alpa_lite.tools.models.gpt import *  # noqa: E402, F401, F403

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # run as a script or imported
import _common  # noqa: E402


def main(argv=None) -> None:
    _common.run_example(sys.modules[__name__], argv)


if __name__ == "__main__":
    main()
