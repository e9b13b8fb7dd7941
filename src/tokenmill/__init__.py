"""tokenmill."""
