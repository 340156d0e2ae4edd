"""Tests for alpa_lite.solvers.layer_clustering: brute-force equality, hand-built chains, errors."""

import math

import numpy as np
import pytest

from alpa_lite.solvers.layer_clustering import (
    FLOPS_RELATIVE_TOLERANCE,
    Clustering,
    ClusteringError,
    ClusteringProblem,
    brute_force_clustering,
    choose_num_layers,
    cluster_layers,
    cut_costs,
)


def random_problem(rng: np.random.Generator) -> ClusteringProblem:
    """Up to 10 ops; FLOPs and bytes drawn from a few small integers half the time, so
    zero-FLOP ops, equal cuts and tied objectives are common."""
    n = int(rng.integers(1, 11))
    coarse = rng.random() < 0.5
    if coarse:
        flops = rng.choice([0, 0, 1, 2, 3], size=n)
    else:
        flops = rng.integers(0, 20, size=n)
    tensors = []
    for _ in range(int(rng.integers(0, 12))):
        reader = int(rng.integers(0, n))
        if reader == 0:
            continue
        producer = int(rng.integers(-1, reader))  # -1: a program input
        size = rng.choice([0, 1, 2]) if coarse else rng.integers(0, 50)
        tensors.append((producer, reader, float(size)))
    return ClusteringProblem(tuple(float(f) for f in flops), tuple(tensors))


def assert_within_cap(problem, clustering, eps):
    total = sum(problem.flops)
    limit = (1 + eps) * total / clustering.num_layers + FLOPS_RELATIVE_TOLERANCE * total
    assert max(clustering.layer_flops) <= limit
    assert sum(clustering.layer_flops) == pytest.approx(total)


def test_matches_brute_force_on_random_problems():
    rng = np.random.default_rng(20240611)
    checked = infeasible = 0
    for _ in range(80):
        problem = random_problem(rng)
        x = cut_costs(problem)
        for num_layers in range(1, problem.num_ops + 1):
            for eps in (0.0, 0.1, 0.5):
                try:
                    expected = brute_force_clustering(problem, num_layers, eps)
                except ClusteringError as err:
                    # Infeasible exactly when brute force finds nothing, with the same advice.
                    with pytest.raises(ClusteringError) as raised:
                        cluster_layers(problem, num_layers, eps)
                    assert raised.value.min_eps == pytest.approx(err.min_eps)
                    assert raised.value.min_eps > eps
                    # The advertised eps really works.
                    fixed = cluster_layers(problem, num_layers, raised.value.min_eps)
                    assert_within_cap(problem, fixed, raised.value.min_eps)
                    infeasible += 1
                    continue
                got = cluster_layers(problem, num_layers, eps)
                assert (got.max_cut_bytes, got.sum_cut_bytes, max(got.layer_flops)) == (
                    expected.max_cut_bytes, expected.sum_cut_bytes, max(expected.layer_flops)
                ), (problem, num_layers, eps)
                assert got == expected  # the earliest-cuts tie-break agrees too
                assert got.num_layers == num_layers and got.boundaries[0] == 0
                assert got.cut_bytes == tuple(x[b - 1] for b in got.boundaries[1:])
                assert_within_cap(problem, got, eps)
                assert_within_cap(problem, expected, eps)
                checked += 1
    assert checked > 300 and infeasible > 20  # both branches were exercised


def test_cut_costs_by_hand():
    problem = ClusteringProblem(
        flops=(1, 1, 1, 1, 1),
        tensors=(
            (0, 2, 10.0),  # crosses the cuts after ops 0 and 1
            (1, 4, 3.0),  # after ops 1, 2, 3
            (2, 3, 7.0),  # after op 2
            (-1, 3, 100.0),  # a program input: never counts
        ),
    )
    # cut after op:        0     1         2       3
    expected = np.array([10.0, 10.0 + 3, 3 + 7.0, 3.0])
    np.testing.assert_array_equal(cut_costs(problem), expected)
    assert cut_costs(ClusteringProblem(flops=(4.0,))).shape == (0,)


# A transformer-like chain: 4 identical blocks of 6 ops (24 FLOPs each).
BLOCK_FLOPS = (6, 4, 1, 1, 4, 8)  # qkv, scores, mask, softmax, attn·v, out-proj + MLP


