"""Features: sparse autoencoders and transcoders (DESIGN.md "Features"): load, save, splice, steer."""
