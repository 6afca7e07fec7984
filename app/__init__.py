"""The slmviz Gradio app: a thin layer that turns widget values into slmviz calls and figures.

`app.main.launch()` starts it (also `python -m slmviz.cli app`, `make app`, or `python app/main.py` on a Hugging
Face Space). app/main.py lays out the page; app/tabs/ holds one module per tab (its layout, events and handlers);
app/jobs.py runs the long jobs; app/models.py, app/saes.py, app/scans.py and app/transcoder_sets.py keep what the
server shares between sessions (models, SAEs, corpus scans, full transcoder sets); app/shared.py holds the helpers
every tab uses. Imports run one way: main -> tabs -> the shared modules -> slmviz.
"""
