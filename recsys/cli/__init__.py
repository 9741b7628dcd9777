"""Commands: the ``recsys`` CLI (``main``), the demo, and the operator's view of past runs."""