def transformer_chain(num_blocks: int = 4) -> ClusteringProblem:
    tensors = []
    for k in range(num_blocks):
        o = 6 * k
        residual_producer = o - 1 if k > 0 else -1  # block 0 reads the program input
        tensors += [
            (residual_producer, o + 5, 1.0),  # residual stream, read by qkv and by the add
            (o, o + 4, 3.0),  # q, k, v (v is read by attn·v)
            (o + 1, o + 4, 100.0),  # attention scores: the fat tensor inside the block
            (o + 4, o + 5, 2.0),  # attention output
        ]
    return ClusteringProblem(BLOCK_FLOPS * num_blocks, tuple(tensors))


def test_transformer_chain_cuts_at_block_boundaries():
    problem = transformer_chain()
    x = cut_costs(problem)
    # Inside block 1 (ops 6..11), cut after op:  6      7    8    9   10    11 (boundary)
    np.testing.assert_array_equal(x[6:12], [3 + 1, 104, 104, 104, 2 + 1, 1])
    four = cluster_layers(problem, 4, eps=0.1)
    assert four.boundaries == (0, 6, 12, 18)
    assert four.cut_bytes == (1.0, 1.0, 1.0)
    assert four.layer_flops == (24.0,) * 4
    assert four.imbalance == 1.0
    two = cluster_layers(problem, 2, eps=0.1)
    assert two.boundaries == (0, 12) and two.cut_bytes == (1.0,)
    # Eight layers of at most 1.1 · 96/8 = 13.2 FLOPs must cut inside every block.
    assert cluster_layers(problem, 8, eps=0.1).max_cut_bytes > 1.1 * 1.0


def test_choose_num_layers_keeps_only_thin_cuts():
    problem = transformer_chain()
    # Only L = 2 and L = 4 cut at block boundaries alone (max cut 1 byte); L = 3 cannot be
    # balanced within 10% without cutting a block, nor can any L > 4. So the rule picks 4.
    chosen = choose_num_layers(problem)
    assert chosen.num_layers == 4
    assert chosen.boundaries == (0, 6, 12, 18)
    assert choose_num_layers(problem, candidates=[2, 3]).boundaries == (0, 12)
    assert choose_num_layers(problem, candidates=[1]).boundaries == (0,)
    assert choose_num_layers(problem, candidates=[1, 100]).num_layers == 1  # 100 > n: skipped


def test_ties_go_to_balance_then_earliest_cuts():
    # Every cut costs 4 bytes, so max and sum tie for every 3-layer clustering; the heaviest
    # layer must be ceil(10 / 3) = 4 FLOPs, and the earliest such cuts are after ops 1 and 5.
    problem = ClusteringProblem((1.0,) * 10, tuple((j, j + 1, 4.0) for j in range(9)))
    got = cluster_layers(problem, 3, eps=0.5)
    assert got.boundaries == (0, 2, 6)
    assert got.layer_flops == (2.0, 4.0, 4.0)


def test_max_then_sum_is_not_one_lexicographic_dp():
    # A forward DP that keeps the lexicographic min of (max, sum) per prefix prefers the
    # prefix with cuts at 2, 4 (max 17, sum 26) over cuts at 1, 3 (max 18, sum 19); the
    # forced last cut at 5 costs 19, so both end with max 19 and 1, 3, 5 wins on sum, 38 < 45.
    problem = ClusteringProblem(
        flops=(1, 2, 1, 1, 2, 2, 1),
        tensors=((2, 3, 1.0), (2, 6, 4.0), (1, 6, 3.0), (4, 5, 2.0), (1, 6, 5.0),
                 (0, 2, 1.0), (2, 5, 5.0)),
    )
    np.testing.assert_array_equal(cut_costs(problem), [1, 9, 18, 17, 19, 12])
    got = cluster_layers(problem, 4, eps=0.5)
    assert got.boundaries == (0, 1, 3, 5)
    assert (got.max_cut_bytes, got.sum_cut_bytes) == (19.0, 38.0)


