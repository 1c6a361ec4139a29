"""``python -m jaxdd.serve``: the OpenAI-compatible server (see ``jaxdd.serve.__main__``)."""
