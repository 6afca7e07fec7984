"""plotly figures and HTML shared by notebooks and the app: traces (`trace`), patch sweeps (`patch`), scans (`scan`).

`slmviz.plots.attention(...)` and the other trace figures are re-exported here, where notebooks found them
before the package had folders.
"""

from .trace import *  # noqa: F403 - the trace figures' public names, as `slmviz.plots.X` has always offered
