"""alpa_lite installed as a user installs it: a wheel in a fresh virtual environment, used
from a directory outside the repository.

The module fixture copies the source tree, `pip install`s it (not editable: pip builds a
wheel, in an isolated build environment) into a new venv, and the tests then run the venv's
`alpa-lite clusters`, `alpa-lite plan gpt-tiny` and a script that parallelizes a built-in
model's step, each from a temporary directory. The venv sees this interpreter's packages
(jax, optax, pulp, ...: `--system-site-packages`, or a .pth file when this interpreter is
itself a venv), so pip installs alpa_lite alone (`--no-deps`); the wheel's own package
shadows this interpreter's alpa_lite, which every test checks.

About 20 s on 2 cores. Runs by default (CI); ALPA_LITE_SKIP_INSTALL_TEST=1 skips it.
"""

import json
import os
import pathlib
import shutil
import site
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
SKIP_ENV = "ALPA_LITE_SKIP_INSTALL_TEST"

pytestmark = pytest.mark.skipif(os.environ.get(SKIP_ENV) == "1",
                                reason=f"{SKIP_ENV}=1: the wheel install test is skipped")

# Not copied into the tree pip builds from: version control, build outputs, caches.
IGNORED = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", ".venv",
                                 ".pytest_cache", ".hypothesis", ".benchmarks")

# Parallelizes and runs one step of a built-in model from the installed package, checks it
# against plain jax.jit, and says where alpa_lite was imported from.
STEP_SCRIPT = """
import json
import jax, optax
import numpy as np
import alpa_lite as al
from alpa_lite.tools.models import common, mlp

cfg = mlp.CONFIGS["tiny"]
tx = optax.adamw(1e-3)
args = common.init_args(mlp.init_params, mlp.make_batch, cfg, cfg.batch_size, tx)
train_step = mlp.make_train_step(cfg, tx)
step = al.parallelize(train_step, method=al.Manual(dp=4, tp=2))
_, _, loss = step(*args)
_, _, expected = jax.jit(train_step)(*args)
np.testing.assert_allclose(float(loss), float(expected), rtol=1e-5)
print(json.dumps({"alpa_lite": al.__file__, "models": mlp.__file__,
                  "devices": jax.device_count(), "loss": float(loss)}))
"""


def _site_packages(venv: pathlib.Path) -> pathlib.Path:
    found = sorted(venv.glob("lib/python*/site-packages")) + sorted(venv.glob("Lib/site-packages"))
    assert len(found) == 1, f"no single site-packages in {venv}: {found}"
    return found[0]


def _bin(venv: pathlib.Path, name: str) -> pathlib.Path:
    return venv / ("Scripts" if os.name == "nt" else "bin") / name


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv, its site-packages, a work directory outside the repository, the env to run
    in)."""
    root = tmp_path_factory.mktemp("install")
    src, venv, work = root / "src", root / "venv", root / "work"
    shutil.copytree(REPO, src, ignore=IGNORED)
    work.mkdir()
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip",
                    str(venv)], check=True, timeout=120)
    packages = _site_packages(venv)
    if sys.prefix != sys.base_prefix:
        # This interpreter is a venv, whose packages --system-site-packages does not see:
        # add them after the new venv's own (so the wheel's alpa_lite still comes first).
        dirs = [d for d in site.getsitepackages() if pathlib.Path(d).is_dir()]
        (packages / "outer_site_packages.pth").write_text(
            "".join(f"import site; site.addsitedir({d!r})\n" for d in dirs))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    python = _bin(venv, "python")
    proc = subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-input",
                           "--quiet", str(src)], cwd=work, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, \
        f"pip install failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return venv, packages, work, env


def _run(installed, *command, timeout=300):
    _, _, work, env = installed
    proc = subprocess.run([str(c) for c in command], cwd=work, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"{command} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_the_wheel_holds_every_subpackage(installed):
    venv, packages, _, _ = installed
    source = {p.parent.relative_to(REPO) for p in (REPO / "alpa_lite").rglob("__init__.py")}
    wheel = {p.parent.relative_to(packages) for p in (packages / "alpa_lite").rglob("__init__.py")}
    assert source == wheel, f"missing {source - wheel}, extra {wheel - source}"
    assert (packages / "alpa_lite" / "tools" / "models" / "gpt.py").is_file()
    out = _run(installed, _bin(venv, "python"), "-c",
               "import alpa_lite; print(alpa_lite.__file__)")
    assert pathlib.Path(out.strip()).is_relative_to(packages), out


def test_cli_lists_the_clusters(installed):
    venv = installed[0]
    out = _run(installed, _bin(venv, "alpa-lite"), "clusters")
    assert "8xV100" in out and "V100-SXM2-16GB" in out


def test_cli_plans_a_builtin_model(installed):
    venv = installed[0]
    out = _run(installed, _bin(venv, "alpa-lite"), "plan", "gpt-tiny", "--cluster", "8xV100",
               "-o", "plan.json")
    assert "estimated step" in out and "wrote plan.json" in out
    plan = json.loads((installed[2] / "plan.json").read_text())
    assert plan["cluster_name"] == "8xV100"


def test_a_parallelized_step_runs_from_the_wheel(installed):
    venv, packages, work, _ = installed
    script = work / "step.py"
    script.write_text(STEP_SCRIPT)
    out = _run(installed, _bin(venv, "python"), script)
    result = json.loads(out.strip().splitlines()[-1])
    assert pathlib.Path(result["alpa_lite"]).is_relative_to(packages), result
    assert pathlib.Path(result["models"]).is_relative_to(packages), result
    assert result["devices"] == 8
