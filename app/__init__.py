"""The slmviz Gradio app: a thin layer that turns widget values into slmviz calls and figures.

`app.main.launch()` starts it (also `python -m slmviz.cli app`, `make app`, or `python app/main.py`
on a Hugging Face Space). `app.handlers` holds the event handlers, free of Gradio layout code.
"""
