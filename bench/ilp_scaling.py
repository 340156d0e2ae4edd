"""How the sharding ILP scales: random chain-plus-skip-edge graphs, CBC vs HiGHS.

Each node has 4–8 strategies that share 3–4 output shardings ("specs") out of a mesh's four
(R = replicated, S0, S1, S01); each consumer strategy reads each operand in one of those specs.
An edge's cost depends only on the pair (producer output spec, consumer input spec): free when
they agree or when the producer is replicated (a local slice), otherwise an all-gather- or
all-to-all-like time proportional to the tensor size. Node costs are compute times that shrink
as strategies split more, plus a random all-reduce term. Optionally, per-strategy memory and a
budget that forces some sharding.

Two tables: the default solver (presolve + MARGINAL edges) at each size, without and with a
binding memory budget (the budget stops presolve from eliminating nodes, so the solver does
real work); and an ablation at 300 nodes with the budget: presolve on/off × edge formulation.
"naive vars" counts the textbook model, one variable per strategy pair of every edge.

Run:
    python bench/ilp_scaling.py            # 100, 300, 1000, 3000 nodes; ~2 min on 2 cores
    python bench/ilp_scaling.py --quick    # 100 and 300 nodes, ablation at 100
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
TIME_LIMIT_S = 60.0  # per solve; a solve that stops there is marked "(limit)"
ABLATION_NODES = 300  # presolve on/off × edge formulation, with a memory budget
QUICK_ABLATION_NODES = 100
ABLATION_TIME_LIMIT_S = 30.0
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


def run_one(problem, solver, formulation=EdgeFormulation.MARGINAL, presolve=True,
            time_limit_s=TIME_LIMIT_S) -> dict:
    """One solve as a JSON-able dict; a solve with no solution in the limit is recorded."""
    try:
        s = solve_sharding_ilp(problem, solver, time_limit_s,
                               edge_formulation=formulation, presolve=presolve)
    except RuntimeError as err:
        return {"status": "no solution", "error": str(err), "time_s": None, "objective_s": None}
    return {"status": s.status, "time_s": round(s.solve_time_s, 3), "objective_s": s.objective_s,
            "variables": s.num_variables, "constraints": s.num_constraints}


def same_objective(a: dict, b: dict) -> bool | None:
    """Equal to 1e-8 relative (each solver closes a 1e-9 relative gap); None if one failed."""
    if a["objective_s"] is None or b["objective_s"] is None:
        return None
    return bool(np.isclose(a["objective_s"], b["objective_s"], rtol=1e-8, atol=0))


def scaling_rows(sizes, with_memory: bool, time_limit_s: float) -> list[dict]:
    rows = []
    for n in sizes:
        problem = random_problem(n, np.random.default_rng(SEED + n), with_memory)
        row = {"nodes": n, "edges": len(problem.edges),
               "strategies": sum(x.num_strategies for x in problem.nodes),
               "memory_budget": with_memory}
        row["naive_variables"], row["naive_constraints"] = naive_size(problem)
        for solver in Solver:
            row[solver.value] = run_one(problem, solver, time_limit_s=time_limit_s)
        row["objectives_equal"] = same_objective(row["cbc"], row["highs"])
        rows.append(row)
        print(f"  done: {n} nodes, memory budget {with_memory}", file=sys.stderr, flush=True)
    return rows


def ablation_rows(n: int, time_limit_s: float) -> list[dict]:
    """Presolve on/off × edge formulation, on one instance with a binding memory budget."""
    problem = random_problem(n, np.random.default_rng(SEED + n), with_memory=True)
    rows = []
    for presolve in (True, False):
        for formulation in EdgeFormulation:
            row = {"nodes": n, "presolve": presolve, "formulation": formulation.value}
            for solver in Solver:
                row[solver.value] = run_one(problem, solver, formulation, presolve, time_limit_s)
            row["objectives_equal"] = same_objective(row["cbc"], row["highs"])
            rows.append(row)
            print(f"  done: ablation {formulation.value} presolve={presolve}", file=sys.stderr,
                  flush=True)
    return rows


def _cell(result: dict) -> str:
    if result["time_s"] is None:
        return "no solution"
    mark = "" if result["status"] == "optimal" else " (limit)"
    return f"{result['time_s']:.2f}{mark}"


def print_tables(scaling: list[dict], ablation: list[dict]) -> None:
    print("| nodes | edges | strategies | budget | naive vars | vars | constraints "
          "| CBC s | HiGHS s | same objective |")
    print("|---:|---:|---:|:---:|---:|---:|---:|---:|---:|:---:|")
    for r in scaling:
        model = r["highs"] if r["highs"]["time_s"] is not None else r["cbc"]
        print(f"| {r['nodes']} | {r['edges']} | {r['strategies']} | "
              f"{'yes' if r['memory_budget'] else 'no'} | {r['naive_variables']} | "
              f"{model.get('variables', '-')} | {model.get('constraints', '-')} | "
              f"{_cell(r['cbc'])} | {_cell(r['highs'])} | {r['objectives_equal']} |")
    if not ablation:
        return
    print()
    print(f"Ablation, {ablation[0]['nodes']} nodes with a memory budget:")
    print("| presolve | edge formulation | vars | constraints | CBC s | HiGHS s | same objective |")
    print("|:---:|:---|---:|---:|---:|---:|:---:|")
    for r in ablation:
        model = r["highs"] if r["highs"]["time_s"] is not None else r["cbc"]
        print(f"| {'on' if r['presolve'] else 'off'} | {r['formulation']} | "
              f"{model.get('variables', '-')} | {model.get('constraints', '-')} | "
              f"{_cell(r['cbc'])} | {_cell(r['highs'])} | {r['objectives_equal']} |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"only {QUICK_SIZES} nodes, ablation at {QUICK_ABLATION_NODES}")
    parser.add_argument("--sizes", type=int, nargs="+", help="override the node counts")
    parser.add_argument("--time-limit", type=float, default=TIME_LIMIT_S,
                        help="seconds per solve in the scaling table")
    parser.add_argument("--ablation-time-limit", type=float, default=ABLATION_TIME_LIMIT_S)
    parser.add_argument("--no-ablation", action="store_true")
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" / "ilp_scaling.json")
    args = parser.parse_args(argv)
    sizes = args.sizes or (QUICK_SIZES if args.quick else SIZES)
    started = time.perf_counter()
    scaling = scaling_rows(sizes, False, args.time_limit) + scaling_rows(
        sizes, True, args.time_limit)
    ablation = [] if args.no_ablation else ablation_rows(
        QUICK_ABLATION_NODES if args.quick else ABLATION_NODES, args.ablation_time_limit)
    print_tables(scaling, ablation)
    import highspy  # noqa: F401  (only for its version; the solves above needed it anyway)
    import pulp

    result = {
        "benchmark": "ilp_scaling",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"processor": platform.processor(), "cpu_count": os.cpu_count(),
                    "platform": platform.platform(), "python": platform.python_version(),
                    "pulp": pulp.__version__, "highspy": _version("highspy")},
        "settings": {"seed": SEED, "strategies": STRATEGIES, "specs_per_node": SPECS_PER_NODE,
                     "skip_probability": SKIP_PROBABILITY, "skip_distance": SKIP_DISTANCE,
                     "time_limit_s": args.time_limit,
                     "ablation_time_limit_s": args.ablation_time_limit,
                     "default_model": "presolve + marginal edge formulation"},
        "scaling": scaling,
        "ablation": ablation,
        "wall_time_s": round(time.perf_counter() - started, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {args.out} ({result['wall_time_s']} s)")


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


if __name__ == "__main__":
    main()
