"""Training sparse coders with ONE trainer: train_sae (an SAE or transcoder) and train_transcoders (a per-layer set or
a cross-layer transcoder) build one configuration (config) and run one loop (loop) over one row builder (rows) and
one checkpoint format (formats.checkpoint); what differs between the coders is an objective (sae_objective,
clt_objective). Also the bundled models' prepared recipes (prepare) and the command line (cli).

May import every part below it (features, replacement, formats, ...); nothing below imports training."""
