"""The model adapter (:class:`MaskedLM`), the released model families it recognises, loading their
code, and the library's own tiny bidirectional transformers model."""
