"""linear_logprob's chunked path stays within a quarter of eager's peak memory (issue bound)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from memory_linear_logprob import measure  # noqa: E402


def test_linear_logprob_peak_memory_is_at_most_a_quarter_of_eager():
    # Eager's peak is its [N, V] logits and their gradients, whatever the width H; a narrow head
    # keeps the matrix products (the run time) small. ``make bench-quick`` measures H = 256.
    peaks = measure(n=4096, vocab=32000, hidden=64)
    assert peaks["eager"] > 1000, peaks  # the measurement sees eager's ~1.5 GB of logits traffic
    assert peaks["daca"] <= 0.25 * peaks["eager"], peaks
