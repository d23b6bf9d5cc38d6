"""Checkpoint layouts: the names of the layouts eaglekit exports and imports (`names`)."""
