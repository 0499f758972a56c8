"""Kernels of the engine.

Each module holds a Triton kernel, its wrapper and a torch reference with the same signature, plus a
dispatcher named after the operation: CUDA tensors go to the Triton kernel, CPU tensors to the
reference. The reference is the CPU path and the test oracle.
"""
