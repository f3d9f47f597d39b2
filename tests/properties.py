"""Hypothesis's ``given``, ``settings``, ``st``, ``HealthCheck`` and ``Phase`` for the property tests.

Hypothesis is a test dependency (the ``test`` extra), not one of the GPU image's packages (torch, triton,
transformers, pytest). Where it is not installed, a ``@given`` test is skipped with the reason
"hypothesis is not installed" and the rest of its module still runs: ``given`` marks the test skipped
and the other names accept any use at import time (``st.integers(1, 4)``, ``@st.composite``,
``a | b``, ``settings(...)`` as a decorator) without doing anything, since no skipped test draws from them.
"""
import importlib.util

import pytest

HYPOTHESIS = importlib.util.find_spec("hypothesis") is not None

if HYPOTHESIS:
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st
else:

    class _Inert:
        """Stands for any hypothesis object while a module is imported."""

        def __getattr__(self, name):
            return self

        def __call__(self, *args, **kwargs):
            return self

        def __or__(self, other):  # st.one_of written as a | b
            return self

    st = HealthCheck = Phase = _Inert()

    def given(*args, **kwargs):
        return pytest.mark.skip(reason="hypothesis is not installed (the test extra)")

    def settings(*args, **kwargs):
        return lambda test: test


__all__ = ["HYPOTHESIS", "HealthCheck", "Phase", "given", "settings", "st"]