def test_exactly_balanced_and_single_op_over_cap():
    assert cluster_layers(ClusteringProblem((2.0,) * 4), 4, eps=0.0).boundaries == (0, 1, 2, 3)
    # 0.1 + 0.2 rounds above 0.3: the relative tolerance keeps eps = 0 usable.
    assert cluster_layers(ClusteringProblem((0.1, 0.2, 0.3)), 2, eps=0.0).boundaries == (0, 2)
    heavy = ClusteringProblem((1.0, 1.0, 1.0, 5.0))  # W = 8, L = 2: cap 1.1 · 4 = 4.4 < 5
    with pytest.raises(ClusteringError, match=r"op 3 alone has 5 FLOPs.*eps >= 0\.25") as err:
        cluster_layers(heavy, 2, eps=0.1)
    assert err.value.min_eps == pytest.approx(0.25)  # 5 / (8 / 2) − 1
    assert cluster_layers(heavy, 2, eps=0.25).boundaries == (0, 3)
    # No single op is over the cap, yet pairs are: 3 + 3 > 1.1 · 9 / 2 = 4.95.
    with pytest.raises(ClusteringError, match=r"layer of 6.*eps >= 0\.3334"):
        cluster_layers(ClusteringProblem((3.0, 3.0, 3.0)), 2, eps=0.1)
    with pytest.raises(ClusteringError, match="at least one operator") as err:
        cluster_layers(heavy, 5)
    assert err.value.min_eps is None
    zero = ClusteringProblem((0.0, 0.0, 0.0), ((0, 1, 5.0),))  # W = 0: every layer fits
    assert cluster_layers(zero, 2, eps=0.0).boundaries == (0, 2)  # the cut after op 0 costs 5
    assert cluster_layers(zero, 1).imbalance == 1.0


def test_clustering_record():
    c = Clustering(boundaries=(0, 3), layer_flops=(6.0, 2.0), cut_bytes=(5.0,))
    assert (c.num_layers, c.max_cut_bytes, c.sum_cut_bytes) == (2, 5.0, 5.0)
    assert c.imbalance == pytest.approx(6.0 / 4.0)
    assert Clustering((0,), (1.0,), ()).max_cut_bytes == 0.0
    with pytest.raises(ValueError, match="strictly increasing"):
        Clustering((0, 2, 2), (1.0, 0.0, 1.0), (0.0, 0.0))


@pytest.mark.parametrize(
    "flops, tensors, match",
    [
        ((), (), "at least one operator"),
        ((1.0, -1.0), (), r"flops\[1\] = -1\.0"),
        ((1.0, math.nan), (), r"flops\[1\] = nan"),
        ((1.0, math.inf), (), r"flops\[1\] = inf"),
        (("a",), (), "sequence of numbers"),
        ((1, 1, 1), ((0, 5, 1.0),), r"tensors\[0\].*last reader 5 is out of range"),
        ((1, 1, 1), ((-2, 1, 1.0),), r"tensors\[0\].*producer -2 is out of range"),
        ((1, 1, 1), ((0, 1, 1.0), (1, 1, 1.0)), r"tensors\[1\].*producer op 1 must come before"),
        ((1, 1, 1), ((2, 1, 1.0),), "must come before its last reader"),
        ((1, 1, 1), ((0, 1, -2.0),), r"tensors\[0\].*bytes must be finite and >= 0"),
        ((1, 1, 1), ((0, 1, math.nan),), "bytes must be finite"),
        ((1, 1, 1), ((0, 1),), "triple"),
        ((1, 1, 1), ((0.5, 1, 1.0),), "int op index"),
    ],
)
def test_bad_problem_raises(flops, tensors, match):
    with pytest.raises(ValueError, match=match):
        ClusteringProblem(flops, tensors)


def test_bad_arguments_raise():
    problem = ClusteringProblem((1.0, 2.0, 3.0))
    with pytest.raises(ValueError, match="num_layers must be >= 1"):
        cluster_layers(problem, 0)
    with pytest.raises(ValueError, match="num_layers must be an int"):
        cluster_layers(problem, 2.0)
    with pytest.raises(ValueError, match="eps must be finite and >= 0"):
        cluster_layers(problem, 2, eps=-0.1)
    with pytest.raises(ValueError, match="candidates is empty"):
        choose_num_layers(problem, candidates=[])
    with pytest.raises(ClusteringError, match="exceeds the 3 operators"):
        choose_num_layers(problem, candidates=[4, 5])
    with pytest.raises(ValueError, match="cut sets"):
        brute_force_clustering(ClusteringProblem((1.0,) * 40), 20, eps=0.5)
