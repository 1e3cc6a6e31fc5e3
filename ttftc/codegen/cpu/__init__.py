"""CPU lowerings: the fastest ATen/oneDNN primitives measured on CPU."""
