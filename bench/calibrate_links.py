"""The NVLink constants of the GPU presets, fitted to published nccl-tests all-reduce sweeps.

Reads the `nccl_allreduce_busbw_8gpu_intranode` rows of `bench/data/device_microbenchmarks.json`
(nccl-tests `all_reduce_perf` on 8 GPUs of one node, 1 KiB to 8 GiB, Azure ND H100 v5 and
ND A100 v4; source and quote in the file), turns each bus bandwidth into the time of one
all-reduce (nccl-tests: busbw = algbw * 2(n-1)/n, algbw = size / time), and fits the ring
model's alpha (latency per step) and beta (bandwidth) with the same function `alpa-lite
calibrate` uses (`cost_models.calibration.fit_link`, relative-error least squares). The
results are the `_NVLINK*` constants of `alpa_lite/cost_models/cluster.py`.

    python bench/calibrate_links.py         # prints the fits, writes bench/results/calibrated_links.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

from alpa_lite.cost_models.calibration import CollectiveSample, fit_link  # noqa: E402
from alpa_lite.cost_models.cluster import CollectiveKind  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "device_microbenchmarks.json"
UNITS = {"K": 1024, "M": 1024**2, "G": 1024**3}
GPUS = 8


def samples(points: dict[str, float]) -> list[CollectiveSample]:
    out = []
    for size, busbw_gb in points.items():
        nbytes = float(size[:-1]) * UNITS[size[-1]]
        algbw = busbw_gb * 1e9 * GPUS / (2 * (GPUS - 1))
        out.append(CollectiveSample(CollectiveKind.ALL_REDUCE, GPUS, nbytes, nbytes / algbw))
    return out


def main() -> None:
    devices = json.loads(DATA.read_text())["devices"]
    result = {}
    for kind in ("H100-SXM5-80GB", "A100-SXM4-80GB"):
        row = devices[kind]["nccl_allreduce_busbw_8gpu_intranode"]
        s = samples(row["points_bytes_to_busbw"])
        fit = fit_link(s, f"nvlink-{kind}")
        print(f"{kind}: alpha {fit.link.latency_s * 1e6:.2f} us per ring step, busbw "
              f"{fit.link.bandwidth_bytes_per_s / 1e9:.1f} GB/s  ({row['source']})")
        _common.print_table(
            kind, [("bytes", ">"), ("measured us", ">"), ("model us", ">"), ("error", ">")],
            [(f"{x.nbytes:.0f}", f"{x.seconds * 1e6:.1f}", f"{p * 1e6:.1f}", f"{e:+.0%}")
             for x, p, e in zip(s, fit.predicted_s, fit.relative_errors)])
        result[kind] = {"latency_s": fit.link.latency_s,
                        "bandwidth_bytes_per_s": fit.link.bandwidth_bytes_per_s,
                        "relative_errors": list(fit.relative_errors),
                        "source": row["source"]}
    _common.write_result(_common.RESULTS_DIR / "calibrated_links.json",
                         {"benchmark": "calibrate_links", "command": _common.command_line(),
                          "date": _common.now_utc(), "fits": result})


if __name__ == "__main__":
    main()
