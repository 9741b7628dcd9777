"""On demand: a warm Spark Connect backend (``recsys backend``) and an HTTP frontend (``recsys serve``).

See docs/on-demand.md. The backend is a Spark Connect server whose Python workers keep the model
cache warm; the frontend queues requests, coalesces them into Spark jobs and exports its figures.
"""
