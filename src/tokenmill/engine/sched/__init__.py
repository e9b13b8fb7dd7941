"""Scheduling: who runs each step with how many tokens, the batching policy, and fairness between tenants and classes."""
