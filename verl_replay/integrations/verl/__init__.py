"""The only package that imports verl internals."""
