"""Features: one sparse coder (SAE, transcoder, skip transcoder): encode, decode, splice, steer, labels, dashboards,
evaluation, loading one from any layout (`load`), and the bundled SAEs.

Imports: formats (the files), slmviz.errors, and the parts below them; never replacement, training or graphs."""
