"""Conformance tests on the families' released modeling code (see ``hub.py``). Import as ``from released
import hub`` (``tests/`` is on ``sys.path`` when pytest runs)."""
