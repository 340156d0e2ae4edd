"""Test set-up: 8 virtual CPU devices (set before JAX is imported) and shared helpers."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
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
