"""Attribution graphs over a replacement model (circuit-tracer's semantics): build, prune, the graph JSON, the
prompt's frozen state (`frozen`), interventions, and the workbench (pins, supernodes, labels)."""
