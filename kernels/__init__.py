"""Fused Triton kernels for Wiola. Each ``kernels/<op>.py`` computes exactly what the
reference function of the same name in ``wiola/ops`` computes, forward and backward.

Set ``TRITON_INTERPRET=1`` before importing this package to run the kernels on CPU tensors.
"""
