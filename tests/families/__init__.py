"""Test doubles of the model families RL engineers post-train through their released remote code.

Each module holds a tiny, randomly initialised transformers model written for these tests (no released
modeling code is copied) that shows the *interface* of one family's hub checkpoint: class and attribute
names, output classes and fields, the attention-mask forms the forward accepts, its cache arguments,
its ``generate``-style API and the ways it breaks under the installed transformers. The module
docstrings list each fact with the released file it was read from. Import as ``from families import
llada`` (``tests/`` is on ``sys.path`` when pytest runs; ``tests/`` itself is not a package).

Modules: ``llada`` (LLaDA-8B), ``llada_moe`` (LLaDA-MoE-7B-A1B), ``dream`` (Dream-v0-7B and
DiffuCoder-7B), ``sdar`` (SDAR and TraDo), ``llada2`` (LLaDA2.0 MoE).
"""
