"""A pipeline stage that accumulates its gradients per replica reduces them once per step,
so its intra-op layout is chosen with those reductions weighed once per step, not in every
micro-batch's backward (`planning.pipeline._amortized_fit`)."""

import dataclasses

import optax

import alpa_lite as al
from alpa_lite.cost_models.cluster import LinkSpec
from alpa_lite.tools.models import common, gpt


def test_an_accumulating_stage_is_laid_out_as_if_its_reductions_were_free():
    # Megatron-LM SC21 Table 2's 530B row on 560 A100s (dp 2 x tp 8 x pp 35, 1120
    # micro-batches of one example per replica): the 2-way dp axis crosses nodes. Charged
    # per micro-batch, its gradient all-reduces made the stage repeat work to avoid them
    # (0.187 s of compute per micro-batch against 0.150 s); weighed as the once-per-step
    # reductions they are, the layout is the one a free inter-node link gives.
    cfg = gpt.Config(vocab_size=51200, seq_len=2048, hidden=20480, num_layers=105,
                     num_heads=128, dtype="bfloat16")
    tx = optax.adamw(1e-4)
    args = common.abstract_args(gpt.init_params, gpt.abstract_batch, cfg, 2240, tx)
    method = al.Manual(dp=2, tp=8, pp=35, num_micro_batches=1120, remat=True)
    cluster = al.Cluster.of_gpus("A100", 70, 8)
    free = dataclasses.replace(cluster, name=cluster.name + "-free-links",
                               inter_node=LinkSpec("free", 1e15, 1e-9))
    step = common.make_train_step(gpt.loss_fn, cfg, tx)
    plans = [al.parallelize(step, method=method).plan(*args, cluster=c)
             for c in (cluster, free)]
    for a, b in zip(*(p.stages for p in plans)):
        assert a.accumulate_axes == ("dp",)
        assert abs(a.compute_s - b.compute_s) <= 1e-3 * b.compute_s, (a.layers, a.compute_s,
                                                                      b.compute_s)
