"""The reference GRPO loop for masked diffusion language models: verifiable tasks (``tasks``)
generated in code, a tiny bidirectional model, and the trainer that uses the package's estimators."""
