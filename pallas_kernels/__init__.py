"""Pallas kernels for jaxinfer; importing nothing from jaxinfer."""
