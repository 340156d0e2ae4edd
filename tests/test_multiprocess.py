"""Multi-process runs: 2 processes x 4 virtual CPU devices on 127.0.0.1, joined by
`jax.distributed` (gloo collectives), started by `alpa_lite.tools.launch`.

Each test starts its processes with `LocalJob`, which stops every one of them when the
test leaves it, also when the test fails. The processes run tests/multiprocess_worker.py;
the single-process references run here, on this process's 8 devices.
"""

import pathlib
import re
import sys
import time

import jax
import numpy as np
import pytest
from _reference import reference_run, run_steps

import alpa_lite as al
from alpa_lite.tools.launch import LocalJob, launch

WORKER = str(pathlib.Path(__file__).resolve().parent / "multiprocess_worker.py")
CONFIGS = [f"{example}:{method}" for example in ("mlp", "gpt")
           for method in ("dp", "tp", "auto", "pp", "dense")] + ["mlp:dp:local", "gpt:tp:local"]
JOB_TIMEOUT_S = 150


def _run_job(*args, timeout_s=JOB_TIMEOUT_S) -> None:
    results = launch([sys.executable, WORKER, *map(str, args)], num_processes=2,
                     cpu_devices=4, timeout_s=timeout_s)
    failed = [r for r in results if not r.ok]
    assert not failed, "\n".join(f"{r.describe()}\n{r.output[-3000:]}" for r in failed)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """One job for the three checks below (each job start imports JAX and joins the
    processes): calibrate, train every config, restore a checkpoint of one process's run
    onto the plans of two. Returns (output folder, the uninterrupted next loss after the
    checkpoint).

    Calibration goes first, in the fresh job, as `alpa-lite calibrate` runs: after the
    training, single collective timings of its link phase took 20-40 s instead of 0.2 s
    on the 2-core test machine, and once a fit gave up on them."""
    out = tmp_path_factory.mktemp("multiprocess")
    ckpt = out / "ckpt"
    next_loss = _dp_checkpoint("gpt", ckpt, steps=2)
    _run_job("calibrate", out, "--", "train", out, *CONFIGS,
             "--", "restore", ckpt, out, "gpt:pp", "gpt:tp", timeout_s=2 * JOB_TIMEOUT_S)
    return out, next_loss


@pytest.fixture(scope="module")
def trained(job):
    return job[0]


@pytest.mark.parametrize("config", CONFIGS)
def test_two_processes_equal_one(trained, config):
    example, method, *feed = config.split(":")
    _, _, ref_losses, ref_params = reference_run(example)
    method = "_".join([method, *feed])
    ref = {"/".join(str(k) for k in path): np.asarray(v)
           for path, v in jax.tree_util.tree_flatten_with_path(ref_params)[0]}
    for proc in (0, 1):
        got = np.load(trained / f"{example}_{method}_p{proc}.npz")
        np.testing.assert_allclose(got["losses"], ref_losses, rtol=1e-5)
        params = {k[len("param:"):]: got[k] for k in got.files if k.startswith("param:")}
        assert params.keys() == ref.keys()
        for k in ref:
            np.testing.assert_allclose(params[k], ref[k], rtol=1e-5, atol=1e-6, err_msg=k)
        stages = list(got["stage_processes"])
        if method.startswith("pp"):
            assert stages == ["0", "1"], "one pipeline stage per process"
        else:
            assert stages == ["0,1"], "one SPMD stage across both processes"


def _dp_checkpoint(example, directory, steps):
    """`steps` DataParallel steps on this process's 8 devices, saved; returns the
    uninterrupted next loss."""
    step_fn, (params, opt_state, batch), _, _ = reference_run(example)
    step = al.parallelize(step_fn, method=al.DataParallel())
    p, s, _ = run_steps(step, (params, opt_state, batch), steps)
    al.checkpoint.save(directory, (p, s), step_number=steps, step=step)
    _, _, loss = step(p, s, batch)
    return float(loss)


def test_checkpoint_from_one_process_restores_onto_two(job):
    # The job restored the checkpoint onto the gpt:pp and gpt:tp steps it trained (as a
    # job resuming from a checkpoint does), after the training above.
    out, next_loss = job
    for method in ("pp", "tp"):
        for proc in (0, 1):
            got = np.load(out / f"restore_gpt_{method}_p{proc}.npz")
            np.testing.assert_allclose(got["loss"], next_loss, rtol=1e-5)
            where = set(got["where"])
            # Each leaf was read straight onto the target plan's devices.
            assert where == ({"0", "1"} if method == "pp" else {"0,1"})


