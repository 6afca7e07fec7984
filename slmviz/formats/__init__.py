"""File formats, one module per external format: each reads and writes every object that format holds, as plain
configs and tensors. The objects (features, replacement) import these modules, never the other way round, and no
format module imports training."""
