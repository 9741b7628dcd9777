"""MLflow: the tracking store and registry, what makes a run readable, the remembered model, plots."""
