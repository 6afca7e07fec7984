"""Attribution graphs over a replacement model (circuit-tracer's semantics). `attribution` builds a graph from the
prompt's frozen run (`frozen`), its phases split around one `context.AttributionContext`: `budget` (memory),
`targets` (what is attributed), `backward` (the backward passes), `selection` (a capped graph's features), `nodes`
(constants, the node table). `graph` is the result, `AttributionGraph`, which holds data; `prune` and `graph_json`
prune it by influence and write circuit-tracer's JSON; `derived` reads values off it (node index, kept adjacency,
influence); `summary` tells it as a few checked groups (`GraphSummary`). The workbench: `workbench` (pins,
supernodes, labels: one `Workbench` object the graph carries and saves), `subgraph` (the pinned nodes and their
scores), `view` (what the workbench's figure draws) and `intervene` (setting features and rerunning the model).

Imports replacement/, features/ and below; plots/ only inside a result's `plot` method.
"""
