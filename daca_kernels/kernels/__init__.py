"""Triton kernels and their launchers. No autograd and no input validation here: see ``ops``.

Importing this package requires triton; ``TRITON_INTERPRET=1`` must be set before the import for
the kernels to run on CPU tensors under the interpreter.
"""
