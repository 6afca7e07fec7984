"""Circuits (DESIGN.md "Circuits"): edges between components (the component graph, exact edge patching, EAP and
EAP-IG scores, faithfulness curves) and built-in prompt-pair tasks. Built on the decoder's input hooks; imports
interventions and features, never plots except in `Circuit.plot`."""
