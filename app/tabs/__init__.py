"""One module per tab of the page (and its companions, named after it): layout, events and handlers.

A tab imports the app's shared modules (app/models.py, app/shared.py, app/jobs.py, ...) and slmviz, never another
tab; app/main.py builds the tabs in order and wires the few events whose outputs span tabs (switching the model,
loading an SAE). The attribution graph has a tab of its own (app/tabs/graph.py and its graph_*.py companions).
"""
