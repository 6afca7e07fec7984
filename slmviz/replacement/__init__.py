"""Replacement models, what attribution graphs run on: the per-layer transcoder set (`transcoder_set`) and the
cross-layer transcoder (`clt`) behind one interface (`base.ReplacementSet`); loading one by name or folder (`load`,
`prepared`); evaluating a whole set spliced into the model (`evaluate`).

Imports: features (the SAE a per-layer set holds), formats (the files), and the parts below them; never training,
graphs or plots."""
