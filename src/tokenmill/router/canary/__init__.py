"""Canary releases: named variants, the traffic split, the SLO guard, the split's admin route."""
