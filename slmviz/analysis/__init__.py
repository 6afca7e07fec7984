"""Read-outs of one trace or two: logit lens, direct logit attribution, and trace-to-trace divergence.

Everything here takes finished Traces and never runs the model, so `Trace` may import it at module level.
"""
