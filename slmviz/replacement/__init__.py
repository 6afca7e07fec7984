"""Replacement models, what attribution graphs run on: the per-layer transcoder set (`transcoder_set`) and the
cross-layer transcoder (`clt`) behind one interface; loading one by name or folder (`load`, `prepared`); evaluating a
whole set spliced into the model (`evaluate`)."""
