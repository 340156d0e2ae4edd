"""Tests for alpa_lite.solvers.sharding_ilp: exactness against brute force, known optima, errors."""

import itertools

import numpy as np
import pytest

from alpa_lite.solvers import sharding_ilp as ilp
from alpa_lite.solvers.sharding_ilp import (
    EdgeFormulation,
    ILPEdge,
    ILPNode,
    InfeasibleMemoryError,
    ShardingProblem,
    Solver,
    SolverUnavailableError,
    brute_force,
    evaluate,
    solve_sharding_ilp,
)

SOLVERS = [Solver.CBC, Solver.HIGHS]


def random_problem(rng: np.random.Generator, with_budget: bool) -> ShardingProblem:
    """Up to 8 nodes × up to 4 strategies; random, parallel, reversed and zero edges.

    Half the instances draw costs from a few integers, so rows/columns repeat (edge classes),
    strategies tie, and dominance / elimination have something to do.
    """
    n = int(rng.integers(1, 9))
    # Dense instances have many cycles and small node costs next to edge costs, so presolve
    # leaves a real model; sparse ones exercise folding, dominance and elimination.
    dense = n > 3 and rng.random() < 0.6
    counts = rng.integers(1, 5, size=n) if not dense else np.full(n, rng.integers(3, 5))
    coarse = not dense and rng.random() < 0.5

    def draw(shape):
        return rng.integers(0, 4, size=shape).astype(float) if coarse else rng.random(shape)

    memory = [rng.integers(0, 10, size=k).astype(float) for k in counts]
    nodes = tuple(
        ILPNode(f"n{v}", tuple(draw(k) * (0.1 if dense else 1.0)),
                tuple(memory[v]) if with_budget else None)
        for v, k in enumerate(counts)
    )
    edges = []
    if dense:
        pairs = [(u, v) for u in range(n) for v in range(u + 1, n) if rng.random() < 0.9]
    elif n > 1:
        pairs = [rng.choice(n, size=2, replace=False) for _ in range(int(rng.integers(0, 2 * n + 1)))]
    else:
        pairs = []
    for u, v in pairs:
        if rng.random() < 0.3:  # repeat an existing pair, possibly reversed
            if edges:
                old = edges[int(rng.integers(len(edges)))]
                u, v = (old.dst, old.src) if rng.random() < 0.5 else (old.src, old.dst)
        matrix = draw((counts[u], counts[v]))
        if dense:  # Potts-like: free when both sides agree, noisy positive cost otherwise
            matrix = rng.random() * (1.0 - np.eye(counts[u])) + 0.05 * matrix
        elif rng.random() < 0.1:
            matrix = np.zeros_like(matrix)
        elif rng.random() < 0.3:  # resharding cost that depends on the class only
            spec_u = rng.integers(0, 2, size=counts[u])
            spec_v = rng.integers(0, 2, size=counts[v])
            table = draw((2, 2))
            matrix = table[spec_u][:, spec_v]
        edges.append(ILPEdge(int(u), int(v), matrix))
    budget = None
    if with_budget:
        low = sum(m.min() for m in memory)
        high = sum(m.max() for m in memory)
        budget = float(rng.integers(int(low), int(high) + 1)) + 0.5  # no ties with integers
    return ShardingProblem(nodes, tuple(edges), budget)


