"""Component circuits: edges between components (the component graph, exact edge patching, EAP and EAP-IG scores,
faithfulness curves) and built-in prompt-pair tasks. Built on the decoder's input hooks; never imports plots except
in `Circuit.plot`."""
