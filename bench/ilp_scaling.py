"""How the sharding ILP scales: random chain-plus-skip-edge graphs, CBC vs HiGHS.

Each node has 4–8 strategies that share 3–4 output shardings ("specs") out of a mesh's four
(R = replicated, S0, S1, S01); each consumer strategy reads each operand in one of those specs.
An edge's cost depends only on the pair (producer output spec, consumer input spec): free when
they agree or when the producer is replicated (a local slice), otherwise an all-gather- or
all-to-all-like time proportional to the tensor size. Node costs are compute times that shrink
as strategies split more, plus a random all-reduce term. Optionally, per-strategy memory and a
budget that forces some sharding.

Run:
    python bench/ilp_scaling.py            # 100, 300, 1000, 3000 nodes; ~2 min on 2 cores
    python bench/ilp_scaling.py --quick    # 100 and 300 nodes
Writes bench/results/ilp_scaling.json (``--out`` to change).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

from alpa_lite.solvers.sharding_ilp import (
    EdgeFormulation,
    ILPEdge,
    ILPNode,
    ShardingProblem,
    Solver,
    solve_sharding_ilp,
)

# Knobs -----------------------------------------------------------------------------------
SIZES = (100, 300, 1000, 3000)  # nodes; --quick keeps the first two
QUICK_SIZES = (100, 300)
STRATEGIES = (4, 8)  # strategies per node, inclusive range
SPECS_PER_NODE = (3, 4)  # distinct output specs among a node's strategies
SKIP_PROBABILITY = 0.5  # chance that node i also reads node i - d, d in SKIP_DISTANCE
SKIP_DISTANCE = (2, 10)
TIME_LIMIT_S = 60.0  # per solve; a solve that hits it is reported as "time-limit"
SEED = 0

SPECS = ("R", "S0", "S1", "S01")
# Resharding time per byte, relative, from producer spec (row) to consumer spec (column):
# from R anything is a local slice (free); S0 -> R is an all-gather over axis 0; S0 -> S1 an
# all-to-all; S01 -> R all-gathers over both axes.
RESHARD_PER_BYTE = np.array([
    [0.0, 0.0, 0.0, 0.0],
    [1.0, 0.0, 0.7, 0.5],
    [1.0, 0.7, 0.0, 0.5],
    [1.5, 1.0, 1.0, 0.0],
])
BANDWIDTH_BYTES_PER_S = 100e9


def random_problem(num_nodes: int, rng: np.random.Generator, with_memory: bool) -> ShardingProblem:
    """A chain 0 → 1 → … → n-1 plus random skip edges (i - d → i), see module docstring."""
    out_spec, in_spec, nodes = [], [], []
    for v in range(num_nodes):
        k = int(rng.integers(STRATEGIES[0], STRATEGIES[1] + 1))
        num_specs = int(rng.integers(SPECS_PER_NODE[0], SPECS_PER_NODE[1] + 1))
        specs = rng.choice(len(SPECS), size=num_specs, replace=False)
        out = np.concatenate([specs, rng.choice(specs, size=k - num_specs)])
        rng.shuffle(out)
        out_spec.append(out)
        in_spec.append(lambda k=k, specs=specs: rng.choice(specs, size=k))  # per operand
        flops_time_s = float(rng.lognormal(np.log(1e-3), 1.0))
        split = np.where(out == 0, 1.0, np.where(out == 3, 0.25, 0.5))  # R, S0/S1, S01
        all_reduce_s = rng.random(k) * 0.3 * flops_time_s * (rng.random(k) < 0.5)
        costs = flops_time_s * split * (1 + 0.2 * rng.random(k)) + all_reduce_s
        memory = 1e9 * split * (1 + rng.random(k)) if with_memory else None
        nodes.append(ILPNode(f"op{v}", tuple(costs), None if memory is None else tuple(memory)))
    edges = []
    for v in range(1, num_nodes):
        sources = [v - 1]
        if v >= SKIP_DISTANCE[0] and rng.random() < SKIP_PROBABILITY:
            sources.append(v - int(rng.integers(SKIP_DISTANCE[0], min(v, SKIP_DISTANCE[1]) + 1)))
        for u in sources:
            tensor_bytes = float(rng.lognormal(np.log(64e6), 1.0))
            per_spec = RESHARD_PER_BYTE * tensor_bytes / BANDWIDTH_BYTES_PER_S
            edges.append(ILPEdge(u, v, per_spec[out_spec[u]][:, in_spec[v]()]))
    budget = None
    if with_memory:
        low = sum(min(n.memory) for n in nodes)
        high = sum(max(n.memory) for n in nodes)
        budget = low + 0.3 * (high - low)  # forces many nodes off their fastest strategy
    return ShardingProblem(tuple(nodes), tuple(edges), budget)


def naive_size(problem: ShardingProblem) -> tuple[int, int]:
    """(variables, constraints) of the textbook model: one e per strategy pair of each edge."""
    variables = sum(n.num_strategies for n in problem.nodes) + sum(e.costs.size for e in problem.edges)
    constraints = len(problem.nodes) + sum(e.costs.size for e in problem.edges)
    return variables, constraints


def run_one(problem, solver, formulation, presolve, time_limit_s):
    try:
        s = solve_sharding_ilp(problem, solver, time_limit_s,
                               edge_formulation=formulation, presolve=presolve)
    except RuntimeError as err:  # no solution within the time limit
        return {"status": f"no solution: {err}", "time_s": None, "objective_s": None}
    return {"status": s.status, "time_s": round(s.solve_time_s, 3), "objective_s": s.objective_s,
            "variables": s.num_variables, "constraints": s.num_constraints}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="only 100 and 300 nodes")
    parser.add_argument("--sizes", type=int, nargs="*", help="override the node counts")
    parser.add_argument("--memory", action="store_true", help="add a binding memory budget")
    parser.add_argument("--formulation", choices=[f.value for f in EdgeFormulation],
                        default=EdgeFormulation.MARGINAL.value)
    parser.add_argument("--no-presolve", action="store_true")
    parser.add_argument("--time-limit", type=float, default=TIME_LIMIT_S)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "ilp_scaling.json"))
    args = parser.parse_args(argv)
    sizes = args.sizes or (QUICK_SIZES if args.quick else SIZES)
    formulation = EdgeFormulation(args.formulation)
    rows = []
    for n in sizes:
        problem = random_problem(n, np.random.default_rng(SEED + n), args.memory)
        row = {"nodes": n, "edges": len(problem.edges),
               "strategies": sum(x.num_strategies for x in problem.nodes)}
        row["naive_variables"], row["naive_constraints"] = naive_size(problem)
        for solver in (Solver.CBC, Solver.HIGHS):
            row[solver.value] = run_one(problem, solver, formulation, not args.no_presolve,
                                        args.time_limit)
        objectives = [row[s.value]["objective_s"] for s in Solver]
        row["objectives_equal"] = None if None in objectives else bool(
            np.isclose(objectives[0], objectives[1], rtol=1e-9, atol=0))
        rows.append(row)
        print(row, file=sys.stderr, flush=True)
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
