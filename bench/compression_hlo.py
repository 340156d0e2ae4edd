"""Bytes on the wire, read from the compiled program: each exchange method against the dense
all-reduce, for the tiny GPT example data parallel on 8 virtual CPU devices.

For each method the parallelized step is compiled and the collectives in XLA's HLO are
summed by kind (result bytes per device, `alpa_lite.runtime.hlo`). Beside them: the plan's
`wire_bytes` (what the cost model charges: bytes one worker sends per step) for the same
layout. On one node of 8 devices the exchange runs among them; with `--nodes 2` the same 8
devices are described as 2 nodes of 4 and the exchange is hierarchical (reduce-scatter and
all-gather inside a node, the method between nodes).

The HLO's collectives are listed by their result bytes per device (`alpa_lite.runtime.hlo`); the
"HLO sent" column turns them into bytes one device sends with ring algorithms (all-reduce
2(n-1)/n of its buffer, all-gather and all-to-all (n-1)/n of their result, n = the op's
replica group), the measure the plan's `wire_bytes` uses; across nodes only the ops between
nodes (replica groups of one device per node) count, as in the plan. The scalar all-reduces
(the loss, the NaN count) are in the HLO and not in the plan.

Run:
    python bench/compression_hlo.py [--nodes 2]
Writes bench/results/compression_hlo.json (or compression_hlo_2nodes.json).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

_common.use_examples()

import gpt  # noqa: E402
import jax  # noqa: E402
import optax  # noqa: E402

import alpa_lite as al  # noqa: E402
from alpa_lite import compression as C  # noqa: E402
from alpa_lite.runtime.hlo import bytes_by_kind, collectives_in_hlo  # noqa: E402

METHODS = [C.Dense(), C.Cast("bf16"), C.Cast("fp16"), C.TopK(0.01), C.RandomK(0.01),
           C.DGC(0.999, momentum=0.0), C.PowerSGD(rank=2), C.OneBit(), C.SignSGD(),
           C.TernGrad(), C.QSGD(levels=8)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--size", default="tiny")
    args = ap.parse_args()
    local = al.Cluster.local()
    cluster = local if args.nodes == 1 else dataclasses.replace(
        local, name=f"local-{args.nodes}x{8 // args.nodes}", num_nodes=args.nodes,
        devices_per_node=8 // args.nodes, inter_node=local.intra_node)
    cfg = gpt.CONFIGS[args.size]
    tx = optax.sgd(1e-2, momentum=0.9)
    params = gpt.init_params(cfg, jax.random.PRNGKey(0))
    batch = gpt.make_batch(cfg, cfg.batch_size, jax.random.PRNGKey(1))
    step_args = (params, tx.init(params), batch)
    grad_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    rows, results, dense = [], [], None
    for method in METHODS:
        step = al.parallelize(gpt.make_train_step(cfg, tx), method=al.DataParallel(),
                              cluster=cluster, compression=method)
        plan = step.plan(*step_args, cluster=cluster)
        found = collectives_in_hlo(step.compile(*step_args).hlo(*step_args))
        hlo = bytes_by_kind(found)
        # Across nodes, the exchange is the ops over the node axis (groups of one device per
        # node); the full-precision reduce-scatter and all-gather inside nodes are not in it.
        exchange = [c for c in found if args.nodes == 1 or c.group_size == args.nodes]
        total = round(sum(c.sent_bytes(8) for c in exchange))
        dense = dense or (total, plan.compression.wire_bytes)
        results.append({"method": method.describe(), "config": C.to_config(method),
                        "hlo_bytes_by_kind": hlo, "hlo_sent_bytes": total,
                        "plan_wire_bytes": plan.compression.wire_bytes,
                        "hlo_ratio_to_dense": dense[0] / total,
                        "plan_ratio_to_dense": dense[1] / plan.compression.wire_bytes})
        rows.append([method.describe().split(":")[0],
                     ", ".join(f"{k} {v:,}" for k, v in sorted(hlo.items())), f"{total:,}",
                     f"{dense[0] / total:.1f}x", f"{plan.compression.wire_bytes:,.0f}",
                     f"{dense[1] / plan.compression.wire_bytes:.1f}x"])
        print(rows[-1], flush=True)
    _common.print_table(
        f"GPT-{args.size} ({grad_bytes:,} gradient bytes), data parallel on {cluster.name}: "
        "collective bytes in the compiled HLO against the plan's wire bytes",
        [("method", "left"), ("HLO collectives (bytes per device)", "left"),
         ("HLO sent (exchange)", "right"), ("HLO dense/this", "right"), ("plan wire bytes", "right"),
         ("plan dense/this", "right")], rows)
    name = "compression_hlo.json" if args.nodes == 1 else f"compression_hlo_{args.nodes}nodes.json"
    _common.write_result(_common.RESULTS_DIR / name, {
        "benchmark": "compression_hlo", "command": _common.command_line(),
        "date": _common.now_utc(), "machine": _common.machine(), "code": _common.CODE_AT_START,
        "model": f"gpt-{args.size}", "cluster": cluster.name, "gradient_bytes": grad_bytes,
        "results": results})


if __name__ == "__main__":
    main()
