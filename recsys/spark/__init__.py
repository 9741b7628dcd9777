"""Spark plumbing: the session, live task progress, the executors' work directory, the packed environment."""
