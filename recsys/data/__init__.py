"""Input contracts and the readers, generators and importers that honour them."""
