"""Features: one sparse coder (SAE, transcoder, skip transcoder): encode, decode, splice, steer, labels, dashboards,
evaluation, and the bundled SAEs."""
