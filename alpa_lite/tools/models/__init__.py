"""The built-in models: the `<model>-<size>` targets of `alpa-lite plan` and the models the
scripts in the repository's `examples/` folder train.

One module per model, each a pytree of arrays and pure functions in plain JAX + optax:
`gpt` (GPT-2 style decoder), `moe` (GShard top-2 mixture of experts, built on gpt's
pieces), `wide_resnet` (bottleneck Wide-ResNet), `mlp` (dense regression). Each exposes the
same interface: `Config`, `CONFIGS` (named sizes), `init_params`, `abstract_params`,
`make_batch`, `abstract_batch`, `loss_fn`, `make_train_step`, `abstract_args`; `common`
holds what they share (the optax train step, abstract and initial arguments).

Importing a model imports optax (the `examples` extra). They import only `alpa_lite.ir`
(for `value_and_grad`) from the package, never planning or runtime, and import nothing on
being imported here: `alpa_lite.tools.targets` loads them by name.
"""
