"""`mpiscale bench NAME`: each benchmark measures a baseline in the same run."""
