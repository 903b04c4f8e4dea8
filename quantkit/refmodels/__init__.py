"""refmodels."""