def assert_same_objective(got, want):
    assert got.objective_s == pytest.approx(want.objective_s, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("solver", SOLVERS, ids=lambda s: s.value)
@pytest.mark.parametrize("with_budget", [False, True], ids=["no-budget", "budget"])
def test_random_graphs_match_brute_force(solver, with_budget):
    rng = np.random.default_rng(1234 + with_budget)
    presolved_sizes = []
    for trial in range(30):
        problem = random_problem(rng, with_budget)
        try:
            want = brute_force(problem)
        except InfeasibleMemoryError:
            with pytest.raises(InfeasibleMemoryError):
                solve_sharding_ilp(problem, solver)
            continue
        for formulation, presolve in [
            (EdgeFormulation.MARGINAL, True),
            (EdgeFormulation.MARGINAL, False),
            (EdgeFormulation.PRODUCT_BOUND, False),
        ]:
            got = solve_sharding_ilp(
                problem, solver, edge_formulation=formulation, presolve=presolve,
                eliminate=False,
            )
            assert got.status == "optimal", (trial, formulation, presolve)
            if presolve:
                presolved_sizes.append(got.num_variables)
            assert_same_objective(got, want)
            if problem.memory_budget_bytes is not None:
                assert got.memory_bytes <= problem.memory_budget_bytes
            assert (got.node_cost_s, got.edge_cost_s, got.memory_bytes) == evaluate(
                problem, got.choices
            )
    assert sum(size > 0 for size in presolved_sizes) >= 3  # presolve did not solve them all


def test_elimination_equals_brute_force():
    """Bucket elimination (no memory budget) against enumeration, on dense random graphs
    whose presolve leaves nodes of degree > 2 behind."""
    rng = np.random.default_rng(11)
    solved_by_elimination = 0
    for _ in range(30):
        n = int(rng.integers(4, 9))
        counts = rng.integers(2, 5, size=n)
        nodes = tuple(ILPNode(f"v{v}", tuple(rng.random(k))) for v, k in enumerate(counts))
        edges = tuple(ILPEdge(u, v, rng.random((counts[u], counts[v])))
                      for u in range(n) for v in range(u + 1, n) if rng.random() < 0.6)
        problem = ShardingProblem(nodes, edges)
        got = solve_sharding_ilp(problem, Solver.HIGHS)
        want = brute_force(problem)
        assert_same_objective(got, want)
        assert (got.node_cost_s, got.edge_cost_s, got.memory_bytes) == evaluate(problem,
                                                                               got.choices)
        solved_by_elimination += got.solver == "elimination"
    assert solved_by_elimination >= 5     # the rest presolve alone solved


def test_reduced_cost_fixing_is_exact(monkeypatch):
    """P7 against enumeration, with and without a memory budget: where the relaxation is
    fractional, fixing drops strategies and the MILP (eliminate=False) or elimination
    solves what is left, to the same optimum."""
    fixed = []
    real = ilp._fix_by_reduced_costs

    def spy(work, relaxed):
        out = real(work, relaxed)
        fixed.append(out is not None)
        return out

    monkeypatch.setattr(ilp, "_fix_by_reduced_costs", spy)
    rng = np.random.default_rng(1)
    for trial in range(200):
        problem = random_problem(rng, with_budget=trial % 2 == 1)
        try:
            want = brute_force(problem)
        except InfeasibleMemoryError:
            continue
        for eliminate in (False, True):
            got = solve_sharding_ilp(problem, Solver.HIGHS, eliminate=eliminate)
            assert got.status == "optimal", trial
            assert_same_objective(got, want)
            if problem.memory_budget_bytes is not None:
                assert got.memory_bytes <= problem.memory_budget_bytes
    assert sum(fixed) >= 10        # fixing ran and dropped strategies that often


def test_presolve_is_exact_on_larger_random_graphs():
    """Presolve (dominance, elimination) against the unreduced model, 10-12 nodes."""
    rng = np.random.default_rng(7)
    for _ in range(10):
        n = int(rng.integers(10, 13))
        counts = rng.integers(2, 6, size=n)
        nodes = tuple(ILPNode(f"v{v}", tuple(rng.integers(0, 5, size=k) * 1.0))
                      for v, k in enumerate(counts))
        edges = []
        for v in range(1, n):
            for u in {v - 1, int(rng.integers(0, v))}:
                spec_u = rng.integers(0, 3, size=counts[u])
                spec_v = rng.integers(0, 3, size=counts[v])
                table = rng.integers(0, 4, size=(3, 3)) * 1.0
                np.fill_diagonal(table, 0.0)
                edges.append(ILPEdge(u, v, table[spec_u][:, spec_v]))
        problem = ShardingProblem(nodes, tuple(edges))
        full = solve_sharding_ilp(problem, Solver.HIGHS, presolve=False)
        reduced = solve_sharding_ilp(problem, Solver.HIGHS)
        assert_same_objective(reduced, full)
        assert reduced.num_variables <= full.num_variables


@pytest.mark.parametrize("solver", SOLVERS, ids=lambda s: s.value)
@pytest.mark.parametrize("presolve", [True, False], ids=["presolve", "raw"])
def test_hand_written_triangle(solver, presolve):
    """Three nodes in a triangle; the optimum is not the per-node cheapest choice.

    a: costs (1, 3)   b: costs (2, 2, 5)   c: costs (4, 1)
    a->b: [[0, 6, 6], [6, 0, 0]]   b->c: [[0, 2], [3, 0], [0, 0]]   a->c: [[0, 5], [0, 0]]

    Per-node cheapest: a=0, b=0 (tie, first), c=1 → 1 + 2 + 1 + (0 + 2 + 5) = 11.
    a=0, b=0, c=0: 1 + 2 + 4 + (0 + 0 + 0) = 7.
    a=1, b=1, c=1: 3 + 2 + 1 + (0 + 0 + 0) = 6   ← optimum
    a=1, b=2, c=1: 3 + 5 + 1 + (0 + 0 + 0) = 9.
    """
    nodes = (ILPNode("a", (1.0, 3.0)), ILPNode("b", (2.0, 2.0, 5.0)), ILPNode("c", (4.0, 1.0)))
    edges = (
        ILPEdge(0, 1, np.array([[0.0, 6, 6], [6, 0, 0]])),
        ILPEdge(1, 2, np.array([[0.0, 2], [3, 0], [0, 0]])),
        ILPEdge(0, 2, np.array([[0.0, 5], [0, 0]])),
    )
    problem = ShardingProblem(nodes, edges)
    solution = solve_sharding_ilp(problem, solver, presolve=presolve)
    assert solution.choices == (1, 1, 1)
    assert solution.objective_s == 6.0
    assert (solution.node_cost_s, solution.edge_cost_s) == (6.0, 0.0)
    assert brute_force(problem).choices == (1, 1, 1)


@pytest.mark.parametrize("solver", SOLVERS, ids=lambda s: s.value)
def test_memory_budget_changes_the_optimum(solver):
    """Two nodes, "replicated" (fast, 8 bytes) vs "sharded" (slow, 2 bytes).

    x: costs (1, 2) memory (8, 2)   y: costs (1, 3) memory (8, 2)   x->y: [[0, 4], [4, 0]]
    No budget: (0, 0) = 1 + 1 = 2.
    Budget 10.5: (0, 0) needs 16 bytes; (0, 1) = 1 + 3 + 4 = 8 with 10 bytes;
    (1, 0) = 2 + 1 + 4 = 7 with 10 bytes ← optimum; (1, 1) = 2 + 3 = 5 with 4 bytes ← better.
    So with budget 10.5 the optimum is (1, 1) = 5; with budget 3.9 nothing fits (min 4).
    """
    nodes = (ILPNode("x", (1.0, 2.0), (8.0, 2.0)), ILPNode("y", (1.0, 3.0), (8.0, 2.0)))
    edges = (ILPEdge(0, 1, np.array([[0.0, 4.0], [4.0, 0.0]])),)
    free = solve_sharding_ilp(ShardingProblem(nodes, edges), solver)
    assert free.choices == (0, 0) and free.objective_s == 2.0 and free.memory_bytes == 16.0
    tight = solve_sharding_ilp(ShardingProblem(nodes, edges, 10.5), solver, presolve=False)
    assert tight.choices == (1, 1) and tight.objective_s == 5.0 and tight.memory_bytes == 4.0
    with pytest.raises(InfeasibleMemoryError) as info:
        solve_sharding_ilp(ShardingProblem(nodes, edges, 3.9), solver)
    assert info.value.min_memory_bytes == 4.0
    assert info.value.budget_bytes == 3.9


def test_infeasible_budget_reports_brute_force_minimum_memory():
    rng = np.random.default_rng(3)
    counts = [3, 2, 4, 3]
    memory = [rng.integers(1, 100, size=k) * 1024.0 for k in counts]
    nodes = tuple(ILPNode(f"n{v}", tuple(rng.random(k)), tuple(memory[v]))
                  for v, k in enumerate(counts))
    edges = (ILPEdge(0, 1, rng.random((3, 2))), ILPEdge(2, 3, rng.random((4, 3))))
    smallest = min(
        sum(memory[v][s] for v, s in enumerate(choice))
        for choice in itertools.product(*(range(k) for k in counts))
    )
    problem = ShardingProblem(nodes, edges, smallest - 1.0)
    for solve in (brute_force, lambda p: solve_sharding_ilp(p, Solver.CBC),
                  lambda p: solve_sharding_ilp(p, Solver.HIGHS)):
        with pytest.raises(InfeasibleMemoryError) as info:
            solve(problem)
        assert info.value.min_memory_bytes == smallest
        assert info.value.budget_bytes == smallest - 1.0
        message = str(info.value)
        assert "smallest peak memory" in message
        assert "more devices" in message and "rematerialise" in message
    # Exactly the minimum fits.
    assert solve_sharding_ilp(ShardingProblem(nodes, edges, smallest)).memory_bytes == smallest


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: ILPNode("w", ()), "'w' has no strategies"),
        (lambda: ILPNode("w", (1.0, float("nan"))), "'w'.*NaN"),
        (lambda: ILPNode("w", (1.0, -2.0)), "'w'.*>= 0"),
        (lambda: ILPNode("w", (1.0, float("inf"))), "'w'.*inf"),
        (lambda: ILPNode("w", (1.0, 2.0), memory=(1.0,)), "'w' has 2 costs but 1 memory"),
        (lambda: ILPNode("w", (1.0,), memory=(-1.0,)), "'w'.*memory.*>= 0"),
        (lambda: ILPNode("w", (1.0, 2.0), strategy_names=("a",)), "'w' has 2 costs but 1 str"),
        (lambda: ILPEdge(1, 1, np.zeros((2, 2))), "node 1 to itself"),
        (lambda: ILPEdge(0, 1, np.array([[0.0, np.nan]])), "edge 0->1.*NaN"),
        (lambda: ILPEdge(0, 1, np.array([[0.0, -1.0]])), "edge 0->1.*>= 0"),
        (lambda: ILPEdge(0, 1, np.zeros(3)), "edge 0->1.*2-D"),
        (
            lambda: ShardingProblem((ILPNode("a", (1.0, 2.0)), ILPNode("b", (1.0,))),
                                    (ILPEdge(0, 1, np.zeros((2, 2))),)),
            r"edges\[0\] \(0->1, 'a' -> 'b'\): costs have shape \(2, 2\).*must be \(2, 1\)",
        ),
        (
            lambda: ShardingProblem((ILPNode("a", (1.0,)),), (ILPEdge(0, 3, np.zeros((1, 1))),)),
            r"edges\[0\] \(0->3\): dst index 3 is out of range for a problem with 1 nodes",
        ),
        (
            lambda: ShardingProblem((ILPNode("a", (1.0,)),), (ILPEdge(-1, 0, np.zeros((1, 1))),)),
            r"src index -1 is out of range",
        ),
        (lambda: ShardingProblem((ILPNode("a", (1.0,)),), (), -5.0), "memory_budget_bytes"),
    ],
)
def test_bad_input_names_the_problem(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_edge_costs_are_frozen_copies():
    matrix = np.ones((2, 2))
    edge = ILPEdge(0, 1, matrix)
    matrix[0, 0] = 99.0
    assert edge.costs[0, 0] == 1.0
    with pytest.raises(ValueError):
        edge.costs[0, 0] = 5.0


def test_evaluate_rejects_bad_choices():
    problem = ShardingProblem((ILPNode("a", (1.0, 2.0)),), ())
    with pytest.raises(ValueError, match="got 2 choices for a problem with 1 nodes"):
        evaluate(problem, (0, 0))
    with pytest.raises(ValueError, match="choice 2 for node 'a' is out of range"):
        evaluate(problem, (2,))


@pytest.mark.parametrize("solver", SOLVERS, ids=lambda s: s.value)
@pytest.mark.parametrize("presolve", [True, False], ids=["presolve", "raw"])
def test_single_strategy_nodes_and_zero_edges(solver, presolve):
    """Constant nodes fold into their neighbours; an all-zero edge changes nothing.

    p: (2.0,) fixed   q: (1.0, 1.5)   r: (0.5, 0.25)
    p->q: [[3, 0]] so q=0 costs 1+3=4, q=1 costs 1.5+0 = 1.5 → q=1.
    q->r: zeros; r alone → r=1.   Objective 2 + 1.5 + 0.25 = 3.75.
    """
    nodes = (ILPNode("p", (2.0,)), ILPNode("q", (1.0, 1.5)), ILPNode("r", (0.5, 0.25)))
    edges = (ILPEdge(0, 1, np.array([[3.0, 0.0]])), ILPEdge(1, 2, np.zeros((2, 2))))
    solution = solve_sharding_ilp(ShardingProblem(nodes, edges), solver, presolve=presolve)
    assert solution.choices == (0, 1, 1)
    assert solution.objective_s == pytest.approx(3.75)
    all_fixed = ShardingProblem((ILPNode("p", (2.0,)), ILPNode("q", (1.0,))),
                                (ILPEdge(1, 0, np.array([[0.5]])),))
    solution = solve_sharding_ilp(all_fixed, solver, presolve=presolve)
    assert solution.choices == (0, 0) and solution.objective_s == 3.5


@pytest.mark.parametrize("solver", SOLVERS, ids=lambda s: s.value)
def test_empty_problem(solver):
    solution = solve_sharding_ilp(ShardingProblem((), ()), solver)
    assert solution.choices == () and solution.objective_s == 0.0
    assert solution.num_variables == 0 and solution.status == "optimal"
    assert brute_force(ShardingProblem((), ())).choices == ()


def test_parallel_and_reversed_edges_are_summed():
    """a->b [[0, 1], [1, 0]] plus b->a [[0, 5], [0, 0]] (= a->b [[0, 0], [5, 0]]).

    Summed a->b: [[0, 1], [6, 0]].  a: (0, 0.5)  b: (0.7, 0)
    (0,0)=0.7  (0,1)=0+0+1=1  (1,0)=0.5+0.7+6=7.2  (1,1)=0.5 ← optimum.
    """
    problem = ShardingProblem(
        (ILPNode("a", (0.0, 0.5)), ILPNode("b", (0.7, 0.0))),
        (ILPEdge(0, 1, np.array([[0.0, 1], [1, 0]])), ILPEdge(1, 0, np.array([[0.0, 5], [0, 0]]))),
    )
    for presolve in (True, False):
        solution = solve_sharding_ilp(problem, Solver.HIGHS, presolve=presolve)
        assert solution.choices == (1, 1) and solution.objective_s == 0.5


def test_edge_classes_keep_the_model_small():
    """8 strategies on each side but only 2 output specs and 2 input specs: one edge needs
    2 × 2 = 4 class-pair variables (MARGINAL), not 8 × 8 = 64."""
    spec_u = np.array([0, 0, 0, 0, 1, 1, 1, 1])
    spec_v = np.array([0, 1, 0, 1, 0, 1, 0, 1])
    table = np.array([[0.0, 2.0], [3.0, 0.0]])
    nodes = (ILPNode("u", tuple(np.linspace(1, 2, 8))), ILPNode("v", tuple(np.linspace(2, 1, 8))))
    problem = ShardingProblem(nodes, (ILPEdge(0, 1, table[spec_u][:, spec_v]),))
    raw = solve_sharding_ilp(problem, Solver.HIGHS, presolve=False)
    # 16 x + 4 e variables; 2 unique + 2 row + 2 column constraints.
    assert (raw.num_variables, raw.num_constraints) == (20, 6)
    product = solve_sharding_ilp(problem, Solver.HIGHS, presolve=False,
                                 edge_formulation=EdgeFormulation.PRODUCT_BOUND)
    # 16 x + 2 e (the two nonzero class pairs); 2 unique + 2 edge constraints.
    assert (product.num_variables, product.num_constraints) == (18, 4)
    assert raw.objective_s == product.objective_s == brute_force(problem).objective_s


def test_constraints_are_named():
    problem = ShardingProblem(
        (ILPNode("dot/0", (1.0, 2.0), (1.0, 0.0)), ILPNode("b", (2.0, 1.0), (0.0, 1.0))),
        (ILPEdge(0, 1, np.array([[0.0, 1.0], [2.0, 0.0]])),),
        memory_budget_bytes=1.5,
    )
    work = ilp._presolve(problem, reduce=False)
    for formulation, edge_names in [
        (EdgeFormulation.PRODUCT_BOUND, {"edge_0_1_0_1", "edge_0_1_1_0"}),
        (EdgeFormulation.MARGINAL,
         {"edge_0_1_row_0", "edge_0_1_row_1", "edge_0_1_col_0", "edge_0_1_col_1"}),
    ]:
        model = ilp._build_model(work, formulation)
        names = set(model.row_names)
        assert names == {"unique_0_dot_0", "unique_1_b", "memory"} | edge_names


def test_highs_missing_gives_install_hint(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_highspy(name, *args, **kwargs):
        if name == "highspy":
            raise ImportError("No module named 'highspy'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_highspy)
    problem = ShardingProblem((ILPNode("a", (1.0,)),), ())
    with pytest.raises(SolverUnavailableError, match="pip install highspy.*Solver.CBC"):
        solve_sharding_ilp(problem, Solver.HIGHS)
    assert solve_sharding_ilp(problem, Solver.CBC).choices == (0,)


def test_brute_force_refuses_large_problems():
    nodes = tuple(ILPNode(f"n{v}", (1.0,) * 10) for v in range(7))  # 10^7 combinations
    with pytest.raises(ValueError, match="10000000 strategy combinations"):
        brute_force(ShardingProblem(nodes, ()))


def test_bad_solver_arguments():
    problem = ShardingProblem((ILPNode("a", (1.0,)),), ())
    with pytest.raises(ValueError, match="time_limit_s"):
        solve_sharding_ilp(problem, Solver.CBC, time_limit_s=0)
    with pytest.raises(ValueError, match="Solver.CBC or Solver.HIGHS"):
        solve_sharding_ilp(problem, "cbc")


def test_describe_lists_choices():
    problem = ShardingProblem((ILPNode("mm", (2.0, 1.0), strategy_names=("R", "S0")),), ())
    text = solve_sharding_ilp(problem, Solver.HIGHS).describe(problem)
    assert "mm: S0 (1 s)" in text


_TWO_NODES = ShardingProblem(
    (ILPNode("a", (1.0, 2.0)), ILPNode("b", (2.0, 1.0))),
    (ILPEdge(0, 1, np.array([[0.0, 5.0], [5.0, 0.0]])),),
)


@pytest.mark.parametrize(
    "solution_status, expect",
    [(1, "optimal"), (2, "time-limit (feasible)"), (0, "larger time_limit_s")],
)
def test_cbc_status_is_reported(monkeypatch, solution_status, expect):
    """Stopping at the time limit: a feasible answer is returned and marked, none raises."""
    import pulp

    assert (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible,
            pulp.LpSolutionNoSolutionFound) == (1, 2, 0)
    real_solve = pulp.LpProblem.solve

    def solve_then_pretend(self, backend):
        real_solve(self, backend)
        self.sol_status = solution_status

    monkeypatch.setattr(pulp.LpProblem, "solve", solve_then_pretend)
    if solution_status == 0:
        with pytest.raises(RuntimeError, match=expect):
            solve_sharding_ilp(_TWO_NODES, Solver.CBC, presolve=False)
    else:
        solution = solve_sharding_ilp(_TWO_NODES, Solver.CBC, presolve=False)
        assert solution.status == expect and solution.objective_s == 3.0


@pytest.mark.parametrize(
    "time_limit, feasible, expect",
    [(False, True, "optimal"), (True, True, "time-limit (feasible)"),
     (True, False, "larger time_limit_s")],
)
def test_highs_status_is_reported(monkeypatch, time_limit, feasible, expect):
    """The same through highspy: its model status and primal solution status."""
    import highspy

    class Pretend(highspy.Highs):
        def getModelStatus(self):
            real = super().getModelStatus()
            return highspy.HighsModelStatus.kTimeLimit if time_limit else real

        def getInfo(self):
            info = super().getInfo()
            if not feasible:
                info.primal_solution_status = 0
            return info

    monkeypatch.setattr(highspy, "Highs", Pretend)
    if not feasible:
        with pytest.raises(RuntimeError, match=expect):
            solve_sharding_ilp(_TWO_NODES, Solver.HIGHS, presolve=False)
    else:
        solution = solve_sharding_ilp(_TWO_NODES, Solver.HIGHS, presolve=False)
        assert solution.status == expect and solution.objective_s == 3.0


def _count_highs_runs(monkeypatch) -> list[bool]:
    """Records, per HiGHS run, whether the model it solved had integer columns."""
    import highspy

    runs: list[bool] = []

    class Counting(highspy.Highs):
        def run(self):
            runs.append(self.getLp().integrality_ != [] and any(
                t == highspy.HighsVarType.kInteger for t in self.getLp().integrality_))
            return super().run()

    monkeypatch.setattr(highspy, "Highs", Counting)
    return runs


def test_an_integral_lp_relaxation_answers_without_the_milp(monkeypatch):
    """A chain's MARGINAL relaxation is exact (a tree): one LP run, no MILP, and the optimum
    is brute force's."""
    rng = np.random.default_rng(3)
    nodes = tuple(ILPNode(f"n{v}", tuple(rng.random(3))) for v in range(5))
    edges = tuple(ILPEdge(v, v + 1, rng.random((3, 3))) for v in range(4))
    problem = ShardingProblem(nodes, edges)
    runs = _count_highs_runs(monkeypatch)
    solution = solve_sharding_ilp(problem, Solver.HIGHS, presolve=False)
    assert runs == [False]
    assert solution.status == "optimal"
    assert solution.objective_s == pytest.approx(brute_force(problem).objective_s, abs=1e-12)


def test_a_fractional_lp_relaxation_falls_back_to_the_milp(monkeypatch):
    """A frustrated triangle: every edge costs 1 where its ends agree, and two strategies
    per node, so any choice pays at least 1 but the local polytope reaches 0 with every
    x at 1/2. The LP is fractional, the MILP runs, and the answer is the true optimum."""
    same = np.eye(2)
    nodes = tuple(ILPNode(f"n{v}", (0.0, 0.0)) for v in range(3))
    edges = (ILPEdge(0, 1, same), ILPEdge(1, 2, same), ILPEdge(0, 2, same))
    problem = ShardingProblem(nodes, edges)
    runs = _count_highs_runs(monkeypatch)
    solution = solve_sharding_ilp(problem, Solver.HIGHS, presolve=False)
    assert runs == [False, True]
    assert solution.objective_s == pytest.approx(1.0)
