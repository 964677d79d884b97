"""Fused Triton kernels for Wiola. Each ``kernels/<op>.py`` computes exactly what the
reference function of the same name in ``wiola/ops`` computes, forward and backward.

Set ``TRITON_INTERPRET=1`` before importing this package to run the kernels on CPU tensors.

The conventions every kernel module follows (launch configs, the interpreter rule, the SM count,
allocation, input checks) are in ``_utils``; the ahead-of-time builds in ``aot/``. Attention keeps
its Triton code (``attention_triton``) apart from its launchers and op (``attention``).
"""
