"""What training and evaluation share above the models: the held-out split, the vocabulary, and the
translation of the typed configuration into model and training settings."""
