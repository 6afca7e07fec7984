"""Running the model with something changed: activation and attribution patching, ablation, variant comparison."""
