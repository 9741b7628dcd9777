"""Staging, validation, atomic partition publish and the manifest."""
