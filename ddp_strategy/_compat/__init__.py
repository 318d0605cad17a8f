"""_compat."""
