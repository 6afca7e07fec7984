"""Read-outs of one trace or two: logit lens, direct logit attribution, and trace-to-trace divergence.

Everything here takes finished traces (anything `traced.Traced` describes) and never runs the model or imports
`Trace`, so `Trace` may import it at module level.
"""
