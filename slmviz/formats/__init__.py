"""File formats, one module per format: each reads and writes every object that format holds, as plain data (a
`spec` of the object's settings and its tensors, in slmviz's names), and never imports the objects, which build
themselves from what a reader returns and hand their spec and tensors to a writer.

    saelens          an SAE or transcoder folder (cfg.json + sae_weights.safetensors)
    gemma_scope      Gemma Scope 2: SAE / transcoder folders, every-layer transcoder sets, cross-layer transcoders
    circuit_tracer   circuit-tracer: per-layer transcoder sets (config.yaml + layer_{L}), CLTs (W_enc_{L} / W_dec_{L})
    slmviz           slmviz's own set layout (transcoder_set.json + one SAELens folder per layer)
    hub              one SAE folder from the Hugging Face hub, in bounded time
    files            shared file safety: pickles refused, safetensors / JSON / YAML read with errors naming the file
    checkpoint       a training run's checkpoint header

Imports: slmviz.errors, and this part's own modules; never features, replacement or training.
"""
