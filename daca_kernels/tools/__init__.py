"""Tools over the Triton kernels, not kernels themselves: ``ahead_of_time`` compiles every kernel for
sm_80 / sm_90 on a CPU machine (``python -m daca_kernels.tools.ahead_of_time``), ``roofline`` is the
static H100 model of the hot kernels from their SASS (``make roofline``)."""
