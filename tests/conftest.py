"""Test set-up: 8 virtual CPU devices (set before JAX is imported) and shared helpers."""

import os

# XLA:CPU compiles every program the tests run, and compiling, not running, is most of the
# suite's time (the models are tiny). Two backend options about halve it: LLVM at -O1
# instead of -O2, and XLA's older loop emitters for fusions instead of the MLIR fusion
# emitters. Neither changes the SPMD partitioning or the collectives in the compiled HLO
# (only how element-wise work is fused and emitted); both change float32 results in the
# last bits only, as compiling for another CPU does, well inside every tolerance here.
# (-O0 would be faster still, but it moves test_library_models' optax_chain-dp2_tp4 past
# its tolerance.)
TEST_XLA_FLAGS = ("--xla_force_host_platform_device_count=8 "
                  "--xla_backend_optimization_level=1 --xla_cpu_use_fusion_emitters=false")
os.environ.setdefault("XLA_FLAGS", TEST_XLA_FLAGS)
# Plans are made afresh in every test (the disk cache's own tests turn it on for a folder
# of theirs): a test must not pass or fail by what an earlier run left on the machine.
os.environ["ALPA_LITE_CACHE"] = "off"

import pathlib
import sys

import jax

# The examples live in examples/, a folder of scripts rather than a package.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))

assert jax.device_count() == 8, (
    "the tests need 8 virtual CPU devices: run them in a fresh process (XLA_FLAGS is set "
    "by tests/conftest.py before JAX starts)")
