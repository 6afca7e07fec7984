"""Training sparse coders: train_sae, train_transcoders (a per-layer set or a cross-layer transcoder from one forward
per batch), the prepared recipes of the bundled models (`prepare`) and their command line (`cli`)."""