def test_killed_process_stops_the_survivor(tmp_path):
    ckpt = tmp_path / "ckpt"
    with LocalJob([sys.executable, WORKER, "forever", str(ckpt)], num_processes=2,
                  cpu_devices=4) as job:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while not all(re.search(r"^step 4 ", job.output(i), re.M) for i in (0, 1)):
            assert all(rc is None for rc in job.poll()), job.results()
            assert time.monotonic() < deadline, "the job never reached step 4"
            time.sleep(0.1)
        job.kill(1)
        killed_at = time.monotonic()
        while job.poll()[0] is None:
            assert time.monotonic() - killed_at < 60, "the survivor still runs after 60 s"
            time.sleep(0.1)
        survivor = job.results()[0]
    assert survivor.returncode != 0
    # Usually JAX's coordination service stops the survivor, naming the process that
    # stopped sending heartbeats. When the kill lands inside a collective, gloo's broken
    # connection can abort the survivor first, with gloo's own message.
    assert re.search(r"unhealthy \(stopped sending heartbeats\):\s*1|gloo::\w+", survivor.output), \
        survivor.output[-3000:]
    # The checkpoint of step 2 is intact: it restores, here onto one process's 8 devices.
    step_fn, (params, opt_state, batch), _, _ = reference_run("mlp")
    step = al.parallelize(step_fn, method=al.DataParallel())
    want, _, _ = run_steps(step, (params, opt_state, batch), 2)
    got, _ = al.checkpoint.restore(ckpt, (params, opt_state), step=step, batch=batch)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-8)


def test_calibration_across_processes(job):
    texts = [(job[0] / f"cluster_p{i}.json").read_text() for i in (0, 1)]
    # Process 0's timings are shared, so both processes plan with the same cluster.
    assert texts[0] == texts[1]
    cluster = al.Cluster.from_json(texts[0])
    assert (cluster.num_nodes, cluster.devices_per_node) == (2, 4)
    # The link between processes was measured (gloo over loopback), not assumed.
    assert cluster.inter_node is not None and "calibrated" in cluster.inter_node.name


def test_launcher_refuses_bad_input(monkeypatch):
    # Checked before anything is configured, so this process is left as it was.
    with pytest.raises(ValueError, match="heartbeat_timeout_s"):
        al.distributed.initialize(heartbeat_timeout_s=0)
    monkeypatch.setenv("ALPA_LITE_NUM_PROCESSES", "two")
    with pytest.raises(ValueError, match="ALPA_LITE_NUM_PROCESSES='two'"):
        al.distributed.initialize()
    with pytest.raises(ValueError, match="num_processes"):
        LocalJob([sys.executable, WORKER], num_processes=0)
    with pytest.raises(ValueError, match="non-empty list"):
        LocalJob("python worker.py")


def test_launcher_stops_processes_on_timeout():
    job = LocalJob([sys.executable, "-c", "import time; time.sleep(600)"], num_processes=2,
                   cpu_devices=None)
    with job, pytest.raises(TimeoutError, match=r"still running after 1 s"):
        job.wait(timeout_s=1)
    assert all(rc is not None for rc in job.poll())


def test_cli_launch(tmp_path, capsys):
    from alpa_lite.tools.cli import main
    script = tmp_path / "hello.py"
    script.write_text(
        "import sys\n"
        "import alpa_lite as al\n"
        "al.distributed.initialize()\n"
        "import jax\n"
        "print(f'process {jax.process_index()} of {jax.process_count()}: '\n"
        "      f'{jax.local_device_count()} local, {jax.device_count()} devices, '\n"
        "      f'cluster {al.Cluster.local().name}')\n"
        "sys.exit(int(sys.argv[1]))\n")
    assert main(["launch", "-n", "2", "--cpu-devices", "2", str(script), "0"]) == 0
    out = capsys.readouterr()
    for i in (0, 1):
        assert f"[p{i}] process {i} of 2: 2 local, 4 devices, cluster local-cpu-2x2" in out.out
    assert "process 1: exit 0" in out.err
    # A script's failure is the command's: its exit status comes back.
    assert main(["launch", "-n", "2", "--cpu-devices", "2", str(script), "3"]) == 3
    assert main(["launch", str(tmp_path / "missing.py")]) == 2
