"""Where the ranks are and how they talk: the parallel layout and the processes behind it.

- :mod:`.mesh`: ``DeviceMesh`` (TP / PP / CP / EP / DP sizes), ``initialize`` / ``shutdown``
  (torch.distributed and megatron-core's parallel state), the facade's process group;
- :mod:`.cpu_compat`: the documented compatibility layer that lets megatron-core run on CPU +
  gloo (applied by ``initialize`` on CPU, reverted by ``shutdown``);
- :mod:`.ddp`: the model chunks in megatron's DDP;
- :mod:`.mindspeed`: MindSpeed's megatron adaptor on Ascend NPUs;
- :mod:`.launch`: the one local multi-rank launcher (free port, timeout, a hung rank fails the
  caller), used by the training job, the tests' workers and the benchmarks.

From this project they import only each other and :mod:`twinkle_kernels` (the patcher
``cpu_compat`` is built on); nothing is imported here, so a submodule loads only when asked for.
"""
