"""A test-only stand-in package: only ``_custom_ops`` (tests/stand_ins/README.md)."""
