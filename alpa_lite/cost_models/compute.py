"""Per-op compute time: a roofline over a device's FLOP peak and memory bandwidth.

An op that does ``flops`` floating-point operations and moves ``bytes_accessed`` bytes
between memory and the device takes

    ``max(flops / (peak_flops(dtype) * eff), bytes_accessed / memory_bandwidth)``

seconds (Williams, Waterman & Patterson, "Roofline", CACM 2009), plus the device's fixed
per-kernel ``op_overhead_s`` for each kernel the op starts (``kernels``: one for a matmul or
a convolution, one per fused element-wise kernel, which ``planning/fusion.py`` counts):

* matmul/conv: ``eff = device.matmul_efficiency_at(flops)``, the size-dependent efficiency
  curve (``DeviceSpec.matmul_efficiency_curve``, interpolated in ``log(flops)`` of the op on
  one device), or the constant ``matmul_efficiency`` when the spec has no curve. On the lent
  H100 large bf16 matmuls reach 71-82% of peak but small ones (512 tokens x hidden 1024)
  only 1-6% (HARDWARE.md), so a constant prices small or heavily sharded matmuls
  optimistically; a calibrated curve (``calibration.py``) does not.
* everything else: ``eff = elementwise_efficiency``. XLA fuses element-wise ops into
  their neighbours, so charging each traced equation a kernel launch would count launches
  that never happen: the caller says how many kernels an op starts (the planner charges
  a fused group's launch to its first equation, ``planning/fusion.py``), and its bytes are
  its share of the fused kernel's traffic, not every operand and result of the equation.

The memory term uses ``memory_bandwidth_bytes_per_s``: the datasheet figure in presets
(measured elementwise ops reach ~80% of it on the H100, HARDWARE.md), the measured
rate in a calibrated spec. FLOPs and bytes come from the traced graph (count them from the
jaxpr; DESIGN.md explains why not from XLA's ``cost_analysis()``).
"""

from __future__ import annotations

from typing import Any

from alpa_lite.cost_models.devices import DeviceSpec, require_non_negative

__all__ = ["compute_time"]


def compute_time(
    flops: float,
    bytes_accessed: float,
    device: DeviceSpec,
    dtype: Any,
    is_matmul: bool,
    kernels: int | None = None,
) -> float:
    """Roofline time of one op on one device, in seconds.

    Args:
      flops: Floating-point operations (a multiply-add counts 2).
      bytes_accessed: Bytes read plus written in device memory.
      device: The device.
      dtype: Compute dtype, a name (``"bfloat16"``) or a numpy/jax dtype; picks the peak.
      is_matmul: True for dot/conv ops (``matmul_efficiency_at(flops)``), False otherwise
        (``elementwise_efficiency``).
      kernels: Kernels the op starts, each paying ``op_overhead_s``; None: one for a
        matmul, none otherwise.

    Returns:
      ``max(flops / (peak * eff), bytes_accessed / memory_bandwidth)``, plus
      ``kernels * op_overhead_s``; 0.0 for no work.

    Raises:
      ValueError: for negative or non-finite ``flops``/``bytes_accessed``.

    Example:
      >>> from alpa_lite.cost_models.devices import DEVICES
      >>> t = compute_time(2 * 8192**3, 3 * 8192**2 * 2, DEVICES["H100"], "bfloat16", True)
      >>> round(t * 1e3, 3)  # 1.1 TFLOP at 0.75 * 989 TFLOP/s
      1.482
    """
    f = require_non_negative("compute_time", "flops", flops)
    b = require_non_negative("compute_time", "bytes_accessed", bytes_accessed)
    if not isinstance(device, DeviceSpec):
        raise ValueError(
            f"compute_time: device must be a DeviceSpec, got {device!r}; use "
            f"alpa_lite.cost_models.devices.DEVICES[...] or cluster.device."
        )
    if f == 0.0 and b == 0.0:
        return 0.0
    eff = device.matmul_efficiency_at(f) if is_matmul else device.elementwise_efficiency
    flop_time_s = f / (device.peak_flops(dtype) * eff) if f else 0.0
    memory_time_s = b / device.memory_bandwidth_bytes_per_s
    if kernels is None:
        kernels = 1 if is_matmul else 0
    overhead_s = kernels * device.op_overhead_s
    return max(flop_time_s, memory_time_s) + overhead_s
