"""Circuits (DESIGN.md "Circuits"): edges between components (the component graph, exact edge patching, EAP and
EAP-IG scores, faithfulness curves), built-in prompt-pair tasks, and attribution graphs over transcoder features
(attribution, replacement, attribution_prune, attribution_json). Built on the decoder's input hooks; imports
interventions and features, never plots except in `Circuit.plot` and `AttributionGraph.plot`."""
